"""How a launch keeps long documents warm (`decide.documents`): context checkpoints on hybrid
and sliding-window models, --cache-reuse off on hybrid ones, --cache-ram sized from the host's
RAM, a context past the model's trained one capped and said, and a binary that lacks a flag
told. The 27B is a shape-only GGUF on the recorded RTX 4090; the forks' --help stand in for
their binaries."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtpwrap.build import tiny_gguf
from mtpwrap.config import settings
from mtpwrap.decide import documents
from mtpwrap.service import startup
from tests.helpers import DATA, recorded_fork, replay

GiB, MiB = 2**30, 2**20


def _resolve(tmp_path: Path, profile: str | Path, model: Path, binary: Path, *,
             gpu: str = "rtx4090", ram_gib: float | None = None) -> startup.Runtime:
    snap = replay(tmp_path, None, gpu)
    if ram_gib is not None:
        record = json.loads(snap.read_text())
        record["host"]["ram_total"] = int(ram_gib * GiB)
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
    assert _flag(argv, "-cms", "--checkpoint-min-step") == "1024"
    assert _flag(argv, "-b", "--batch-size") == "1024"
    assert int(_flag(argv, "-ctxcp", "--ctx-checkpoints") or 0) * 1024 >= 8192
    assert _flag(argv, "--cache-reuse") == "0"
    # the RAM cache: the recorded host's 63 GiB less the system's share and the model's host
    # rows, several 262K documents of tbq4_0 KV (about 5.5 GiB each) with their checkpoints
    ram = int(_flag(argv, "-cram", "--cache-ram") or 0)
    assert 50 * 1024 < ram < 58 * 1024, ram
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
                      ram_gib=10)
    doc = launch.resolved.documents
    assert doc is not None and doc.documents == 0
    (w,) = [w for w in launch.resolved.launch.warnings if "full-context document" in w]
    assert "262,144 tokens" in w and "not kept in RAM" in w and "add RAM" in w


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
    i = next(n for n, line in enumerate(help_text) if line.startswith("-cms,"))
    lacking = tmp_path / "lacking.txt"
    lacking.write_text("".join(help_text[:i] + help_text[i + 2:]))
    exe.write_text(exe.read_text().replace(str(DATA / "help" / "upstream-0c1e570.txt"),
                                           str(lacking)))
    launch = _resolve(tmp_path, "4090-262k", model_27b, exe)
    argv = _argv(launch)
    assert "-cms" not in argv and "--checkpoint-min-step" not in argv
    doc = launch.resolved.documents
    assert doc is not None and doc.min_step is None
    assert "only llama.cpp's own checkpoints" in doc.summary()
    assert "lacks --checkpoint-min-step" in dict(doc.why)["min_step"]
    (w,) = [w for w in launch.warnings if "this binary lacks" in w]
    assert "--checkpoint-min-step" in w


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
                         ram_total=ram_gib * GiB if ram_gib else None, host_used=0)
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
