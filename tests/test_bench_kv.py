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
        srv = launch_config(BenchConfig(f"kv-{t}", spec="none", kv=t),
                            binary=llama_server_bin, model=demo_model, ctx_size=512,
                            threads=1, log_path=log)
        srv.stop()
        logged = parse_kv_log(log.read_text(errors="replace"))
        assert logged is not None and logged["k_type"] == t
        got = bench_kv.effective_bits(facts, logged)
        nominal = rows[t]["nominal_bits_per_value"]
        assert got["k_bits_per_value"] == pytest.approx(nominal, rel=0.01)
        assert got["v_bits_per_value"] == pytest.approx(nominal, rel=0.01)


# --------------------------------------------------------------------------- llama-perplexity

PPL_DATA = Path(__file__).parent / "data" / "perplexity"


def _recorded(kind: str) -> str:
    """What upstream's llama-perplexity (0c1e570, CPU) printed on gemma-3-270m, Korean court
    rulings, windows of 512, 2 chunks, K and V of the type, against the f16 base file."""
    return (PPL_DATA / f"upstream-0c1e570-gemma-ruling-512-{kind}.log").read_text()


@pytest.fixture(scope="module")
def gemma_shape(tmp_path_factory: pytest.TempPathFactory) -> gguf_facts.ModelFacts:
    spec = tiny_gguf._gemma3_spec(name="gemma-3-270m", n_embd=640, n_layer=18, n_head=4,
                                  n_head_kv=1, head_dim=256, n_ff=2048, n_ctx=32768,
                                  window=512, ftype="q4_0")
    path = tmp_path_factory.mktemp("g") / "gemma.gguf"
    return gguf_facts.read_facts(tiny_gguf.write_spec_shape_only(spec, path))


def test_the_parser_reads_the_kld_statistics_llama_perplexity_printed() -> None:
    q8 = bench_kv.parse_perplexity(_recorded("q8_0"))
    assert q8["kld_mean"] == pytest.approx(0.010772) and q8["kld_mean_unc"] == pytest.approx(
        0.000975)
    assert q8["kld_p99"] == pytest.approx(0.097225)
    assert q8["same_top_p_pct"] == pytest.approx(92.157)
    assert q8["ppl_ratio"] == pytest.approx(0.995558)
    assert q8["ln_ppl_ratio"] == pytest.approx(-0.004452)
    assert (q8["chunks"], q8["window"], q8["seqs_per_pass"]) == (2, 512, 4)
    # the first pass decoded both windows (2 chunks, up to 4 sequences a pass) in 5.69 s
    assert q8["prefill_tokens_per_s"] == pytest.approx(1024 / 5.69)
    assert [c["chunk"] for c in q8["per_chunk"]] == [1, 2]
    q4 = bench_kv.parse_perplexity(_recorded("q4_0"))
    assert q4["kld_mean"] == pytest.approx(0.120182) and q4["same_top_p_pct"] == pytest.approx(
        83.137)
    f16 = bench_kv.parse_perplexity(_recorded("f16"))
    assert abs(f16["kld_mean"]) < 1e-5 and f16["same_top_p_pct"] == 100.0


def test_the_reference_pass_has_a_perplexity_and_no_kld() -> None:
    base = bench_kv.parse_perplexity(_recorded("base"))
    assert base["final_ppl"] == pytest.approx(5.3745)
    assert "kld_mean" not in base and base["window"] == 512
    assert bench_kv.parse_perplexity("error: failed to load model\n") == {"kv_caches": []}


def test_bits_per_value_of_a_sliding_window_model_count_both_caches(
        gemma_shape: gguf_facts.ModelFacts) -> None:
    # gemma-3-270m logs a non-SWA cache (3 layers) and a SWA cache (15 layers)
    for kind, bits in (("f16", 16.0), ("q8_0", 8.5), ("q4_0", 4.5)):
        caches = bench_kv.parse_kv_caches(_recorded(kind))
        assert [c["part"] for c in caches] == ["non-swa", "swa"]
        got = bench_kv.effective_bits(gemma_shape, caches)
        assert got["k_bits_per_value"] == pytest.approx(bits, rel=0.01)
        assert got["v_bits_per_value"] == pytest.approx(bits, rel=0.01)
    # a second context's caches (the fork logs them again) are not added to the first's
    twice = bench_kv.parse_kv_caches(_recorded("q8_0") * 2)
    assert len(twice) == 4
    assert bench_kv.effective_bits(gemma_shape, twice)["k_bits_per_value"] == pytest.approx(
        8.5, rel=0.01)


def _rows(ko: dict[str, list[float]], en: dict[str, list[float]],
          depths: tuple[int, ...] = (1024, 4096)) -> list[dict]:
    out = []
    for lang, table in (("ko", ko), ("en", en)):
        for t, klds in table.items():
            out += [{"kv": t, "lang": lang, "depth": d, "kld_mean": x, "kld_mean_unc": 0.001}
                    for d, x in zip(depths, klds, strict=True)]
    return out


def test_the_answers_follow_the_figures() -> None:
    a = bench_kv.hypotheses(_rows({"q8_0": [0.01, 0.02], "q4_0": [0.10, 0.20]},
                                  {"q8_0": [0.02, 0.03], "q4_0": [0.20, 0.30]}))
    assert a["korean_vs_english"].startswith("Yes: ") and "4 of 4" in a["korean_vs_english"]
    assert a["four_bit_vs_q8_0"].startswith("No: ")
    assert a["depth"].startswith("Yes: ") and "4 of 4" in a["depth"]
    b = bench_kv.hypotheses(_rows({"q8_0": [0.03, 0.02], "q4_0": [0.0305, 0.02]},
                                  {"q8_0": [0.02, 0.01], "q4_0": [0.02, 0.01]}))
    assert b["korean_vs_english"].startswith("No: ")
    assert b["four_bit_vs_q8_0"].startswith("Yes: ") and "q4_0 (ko, 1024)" in b[
        "four_bit_vs_q8_0"]
    assert b["depth"].startswith("No: ")
    one = bench_kv.hypotheses(_rows({"q4_0": [0.1]}, {}, depths=(1024,)))
    assert "not measured" in one["depth"] and "not measured" in one["korean_vs_english"]


def test_kld_order_is_lowest_first_with_f16_as_zero() -> None:
    rows = _rows({"q4_0": [0.12], "q8_0": [0.009], "f16": [-0.0000001]},
                 {"q4_0": [0.14], "q8_0": [0.011], "f16": [0.0]}, depths=(2048,))
    got = bench_kv.kld_order(rows, 2048)
    assert [t for t, _ in got] == ["f16", "q8_0", "q4_0"]
    assert got[2][1] == pytest.approx(0.13)


def test_a_type_the_build_does_not_offer_or_the_model_cannot_take_says_why(
        tmp_path: Path) -> None:
    from mtpwrap.bench.kv_run import KvPlan, admitted

    spec = tiny_gguf.tiny_spec("qwen35")  # heads of 64 values
    facts = gguf_facts.read_facts(tiny_gguf.write_spec_shape_only(spec, tmp_path / "t.gguf"))
    plan = KvPlan(perplexity=tmp_path / "p", server=tmp_path / "s", model=tmp_path / "t.gguf",
                  types=["q8_0", "tbq4_0", "q5_1"], offered=["f16", "q8_0", "tbq4_0"],
                  corpora=["licence"], depths=[512])
    rows = {r["kv"]: r for r in admitted(plan, facts)}
    assert list(rows) == ["f16", "q8_0", "tbq4_0", "q5_1"]  # the reference always runs
    assert rows["f16"]["applicable"] and rows["q8_0"]["applicable"]
    from mtpwrap.decide import kv as rule

    refused = [rule.admits(facts, "tbq4_0", r) for r in ("K", "V")]
    assert rows["tbq4_0"]["reason"] == "; ".join(a.reason for a in refused if not a.admitted)
    assert "head size is 64" in rows["tbq4_0"]["reason"]
    assert not rows["q5_1"]["applicable"]
    assert rows["q5_1"]["reason"].startswith("this build does not offer it")


@pytest.mark.parametrize(("args", "says"), [
    (["--from", "missing.json"], "--from missing.json: cannot read a KV benchmark report"),
    (["--from", "{bad}"], "not a `mtpwrap bench kv` report.json"),
    (["--chunks", "1,2", "--depths", "512,1024,2048", "--binary", "/nonexistent/llama-server"],
     ""),
])
def test_bad_input_is_one_sentence_and_exit_78(tmp_path: Path, args: list[str],
                                               says: str) -> None:
    from mtpwrap.errors import EXIT_CONFIG
    from tests.helpers import run_cli

    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "bench"}')
    args = [str(bad) if a == "{bad}" else a for a in args]
    r = run_cli("bench", "kv", *args, cwd=tmp_path)
    assert "Traceback" not in r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    if says:
        assert r.returncode == EXIT_CONFIG
        assert len(lines) == 1 and says in lines[0]
    else:  # no such binary: a missing tool, not a configuration error
        assert r.returncode != 0 and lines


def test_one_corpus_per_language(tmp_path: Path) -> None:
    from mtpwrap.bench import materials
    from mtpwrap.bench.kv_run import KvPlan
    from mtpwrap.errors import ConfigError

    plan = KvPlan(perplexity=tmp_path / "p", server=tmp_path / "s", model=tmp_path / "m",
                  types=["q8_0"], offered=None, corpora=["ruling", "statute"], depths=[512])
    with pytest.raises(ConfigError, match="ruling and statute are both ko"):
        materials.check_kv_plan(plan)


def test_the_profiles_kv_reason_is_the_launchs_reason(tmp_path: Path) -> None:
    from mtpwrap.decide import choice, profiles

    base = profiles.load_profile("cpu-demo")
    why = "measured: mean KLD at 1K q8_0 0.0104, q4_0 0.142"
    prof = profiles.with_overrides(base, {"kv": {"k": ["q8_0", "q4_0"], "v": ["q8_0"],
                                                 "why": why}}, where="test")
    assert profiles.to_yaml(prof)["kv"]["why"] == why
    assert profiles.validate(profiles.to_yaml(prof), where="again").kv == prof.kv
    cfg = choice.choose(prof, None, None, model="m.gguf")
    assert cfg.cache_k == "q8_0" and why in cfg.reason("cache_k")
    plain = choice.choose(base, None, None, model="m.gguf")
    assert "the list's order" not in plain.reason("cache_k")
    with pytest.raises(Exception, match=r"kv\.why"):
        profiles.with_overrides(base, {"kv": {"k": ["f16"], "v": ["f16"], "why": "a\nb"}},
                                where="test")


# --------------------------------------------------------------------------- the real build


@pytest.fixture(scope="module")
def gemma_model() -> Path:
    from mtpwrap.models import known

    return known.ensure(known.GEMMA)


@pytest.fixture(scope="module")
def gemma_figures(cpu_manifest: dict, gemma_model: Path,
                  tmp_path_factory: pytest.TempPathFactory) -> dict:
    """bench kv on the CPU build and gemma-3-270m: Korean court rulings, one window of 256,
    two chunks, f16 (against itself), q8_0 and q4_0, one thread.

    A window of 256 (a quarter of 1024's tokens) still separates the types by far: mean KLD
    q8_0 0.0087 ± 0.0009 against q4_0 0.100 ± 0.013 here, top-1 agreement 94.9 % against
    85.4 % (1024: 0.012 against 0.143, 94.6 % against 81.7 %). One thread: the figures are
    the same as with two, and a loaded machine does not slow it down as much."""
    from mtpwrap.bench import kv_run, materials

    build = materials.kv_build(cpu_manifest["binaries"]["llama-server"]["path"])
    plan = kv_run.KvPlan(perplexity=build.perplexity, server=build.server, model=gemma_model,
                         types=["f16", "q8_0", "q4_0"], offered=build.offered,
                         corpora=["ruling"], depths=[256], chunks=[2], speed=False,
                         target=build.target, threads=1)
    return kv_run.run(plan, tmp_path_factory.mktemp("kv"))


@pytest.mark.integration
def test_f16_against_itself_is_zero_and_q4_0_loses_more_than_q8_0(gemma_figures: dict) -> None:
    rows = {r["kv"]: r for r in gemma_figures["rows"]}
    assert set(rows) == {"f16", "q8_0", "q4_0"}
    assert all("error" not in r for r in rows.values()), rows
    f16, q8, q4 = rows["f16"], rows["q8_0"], rows["q4_0"]
    assert abs(f16["kld_mean"]) < 1e-4 and f16["kld_p99"] < 1e-3
    assert f16["same_top_p_pct"] > 99.9
    assert q8["kld_mean"] > 1e-4  # a quantized cache changes the distributions
    assert q4["kld_mean"] > q8["kld_mean"] and q4["same_top_p_pct"] < q8["same_top_p_pct"]
    for t, bits in (("f16", 16.0), ("q8_0", 8.5), ("q4_0", 4.5)):
        assert rows[t]["k_bits_per_value"] == pytest.approx(bits, rel=0.02)
        assert rows[t]["scored_positions"] == [128, 255] and rows[t]["chunks"] == 2
    docs = gemma_figures["corpora"]["ruling"]["documents"]
    assert docs and all(len(d["sha256"]) == 64 for d in docs)
    assert len({d["name"] for d in docs}) == len(docs)  # whole documents, each once


@pytest.mark.integration
def test_write_orders_the_profiles_kv_by_measured_kld_and_args_says_why(
        gemma_figures: dict, cpu_manifest: dict, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from mtpwrap.bench import kv_tune
    from tests.helpers import cli_env, run_cli

    # the override goes to a configuration folder of the test's own, never the user's
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    server = cpu_manifest["binaries"]["llama-server"]["path"]
    path, why = kv_tune.write_kv_order(gemma_figures, profile="cpu-demo", context=2048,
                                       binary=server)
    written = yaml.safe_load(path.read_text())
    measured = {r["kv"]: r["kld_mean"] for r in gemma_figures["rows"]}
    want = sorted(measured, key=lambda t: 0.0 if t == "f16" else measured[t])
    assert path.is_relative_to(tmp_path / "config")
    assert written["kv"]["k"] == want == written["kv"]["v"]
    assert written["context"] == 2048 and written["model"] == gemma_figures["plan"]["model"]
    assert f"KLD {measured['q8_0']:.3g} vs {measured['q4_0']:.3g} at 256" in why
    r = run_cli("args", "--profile", "cpu-demo", "--binary", server, cwd=tmp_path,
                env=cli_env(XDG_CONFIG_HOME=str(tmp_path / "config")))
    assert r.returncode == 0, r.stderr
    assert "q8_0 before q4_0 for this model" in r.stdout


@pytest.mark.integration
def test_demo_model_runs_on_and_reports_a_128_value_block_type_not_applicable(
        cpu_manifest: dict, demo_model: Path, tmp_path: Path) -> None:
    import json

    from tests.helpers import run_cli

    server = cpu_manifest["binaries"]["llama-server"]["path"]
    r = run_cli("bench", "kv", "--binary", server, "--model", str(demo_model), "--types",
                "f16,tbq4_0", "--corpora", "licence", "--depths", "256", "--chunks", "2",
                "--no-speed", "--threads", "1", "--out", str(tmp_path / "out"), timeout=600,
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    na = {t["kv"]: t for t in rep["types"] if not t["applicable"]}
    assert "not a multiple of its block of 128" in na["tbq4_0"]["reason"]
    assert "tbq4_0: not applicable" in r.stderr
    assert [x["kv"] for x in rep["rows"]] == ["f16"] and abs(rep["rows"][0]["kld_mean"]) < 1e-4
    md = (tmp_path / "out" / "report.md").read_text()
    assert "## Not applicable" in md and "CC-BY-4.0" in md


def test_a_window_the_machine_cannot_hold_is_refused_with_its_size() -> None:
    """gemma-3-270m's 262,144-token vocabulary: a 16K window's reference needs 16 GiB of memory
    (llama-perplexity keeps a log-probability row per position), a 1K window 1 GiB."""
    from mtpwrap.units import GiB

    vocab = 262_144
    assert bench_kv.window_cost(16_384, vocab, 1) == (16 * GiB, 4 * GiB)
    assert bench_kv.window_refusal(1024, vocab, 2, memory_free=20 * GiB,
                                   disk_free=100 * GiB) is None
    why = bench_kv.window_refusal(16_384, vocab, 1, memory_free=19 * GiB, disk_free=100 * GiB)
    assert why is not None and "16.0 GiB of memory" in why and "19.0 GiB is available" in why
    why = bench_kv.window_refusal(16_384, vocab, 4, memory_free=64 * GiB, disk_free=10 * GiB)
    assert why is not None and "16.0 GiB of disk" in why and "--chunks" in why
