"""`up`'s resolving step on a recorded RTX 4090: profile, memory plan and argv before anything
starts. The fork cannot be built here, so its recorded --help stands in for the binary, and the
27B model is a shape-only GGUF (real header and tensor shapes, sparse file)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.config import settings
from mtpwrap.decide import profiles
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.errors import ConfigError
from mtpwrap.service import startup
from tests.helpers import DATA, recorded_fork, replay

FORKS = ["fork-0bc0a27", "fork-1c6e4ea"]
#: every shipped GPU profile and the recorded GPU it is meant for
SHIPPED_GPU = [("3090-192k", "rtx3090"), ("4090-128k-q8", "rtx4090"), ("4090-262k", "rtx4090"),
               ("5090-262k", "rtx5090"), ("h100-262k", "h100"), ("h200-262k", "h200")]
MiB = 2**20


def resolve(tmp_path: Path, profile: str, model: Path, binary: Path,
            free_gib: float | None = None, plan: str | None = None,
            gpu: str = "rtx4090",
            slot_save_path: Path | None | Literal["settings"] = "settings") -> startup.Runtime:
    s = settings.load_settings({"profile": profile, "model": str(model), "binary": str(binary),
                                "hw_replay": str(replay(tmp_path, free_gib, gpu)),
                                "plan": plan}, env={})
    return startup.load_runtime(s, slot_save_path)


@pytest.mark.parametrize("fork", FORKS)
def test_the_recipe_plans_and_fits_on_a_4090_with_an_uncalibrated_fork(
        tmp_path: Path, model_27b: Path, fork: str) -> None:
    launch = resolve(tmp_path, "4090-262k", model_27b, recorded_fork(tmp_path, fork))
    plan = launch.resolved.plan
    assert plan is not None and plan.fits and plan.context == 262_144
    # the fork reports ~20 GB for this launch on its own RTX 4090
    assert 19 * 2**30 <= plan.total <= 22 * 2**30, plan.total / 2**30
    rows = {r.name: r for r in plan.rows}
    assert rows["main KV"].bytes == 4224 * MiB  # the fork's README: tbq4_0 at 262K
    assert rows["MTP context KV"].bytes == 264 * MiB and "tbq4_0" in rows["MTP context KV"].note
    assert rows["MTP compute"].bytes == 712 * MiB
    assert rows["MTP head output"].bytes > 900 * MiB  # the head model's own output matrix
    assert rows["margin"].bytes == 1024 * MiB and "--fit" in rows["margin"].note
    spec = launch(Endpoint(port=1), "k" * 20, 0)
    assert spec is not None
    argv = spec.argv
    assert argv[argv.index("-ctk") + 1] == argv[argv.index("-ctkd") + 1] == "tbq4_0"
    assert argv[argv.index("--spec-type") + 1] == "mtp"


@pytest.mark.parametrize("fork", [*FORKS, "upstream-0c1e570"])
@pytest.mark.parametrize(("profile", "gpu"), SHIPPED_GPU)
def test_every_shipped_profile_fits_its_gpu_on_the_fork(tmp_path: Path, model_27b: Path,
                                                        fork: str, profile: str,
                                                        gpu: str) -> None:
    launch = resolve(tmp_path, profile, model_27b, recorded_fork(tmp_path, fork), gpu=gpu)
    plan = launch.resolved.plan
    assert plan is not None and plan.fits, (profile, plan.total / MiB if plan else None)
    assert plan.headroom is not None and plan.headroom >= 0


def test_the_fit_cross_check_on_the_fork_adds_the_recurrent_snapshots(tmp_path: Path,
                                                                     model_27b: Path) -> None:
    """The fork's llama-fit-params takes no --spec-type, so llama.cpp sizes one recurrent row
    per slot; MTP at depth 3 keeps four (common/common.cpp: n_rs_seq = the draft depth). The
    measurement adds the three it cannot see, and says so. The stand-in replays what the
    fork's own llama-fit-params printed for the 27B at 262K with -ub 32."""
    exe = recorded_fork(tmp_path, "fork-0bc0a27")
    fit = exe.with_name("llama-fit-params")
    log = DATA / "fit-params" / "fork-0bc0a27" / "qwen3.6-27b-c262144-tbq4_0-ub32.txt"
    fit.write_text("#!/bin/sh\n"
                   f'case "$1" in --help) cat "{DATA}/help/fork-0bc0a27-fit-params.txt";; '
                   f'*) cat "{log}";; esac\n')
    fit.chmod(0o755)
    launch = resolve(tmp_path, "4090-262k", model_27b, exe)
    r = launch.resolved
    assert r.measured is not None and r.plan is not None, r.measured_text
    assert r.measured["recurrent"] == int(149.62 * MiB) or abs(
        r.measured["recurrent"] - 149.62 * MiB) < 0.01 * MiB
    snap = r.measured["planned recurrent snapshots"]
    assert snap == r.plan.row("recurrent state").bytes - r.measured["recurrent"]
    assert 3 * 149 * MiB <= snap <= 3 * 150 * MiB
    assert "MTP rows and recurrent snapshots added" in (r.measured_text or "")


def test_cli_plan_of_the_recipe_on_the_recorded_4090(tmp_path: Path, model_27b: Path) -> None:
    from tests.helpers import run_cli

    r = run_cli("plan", "--profile", "4090-262k", "--model", str(model_27b), "--binary",
                str(recorded_fork(tmp_path, "fork-0bc0a27")), "--hw-replay",
                str(DATA / "snapshots" / "rtx4090.json"), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["fits"] is True and d["config"]["type_k"] == "tbq4_0"
    assert 19 * 2**30 <= d["total"] <= 22 * 2**30
    # the fork's own types are listed with the largest context each fits
    assert d["largest_context"]["tbq4_0"] == 262_144
    assert d["largest_context"]["q4_0"] < 262_144
    assert set(d["largest_context"]) >= {"tbq3_0", "planar3_0", "iso4_0"}


def test_cli_plan_lists_only_types_the_binary_offers_and_the_model_takes(
        tmp_path: Path, model_27b: Path) -> None:
    from tests.helpers import run_cli

    snap = str(DATA / "snapshots" / "rtx4090.json")
    up = run_cli("plan", "--profile", "4090-262k", "--model", str(model_27b), "--binary",
                 str(recorded_fork(tmp_path, "upstream-0c1e570")), "--hw-replay", snap,
                 "--json")
    assert up.returncode == 0, up.stderr
    d = json.loads(up.stdout)
    assert d["fits"] is True  # with f16 for upstream's MTP context (profile draft_kv)
    assert set(d["largest_context"]) == {"f16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0",
                                         "iq4_nl"}
    # the demo model's K/V rows (192 values) take none of the fork's 128-value blocks
    demo = tiny_gguf.write_shape_only(tmp_path / "smollm2.gguf", "smollm2-135m")
    fork_exe = str(recorded_fork(tmp_path, "fork-0bc0a27"))
    fork = run_cli("plan", "--model", str(demo), "--binary", fork_exe, "--hw-replay", snap,
                   "--context", "4096", "--json")
    assert fork.returncode == 0, fork.stderr
    d = json.loads(fork.stdout)
    assert "q4_0" in d["largest_context"] and "tbq4_0" not in d["largest_context"]
    assert "not a multiple of its block of 128" in d["not_admitted"]["tbq4_0"]
    text = run_cli("plan", "--profile", "4090-262k", "--model", str(model_27b), "--binary",
                   fork_exe, "--hw-replay", snap)
    assert "planar4_0, iso4_0, planar3_0, iso3_0: attention reads these through" in " ".join(
        text.stdout.split())


def test_plan_on_a_4090_fits_and_argv_carries_the_profile(tmp_path: Path,
                                                         fork_binary: Path,
                                                         model_27b: Path) -> None:
    launch = resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary)
    assert launch.with_plan() is launch  # a GPU plan is made before anything starts
    assert "GiB on the GPU at context 131,072" in launch.info.memory_plan
    assert launch.info.kv == "q8_0 / q8_0" and launch.info.speculation_type == "mtp"
    spec = launch(Endpoint(port=4321), "secret-key", 0)
    assert spec is not None
    assert spec.argv[spec.argv.index("--port") + 1] == "4321"
    assert spec.argv[spec.argv.index("--host") + 1] == "127.0.0.1"
    assert "secret-key" not in spec.argv and "secret-key" in spec.env.values()


def test_the_launch_saves_slots_in_the_directory_of_the_running_store(
        tmp_path: Path, fork_binary: Path, model_27b: Path) -> None:
    from mtpwrap.config.objects import default_snapshot_dir

    def saves_in(launch: startup.Runtime) -> str | None:
        spec = launch(Endpoint(port=4321), "secret-key", 0)
        assert spec is not None and launch.resolved is not None
        assert spec.launch == launch.resolved.launch
        argv = list(spec.argv)
        return argv[argv.index("--slot-save-path") + 1] if "--slot-save-path" in argv else None

    def launch(slot_save_path: Path | None | Literal["settings"]) -> startup.Runtime:
        return resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary,
                       slot_save_path=slot_save_path)

    assert saves_in(launch("settings")) == str(default_snapshot_dir())  # persist.dir's default
    # the directory of the store the running service opened, kept across a reload
    assert saves_in(launch(tmp_path / "store")) == str(tmp_path / "store")
    assert saves_in(launch(None)) is None  # persistence off


def test_plan_that_does_not_fit_stops_before_the_start(tmp_path: Path,
                                                      fork_binary: Path,
                                                      model_27b: Path) -> None:
    with pytest.raises(ConfigError, match=r"needs .* GiB .* but the device has 8\.00 GiB"):
        resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary, free_gib=8)


def test_a_gpu_launch_that_cannot_be_planned_is_refused_unless_told(tmp_path: Path,
                                                                   fork_binary: Path,
                                                                   model_27b: Path) -> None:
    # tbqp4_0 (named at another commit of the fork) has no size in the built-in table and
    # this binary was never measured: the plan cannot be made, and the launch is not started
    # unchecked.
    prof = tmp_path / "odd.yaml"
    prof.write_text((DATA.parent.parent / "profiles" / "4090-262k.yaml").read_text()
                    .replace("[tbq4_0, q4_0]", "[tbqp4_0]"))
    odd_binary = tmp_path / "odd-server"
    odd_binary.write_text(fork_binary.read_text().replace(
        'fork-1c6e4ea.txt"', 'fork-1c6e4ea.txt" | sed s/tbq4_0/tbqp4_0/g'))
    odd_binary.chmod(0o755)
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, str(prof), model_27b, odd_binary)
    assert "the memory plan could not be made (KV cache type 'tbqp4_0'" in str(info.value)
    assert "--no-plan" in str(info.value)
    launch = resolve(tmp_path, str(prof), model_27b, odd_binary, plan="skip")
    assert launch.info.memory_plan == "skipped (--no-plan)"
    assert any("not checked against the GPU's free memory" in w for w in launch.warnings)
    spec = launch(Endpoint(port=1), "k" * 20, 0)
    assert spec is not None and spec.argv[spec.argv.index("-ctk"):][:2] == ["-ctk", "tbqp4_0"]


def test_a_plan_that_does_not_fit_names_the_contexts_that_do(tmp_path: Path,
                                                            fork_binary: Path,
                                                            model_27b: Path) -> None:
    """20 GiB free and 4090-128k-q8: 128K does not fit, but smaller contexts do, for q8_0 and
    for the profile's fallback types."""
    with pytest.raises(ConfigError) as info:
        resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary, free_gib=20)
    msg = str(info.value)
    assert "short by" in msg and "No context fits" not in msg
    listed = dict(part.split(": ") for part in
                  msg.split("Largest context that fits per KV type — ")[1].rstrip(".").split(", "))
    assert "q8_0" in listed
    fits_q8 = int(listed["q8_0"].replace(",", ""))
    assert 0 < fits_q8 < 131072
    # and that context really fits: the same profile at that context is planned and launched
    shipped = profiles.shipped_dirs()[1] / "4090-128k-q8.yaml"
    smaller = tmp_path / "4090-128k-q8.yaml"
    smaller.write_text(shipped.read_text().replace("context: 131072", f"context: {fits_q8}"))
    launch = resolve(tmp_path, str(smaller), model_27b, fork_binary, free_gib=20)
    assert f"at context {fits_q8:,}" in launch.info.memory_plan


def test_cpu_profile_defers_the_plan(tmp_path: Path, fork_binary: Path) -> None:
    tiny = tiny_gguf.write_tiny_random(tmp_path / "tiny.gguf", arch="llama", mtp=False)
    launch = resolve(tmp_path, "cpu-demo", tiny, fork_binary)
    assert launch.info.memory_plan is None
    planned = launch.with_plan()  # a new runtime: the one planned stays as it was
    assert launch.info.memory_plan is None and planned.resolved is not None
    assert "GiB on the host at context 4,096" in planned.info.memory_plan
    assert planned.resolved.planned and planned.supervisor == launch.supervisor


def test_multi_slot_plans_one_kv_stream_per_slot(tmp_path: Path) -> None:
    """llama-server keeps one KV stream per slot when -np is given (a unified pool only when
    -np is "auto"): sliding-window caches are then per slot, window + ubatch each."""
    from mtpwrap.decide import gguf_facts, launch, resolve

    model = tiny_gguf.write_shape_only(tmp_path / "gemma3-12b.gguf", "gemma3-12b")
    facts = gguf_facts.read_facts(model)
    cfg = launch.plain(model, context=32768, slots=4, why="test")
    pc = resolve.plan_config(cfg, facts, backend="cpu")
    assert pc.kv_unified is False
    assert resolve.plan_config(cfg.replace(kv_unified=True), facts, backend="cpu").kv_unified
    from mtpwrap.decide.planner import plan

    p = plan(facts, pc, None)
    unified = plan(facts, resolve.plan_config(cfg.replace(kv_unified=True), facts,
                                              backend="cpu"), None)
    # per slot: window + ubatch cells in every SWA layer, so more than one shared window
    assert p.row("main KV").bytes > unified.row("main KV").bytes


def test_near_the_edge_steps_down_by_default_along_a_planned_ladder(tmp_path: Path,
                                                                    fork_binary: Path,
                                                                    model_27b: Path) -> None:
    """128K with q8_0 KV on a 4090: the plan fits with little to spare, so `auto` turns
    step-down on; each rung of the ladder plans fewer bytes than the one before."""
    roomy = resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary, free_gib=80)
    assert roomy.info.near_edge is False
    assert roomy.supervisor.oom_step_down is False
    tight = resolve(tmp_path, "4090-128k-q8", model_27b, fork_binary)  # 23.5 GiB free
    assert tight.info.near_edge is True
    assert tight.supervisor.oom_step_down is True
    off = settings.load_settings({}, env={"MTPWRAP_SUPERVISOR_OOM_STEP_DOWN": "false"})
    assert startup.supervisor_config(off, near_edge=True).oom_step_down is False

    cost = tight.resolved.cost()
    assert cost is not None
    rungs = []
    step = 1
    while (spec := tight(Endpoint(port=4321), "k" * 20, step)) is not None:
        rungs.append(spec)
        step += 1
    assert rungs and rungs[-1].note.startswith(f"step-down {len(rungs)}: ")
    from mtpwrap.decide import ladder

    cfgs = ladder.ladder(tight.resolved.launch, tight.resolved.inputs.caps,
                         tight.resolved.inputs.kv_sizes, cost)
    assert [c.note for c in cfgs] == [r.note for r in rungs]
    totals = [cost(tight.resolved.launch)] + [cost(c) for c in cfgs]
    assert all(a > b for a, b in zip(totals, totals[1:], strict=False)), totals
    # MTP depth 3 → 1 saves least (a few recurrent snapshots), so it comes first
    assert "draft depth 1" in cfgs[0].note
