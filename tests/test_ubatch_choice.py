"""The ubatch is the memory plan's choice where the profile leaves it open: the largest of
32…2048 whose compute buffers (the main context's and the MTP context's) fit beside the
weights, the KV cache and the MTP context at the profile's context, with the plan's margin.
The 27B is a shape-only GGUF on the recorded RTX 4090; the forks' --help stand in for their
binaries."""

from __future__ import annotations

import json
from pathlib import Path

from mtpwrap.config import settings
from mtpwrap.decide import gguf_facts, ladder, planner
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.decide.launch import plain
from mtpwrap.decide.resolve import plan_config
from mtpwrap.service import startup
from tests.helpers import DATA, recorded_fork, replay, run_cli

GiB, MiB = 2**30, 2**20


def _resolve(tmp_path: Path, profile: str | Path, model: Path, binary: Path, *,
             free_gib: float | None = None) -> startup.Runtime:
    s = settings.load_settings({"profile": str(profile), "model": str(model),
                                "binary": str(binary),
                                "hw_replay": str(replay(tmp_path, free_gib))}, env={})
    return startup.load_runtime(s, None)


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_the_recipe_on_the_fork_keeps_ubatch_32_and_says_why(tmp_path: Path,
                                                             model_27b: Path) -> None:
    """The fork's MTP context takes -ub too; its compute buffer is 712 MiB at -ub 32 (the
    fork's own figure) and grows with the ubatch, so at 262K on the 4090 -ub 64 is short."""
    launch = _resolve(tmp_path, "4090-262k", model_27b, recorded_fork(tmp_path, "fork-1c6e4ea"))
    r = launch.resolved
    assert r is not None and r.plan is not None
    assert r.launch.ubatch == 32
    why = r.launch.reason("ubatch")
    assert "the largest of 32…2048" in why and "64 would be" in why and "MiB short" in why
    assert 600 * MiB < r.plan.headroom < 650 * MiB  # 626 MiB beyond the 1 GiB margin
    spec = launch(Endpoint(port=1), "k" * 20, 0)
    assert spec is not None
    assert any(d.line().startswith("-ub 32: the largest of 32") for d in spec.decisions)
    # the document cache is decided with the chosen ubatch: checkpoints every 1,024 tokens
    assert r.documents is not None and r.documents.min_step == 1024
    assert r.launch.batch == 1024 >= r.launch.ubatch


def test_upstream_takes_a_larger_ubatch_where_it_fits(tmp_path: Path, model_27b: Path) -> None:
    """Upstream's draft-mtp runs the nextn block inside the target (no 712 MiB head-model
    compute): -ub 128 fits at 262K on the 4090, 256 does not."""
    launch = _resolve(tmp_path, "4090-262k", model_27b,
                      recorded_fork(tmp_path, "upstream-0c1e570"))
    r = launch.resolved
    assert r is not None and r.plan is not None and r.plan.fits
    assert r.launch.ubatch == 128
    assert "256 would be" in r.launch.reason("ubatch")
    assert r.documents is not None and r.documents.batch == 1024


def test_more_memory_gives_the_largest_ubatch_and_a_batch_as_large(tmp_path: Path,
                                                                   model_27b: Path) -> None:
    launch = _resolve(tmp_path, "4090-262k", model_27b,
                      recorded_fork(tmp_path, "upstream-0c1e570"), free_gib=40)
    r = launch.resolved
    assert r is not None and r.launch.ubatch == 2048
    assert "2,048 is the largest offered" in r.launch.reason("ubatch")
    # llama.cpp caps the ubatch at the batch: the batch (and the checkpoint step) follow it
    assert r.documents is not None and r.documents.batch == 2048 == r.documents.min_step
    spec = launch(Endpoint(port=1), "k" * 20, 0)
    assert spec is not None
    argv = list(spec.argv)
    assert _flag(argv, "-ub") == "2048" and _flag(argv, "-b") == "2048"


def test_a_profile_ubatch_is_an_override(tmp_path: Path, model_27b: Path) -> None:
    prof = tmp_path / "p.yaml"
    text = (Path(__file__).parent.parent / "profiles" / "4090-262k.yaml").read_text()
    prof.write_text(text + "ubatch: 64\nbatch: 2048\n")
    r = _resolve(tmp_path, prof, model_27b, recorded_fork(tmp_path, "upstream-0c1e570")
                 ).resolved
    assert r is not None and r.launch.ubatch == 64
    assert "from the profile" in r.launch.reason("ubatch")


def test_the_choice_stays_within_the_batch_and_the_context(model_27b: Path) -> None:
    facts = gguf_facts.read_facts(model_27b)
    pc = plan_config(plain(model_27b, context=1024, why="t", cache="q4_0"), facts,
                     backend="cuda")
    c = planner.choose_ubatch(facts, pc, 80 * GiB)
    assert c.ubatch == 1024  # not past the context
    c = planner.choose_ubatch(facts, pc, 80 * GiB, limit=256)
    assert c.ubatch == 256 and c.plan.config.ubatch == 256
    assert c.plan.config.n_outputs == 256  # the fork's whole-ubatch logits follow it
    none = planner.choose_ubatch(facts, pc, 8 * GiB)
    assert none.ubatch == 32 and not none.plan.fits and "no ubatch" in none.reason


def test_the_fork_mtp_compute_grows_with_the_ubatch() -> None:
    assert planner.mtp_compute_floor(32) == planner.FORK_MTP_COMPUTE
    assert planner.mtp_compute_floor(16) == planner.FORK_MTP_COMPUTE
    assert planner.mtp_compute_floor(256) == 8 * planner.FORK_MTP_COMPUTE


def test_an_out_of_memory_start_first_halves_the_ubatch(model_27b: Path) -> None:
    cfg = plain(model_27b, context=262144, why="t", cache="q4_0", ubatch=256)
    steps = ladder.ladder(cfg)
    assert [s.ubatch for s in steps[:3]] == [128, 64, 32]
    assert steps[0].note == "step-down 1: ubatch 128"
    assert all(s.ubatch == 32 for s in steps[3:])


def test_plan_prints_the_ubatch_and_its_reason(tmp_path: Path, model_27b: Path) -> None:
    args = ("plan", "--profile", "4090-262k", "--model", str(model_27b), "--binary",
            str(recorded_fork(tmp_path, "fork-1c6e4ea")), "--hw-replay",
            str(DATA / "snapshots" / "rtx4090.json"))
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    assert "ubatch: 32: the largest of 32…2048 whose compute buffers" in r.stdout
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["ubatch"]["value"] == 32 and "64 would be" in d["ubatch"]["why"]
    assert d["config"]["ubatch"] == 32
