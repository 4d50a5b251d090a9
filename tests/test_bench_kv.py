"""The KV benchmark's admission (the one rule) and effective bits per value from the buffer
sizes llama-server logs."""

from __future__ import annotations

from pathlib import Path

import pytest

from mtpwrap.bench import kv as bench_kv
from mtpwrap.bench.runner import parse_kv_log
from mtpwrap.build import tiny_gguf
from mtpwrap.decide import gguf_facts


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory: pytest.TempPathFactory) -> gguf_facts.ModelFacts:
    path = tmp_path_factory.mktemp("m") / "llama3-8b.gguf"
    return gguf_facts.read_facts(tiny_gguf.write_shape_only(path, model="llama3-8b"))


def test_effective_bits_from_the_logged_buffers(llama8b: gguf_facts.ModelFacts) -> None:
    # 256 cells × 32 layers × 1024 values: f16 is 16 MiB, q8_0 34/32 of half that
    line = ("llama_kv_cache: size =   25.00 MiB (   256 cells,  32 layers,  1/1 seqs), "
            "K (f16):   16.00 MiB, V (q8_0):    8.50 MiB")
    got = bench_kv.effective_bits(llama8b, parse_kv_log(line) or {})
    assert got["k_bits_per_value"] == pytest.approx(16.0)
    assert got["v_bits_per_value"] == pytest.approx(8.5)


def test_a_type_the_model_cannot_take_is_not_applicable_with_the_reason(tmp_path: Path) -> None:
    spec = tiny_gguf.tiny_spec("qwen35")  # heads of 64 values
    facts = gguf_facts.read_facts(tiny_gguf.write_spec_shape_only(spec, tmp_path / "t.gguf"))
    rows = {r["kv"]: r for r in bench_kv.applicable(facts, ["f16", "q8_0", "tbq4_0"])}
    assert rows["f16"]["applicable"] and rows["q8_0"]["applicable"]
    assert rows["q8_0"]["nominal_bits_per_value"] == pytest.approx(8.5)
    assert not rows["tbq4_0"]["applicable"] and "tbq4_0" in rows["tbq4_0"]["reason"]


@pytest.mark.integration
def test_demo_model_bits_per_value_match_the_table_and_tbq_is_not_applicable(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path) -> None:
    from mtpwrap.bench.runner import BenchConfig, launch_config

    facts = gguf_facts.read_facts(demo_model)
    rows = {r["kv"]: r for r in bench_kv.applicable(facts, ["f16", "q8_0", "q4_0", "tbq4_0"])}
    assert not rows["tbq4_0"]["applicable"] and rows["tbq4_0"]["reason"]
    for t in ("f16", "q8_0"):
        assert rows[t]["applicable"]
        log = tmp_path / f"{t}.log"
        _, stop = launch_config(BenchConfig(f"kv-{t}", spec="none", kv=t),
                                binary=llama_server_bin, model=demo_model, ctx_size=512,
                                threads=1, log_path=log)
        stop()
        logged = parse_kv_log(log.read_text(errors="replace"))
        assert logged is not None and logged["k_type"] == t
        got = bench_kv.effective_bits(facts, logged)
        nominal = rows[t]["nominal_bits_per_value"]
        assert got["k_bits_per_value"] == pytest.approx(nominal, rel=0.01)
        assert got["v_bits_per_value"] == pytest.approx(nominal, rel=0.01)
