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


def test_the_read_cells_read_by_ubatch_and_ask_again_after_a_restart(tmp_path: Path) -> None:
    gc = _load()
    cells = gc.read_commands(Path("/opt/llama-server"), Path("/m/27b.gguf"), tmp_path)
    assert [c["doc_tokens"] for c in cells] == [32_768, 131_072]
    for c in cells:
        argv = c["argv"]
        assert argv[1:5] == ["-m", "mtpwrap", "bench", "docs"]
        opt = dict(zip(argv, argv[1:], strict=False))
        assert opt["--binary"] == "/opt/llama-server" and opt["--model"] == "/m/27b.gguf"
        assert opt["--doc-tokens"] == str(c["doc_tokens"])
        assert opt["--steps"] == "cold,restart"
        assert [int(u) for u in opt["--ubatch"].split(",")] == c["ubatch"]
        assert opt["--out"] == str(tmp_path / f"read-{c['doc_tokens']}")
    assert 32 in cells[0]["ubatch"] and 2048 in cells[0]["ubatch"]
    # a cell the budget leaves no time for is named, not run
    skipped = gc.run_read_cells(cells, budget_s=0)
    assert all("skipped" in c for c in skipped)


def test_the_script_runs_the_read_cells_on_a_gpu() -> None:
    text = SCRIPT.read_text()
    assert "--read-cells" in text and "GPU_CHECK_READ" in text
    assert text.index("--read-cells") < text.rindex("mtpwrap bench --quick")


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
    # the speed-only cells with their expected minutes, printed
    assert "GPU speed-only cells" in p.stdout and "KV q4_0  fill  131072" in p.stdout
    assert " min of a 10-minute budget inside the 15-minute lease" in p.stdout
    assert result["gpu_plan"]["expected_s"] <= 600
    model = Path(result["model"]["path"])
    # Sparse: the full 27B length on disk in a few blocks.
    st = model.stat()
    assert st.st_size > 10 * 2**30 and st.st_blocks * 512 < 64 * 2**20
    assert len(result["commands"]) == 5
    assert [c["doc_tokens"] for c in result["read_commands"]] == [32_768, 131_072]
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


@pytest.fixture(scope="module")
def shape_facts(tmp_path_factory: pytest.TempPathFactory):
    from mtpwrap.build import tiny_gguf
    from mtpwrap.decide import gguf_facts

    path = tmp_path_factory.mktemp("shape") / "qwen3.6-27b.gguf"
    return gguf_facts.read_facts(tiny_gguf.write_shape_only(path))


def test_speed_plan_fits_the_budget_inside_the_lease(shape_facts) -> None:
    from benchmarks import gpu_plan

    p = gpu_plan.plan(shape_facts)
    cells = [(c["kv"], c["context"]) for c in p["cells"]]
    for kv in ("f16", "q8_0", "q4_0"):
        assert (kv, 32_768) in cells and (kv, 131_072) in cells
    assert p["speculation"] == "off"
    assert p["expected_s"] <= gpu_plan.BUDGET_S <= gpu_plan.LEASE_S - 300
    assert p["expected_s"] == pytest.approx(
        p["setup_s"] + sum(c["expected_s"] for c in p["cells"]), abs=0.5)
    # 262K is in the plan only when it fits, and said when it is not
    assert (262_144 in {c["context"] for c in p["cells"]}) != bool(p["left_out"])
    # a tighter budget drops the optional length, saying why
    tight = gpu_plan.plan(shape_facts, budget_s=p["expected_s"] - 1)
    assert all(c["context"] < 262_144 for c in tight["cells"])


def test_roofline_falls_with_fill_and_rises_with_smaller_kv(shape_facts) -> None:
    from benchmarks import gpu_plan

    bw = 4.8e12
    f16_32k = gpu_plan.roofline(shape_facts, "f16", 32_768, bw)
    assert gpu_plan.roofline(shape_facts, "f16", 131_072, bw) < f16_32k
    assert gpu_plan.roofline(shape_facts, "q4_0", 32_768, bw) > f16_32k
    # 16 attention layers, 4 KV heads of 256 values, K and V, 2 bytes each
    assert gpu_plan.kv_bytes_per_token(shape_facts, "f16") == 16 * 2 * 4 * 256 * 2
    weights = gpu_plan.weight_bytes(shape_facts) + gpu_plan.state_bytes(shape_facts)
    assert f16_32k == pytest.approx(bw / (weights + 32_768 * 16 * 2 * 4 * 256 * 2))


def test_what_the_gpu_check_carries_is_within_the_limit(repo_root: Path) -> None:
    from benchmarks import gpu_plan

    tracked = subprocess.run(["git", "ls-files"], cwd=repo_root, capture_output=True,
                             text=True, check=True).stdout.split()
    items = gpu_plan.carry(repo_root, tracked)
    assert items[0]["bytes"] > 100_000  # the tree itself is counted
    total = sum(i["bytes"] for i in items)
    assert total <= gpu_plan.CARRY_LIMIT, items


def test_nvml_bandwidth_is_bus_width_times_double_rate_clock() -> None:
    from mtpwrap.decide.hardware import GpuInfo

    # an H200's NVML: 6144-bit bus, 3201 MHz maximum memory clock
    assert GpuInfo(0, memory_bus_width=6144, memory_clock_max_mhz=3201).memory_bandwidth \
        == pytest.approx(4.917e12, rel=1e-3)
    assert GpuInfo(0).memory_bandwidth is None


def test_the_engine_plan_names_what_runs_and_what_it_costs(repo_root: Path) -> None:
    """A carried build is installed in seconds; without one the lent machine compiles (the fork
    when the submodule holds its pin, else the offline source), and the lease says so."""
    from benchmarks import gpu_plan

    items = [{"path": ".", "bytes": 3 * 2**20}, {"path": ".wheelhouse", "bytes": 21 * 2**20}]
    carried = {"variant": "cuda-sm90", "source": {"kind": "submodule", "commit": "0bc0a27"}}
    e = gpu_plan.engine(repo_root, carried, 44 * 2**20, items)
    assert (e["engine"], e["how"], e["bytes"]) == ("fork", "carried", 44 * 2**20)
    assert e["expected_s"] == gpu_plan.PREBUILT_INSTALL_S
    here = gpu_plan.engine(repo_root, None, None, items)
    assert here["how"] == "built there"
    assert here["expected_s"] == round(gpu_plan.CONFIGURE_S + gpu_plan.CUDA_COMPILE_CORE_S / 16)
    if (repo_root / "vendor" / "llama.cpp-mtp" / "CMakeLists.txt").is_file():
        assert here["engine"] == "fork"
    else:
        assert here["engine"] == "upstream" and "carry its packed build" in here["why"]
    plan = {"n_predict": 64, "setup_s": 90, "cells": [], "expected_s": 400, "budget_s": 600,
            "lease_s": 900, "bandwidth_bytes_per_s": 4e12, "left_out": []}
    text = "\n".join(gpu_plan.describe({**plan, "engine": e}))
    assert "engine: fork (carried, 44.0 MiB), 0.5 min" in text
    assert "7.2 min for the first run, 6.7 min for a rerun: fits" in text
    text = "\n".join(gpu_plan.describe({**plan, "engine": here}))
    assert "does NOT fit" in text


def test_the_wheels_for_the_lent_image_are_only_what_it_lacks() -> None:
    """`make wheelhouse WHEELS=lent` carries what the image cannot import at the versions
    mtpwrap needs; everything else comes from the image."""
    from benchmarks import gpu_plan

    every = {w.split("==")[0] for w in gpu_plan.wheels(False)}
    lent = {w.split("==")[0] for w in gpu_plan.wheels(True)}
    assert {"gguf", "starlette", "uvicorn", "httptools", "click", "numpy"} <= every
    assert "matplotlib" not in every  # plots are skipped where it is missing
    assert {"gguf", "starlette", "uvicorn", "httptools", "huggingface-hub"} <= lent
    assert not lent & gpu_plan.LENT_IMAGE_HAS and lent < every
    # the closure is what is installed: each pin names the version here
    from importlib import metadata
    for w in gpu_plan.wheels(True):
        name, version = w.split("==")
        assert metadata.version(name) == version


def test_the_carry_line_adds_the_parts_against_the_limit() -> None:
    from benchmarks import gpu_plan

    items = [{"path": ".", "bytes": 9 * 2**20}, {"path": ".wheelhouse", "bytes": 2 * 2**20},
             {"path": ".prebuilt", "bytes": 52 * 2**20}]
    assert gpu_plan.carry_line(items) == (
        "  carry: . 9.0 + .wheelhouse 2.0 + .prebuilt 52.0 = 63.0 MiB: fits the 64 MiB limit")
    items[2]["bytes"] = 54 * 2**20
    assert "= 65.0 MiB: does NOT fit" in gpu_plan.carry_line(items)
