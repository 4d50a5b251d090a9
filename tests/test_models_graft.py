"""`models graft` on the project's tiny qwen35 models: a base with an MTP head, "fine-tunes" of
the same shape without one (other weights, or the base's own trunk), mismatched models written
by the same model writer; the grafted file served by the real llama-server with draft-mtp."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.decide import gguf_facts
from mtpwrap.errors import ConfigError
from mtpwrap.models import graft
from tests.helpers import run_cli


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("graft")
    return {
        # seed 0 with and without a head: the same trunk weights (the head's tensors come last)
        "base": tiny_gguf.write_tiny_random(d / "base.gguf", "qwen35", mtp=True, seed=0),
        "own-trunk": tiny_gguf.write_tiny_random(d / "own.gguf", "qwen35", mtp=False, seed=0),
        "fine-tune": tiny_gguf.write_tiny_random(d / "ft.gguf", "qwen35", mtp=False, seed=1),
        "other-head": tiny_gguf.write_tiny_random(d / "other.gguf", "qwen35", mtp=True, seed=1),
    }


def tensor_bytes(path: Path) -> dict[str, bytes]:
    """Every tensor's bytes, read through the project's own header reader (not the writer's)."""
    _meta, infos, data_offset, _ = gguf_facts.read_header(path)
    out = {}
    with path.open("rb") as f:
        for t in infos:
            f.seek(data_offset + t.offset)
            out[t.name] = f.read(t.n_bytes)
    return out


def head(tensors: dict[str, bytes], first: int = 4) -> dict[str, bytes]:
    return {k: v for k, v in tensors.items()
            if k.startswith("blk.") and int(k.split(".")[1]) >= first}


def test_the_base_head_joins_the_fine_tunes_trunk(tiny: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "grafted.gguf"
    r = run_cli("models", "graft", "--mtp-from", str(tiny["base"]), str(tiny["fine-tune"]),
                "-o", str(out))
    assert r.returncode == 0, r.stderr
    assert "MTP head yes, 1 nextn layer(s), 15 tensors from base.gguf" in r.stdout
    got, base, ft = (tensor_bytes(p) for p in (out, tiny["base"], tiny["fine-tune"]))
    assert head(got) == head(base) and len(head(got)) == 15
    assert any(k.startswith("blk.4.nextn.") for k in head(got))
    assert {k: v for k, v in got.items() if k not in head(got)} == ft
    meta = gguf_facts.read_header(out)[0]
    assert meta["qwen35.block_count"] == 5 and meta["qwen35.nextn_predict_layers"] == 1
    assert meta["mtpwrap.graft.mtp_from"] == "base.gguf"
    assert meta["mtpwrap.graft.mtp_from_name"] == "tiny-qwen35-mtp"
    assert meta["general.name"] == "tiny-qwen35"  # the target stays itself
    facts = gguf_facts.read_facts(out)
    assert facts.has_mtp and facts.n_layer == 4
    assert [p.name for p in tmp_path.iterdir()] == ["grafted.gguf"]


def test_replace_puts_the_base_head_in_place_of_another(tiny: dict[str, Path],
                                                        tmp_path: Path) -> None:
    out = tmp_path / "replaced.gguf"
    r = run_cli("models", "graft", "--mtp-from", str(tiny["base"]), str(tiny["other-head"]),
                "-o", str(out))
    assert r.returncode == 78, r.stderr
    assert f"TARGET {tiny['other-head']} already has an MTP head (1 nextn layer(s))." in r.stderr
    assert "--replace" in r.stderr and not out.exists()
    graft.graft(tiny["base"], tiny["other-head"], out, replace=True)
    got, base, other = (tensor_bytes(p) for p in (out, tiny["base"], tiny["other-head"]))
    assert head(got) == head(base) != head(other)
    assert {k: v for k, v in got.items() if k not in head(got)} == \
        {k: v for k, v in other.items() if k not in head(other)}


def test_a_base_without_a_head_and_an_existing_output_are_refused(tiny: dict[str, Path],
                                                                 tmp_path: Path) -> None:
    r = run_cli("models", "graft", "--mtp-from", str(tiny["fine-tune"]), str(tiny["own-trunk"]),
                "-o", str(tmp_path / "x.gguf"))
    assert r.returncode == 78
    assert "the base has no MTP head (qwen35.nextn_predict_layers is 0, 0 head tensors)" \
        in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "x.gguf").write_bytes(b"keep me")
    with pytest.raises(ConfigError, match=r"the file exists"):
        graft.graft(tiny["base"], tiny["fine-tune"], tmp_path / "x.gguf")
    assert (tmp_path / "x.gguf").read_bytes() == b"keep me"


def variant(tmp_path: Path, name: str, **meta: int) -> Path:
    """A headless qwen35 model like the tiny one with some metadata changed (shape only: the
    refusal comes before any tensor data is read)."""
    spec = tiny_gguf.tiny_spec("qwen35", mtp=False)
    vocab = meta.pop("n_vocab", None)
    if vocab:
        spec.n_vocab = vocab
    spec.meta.update(meta)
    return tiny_gguf.write_spec_shape_only(spec, tmp_path / f"{name}.gguf")


@pytest.mark.parametrize(("change", "field"), [
    ({"embedding_length": 256}, "embedding size (qwen35.embedding_length) is 256, the "
                                "base's 128"),
    ({"n_vocab": 152064}, "vocabulary size (tokenizer.ggml.tokens) is 152064, the base's "
                          "151936"),
    ({"block_count": 8}, "trunk layer count (qwen35.block_count − nextn_predict_layers) is 8, "
                         "the base's 4"),
    ({"attention.key_length": 128}, "K head size (qwen35.attention.key_length) is 128"),
])
def test_a_mismatch_is_refused_naming_the_field(tiny: dict[str, Path], tmp_path: Path,
                                                change: dict[str, int], field: str) -> None:
    target = variant(tmp_path, "mismatch", **change)
    out = tmp_path / "out.gguf"
    r = run_cli("models", "graft", "--mtp-from", str(tiny["base"]), str(target), "-o", str(out))
    assert r.returncode == 78, r.stderr
    assert f"graft: the target's {field}" in r.stderr
    assert "does not belong to this model" in r.stderr and "Traceback" not in r.stderr
    assert not out.exists() and not list(tmp_path.glob(".*.part"))
    os.unlink(target)


def echo(src: Path, dst: Path) -> Path:
    """A copy of a tiny qwen35 model whose trunk and head both predict from the current token
    alone: every block's output projections are zero (the residual stream is the token's
    embedding) and the head's eh_proj passes the embedding half through. Its head then drafts
    exactly what its trunk will say, so acceptance is high and depends on the head."""
    import re
    import shutil

    import numpy as np

    shutil.copyfile(src, dst)
    _meta, infos, data_offset, _ = gguf_facts.read_header(dst)
    with dst.open("r+b") as f:
        for t in infos:
            data: bytes | None = None
            if re.search(r"\.(attn_output|ssm_out|ffn_down)\.weight$", t.name):
                data = bytes(t.n_bytes)
            elif t.name.endswith(".nextn.eh_proj.weight"):
                n = min(t.shape)  # (2 × n_embd inputs, n_embd outputs)
                w = np.zeros((n, 2 * n), dtype=np.float16)
                w[np.arange(n), np.arange(n)] = 1  # the embedding comes first
                data = w.tobytes()
            if data is not None:
                assert len(data) == t.n_bytes
                f.seek(data_offset + t.offset)
                f.write(data)
    return dst


@pytest.mark.integration
def test_the_grafted_model_drafts_in_llama_server_like_its_base(
        tiny: dict[str, Path], tmp_path: Path, llama_server_bin: Path) -> None:
    from mtpwrap.bench.runner import BenchConfig, Client, launch_config

    base = echo(tiny["base"], tmp_path / "base-echo.gguf")
    trunk = echo(tiny["own-trunk"], tmp_path / "trunk-echo.gguf")  # the base's trunk, no head
    grafted = graft.graft(base, trunk, tmp_path / "grafted.gguf")
    # the same trunk with a random head, and the base's head on a fine-tune's trunk
    control = graft.graft(tiny["other-head"], trunk, tmp_path / "control.gguf")
    tuned = graft.graft(tiny["base"], tiny["fine-tune"], tmp_path / "tuned.gguf")

    def greedy(model: Path) -> dict[str, int]:
        srv = launch_config(BenchConfig("mtp", spec="mtp", depth=3),
                            binary=llama_server_bin, model=model, ctx_size=512, threads=1,
                            log_path=tmp_path / f"{model.stem}.log")
        client = Client.of(srv)
        try:
            prompt = client.tokenize("제1조 대한민국은 민주공화국이다. Article 1. " * 4)
            return client.complete(prompt, 32).timings
        finally:
            client.close()
            srv.stop()

    want, got, ctl, ft = (greedy(m) for m in (base, grafted, control, tuned))
    assert want["draft_n_accepted"] > 0, want
    # the base's head on the base's trunk: the very same drafts and acceptances
    assert (got["draft_n"], got["draft_n_accepted"]) == \
        (want["draft_n"], want["draft_n_accepted"])
    # what was accepted is the grafted head's doing: another head on that trunk is not
    assert ctl["draft_n"] > 0 and ctl["draft_n_accepted"] < want["draft_n_accepted"]
    assert ft["draft_n"] > 0
    log = (tmp_path / "tuned.log").read_text()
    assert "adding speculative implementation 'draft-mtp'" in log


@pytest.mark.integration
def test_an_mtp_profile_on_a_headless_model_names_graft_even_without_a_plan(
        tiny: dict[str, Path], tmp_path: Path, llama_server_bin: Path) -> None:
    from tests.helpers import REPO, cli_env

    prof = tmp_path / "cpu-mtp.yaml"
    prof.write_text((REPO / "profiles" / "cpu-demo.yaml").read_text().replace(
        "spec:\n  kind: none", "spec:\n  kind: mtp\n  depth: 2").replace("slots: 2", "slots: 1"))
    env = cli_env(MTPWRAP_HOME=str(tmp_path / "h"), MTPWRAP_BINARY=str(llama_server_bin))
    for cmd in (["args"], ["args", "--no-plan"], ["up", "--no-plan", "--port", "1"]):
        r = run_cli(*cmd, "--profile", str(prof), "--model", str(tiny["fine-tune"]), env=env)
        assert r.returncode == 78, (cmd, r.stderr)
        assert f"{tiny['fine-tune']}: the model has no MTP (nextn) layers, so profile cpu-mtp's " \
               "spec.kind: mtp cannot be used." in r.stderr, (cmd, r.stderr)
        assert "mtpwrap models graft --mtp-from BASE.gguf" in r.stderr
        assert "Traceback" not in r.stderr
    # once grafted, the same profile renders its MTP flags
    out = graft.graft(tiny["base"], tiny["fine-tune"], tmp_path / "grafted.gguf")
    r = run_cli("args", "--no-plan", "--profile", str(prof), "--model", str(out), env=env)
    assert r.returncode == 0, r.stderr
    assert "--spec-type draft-mtp" in r.stdout
