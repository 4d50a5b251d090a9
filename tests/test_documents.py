"""How a launch keeps long documents warm (`decide.documents`): context checkpoints on hybrid
and sliding-window models, --cache-reuse off on hybrid ones, --cache-ram sized from the RAM
available at start (never 0 unless the profile asks), a context past the model's trained one
capped and said, and a binary that lacks a flag told. The 27B is a shape-only GGUF on the
recorded RTX 4090; the forks' --help stand in for their binaries."""

from __future__ import annotations

import dataclasses
import json
import re
import time
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.config import settings
from mtpwrap.decide import documents, hardware
from mtpwrap.service import startup
from tests.helpers import DATA, recorded_fork, replay

GiB, MiB = 2**30, 2**20


def _resolve(tmp_path: Path, profile: str | Path, model: Path, binary: Path, *,
             gpu: str = "rtx4090", ram_gib: float | None = None) -> startup.Runtime:
    snap = replay(tmp_path, None, gpu)
    if ram_gib is not None:  # a host with this much RAM, all of it available
        record = json.loads(snap.read_text())
        record["host"]["ram_total"] = record["host"]["ram_available"] = int(ram_gib * GiB)
        snap.write_text(json.dumps(record))
    s = settings.load_settings({"profile": str(profile), "model": str(model),
                                "binary": str(binary), "hw_replay": str(snap)}, env={})
    return startup.load_runtime(s, None)


def _argv(launch: startup.Runtime) -> list[str]:
    from mtpwrap.decide.endpoint import Endpoint

    spec = launch(Endpoint(port=1), "k" * 20, 0)
    assert spec is not None
    return list(spec.argv)


def _flag(argv: list[str], *names: str) -> str | None:
    for n in names:
        if n in argv:
            return argv[argv.index(n) + 1]
    return None


def test_the_recipe_keeps_262k_documents_warm_on_the_fork(tmp_path: Path,
                                                           model_27b: Path) -> None:
    launch = _resolve(tmp_path, "4090-262k", model_27b, recorded_fork(tmp_path, "fork-1c6e4ea"))
    doc = launch.resolved.documents
    assert doc is not None and doc.needs_checkpoints
    argv = _argv(launch)
    # a checkpoint every 1,024 tokens, at the batch boundaries, and enough of them to reach back
    # past an 8K-token question
    assert _flag(argv, "-cpent", "--checkpoint-every-n-tokens") == "1024"
    assert "-cms" not in argv and "--checkpoint-min-step" not in argv  # upstream's, as it is
    assert _flag(argv, "-b", "--batch-size") == "1024"
    assert int(_flag(argv, "-ctxcp", "--ctx-checkpoints") or 0) * 1024 >= 8192
    assert _flag(argv, "--cache-reuse") == "0"
    # the RAM cache: the recorded host's 58 GiB available (of 63) less a reserve, the model's
    # host rows and the slot's checkpoints, several 262K documents of tbq4_0 KV (about 5.5 GiB
    # each) with their checkpoints
    ram = int(_flag(argv, "-cram", "--cache-ram") or 0)
    assert 44 * 1024 < ram < 51 * 1024, ram
    assert doc.documents is not None and doc.documents >= 4
    # the checkpoint is the recurrent state of one sequence (48 DeltaNet layers of f32 rows)
    # and, with MTP, the draft context's KV up to its position, whole: about 264 MiB at 262K
    assert 140 * MiB < doc.checkpoint_bytes < 160 * MiB
    mtp_at_end = 11 * (264 * MiB)
    assert 4 * GiB + mtp_at_end < doc.entry_bytes < 6 * GiB + mtp_at_end + 2 * GiB
    assert "holds" in doc.summary() and "every 1,024 tokens" in doc.summary()
    assert not doc.warnings


def test_plan_says_how_many_documents_the_ram_cache_holds(tmp_path: Path,
                                                         model_27b: Path) -> None:
    from tests.helpers import run_cli

    args = ("plan", "--profile", "4090-262k", "--model", str(model_27b), "--binary",
            str(recorded_fork(tmp_path, "fork-1c6e4ea")), "--hw-replay",
            str(DATA / "snapshots" / "rtx4090.json"))
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    text = r.stdout
    assert "documents: RAM cache" in text and "full-context document(s) of 262,144" in text
    assert "cache_reuse: off: KV shifting" in text
    d = json.loads(run_cli(*args, "--json").stdout)["documents"]
    assert d["checkpoints"] >= 8 and d["min_step"] == 1024 and d["documents"] >= 5


def test_a_document_larger_than_the_ram_left_is_said_at_plan_time(tmp_path: Path,
                                                                  model_27b: Path) -> None:
    """llama-server skips a cache entry over --cache-ram without a word: the plan says it."""
    launch = _resolve(tmp_path, "4090-262k", model_27b, recorded_fork(tmp_path, "fork-1c6e4ea"),
                      ram_gib=5)
    doc = launch.resolved.documents
    assert doc is not None and doc.documents == 0
    (w,) = [w for w in launch.resolved.launch.warnings if "full-context document" in w]
    assert "262,144 tokens" in w and "not kept in RAM" in w and "add RAM" in w
    # what is left for the cache is below nothing: it gets its floor, which keeps shorter
    # documents (0 would turn llama-server's cache off)
    assert doc.ram_budget is not None and doc.ram_budget < 0
    ram = int(_flag(_argv(launch), "-cram", "--cache-ram") or 0)
    assert ram == doc.cache_ram_mib and 1024 <= ram < 4096, ram
    assert f"--cache-ram {ram:,} MiB" in w and "shorter ones are kept" in w
    assert _tokens(w) >= documents.FLOOR_TOKENS
    assert "the cache gets its floor" in dict(doc.why)["cache_ram"]


def test_the_fork_spells_the_checkpoint_spacing_its_own_way(tmp_path: Path,
                                                             model_27b: Path) -> None:
    """The fork at 0bc0a27 has no --checkpoint-min-step; its --checkpoint-every-n-tokens
    makes a checkpoint every n tokens during a read, which is what the plan asks for."""
    launch = _resolve(tmp_path, "4090-262k", model_27b, recorded_fork(tmp_path, "fork-0bc0a27"))
    argv = _argv(launch)
    assert "--checkpoint-min-step" not in argv and "-cms" not in argv
    assert _flag(argv, "-cpent", "--checkpoint-every-n-tokens") == "1024"
    assert not [w for w in launch.warnings if "lacks" in w]


def test_a_binary_without_the_checkpoint_step_is_planned_as_it_is(tmp_path: Path,
                                                                  model_27b: Path) -> None:
    """A binary that lacks the spacing flag: the plan says what that costs (the same words in
    `plan` and `up`), and the launch leaves the flag out instead of failing."""
    exe = recorded_fork(tmp_path, "upstream-0c1e570")
    help_text = (DATA / "help" / "upstream-0c1e570.txt").read_text().splitlines(keepends=True)
    i = next(n for n, line in enumerate(help_text) if line.startswith("-cpent,"))
    lacking = tmp_path / "lacking.txt"
    lacking.write_text("".join(help_text[:i] + help_text[i + 3:]))
    exe.write_text(exe.read_text().replace(str(DATA / "help" / "upstream-0c1e570.txt"),
                                           str(lacking)))
    launch = _resolve(tmp_path, "4090-262k", model_27b, exe)
    argv = _argv(launch)
    assert "-cpent" not in argv and "--checkpoint-every-n-tokens" not in argv
    assert "-cms" not in argv and "--checkpoint-min-step" not in argv
    doc = launch.resolved.documents
    assert doc is not None and doc.min_step is None
    assert "only llama.cpp's own checkpoints" in doc.summary()
    assert "lacks --checkpoint-every-n-tokens" in dict(doc.why)["min_step"]
    (w,) = [w for w in launch.warnings if "this binary lacks" in w]
    assert "--checkpoint-every-n-tokens" in w


def _shape(tmp_path: Path, name: str, context: int) -> tuple[Path, startup.Runtime]:
    """A shape-only `name` under a GPU profile of `context` tokens on the recorded 4090."""
    model = tiny_gguf.write_shape_only(tmp_path / f"{name}.gguf", name)
    prof = tmp_path / "p.yaml"
    prof.write_text(f"name: p\ndescription: d\nmodel: x\ncontext: {context}\n"
                    "hardware: {requires_gpu: true}\n")
    return model, _resolve(tmp_path, prof, model, recorded_fork(tmp_path, "fork-1c6e4ea"))


def test_plain_attention_needs_no_checkpoints(tmp_path: Path) -> None:
    model, launch = _shape(tmp_path, "llama3-8b", 16384)
    doc = launch.resolved.documents
    assert doc is not None and not doc.needs_checkpoints
    argv = _argv(launch)
    assert "--checkpoint-min-step" not in argv and "--cache-reuse" not in argv
    assert _flag(argv, "-cram", "--cache-ram") is not None
    assert "no checkpoints needed" in doc.summary()
    model.unlink()


def test_sliding_window_models_get_checkpoints_and_keep_kv_shifting(tmp_path: Path) -> None:
    model, launch = _shape(tmp_path, "gemma3-12b", 32768)
    doc = launch.resolved.documents
    assert doc is not None and doc.needs_checkpoints and doc.cache_reuse is None
    assert "sliding-window" in dict(doc.why)["min_step"]
    model.unlink()


def test_a_profile_batch_is_kept_and_spaces_the_checkpoints(tmp_path: Path,
                                                            model_27b: Path) -> None:
    prof = tmp_path / "p.yaml"
    text = (Path(__file__).parent.parent / "profiles" / "4090-262k.yaml").read_text()
    prof.write_text(text.replace("name: 4090-262k", "name: p") + "batch: 2048\n")
    launch = _resolve(tmp_path, prof, model_27b, recorded_fork(tmp_path, "fork-1c6e4ea"))
    doc = launch.resolved.documents
    assert doc is not None and doc.batch == 2048 and doc.min_step == 2048
    assert doc.checkpoints == 8192 // 2048 + documents.EDGE_CHECKPOINTS


def test_a_context_past_the_trained_one_is_capped_and_said(tmp_path: Path) -> None:
    model = tiny_gguf.write_tiny_random(tmp_path / "tiny.gguf", "qwen35", mtp=True,
                                        context=4096)
    prof = tmp_path / "p.yaml"
    prof.write_text("name: p\ndescription: d\nmodel: x\ncontext: 32768\n"
                    "hardware: {requires_gpu: false}\ngpu_layers: 0\n")
    launch = _resolve(tmp_path, prof, model, recorded_fork(tmp_path, "upstream-0c1e570"),
                      gpu="none")
    cfg = launch.resolved.launch
    assert cfg.context == 4096
    (w,) = [w for w in cfg.warnings if "trained context" in w]
    assert "32,768" in w and "4,096" in w and "rope" in w
    # a profile that stretches the model keeps its context
    prof.write_text(prof.read_text() + "extra_args: [--rope-scaling, yarn]\n")
    (tmp_path / "b").mkdir()
    stretched = _resolve(tmp_path / "b", prof, model,
                         recorded_fork(tmp_path / "b", "upstream-0c1e570"), gpu="none")
    assert stretched.resolved.launch.context == 32768


@pytest.mark.parametrize("ram_gib", [None, 64])
def test_decide_is_stated_for_every_value_it_sets(tmp_path: Path, ram_gib: int | None) -> None:
    from mtpwrap.decide import gguf_facts, planner
    from mtpwrap.decide.launch import plain
    from mtpwrap.decide.resolve import plan_config

    model = tiny_gguf.write_shape_only(tmp_path / "q.gguf", "qwen3.6-27b")
    facts = gguf_facts.read_facts(model)
    pc = plan_config(plain(model, context=65536, why="t"), facts, backend="cpu")
    state = planner.sequence_state(facts, pc)
    d = documents.decide(facts, state, slot_context=65536, ubatch=None, batch=None,
                         ram=_host(ram_gib, ram_gib) if ram_gib else None, host_used=0)
    why = dict(d.why)
    assert set(why) >= {"min_step", "batch", "checkpoints", "cache_reuse"}
    assert ("cache_ram" in why) == (ram_gib is not None)
    assert (d.cache_ram_mib is None) == (ram_gib is None)
    assert d.entry_bytes == state.entry(65536, d.checkpoints or 0)
    model.unlink()


def test_a_checkpoint_carries_the_mtp_kv_only_without_patch_0002(model_27b: Path) -> None:
    """Upstream's checkpoint writes the MTP context's whole KV (a plain KV cache ignores
    PARTIAL_ONLY), so it grows with its position; patch 0002 leaves it out (a restore cuts the
    draft's KV back instead): the plan counts what the binary does."""
    from mtpwrap.decide import gguf_facts, planner
    from mtpwrap.decide.launch import plain
    from mtpwrap.decide.resolve import plan_config

    facts = gguf_facts.read_facts(model_27b)
    cfg = plain(model_27b, context=262_144, why="t").replace(spec="mtp", spec_type="mtp", depth=3)
    pc = plan_config(cfg, facts, backend="cpu")
    assert pc.spec == "mtp"
    upstream = planner.sequence_state(facts, pc)
    patched = planner.sequence_state(facts, pc, draft_in_checkpoints=False)
    assert patched.checkpoint_at(262_144) == patched.checkpoint == upstream.checkpoint
    assert upstream.checkpoint_at(262_144) - upstream.checkpoint > 256 * MiB
    assert patched.entry(262_144, 11) < upstream.entry(262_144, 11) - 11 * 256 * MiB


def _tokens(warning: str) -> int:
    """The document length a warning says the cache still keeps."""
    found = re.search(r"longer than about ([\d,]+) tokens", warning)
    assert found is not None, warning
    return int(found.group(1).replace(",", ""))


def _host(total_gib: float, available_gib: float | None, read_at: int | None = None
          ) -> hardware.HardwareSnapshot:
    return hardware.HardwareSnapshot(
        ram_total=int(total_gib * GiB), ram_read_at=read_at, source="recording:h.json",
        ram_available=None if available_gib is None else int(available_gib * GiB))


def _decide(model_27b: Path, ram: hardware.HardwareSnapshot, **kw: Any) -> documents.DocumentPlan:
    from mtpwrap.decide import gguf_facts, planner
    from mtpwrap.decide.launch import plain
    from mtpwrap.decide.resolve import plan_config

    facts = gguf_facts.read_facts(model_27b)
    pc = plan_config(plain(model_27b, context=131072, why="t"), facts, backend="cpu")
    return documents.decide(facts, planner.sequence_state(facts, pc), slot_context=131072,
                            ubatch=None, batch=None, ram=ram, host_used=2 * GiB, **kw)


def test_the_ram_cache_is_sized_from_the_ram_available_at_start(model_27b: Path) -> None:
    """Lots of RAM, little of it available: the cache is sized from what is available (less
    the reserve and what the launch holds), and the plan says what it read, and when."""
    free = _decide(model_27b, _host(256, 250, read_at=1_700_000_000))
    busy = _decide(model_27b, _host(256, 64, read_at=1_700_000_000))
    assert free.cache_ram_mib is not None and busy.cache_ram_mib is not None
    assert free.cache_ram_mib - busy.cache_ram_mib == 186 * 1024
    assert busy.ram_budget == 64 * GiB - int(25.6 * GiB) - 2 * GiB - 11 * busy.checkpoint_bytes
    assert busy.cache_ram_mib == busy.ram_budget // MiB
    why = dict(busy.why)["cache_ram"]
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1_700_000_000))
    assert why.startswith(f"64.0 GiB of RAM available (of 256.0 GiB) read at {when}, less a "
                          "25.6 GiB reserve, 2.00 GiB the model and its companions will hold")
    assert "of the slots' checkpoints" in why
    # a snapshot that does not say how much is available (a saved one from before it did):
    # the total, and the plan says so
    total, all_free = _decide(model_27b, _host(64, None)), _decide(model_27b, _host(64, 64))
    assert total.cache_ram_mib == all_free.cache_ram_mib
    assert "64.0 GiB of RAM, the total (recording:h.json does not say how much is available)" \
        in dict(total.why)["cache_ram"]
    assert "as recording:h.json gives it" in dict(all_free.why)["cache_ram"]


def test_a_budget_at_or_below_nothing_never_turns_the_cache_off(model_27b: Path) -> None:
    """--cache-ram 0 turns llama-server's cache off: a plan with no RAM left gives it a floor
    that holds a shorter document, and says so; only the operator turns it off."""
    for available in (2, 5.5, 6.4, 8.5):
        d = _decide(model_27b, _host(16, available))
        assert d.ram_budget is not None and d.ram_budget < documents.FLOOR_MIN
        assert d.cache_ram_mib is not None and d.cache_ram_mib * MiB >= documents.FLOOR_MIN
        assert d.documents == 0 and "no RAM cache" not in d.summary()
        (w,) = d.warnings
        assert 8192 <= _tokens(w) < 8300 and "tokens is not kept in RAM" in w, w
        assert "shorter ones are kept" in w
    off = _decide(model_27b, _host(16, 2), asked=0)
    assert off.cache_ram_mib == 0 and off.documents == 0 and not off.warnings
    assert "no RAM cache" in off.summary()
    assert dict(off.why)["cache_ram"].startswith(
        "the profile's extra_args set --cache-ram 0: the RAM cache is off (2.0 GiB of RAM")
    unlimited = _decide(model_27b, _host(256, 250), asked=-1)
    assert "without a limit" in unlimited.summary() and unlimited.documents
    assert documents.asked_cache_ram(["--cache-ram", "0"]) == 0
    assert documents.asked_cache_ram(["-cram=512", "--jinja", "-cram", "-1"]) == -1
    assert documents.asked_cache_ram(["--jinja"]) is None


def test_a_profile_that_turns_the_ram_cache_off_is_honoured(tmp_path: Path,
                                                           model_27b: Path) -> None:
    prof = tmp_path / "p.yaml"
    text = (Path(__file__).parent.parent / "profiles" / "4090-262k.yaml").read_text()
    prof.write_text(text.replace("name: 4090-262k", "name: p")
                    + "extra_args: [--cache-ram, '0']\n")
    launch = _resolve(tmp_path, prof, model_27b, recorded_fork(tmp_path, "fork-1c6e4ea"))
    argv = _argv(launch)
    assert [a for a in argv if a in ("-cram", "--cache-ram")] == ["--cache-ram"]
    assert _flag(argv, "--cache-ram") == "0"
    doc = launch.resolved.documents
    assert doc is not None and doc.cache_ram_mib == 0 and "no RAM cache" in doc.summary()
    assert not [w for w in launch.warnings if "prompt cache" in w]


def test_plan_says_what_ram_it_assumed(tmp_path: Path, model_27b: Path) -> None:
    from tests.helpers import run_cli

    args = ("plan", "--profile", "4090-262k", "--model", str(model_27b), "--binary",
            str(recorded_fork(tmp_path, "fork-1c6e4ea")), "--hw-replay",
            str(DATA / "snapshots" / "rtx4090.json"))
    r = run_cli(*args)
    assert r.returncode == 0, r.stderr
    said = (r"58\.0 GiB of RAM available \(of 63\.1 GiB\) as recording:rtx4090\.json gives it, "
            r"less a 6\.3 GiB reserve, 0\.67 GiB the model and its companions will hold and "
            r"[\d.]+ GiB of the slots' checkpoints: [\d.]+ GiB")
    assert re.search("cache_ram: " + said, " ".join(r.stdout.split())), r.stdout
    d = json.loads(run_cli(*args, "--json").stdout)["documents"]
    assert re.fullmatch(said, d["why"]["cache_ram"]), d["why"]


def test_a_reload_sizes_the_cache_from_the_ram_found_at_start(tmp_path: Path,
                                                             model_27b: Path) -> None:
    """llama-server and its cache hold RAM by the time of a reload: a reload that changes
    nothing keeps the --cache-ram the service started with (it restarts nothing)."""
    first = _resolve(tmp_path, "4090-262k", model_27b, recorded_fork(tmp_path, "fork-1c6e4ea"))
    assert first.resolved is not None
    snap = first.resolved.inputs.snapshot
    assert snap is not None
    # what the RAM figures were then, as if read on this machine before the children started
    then = dataclasses.replace(snap, ram_available=snap.ram_available - 8 * GiB,
                               ram_read_at=1_700_000_000)
    running = dataclasses.replace(first, resolved=dataclasses.replace(
        first.resolved, inputs=dataclasses.replace(first.resolved.inputs, snapshot=then)))
    again = startup.load_runtime(first.settings, None, running)
    assert again.resolved is not None and again.resolved.documents is not None
    assert again.resolved.inputs.snapshot == then
    assert first.resolved.documents is not None
    assert again.resolved.documents.cache_ram_mib == first.resolved.documents.cache_ram_mib - \
        8 * 1024
    assert "read at" in dict(again.resolved.documents.why)["cache_ram"]
    info = hardware.host_info()
    assert info["ram_read_at"] is not None and abs(info["ram_read_at"] - time.time()) < 60
