"""The GGUF writer: sparse shape-only models, tiny runnable ones, and llama.cpp loading them."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from mtpwrap import paths
from mtpwrap.build import tiny_gguf, tokenizer
from mtpwrap.build.calibrate import parse_allocations, run_fit_params
from mtpwrap.decide.gguf_facts import read_facts, read_header

pytestmark = pytest.mark.usefixtures("drop_gguf_files")

MiB = 1024 * 1024


@pytest.mark.parametrize("model", sorted(tiny_gguf.SHAPES))
def test_shape_only_files_are_sparse_and_complete(model: str, tmp_path: Path) -> None:
    path = tiny_gguf.write_shape_only(tmp_path / f"{model}.gguf", model)
    st = path.stat()
    meta, infos, data_offset, size = read_header(path)
    assert size == st.st_size
    # the last tensor ends inside the file, at most one alignment pad before its end
    end = max(data_offset + t.offset + t.n_bytes for t in infos)
    assert size - 32 < end <= size
    assert st.st_blocks * 512 < max(64 * MiB, st.st_size // 50)  # a hole, not zeros
    facts = read_facts(path)
    n_tok = meta["tokenizer.ggml.tokens"]
    assert len(n_tok) == facts.n_vocab  # padded vocabulary matches the embedding rows
    # the tensors fill the file behind the header, up to the alignment pads between them
    assert 0.95 * (size - data_offset) <= facts.tensor_bytes <= size - data_offset


def test_q4_k_m_recipe_gives_more_bits_to_some_layers(tmp_path: Path) -> None:
    spec = tiny_gguf.SHAPES["llama3-8b"]("q4_k_m")
    types = {t.name: t.qtype for t in spec.tensors}
    assert types["output.weight"] == "q6_k" and types["token_embd.weight"] == "q4_k"
    assert types["blk.0.ffn_down.weight"] == "q6_k" and types["blk.4.ffn_down.weight"] == "q4_k"
    assert types["blk.0.attn_norm.weight"] == "f32"
    q8 = tiny_gguf.SHAPES["llama3-8b"]("q8_0")
    assert {t.qtype for t in q8.tensors} == {"q8_0", "f32"}


def test_tiny_random_models_have_real_data_and_an_mtp_block(tmp_path: Path) -> None:
    path = tiny_gguf.write_tiny_random(tmp_path / "t.gguf", arch="qwen35", mtp=True)
    f = read_facts(path)
    assert (f.architecture, f.n_layer_nextn, f.n_layer) == ("qwen35", 1, 4)
    assert f.kv_layers == [3] and f.recurrent_layers == [0, 1, 2]
    st = path.stat()
    assert st.st_blocks * 512 >= f.tensor_bytes  # really written, not a hole
    plain = read_facts(tiny_gguf.write_tiny_random(tmp_path / "p.gguf", mtp=False))
    assert plain.n_layer_nextn == 0 and plain.mtp_bytes == 0


def test_the_tokenizer_is_made_in_code_without_a_source_tree(tmp_path: Path) -> None:
    vocab = tokenizer.vocabulary(2000)
    assert len(vocab) == 2000 == len(set(vocab.tokens)) == len(vocab.token_type)
    assert tuple(vocab.tokens[:256]) == tokenizer.byte_chars()  # every byte has a token
    known = set(vocab.tokens)
    for merge in vocab.merges:  # llama.cpp looks up both halves and the merged token
        left, right = merge.split(" ")
        assert {left, right, left + right} <= known, merge
    assert vocab.tokens[vocab.bos] == tokenizer.BOS and vocab.tokens[vocab.eos] == tokenizer.EOS
    assert vocab.token_type[vocab.eos] == tokenizer.TOKEN_CONTROL
    # learnt from Korean text too: whole Hangul syllables and words are single tokens
    hangul = "".join(tokenizer.byte_chars()[b] for b in "다".encode())
    assert hangul in known
    meta, _, _, _ = read_header(tiny_gguf.write_tiny_random(tmp_path / "t.gguf", arch="llama"))
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "llama-bpe"
    assert not paths.sources_dir().exists()  # no llama.cpp tree fetched or read


# ----------------------------------------------------------------- llama.cpp loads them


@pytest.mark.integration
@pytest.mark.parametrize("model", sorted(tiny_gguf.SHAPES))
def test_llama_cpp_loads_every_shape_model(model: str, fit_params_bin: Path, tmp_path: Path
                                           ) -> None:
    path = tiny_gguf.write_shape_only(tmp_path / f"{model}.gguf", model)
    try:
        log = run_fit_params(fit_params_bin, path, ["-c", "4096", "-fa", "on", "-np", "1"])
        got = parse_allocations(log)
        assert got.model_total > 0 and got.kv, log[-2000:]
    finally:
        path.unlink()


@pytest.mark.integration
def test_tiny_qwen35_runs_mtp_drafts_in_llama_server(llama_server_bin: Path, free_port: int,
                                                     tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from mtpwrap.proc import running_server

    model = tiny_gguf.write_tiny_random(tmp_path / "tiny-mtp.gguf", arch="qwen35", mtp=True)
    base = f"http://127.0.0.1:{free_port}"
    argv = [str(llama_server_bin), "-m", str(model), "--host", "127.0.0.1", "--port",
            str(free_port), "-c", "2048", "-np", "1", "--spec-type", "draft-mtp",
            "--spec-draft-n-max", "3", "--metrics", "--no-warmup", "-t", "1", "-lv", "4"]
    with running_server(argv, base_url=base, timeout=120,
                        log_path=tmp_path / "server.log") as srv:
        out = httpx.post(base + "/completion", timeout=120, json={
            "prompt": "The quick brown fox", "n_predict": 16, "temperature": 0}).json()
        assert out["timings"]["predicted_n"] > 0
        # llama.cpp tokenizes with the writer's merges and gives the text back
        said = "제1조 대한민국은 민주공화국이다. The tenant shall pay the rent."
        ids = httpx.post(base + "/tokenize", timeout=30, json={"content": said}).json()["tokens"]
        assert 0 < len(ids) < len(said.encode()) / 2
        back = httpx.post(base + "/detokenize", timeout=30, json={"tokens": ids}).json()
        assert back["content"].strip() == said
        metrics = httpx.get(base + "/metrics", timeout=10)
        assert metrics.status_code == 200
        values = {sample.name: sample.value
                  for family in text_string_to_metric_families(metrics.text)
                  for sample in family.samples}
        assert values.get("llamacpp:spec_decode_num_drafts_total", 0) > 0, metrics.text
        assert values.get("llamacpp:spec_decode_num_draft_tokens_total", 0) > 0, metrics.text
        text = srv.log_text()
    # the MTP context: its own one-layer KV cache next to the main one
    assert len(parse_allocations(text).kv) >= 2, text[-3000:]
