"""`mtpwrap tune`: the fit, the choice of the measured best, and the profile override."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import yaml

from mtpwrap.bench import stats, tune
from mtpwrap.decide import profiles
from mtpwrap.errors import ConfigError
from tests.helpers import cli_env, run_cli, without

#: the document cache's flags (decide.documents): how prompts are kept between requests, which
#: `up` adds and a speed sweep leaves to llama.cpp
DOCUMENT_FLAGS = ("-cram", "-cpent", "-ctxcp", "--cache-reuse", "-b")


def _point(name: str, spec: str, depth: int, p_min: float | None, tps: float,
           accepted: int = 0, steps: int = 0, drafted: int = 0,
           draft_model: str | None = None) -> dict:
    per = [float(steps)] * depth if spec != "none" else []
    c = stats.Counters(drafted=drafted, accepted=accepted, steps=steps, per_pos=per)
    return {"config": {"name": name, "spec": spec, "depth": depth, "p_min": p_min,
                       "kv": None, "draft_model": draft_model},
            "tokens_per_s": tps, "counters": c.to_dict()}


def _plan(**kw: object) -> tune.TunePlan:
    return tune.TunePlan(binary=Path("/x"), model=Path("/m/model.gguf"),
                         profile=profiles.load_profile("cpu-demo"), **kw)  # type: ignore[arg-type]


def test_analyse_fits_cost_and_picks_measured_best() -> None:
    # Synthetic sweep with every draft accepted (α = 1) and a step cost r(k) = 1.1 + 0.3·k:
    # measured speedup = (k + 1) / r(k).
    base = 100.0
    pts = [_point("baseline", "none", 3, None, base)]
    for k in (1, 2, 3, 5):
        r = 1.1 + 0.3 * k
        pts.append(_point(f"draft-k{k}", "draft", k, 0.0, base * (k + 1) / r,
                          accepted=10 * k, steps=10, drafted=10 * k))
    res = tune.analyse(pts)
    assert res["fit"]["a"] == pytest.approx(1.1) and res["fit"]["c"] == pytest.approx(0.3)
    best = max(res["rows"], key=lambda r: r["tokens_per_s"])
    assert res["best"]["name"] == best["name"] == "draft-k5"
    for r in res["rows"][1:]:
        assert r["alpha"] == 1.0
        assert r["modelled_speedup"] == pytest.approx(r["measured_speedup"])
        assert r["formula_speedup"] == r["k"] + 1


def test_analyse_needs_baseline() -> None:
    with pytest.raises(ConfigError):
        tune.analyse([_point("draft-k1", "draft", 1, 0.0, 10.0, 5, 5, 5)])


def test_ngram_sweep_ignores_p_min() -> None:
    plan = _plan(kind="ngram", depths=[4, 8])
    names = [c.name for c in plan.configs()]
    assert names == ["baseline", "ngram-k4", "ngram-k8"]


def test_write_override_copies_profile_and_sets_spec(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    pts = [_point("baseline", "none", 3, None, 100.0),
           _point("draft-k2-p0.5", "draft", 2, 0.5, 150.0, 15, 10, 20, "/m/drafter.gguf")]
    path = tune.write_override(tune.analyse(pts), _plan())
    assert path == tmp_path / "mtpwrap" / "profiles" / "cpu-demo.yaml"
    data = yaml.safe_load(path.read_text())
    assert data["name"] == "cpu-demo"
    assert data["spec"]["kind"] == "draft" and data["spec"]["depth"] == 2
    assert data["spec"]["p_min"] == 0.5 and data["spec"]["draft_model"] == "/m/drafter.gguf"
    assert "150.0 t/s" in data["description"]
    # the rest is the profile it was measured on, read back as the same profile
    assert data["model"] == "/m/model.gguf" and data["slots"] == 2 and data["context"] == 4096
    assert profiles.validate(data, where="t", expected_name="cpu-demo").spec.depth == 2


def _tune_env(tmp_path: Path, request: pytest.FixtureRequest) -> dict[str, str]:
    """The real built llama-server and demo model, overrides under tmp_path."""
    server = os.environ.get("MTPWRAP_BINARY") or str(
        request.getfixturevalue("llama_server_bin"))
    model = str(request.getfixturevalue("demo_model"))
    return cli_env(MTPWRAP_BINARY=server, MTPWRAP_DEMO_MODEL=model,
                   XDG_CONFIG_HOME=str(tmp_path / "config"))


@pytest.mark.integration
def test_tune_cli_sweeps_and_writes_override(tmp_path: Path,
                                             request: pytest.FixtureRequest) -> None:
    out = tmp_path / "tune"
    env = _tune_env(tmp_path, request)
    # One thread: the self-draft is then bit-exact (acceptance 1.0), see the bench tests.
    p = run_cli("tune", "--depths", "1,3", "--p-min", "0", "--context", "128", "--n-predict",
                "41", "--langs", "en", "--threads", "1", "--write", "--profile", "cpu-demo",
                "--out", str(out), env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "tune.json").read_text())
    assert [r["name"] for r in res["rows"]] == ["baseline", "draft-k1-p0", "draft-k3-p0"]
    best = max(res["rows"], key=lambda r: r["tokens_per_s"])
    assert res["best"]["name"] == best["name"]
    for r in res["rows"][1:]:
        assert r["acceptance_rate"] == 1.0  # self-draft: the known answer again
        assert r["formula_speedup"] == pytest.approx(r["k"] + 1, rel=0.05)
    md = (out / "tune.md").read_text()
    assert "speedup formula" in md and "speedup measured" in md and "speedup model" in md
    override = tmp_path / "config" / "mtpwrap" / "profiles" / "cpu-demo.yaml"
    data = yaml.safe_load(override.read_text())
    assert data["spec"]["kind"] == best["kind"]
    if best["kind"] != "none":
        assert data["spec"]["depth"] == best["depth"]
    # The override is a valid profile that `mtpwrap profiles` now finds under the same name.
    shown = run_cli("profiles", "show", "cpu-demo", env=env)
    assert shown.returncode == 0, shown.stderr
    assert str(override) in shown.stdout or "Tuned by mtpwrap tune" in shown.stdout
    # `up` runs exactly what was measured: `args` on the override gives the measured argv.
    measured = best["argv"]
    assert "--port" not in measured  # tune's server listened on its own socket, as up's does
    shown_args = run_cli("args", "--profile", "cpu-demo", "--json", env=env)
    assert shown_args.returncode == 0, shown_args.stderr
    # the socket's place differs, and the document cache (between requests, not a speed)
    assert without(json.loads(shown_args.stdout)["argv"], "--host", "--port", *DOCUMENT_FLAGS) \
        == without(measured, "--host", *DOCUMENT_FLAGS)


def test_tune_rejects_bad_depths(tmp_path: Path) -> None:
    env = cli_env(MTPWRAP_BINARY="/bin/true", MTPWRAP_DEMO_MODEL=str(tmp_path / "m"))
    (tmp_path / "m").write_bytes(b"GGUF")
    p = run_cli("tune", "--depths", "one", env=env)
    assert p.returncode == 78 and "--depths must be comma-separated integers" in p.stderr
    assert "Traceback" not in p.stderr


@pytest.mark.integration
def test_tune_per_class_writes_the_measured_policy(tmp_path: Path,
                                                   request: pytest.FixtureRequest) -> None:
    """One server at the deepest depth, each request asking for its own: tokens/s per class and
    depth, the best depth per class saved as spec.policy in the profile the sweep served."""
    out = tmp_path / "tune"
    env = _tune_env(tmp_path, request)
    p = run_cli("tune", "--per-class", "--depths", "1,3", "--n-predict", "16", "--threads", "1",
                "--write", "--profile", "cpu-demo", "--out", str(out), env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((out / "tune-per-class.json").read_text())
    assert set(res["per_class"]) == {"ko-prose", "en-prose", "code"}
    for cls, row in res["per_class"].items():
        assert set(row) == {"0", "1", "3"} and all(v and v > 0 for v in row.values()), row
        assert res["policy"][cls] == int(max(row, key=lambda d: row[d]))
    data = yaml.safe_load((tmp_path / "config" / "mtpwrap" / "profiles" /
                           "cpu-demo.yaml").read_text())
    assert data["spec"]["policy"] == res["policy"]
    assert profiles.validate(data, where="t", expected_name="cpu-demo").spec.policy
    measured = res["argv"]
    assert "--port" not in measured  # the sweep's server listened on its own socket
    shown = run_cli("args", "--profile", "cpu-demo", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    assert without(json.loads(shown.stdout)["argv"], "--host", "--port", *DOCUMENT_FLAGS) \
        == without(measured, "--host", *DOCUMENT_FLAGS)
