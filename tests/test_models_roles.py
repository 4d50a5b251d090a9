"""`models inspect` says what a GGUF is made for — chat, embedding or rerank — from its header:
`{arch}.pooling_type`, `{arch}.attention.causal`, the classifier head tensors (cls.*) and
`{arch}.classifier.output_labels`, as llama.cpp's converters write them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.decide import gguf_facts
from mtpwrap.errors import ConfigError
from mtpwrap.models import inspect
from tests.helpers import cli_env, run_cli

N_EMBD, N_VOCAB, N_LAYER = 32, 64, 2


@dataclass(frozen=True)
class Header:
    arch: str
    causal: bool | None = None
    pooling: int | None = None
    labels: tuple[str, ...] = ()
    #: extra tensors, name → numpy shape (rows, columns)
    tensors: tuple[tuple[str, tuple[int, ...]], ...] = ()
    general_type: str | None = None


def write(path: Path, h: Header) -> Path:
    """A small GGUF (f32 zeros) with the header keys llama.cpp's converters write."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(path, h.arch)
    if h.general_type:
        w.add_type(h.general_type)
    w.add_block_count(N_LAYER)
    w.add_embedding_length(N_EMBD)
    w.add_context_length(512)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_feed_forward_length(64)
    if h.causal is not None:
        w.add_causal_attention(h.causal)
    if h.pooling is not None:
        if h.pooling < 0:
            w.add_int32(f"{h.arch}.pooling_type", h.pooling)
        else:
            w.add_uint32(f"{h.arch}.pooling_type", h.pooling)
    if h.labels:
        w.add_classifier_output_labels(list(h.labels))
    w.add_tensor("token_embd.weight", np.zeros((N_VOCAB, N_EMBD), np.float32))
    for il in range(N_LAYER):
        w.add_tensor(f"blk.{il}.attn_q.weight", np.zeros((N_EMBD, N_EMBD), np.float32))
    for name, shape in h.tensors:
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


MEAN, CLS, LAST, RANK = 1, 2, 3, 4
#: a BERT sequence classifier (bge-reranker style): dense + out_proj, one label
BERT_HEAD = (("cls.weight", (N_EMBD, N_EMBD)), ("cls.bias", (N_EMBD,)),
             ("cls.output.weight", (1, N_EMBD)), ("cls.output.bias", (1,)))

MODELS: dict[str, Header] = {
    "bert-embedding": Header("bert", causal=False, pooling=MEAN),
    "bert-rerank": Header("bert", causal=False, pooling=RANK, labels=("score",),
                          tensors=BERT_HEAD),
    # Qwen3-Reranker's convention: causal, rank pooling, labels yes/no
    "qwen3-rerank": Header("qwen3", pooling=RANK, labels=("yes", "no")),
    # Qwen3-Embedding's convention: causal, last-token pooling
    "llama-embedding": Header("llama", pooling=LAST),
    "llama-chat": Header("llama"),
}

#: (role, pooling, embedding_dimensions, causal_attention, words role_why must hold)
EXPECTED: dict[str, tuple[str, str | None, int, bool | None, Sequence[str]]] = {
    "bert-embedding": ("embedding", "mean", N_EMBD, False, ["bert.pooling_type is 1 (mean)"]),
    "bert-rerank": ("rerank", "rank", 1, False,
                    ["bert.pooling_type is 4 (rank)", "cls.output.weight", "1 classifier label"]),
    "qwen3-rerank": ("rerank", "rank", 2, None,
                     ["qwen3.pooling_type is 4 (rank)", "no classifier tensors",
                      "2 classifier label"]),
    "llama-embedding": ("embedding", "last", N_EMBD, None, ["llama.pooling_type is 3 (last)"]),
    "llama-chat": ("chat", None, N_EMBD, None,
                   ["no llama.pooling_type", "no classifier head", "causal attention"]),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("roles")
    return {name: write(folder / f"{name}.gguf", h) for name, h in MODELS.items()}


@pytest.mark.parametrize("name", list(MODELS))
def test_the_role_pooling_and_dimensions_of_each_kind(models: dict[str, Path],
                                                      name: str) -> None:
    role, pooling, dims, causal, why = EXPECTED[name]
    info, facts = inspect.describe(models[name])
    assert (info["role"], info["pooling"], info["embedding_dimensions"],
            info["causal_attention"]) == (role, pooling, dims, causal)
    for words in why:
        assert words in info["role_why"], info["role_why"]
    assert gguf_facts.model_role(facts) == (info["role"], info["role_why"])


def test_the_facts_come_from_the_header(models: dict[str, Path]) -> None:
    rerank = gguf_facts.read_facts(models["bert-rerank"])
    assert rerank.pooling_type == RANK and rerank.causal_attention is False
    assert rerank.classifier_labels == 1
    # shapes in ggml order, as the header holds them
    assert rerank.classifier_tensors == {"cls.weight": [N_EMBD, N_EMBD], "cls.bias": [N_EMBD],
                                         "cls.output.weight": [N_EMBD, 1],
                                         "cls.output.bias": [1]}
    assert not rerank.kv_cache  # llama.cpp runs bert without a KV cache
    chat = gguf_facts.read_facts(models["llama-chat"])
    assert (chat.pooling_type, chat.causal_attention, chat.classifier_labels,
            chat.classifier_tensors, chat.kv_cache) == (None, None, 0, {}, True)


def test_encoders_without_pooling_or_with_a_scoring_head(tmp_path: Path) -> None:
    # nomic-bert without a pooling type: a bidirectional encoder with no classifier
    nomic = inspect.describe(write(tmp_path / "nomic.gguf", Header("nomic-bert", causal=False)))[0]
    assert nomic["role"] == "embedding" and nomic["pooling"] is None
    assert "nomic-bert is a bidirectional encoder" in nomic["role_why"]
    # jina-reranker-v1: cls.weight with one output row scores directly, no rank pooling key
    jina = inspect.describe(write(tmp_path / "jina.gguf", Header(
        "jina-bert-v2", causal=False, tensors=(("cls.weight", (1, N_EMBD)),
                                               ("cls.bias", (1,))))))[0]
    assert (jina["role"], jina["embedding_dimensions"]) == ("rerank", 1)
    assert "cls.weight" in jina["role_why"]
    # a square cls.weight alone (a pre-classifier dense layer) does not make a reranker
    dense = inspect.describe(write(tmp_path / "dense.gguf", Header(
        "modern-bert", causal=False, pooling=MEAN,
        tensors=(("cls.weight", (N_EMBD, N_EMBD)),))))[0]
    assert dense["role"] == "embedding"
    # a diffusion LM is bidirectional too, but not an encoder: chat
    dream = inspect.describe(write(tmp_path / "dream.gguf", Header("dream", causal=False)))[0]
    assert dream["role"] == "chat"
    assert "dream is not an encoder architecture" in dream["role_why"]


def test_an_unspecified_or_unknown_pooling_type(tmp_path: Path) -> None:
    unspecified = gguf_facts.read_facts(write(tmp_path / "u.gguf", Header("llama", pooling=-1)))
    assert unspecified.pooling_type is None and unspecified.pooling is None
    assert gguf_facts.model_role(unspecified)[0] == "chat"
    odd = gguf_facts.read_facts(write(tmp_path / "o.gguf", Header("llama", pooling=9)))
    assert odd.pooling is None and gguf_facts.model_role(odd)[0] == "chat"
    assert any("llama.pooling_type is 9" in w for w in odd.warnings)


def test_a_file_that_is_not_a_model_is_refused_in_one_sentence(tmp_path: Path) -> None:
    lora = write(tmp_path / "lora.gguf", Header("llama", general_type="adapter"))
    with pytest.raises(ConfigError) as exc:
        gguf_facts.read_facts(lora)
    msg = exc.value.message
    assert str(lora) in msg and "general.type is 'adapter'" in msg and "LoRA adapter" in msg


def test_inspect_sends_embedding_and_rerank_models_to_companions(models: dict[str, Path]
                                                                 ) -> None:
    for name, role in (("bert-embedding", "embedding"), ("qwen3-rerank", "rerank")):
        info = inspect.inspect(models[name])
        assert info["profiles"] == []
        assert "`companions:`" in info["companion"] and f"role: {role}" in info["companion"]
    assert "--embeddings --pooling mean" in inspect.inspect(models["bert-embedding"])["companion"]
    bert = inspect.inspect(models["bert-rerank"], profiles=False)
    assert bert["kv"] == [] and bert["kv_types_from"].startswith("none: ")
    chat = inspect.inspect(models["llama-chat"])
    assert "companion" not in chat and chat["profiles"]
    assert any(r["profile"] == "cpu-demo" for r in chat["profiles"])


def _no_binary_env(**extra: str) -> dict[str, str]:
    env = cli_env(MTPWRAP_BUILD_DIR="/nonexistent/build", **extra)
    env.pop("MTPWRAP_BINARY", None)
    return env


def test_cli_human_output_shows_role_pooling_and_dimensions(models: dict[str, Path]) -> None:
    r = run_cli("models", "inspect", str(models["bert-embedding"]), env=_no_binary_env())
    assert r.returncode == 0, r.stderr
    lines = {k.strip(): v.strip() for k, _, v in
             (line.partition(": ") for line in r.stdout.splitlines()) if v}
    assert lines["role"].startswith("embedding — bert.pooling_type is 1 (mean)")
    assert lines["pooling"] == "mean"
    assert lines["dimensions"] == f"{N_EMBD} values per embedding"
    assert lines["attention"].startswith("bidirectional, ")
    assert "served as a companion" in lines["profiles"]
    assert "profiles on" not in r.stdout and "Traceback" not in r.stderr

    r = run_cli("models", "inspect", str(models["qwen3-rerank"]), "--json",
                env=_no_binary_env())
    assert r.returncode == 0, r.stderr
    info: dict[str, Any] = json.loads(r.stdout)
    assert (info["role"], info["pooling"], info["embedding_dimensions"]) == ("rerank", "rank", 2)


def test_models_list_has_the_role_column(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    write(folder / "embed.gguf", MODELS["bert-embedding"])
    write(folder / "chat.gguf", MODELS["llama-chat"])
    (folder / "broken.gguf").write_bytes(b"GGUF\x03\x00")
    r = run_cli("models", "list", "--json", env=cli_env(MTPWRAP_MODELS_DIR=str(folder)))
    assert r.returncode == 0, r.stderr
    roles = {row["name"]: row["role"] for row in json.loads(r.stdout)}
    assert roles == {"embed.gguf": "embedding", "chat.gguf": "chat", "broken.gguf": None}


@pytest.mark.integration
def test_the_demo_model_is_a_chat_model(demo_model: Path) -> None:
    # the project serves it with --embeddings --pooling mean in its tests; it is made for chat
    info, facts = inspect.describe(demo_model)
    assert (info["role"], info["pooling"], info["causal_attention"]) == ("chat", None, None)
    assert info["embedding_dimensions"] == facts.n_embd == 576
