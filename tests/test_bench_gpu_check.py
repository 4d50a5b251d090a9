"""The CPU-side parts of benchmarks/gpu_check.sh: command lines, result folder, model file."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "benchmarks" /
                                                  "gpu_check.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_command_lines_cover_kv_types_and_mtp() -> None:
    gc = _load()
    cmds = gc.command_lines(Path("/opt/llama-server"), Path("/m/27b.gguf"), (1024, 32768))
    by = {c["config"]["name"]: c["argv"] for c in cmds}
    assert set(by) == {"kv-f16", "kv-q8_0", "kv-q4_0", "mtp-kv-f16", "mtp-kv-q4_0"}
    for name, argv in by.items():
        joined = " ".join(argv)
        assert argv[0] == "/opt/llama-server" and "-m /m/27b.gguf" in joined
        assert "-ngl 99" in joined and "--metrics" in joined and "--flash-attn on" in joined
        kv = name.rsplit("-", 1)[-1]
        assert f"-ctk {kv} -ctv {kv}" in joined
        # Context covers the longest prompt plus generation, rounded to 256.
        assert int(argv[argv.index("-c") + 1]) % 256 == 0
        assert int(argv[argv.index("-c") + 1]) >= 32768 + 64
        # Removed upstream flags abort the server: never emitted.
        assert not {"--draft", "--draft-n", "--draft-max", "--draft-min"} & set(argv)
        if name.startswith("mtp"):
            assert "--spec-type draft-mtp --spec-draft-n-max 3" in joined
        else:
            assert "--spec-type" not in argv


def test_allocation_lines_are_parsed() -> None:
    gc = _load()
    log = ("0.01.000.000 I load_tensors:        CUDA0 model buffer size = 15360.50 MiB\n"
           "0.01.100.000 I llama_kv_cache:        CUDA0 KV buffer size =   576.00 MiB\n"
           "0.01.200.000 I llama_memory_recurrent:        CUDA0 RS buffer size =   149.62 MiB\n"
           "0.01.300.000 I sched_reserve:      CUDA0 compute buffer size =   515.00 MiB\n")
    got = gc.allocations(log)
    assert [(a["kind"], a["device"], a["mib"]) for a in got] == [
        ("model", "CUDA0", 15360.5), ("KV", "CUDA0", 576.0), ("RS", "CUDA0", 149.62),
        ("compute", "CUDA0", 515.0)]


def test_summary_puts_prediction_beside_allocation() -> None:
    gc = _load()
    result = {"server_bin": "/b", "model": {"path": "/m"}, "launch_context": 1280,
              "planner_launch": [{"config": "kv-q4_0", "plan": {"rows": [
                  {"name": "main KV", "bytes": 576 * 2**20}]}}],
              "allocations": {"kv-q4_0": [{"device": "CUDA0", "kind": "KV", "mib": 576.0}]}}
    md = gc.summary_markdown(result)
    assert "| kv-q4_0 | main KV 576 | CUDA0 KV 576 |" in md


@pytest.mark.slow
def test_dry_run_creates_result_folder(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"),
               MTPWRAP_BINARY="/opt/llama-server", GPU_CHECK_CONTEXTS="32768",
               GPU_CHECK_PLAN_GPU="rtx4090")
    env.pop("OUT", None)
    p = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert (out / "gpu_check.log").exists()
    log = (out / "gpu_check.log").read_text()
    assert f"results: {out}" in log and "llama-server: /opt/llama-server" in log
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["server_bin"] == "/opt/llama-server"
    assert p.returncode == 0, p.stdout + p.stderr
    model = Path(result["model"]["path"])
    # Sparse: the full 27B length on disk in a few blocks.
    st = model.stat()
    assert st.st_size > 10 * 2**30 and st.st_blocks * 512 < 64 * 2**20
    assert len(result["commands"]) == 5
    # The planner's prediction for every cell, made from the header on this CPU machine.
    plans = {p["config"]: p for p in result["planner"]}
    assert set(plans) == {c["config"]["name"] for c in result["commands"]}
    for name, rec in plans.items():
        assert rec["rc"] == 0 and "plan" in rec, (name, rec.get("error"))


@pytest.mark.slow
def test_result_folder_from_out_variable(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"),
               MTPWRAP_BINARY="/opt/llama-server", OUT=str(tmp_path / "from-env"),
               GPU_CHECK_CONTEXTS="1024", GPU_CHECK_PLAN_GPU="rtx4090")
    subprocess.run([str(SCRIPT), "--dry-run"], capture_output=True, text=True, env=env,
                   timeout=300)
    assert (tmp_path / "from-env" / "gpu_check.json").exists()


@pytest.mark.integration
@pytest.mark.slow
def test_dry_run_from_a_bare_python_with_the_wheelhouse(tmp_path: Path, repo_root: Path) -> None:
    """A lent GPU machine has no network and no project venv: `make wheelhouse` plus the
    script must be enough, starting from a Python that has nothing installed."""
    wheels = tmp_path / "wheelhouse"
    make = subprocess.run(["make", "-s", "wheelhouse", f"WHEELHOUSE={wheels}"], cwd=repo_root,
                          capture_output=True, text=True, timeout=600)
    assert make.returncode == 0, make.stdout + make.stderr
    assert not list(wheels.glob("matplotlib*"))  # kept small enough to carry
    assert sum(f.stat().st_size for f in wheels.iterdir()) < 48 * 2**20
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", str(bare)], check=True, timeout=300)
    py = bare / "bin" / "python"
    assert subprocess.run([str(py), "-c", "import httpx"], capture_output=True).returncode != 0
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OUT")}
    env.update(PYTHON=str(py), GPU_CHECK_WHEELHOUSE=str(wheels),
               GPU_CHECK_SITE=str(tmp_path / "site"), GPU_CHECK_WORK=str(tmp_path / "work"),
               MTPWRAP_BINARY="/opt/llama-server", GPU_CHECK_CONTEXTS="1024",
               GPU_CHECK_PLAN_GPU="rtx4090")
    p = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True,
                       env=env, timeout=600)
    log = (out / "gpu_check.log").read_text()
    assert p.returncode == 0, log
    assert "lacks mtpwrap's dependencies: installing" in log
    result = json.loads((out / "gpu_check.json").read_text())
    assert result["dry_run"] is True and result["planner"]
    assert all(rec["rc"] == 0 for rec in result["planner"]), result["planner"]


def test_a_bare_python_without_wheelhouse_is_told_what_to_do(tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True,
                   timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "OUT")}
    env.update(PYTHON=str(bare / "bin" / "python"), GPU_CHECK_WHEELHOUSE=str(tmp_path / "none"),
               MTPWRAP_BINARY="/opt/llama-server")
    p = subprocess.run([str(SCRIPT), "--dry-run", str(tmp_path / "r")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert p.returncode == 69
    assert "make wheelhouse" in p.stdout


@pytest.mark.slow
@pytest.mark.parametrize("pinned", [True, False])
def test_a_carried_prebuilt_is_used_only_when_it_is_of_the_pin(tmp_path: Path,
                                                               pinned: bool) -> None:
    """`mtpwrap build --pack` on a machine that compiled, carried to the GPU machine: the script
    installs it instead of building when its manifest names the source pin, else builds."""
    from mtpwrap.build import prebuilt
    from tests.helpers import packable_manifest

    made = packable_manifest(tmp_path, identity=None if pinned else "offline:an-older-release")
    archive = prebuilt.pack_prebuilt(made, tmp_path / "carry" / "cuda-sm89.tar.xz")
    out = tmp_path / "results"
    env = {k: v for k, v in os.environ.items() if k not in ("MTPWRAP_BINARY", "OUT")}
    env.update(PYTHON=sys.executable, GPU_CHECK_WORK=str(tmp_path / "work"),
               GPU_CHECK_PREBUILT=str(archive), MTPWRAP_BUILD_DIR=str(tmp_path / "build"),
               GPU_CHECK_CONTEXTS="1024", GPU_CHECK_PLAN_GPU="rtx4090")
    p = subprocess.run([str(SCRIPT), "--dry-run", str(out)], capture_output=True, text=True,
                       env=env, timeout=300)
    log = (out / "gpu_check.log").read_text()
    assert p.returncode in (0, 2), log
    server = tmp_path / "build" / "cuda-sm89" / "bin" / "llama-server"
    if pinned:
        assert f"using the carried build: {server}" in log
        assert server.read_bytes() == Path(made.binaries["llama-server"]["path"]).read_bytes()
        assert json.loads((out / "gpu_check.json").read_text())["server_bin"] == str(server)
    else:
        assert "the carried build was refused: " in log and "but the pin is" in log
        assert "dry run: no build" in log and not server.exists()
