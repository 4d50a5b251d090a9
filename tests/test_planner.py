"""The memory plan against docs/facts.md §3: KV and recurrent sizing rules and the RTX 4090
figure."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.decide.gguf_facts import ModelFacts, read_facts
from mtpwrap.decide.planner import (
    GiB,
    MiB,
    PlanConfig,
    check_fits,
    kv_geometry,
    largest_context,
    n_outputs,
    plan,
    plan_with_limits,
)
from mtpwrap.errors import ConfigError
from tests.helpers import run_cli

pytestmark = pytest.mark.usefixtures("drop_gguf_files")

RTX4090 = 24_080 * MiB
#: a 4.25 bits-per-value cache type (17 bytes per 32 values), sized as calibration would store it
KV425 = {"kv425": {"block": 32, "bytes": 17}}


@pytest.fixture(scope="module")
def q27_path(shape_27b: Path) -> Path:
    return shape_27b


@pytest.fixture(scope="module")
def q27(q27_path: Path) -> ModelFacts:
    return read_facts(q27_path)


def cfg262k(kv: str, **kw: object) -> PlanConfig:
    return PlanConfig(n_ctx=262_144, type_k=kv, type_v=kv, n_slots=1, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("kv,gib", [("f16", 16.0), ("q8_0", 8.5), ("q4_0", 4.5), ("q5_1", 6.0),
                                    ("kv425", 4.25)])
def test_main_kv_in_gib_equals_bits_per_value_at_262k(q27: ModelFacts, kv: str, gib: float
                                                      ) -> None:
    p = plan(q27, cfg262k(kv), RTX4090, KV425)
    assert p.row("main KV").bytes == gib * GiB


@pytest.mark.parametrize("kv,fits,approx_gib", [("f16", False, 31.5), ("q8_0", False, 25.0),
                                                ("q4_0", True, 21.0), ("kv425", True, 20.7)])
def test_rtx4090_verdicts_at_262k(q27: ModelFacts, kv: str, fits: bool, approx_gib: float
                                  ) -> None:
    p = plan(q27, cfg262k(kv), RTX4090, KV425)
    assert p.fits is fits
    assert abs(p.total / GiB - approx_gib) < 0.25
    names = [r.name for r in p.rows]
    assert "MTP weights" not in names and "MTP context KV" not in names


def test_mtp_costs_are_their_own_rows(q27: ModelFacts) -> None:
    off = plan(q27, cfg262k("q4_0"), RTX4090)
    on = plan(q27, cfg262k("q4_0", spec="mtp", draft_depth=3), RTX4090)
    assert on.row("MTP weights").bytes == q27.mtp_bytes > 0
    # the MTP context caches one layer at f16 (-ctkd/-ctvd default): 1 GiB at 262,144
    assert on.row("MTP context KV").bytes == 1 * GiB
    # four recurrent rows (1 + 3 snapshots) of 149.625 MiB instead of one
    assert off.row("recurrent state").bytes == 149.625 * MiB
    assert on.row("recurrent state").bytes == 4 * 149.625 * MiB
    extra = on.total - off.total
    assert 2 * GiB <= extra <= 3.5 * GiB  # "MTP adds roughly 2-3 GiB"
    # a q4_0 draft KV makes the MTP context 3.5x smaller
    q4d = plan(q27, cfg262k("q4_0", spec="mtp", type_k_draft="q4_0", type_v_draft="q4_0"),
               RTX4090)
    assert q4d.row("MTP context KV").bytes == 0.28125 * GiB


def test_outputs_and_compute_follow_the_server(q27: ModelFacts) -> None:
    # llama-server reserves logits for slots × (1 + draft depth) rows, not a whole ubatch
    assert n_outputs(PlanConfig(n_slots=2)) == 2
    assert n_outputs(PlanConfig(n_slots=2, spec="mtp", draft_depth=3)) == 8
    assert n_outputs(PlanConfig(n_outputs=512)) == 512
    fp = plan(q27, PlanConfig(n_ctx=4096, backend="cpu", n_outputs=512), None)
    srv = plan(q27, PlanConfig(n_ctx=4096, backend="cpu"), None)
    assert fp.row("compute").bytes > 512 * 4 * q27.n_vocab > srv.row("compute").bytes
    # smaller ubatch, smaller compute buffer (docs/facts.md: why -ub 32 matters at 262K)
    big = plan(q27, cfg262k("q4_0", ubatch=512, backend="cpu"), None).row("compute").bytes
    small = plan(q27, cfg262k("q4_0", ubatch=32, backend="cpu"), None).row("compute").bytes
    assert small * 8 < big
    # CUDA converts quantized K/V of one layer to f16: 2 B × n_ctx × (K + V width)
    cuda = plan(q27, cfg262k("q4_0", ubatch=512), RTX4090).row("compute").bytes
    assert cuda - big == 2 * 262_144 * 2 * 4 * 256


def test_kv_geometry_padding_and_streams() -> None:
    assert kv_geometry(1000, 1, True) == (1024, 1024, 1)
    assert kv_geometry(8192, 4, True) == (8192, 8192, 1)
    assert kv_geometry(8192, 4, False) == (8192, 2048, 4)
    # 10000 / 3 = 3333 -> 3584 cells per stream, n_ctx rounded to 3 streams of that
    assert kv_geometry(10000, 3, False) == (10752, 3584, 3)


def test_per_slot_streams_and_unified_pool_hold_the_same_cells(q27: ModelFacts) -> None:
    uni = plan(q27, PlanConfig(n_ctx=32768, n_slots=4, kv_unified=True), None)
    per = plan(q27, PlanConfig(n_ctx=32768, n_slots=4, kv_unified=False), None)
    assert uni.row("main KV").bytes == per.row("main KV").bytes == 2 * GiB
    # recurrent state scales with slots either way
    assert per.row("recurrent state").bytes == 4 * 149.625 * MiB


def test_largest_context_grows_as_kv_shrinks(q27: ModelFacts) -> None:
    base = cfg262k("f16")
    sizes = {t: largest_context(q27, base, RTX4090, KV425, kv_type=t)
             for t in ("f16", "q8_0", "q4_0", "kv425")}
    assert 0 < sizes["f16"] < sizes["q8_0"] < sizes["q4_0"] <= sizes["kv425"]
    assert sizes["q4_0"] == 262_144  # capped at the trained context
    # the answer really is the edge: it fits, 256 more does not
    f16 = replace(base, type_k="f16", type_v="f16")
    assert plan(q27, replace(f16, n_ctx=sizes["f16"]), RTX4090).fits
    assert not plan(q27, replace(f16, n_ctx=sizes["f16"] + 256), RTX4090).fits


def test_check_fits_raises_with_numbers_and_the_largest_context(q27: ModelFacts) -> None:
    p = plan_with_limits(q27, cfg262k("f16"), RTX4090, kv_types=["f16", "q4_0"])
    with pytest.raises(ConfigError) as err:
        check_fits(p)
    msg = str(err.value)
    assert "262,144" in msg and "GiB" in msg and "short by" in msg
    assert f"q4_0: {p.largest_context['q4_0']:,}" in msg
    check_fits(plan_with_limits(q27, cfg262k("q4_0"), RTX4090))  # fits: no error


def test_bad_inputs_are_config_errors(q27: ModelFacts, tmp_path: Path) -> None:
    # tbqp4_0 (another commit of the fork) has no size in the built-in table
    with pytest.raises(ConfigError, match="tbqp4_0"):
        plan(q27, cfg262k("tbqp4_0"), RTX4090)
    with pytest.raises(ConfigError, match="spec kind"):
        PlanConfig(spec="eagle")
    dense = read_facts(tiny_gguf.write_shape_only(tmp_path / "l.gguf", "llama3-8b"))
    with pytest.raises(ConfigError, match="no MTP"):
        plan(dense, PlanConfig(spec="mtp"), RTX4090)


def test_dense_llama_kv_counts_every_layer(tmp_path: Path) -> None:
    f = read_facts(tiny_gguf.write_shape_only(tmp_path / "l.gguf", "llama3-8b"))
    p = plan(f, PlanConfig(n_ctx=8192), None)
    # Llama-3-8B: 32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes = 128 KiB per token
    assert p.row("main KV").bytes == 8192 * 128 * 1024
    assert p.row("recurrent state").bytes == 0


def test_gemma_sliding_window_layers_hold_only_the_window(tmp_path: Path) -> None:
    f = read_facts(tiny_gguf.write_shape_only(tmp_path / "g.gguf", "gemma3-12b"))
    p = plan(f, PlanConfig(n_ctx=131072, ubatch=512), None)
    per_layer_tok = 8 * 256 * 2 * 2  # KV heads × head dim × (K, V) × f16
    glob = 8 * 131072 * per_layer_tok
    swa = 40 * 1536 * per_layer_tok  # pad(1024 + 512, 256)
    assert p.row("main KV").bytes == glob + swa


def test_cli_plan_table_and_json(q27_path: Path) -> None:
    r = run_cli("plan", "--model", str(q27_path), "--gpu", "rtx4090", "--kv", "q4_0",
                "--spec", "mtp")
    assert r.returncode == 0, r.stderr
    for word in ("main KV", "recurrent state", "MTP weights", "MTP context KV", "compute",
                 "margin", "largest context that fits"):
        assert word in r.stdout
    r = run_cli("plan", "--model", str(q27_path), "--gpu", "4090", "--kv", "f16", "--json")
    import json

    d = json.loads(r.stdout)
    assert d["fits"] is False and d["context"] == 262_144
    assert d["largest_context"]["q4_0"] == 262_144
    r = run_cli("plan", "--model", str(q27_path), "--gpu", "rtx9999")
    assert r.returncode == 78 and "unknown GPU" in r.stderr


def test_cli_plan_from_a_profile(q27_path: Path, tmp_path: Path) -> None:
    import json

    prof = tmp_path / "mine.yaml"
    prof.write_text("description: test\nhardware:\n  gpu_name: RTX 4090\nmodel: x.gguf\n"
                    "context: max\nkv:\n  k: [tbqp4_0, q8_0]\n  v: [tbqp4_0, q8_0]\n"
                    "spec:\n  kind: mtp\n  depth: 2\nubatch: 32\n")
    r = run_cli("plan", "--profile", str(prof), "--model", str(q27_path), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    # tbqp4_0 has no known size without calibration: the profile's fallback q8_0 is planned
    assert d["config"]["type_k"] == "q8_0" and d["config"]["spec"] == "mtp"
    assert d["config"]["ubatch"] == 32 and d["config"]["draft_depth"] == 2
    # context: max resolves to the largest context that fits, and it does fit
    assert d["fits"] is True and 0 < d["context"] < 262_144
    assert d["context"] == d["largest_context"]["q8_0"]
