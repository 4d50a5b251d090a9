"""The plan against llama.cpp's own allocations on the CPU (shape-only and tiny models).

llama-fit-params loads a model without allocating and logs what it would allocate; llama-server
is needed for MTP, whose second context fit-params does not model. Weights, KV and recurrent
state must be within 1 %, compute within 15 %.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.build.calibrate import (
    accepted_cache_types,
    kv_type_sizes,
    measure_config,
    measure_server,
)
from mtpwrap.decide import kv
from mtpwrap.decide.gguf_facts import read_facts
from mtpwrap.decide.planner import MemoryPlan, PlanConfig, plan

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("drop_gguf_files")]


def within(pred: int, got: int, tol: float) -> bool:
    return got > 0 and abs(pred - got) <= tol * got


def weights(p: MemoryPlan) -> int:
    return sum(r.bytes for r in p.rows if r.name.startswith("weights"))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    tmp = tmp_path_factory.mktemp("shapes")
    paths = {m: tiny_gguf.write_shape_only(tmp / f"{m}.gguf", m)
             for m in ("qwen3.6-27b", "llama3-8b", "gemma3-12b")}
    yield paths
    for p in paths.values():
        p.unlink()


CASES = [
    ("qwen3.6-27b", dict(n_ctx=32768, type_k="q4_0", type_v="q4_0")),
    ("qwen3.6-27b", dict(n_ctx=65536, type_k="q8_0", type_v="q8_0", n_slots=2,
                         kv_unified=False)),
    ("qwen3.6-27b", dict(n_ctx=262144, type_k="f16", type_v="f16")),
    ("llama3-8b", dict(n_ctx=16384, type_k="q8_0", type_v="q8_0", n_slots=4,
                       kv_unified=False)),
    ("gemma3-12b", dict(n_ctx=131072, type_k="f16", type_v="f16")),
    # sliding-window layers with four slots: one stream per slot, as llama.cpp keeps them when
    # -np is given (the launch's plan_config says so, see test_resolve)
    ("gemma3-12b", dict(n_ctx=32768, type_k="f16", type_v="f16", n_slots=4,
                        kv_unified=False)),
]


@pytest.mark.parametrize("model,kw", CASES, ids=[f"{m}-{kw['n_ctx']}-{kw['type_k']}"
                                                 for m, kw in CASES])
def test_plan_matches_fit_params(model: str, kw: dict, shapes: dict[str, Path],
                                 fit_params_bin: Path) -> None:
    # fit-params reserves logits for a whole ubatch; llama-server only slots × (1 + depth)
    cfg = PlanConfig(backend="cpu", n_outputs=512, **kw)
    facts = read_facts(shapes[model])
    p = plan(facts, cfg, None)
    got = measure_config(fit_params_bin, shapes[model], cfg)
    # weights come from whole-MiB breakdown columns: allow that rounding on top of 1 %
    assert within(weights(p), got.model_total, 0.01), (weights(p), got.model)
    assert within(p.row("main KV").bytes, got.kv[0], 0.01), (p.row("main KV"), got.kv)
    if facts.recurrent_layers:
        assert within(p.row("recurrent state").bytes, got.recurrent_total, 0.01)
    else:
        assert got.recurrent_total == 0
    assert within(p.row("compute").bytes, got.compute_total, 0.15), (
        p.row("compute").bytes, got.compute_total)


def test_mtp_rows_match_llama_server(llama_server_bin: Path, tmp_path: Path) -> None:
    model = tiny_gguf.write_tiny_random(tmp_path / "tiny-mtp.gguf", arch="qwen35", mtp=True)
    facts = read_facts(model)
    cfg = PlanConfig(backend="cpu", n_ctx=32768, type_k="q8_0", type_v="q8_0", spec="mtp",
                     draft_depth=3, type_k_draft="f16", type_v_draft="f16", cpu_repack=False)
    p = plan(facts, cfg, None)
    got, log = measure_server(llama_server_bin, model, cfg)
    assert len(got.kv) == 2, log[-3000:]  # main context, then the MTP context
    assert within(weights(p) + p.row("MTP weights").bytes, got.model_total, 0.01)
    assert within(p.row("main KV").bytes, got.kv[0], 0.01)
    assert within(p.row("MTP context KV").bytes, got.kv[1], 0.01)
    assert got.kv_detail[1]["type_k"] == "f16" and got.kv_detail[1]["layers"] == 1
    # four recurrent rows (1 + depth 3); small enough that log rounding is ±0.005 MiB
    assert abs(p.row("recurrent state").bytes - got.recurrent_total) <= 0.006 * 2**20
    assert within(p.row("compute").bytes, got.compute_per_context[0], 0.15)
    assert within(p.row("MTP compute").bytes, got.compute_per_context[1], 0.15)
    # MTP off: no MTP weights are loaded and only one context exists
    off = PlanConfig(backend="cpu", n_ctx=32768, type_k="q8_0", type_v="q8_0", cpu_repack=False)
    got_off, _ = measure_server(llama_server_bin, model, off)
    assert len(got_off.kv) == 1
    assert within(weights(plan(facts, off, None)), got_off.model_total, 0.01)
    assert got.model_total - got_off.model_total == pytest.approx(facts.mtp_bytes, abs=2**14)


def test_calibration_sizes_every_cache_type_the_binary_accepts(llama_server_bin: Path) -> None:
    types = accepted_cache_types(llama_server_bin)
    assert "f16" in types and "q4_0" in types
    sizes = kv_type_sizes(llama_server_bin, types=types)
    # upstream types measure exactly as the built-in table says (bytes per 256 values)
    for t, (block, size) in ((n, (k.block, k.bytes)) for n, k in kv.TABLE.items()):
        if t in sizes:
            assert sizes[t]["bytes"] * block == size * sizes[t]["block"], (t, sizes[t])
    assert set(sizes) >= {"f16", "q8_0", "q4_0"}
