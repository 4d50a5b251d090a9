"""`up`, `args` and `plan` resolve a profile the same way: every shipped profile × every recorded
hardware snapshot × {upstream, fork} capabilities gives one argv and one memory plan.

The binaries are stand-ins that print the recorded --help of the pinned upstream source and of
the fork; the model is a shape-only Qwen3.6-27B (real header and tensor shapes, sparse file).
Snapshots and binaries reach the commands through their own options (--hw-replay, --binary),
as a person would pass them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from mtpwrap.build import tiny_gguf
from mtpwrap.cli import cli
from mtpwrap.config import settings
from mtpwrap.decide import profiles
from mtpwrap.decide.endpoint import Endpoint
from mtpwrap.errors import EXIT_CONFIG, ConfigError, MtpwrapError
from mtpwrap.service import startup

DATA = Path(__file__).resolve().parent / "data"
SNAPSHOTS = sorted(p.stem for p in (DATA / "snapshots").glob("*.json"))
HELP = {"upstream": "upstream-0c1e570", "fork": "fork-1c6e4ea"}
PROFILES = sorted(p.stem for p in (profiles.shipped_dirs()[1]).glob("*.yaml"))
PORT = 41234


@pytest.fixture(scope="module")
def binaries(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for kind, stem in HELP.items():
        exe = tmp_path_factory.mktemp(kind) / "llama-server"
        exe.write_text("#!/bin/sh\n"
                       f'case "$1" in --help) cat "{DATA}/help/{stem}.txt";; '
                       f'--version) cat "{DATA}/help/{stem}.version.txt";; *) exit 1;; esac\n')
        exe.chmod(0o755)
        out[kind] = exe
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_gguf.write_shape_only(tmp_path_factory.mktemp("m") / "qwen3.6-27b.gguf")


def _cli(*args: str) -> tuple[int, Any]:
    """The command run in this process, as `mtpwrap ARGS` runs it (its error handling too)."""
    r = CliRunner().invoke(cli, list(args), catch_exceptions=True, env={"NO_COLOR": "1"})
    if isinstance(r.exception, MtpwrapError):
        return r.exception.exit_code, str(r.exception)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    assert r.exit_code == 0, r.output
    return 0, json.loads(r.output)


def _up(profile: str, model: Path, binary: Path, snap: Path) -> tuple[int, Any]:
    s = settings.load_settings({"profile": profile, "model": str(model), "binary": str(binary),
                                "hw_replay": str(snap)}, env={})
    try:
        # `args` shows the launch without the snapshot directory of a running service
        launch = startup.load_runtime(s, slot_save_path=None)
    except ConfigError as exc:
        return EXIT_CONFIG, str(exc)
    launch = launch.with_plan()
    # the socket `up` would bind, or, for a binary without socket support, the port `args` shows
    where = launch.endpoint if launch.endpoint.socket else Endpoint(port=PORT)
    spec = launch(where, "internal-key", 0)
    assert spec is not None
    return 0, {"argv": spec.argv, "plan": launch.resolved.plan,
               "memory_plan": launch.info.memory_plan}


@pytest.mark.parametrize("caps", sorted(HELP))
@pytest.mark.parametrize("snap", SNAPSHOTS)
@pytest.mark.parametrize("profile", PROFILES)
def test_up_args_and_plan_agree(profile: str, snap: str, caps: str,
                                binaries: dict[str, Path], model: Path) -> None:
    snap_file = DATA / "snapshots" / f"{snap}.json"
    common = ("--profile", profile, "--model", str(model), "--binary", str(binaries[caps]),
              "--hw-replay", str(snap_file))
    up_rc, up = _up(profile, model, binaries[caps], snap_file)
    args_rc, args = _cli("args", *common, "--port", str(PORT), "--json")
    plan_rc, plan = _cli("plan", *common, "--json")
    if up_rc != 0:
        # refused before anything starts: `args` refuses with the same sentence
        assert args_rc == EXIT_CONFIG and up in args, (up, args)
        if "short by" in up:  # does not fit: `plan` shows the same verdict, not an error
            assert plan_rc == 0 and plan["fits"] is False
            assert f"{plan['total'] / 2**30:.2f} GiB on the device" in up
        else:
            # the same refusal; `plan` names the unplannable part without the launch advice
            root = (up.split(" (", 1)[1].split("), and a GPU launch")[0]
                    if "could not be made" in up else up)
            assert plan_rc == EXIT_CONFIG and root in plan, (up, plan)
        return
    assert args_rc == 0 and args["argv"] == up["argv"], (args, up)
    assert args["memory_plan"] in (None, up["memory_plan"])
    argv = up["argv"]
    if up["plan"] is None:
        # a CPU launch whose plan cannot be made (a KV type without a measured size) starts;
        # `plan` cannot size it either
        assert plan_rc == EXIT_CONFIG and "not planned" in up["memory_plan"]
        return
    assert plan_rc == 0, plan
    p = up["plan"]
    assert plan["context"] == p.context and plan["total"] == p.total
    cfg = plan["config"]
    assert (cfg["type_k"], cfg["type_v"]) == (argv[argv.index("-ctk") + 1],
                                              argv[argv.index("-ctv") + 1])
    assert cfg["n_slots"] == int(argv[argv.index("-np") + 1])
    assert cfg["n_ctx"] == int(argv[argv.index("-c") + 1]) or argv[argv.index("-c") + 1] == "0"
    spec = argv[argv.index("--spec-type") + 1] if "--spec-type" in argv else None
    assert (cfg["spec"] == "mtp") == (spec in ("mtp", "draft-mtp"))
