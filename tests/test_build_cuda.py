"""The CUDA build on a machine without a GPU: cuBLAS from the wheel, the driver library, several
architectures, CMake's configure step checked for real, and builds refused on a GPU they lack."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from mtpwrap import doctor, hashing
from mtpwrap.build import binary, builder, cmake, planning, prebuilt, source, toolchain
from mtpwrap.build import manifest as build_manifest
from mtpwrap.decide import hardware
from mtpwrap.errors import ConfigError, MissingToolError
from tests.helpers import cli_env, packable_manifest, run_cli

FAKE_TREE = Path(__file__).parent / "data" / "fake-llama-tree"
SNAPSHOTS = Path(__file__).parent / "data" / "snapshots"


def _fake_wheel(tmp_path: Path, version: str = "13.10.0.20") -> toolchain.CublasWheel:
    """A cuBLAS wheel's layout: headers in include/, only versioned libraries in lib/."""
    root = tmp_path / "site" / "nvidia" / f"cu{version.split('.')[0]}"
    (root / "include").mkdir(parents=True, exist_ok=True)
    (root / "lib").mkdir(exist_ok=True)
    (root / "include" / "cublas_v2.h").write_text("")
    for lib in ("libcublas", "libcublasLt"):
        (root / "lib" / f"{lib}.so.{version.split('.')[0]}").write_bytes(b"\x7fELF")
    return toolchain.CublasWheel("nvidia-cublas", version, root / "include", root / "lib")


def _toolkit(tmp_path: Path, *, driver: Path | None = None, wheel: bool = True,
             cublas: bool = True, mismatch: toolchain.CublasWheel | None = None
             ) -> toolchain.CudaToolkit:
    return toolchain.CudaToolkit("/opt/cuda/bin/nvcc", "13.0", Path("/opt/cuda"), cublas,
                                 cublas_wheel=_fake_wheel(tmp_path) if wheel else None,
                                 wheel_mismatch=mismatch, driver_lib=driver)


# --------------------------------------------------------------------------- planning


def test_several_architectures_are_parsed_once_in_order_and_name_the_variant() -> None:
    assert planning.parse_cuda_archs("90, 89,89") == ["89", "90"]
    assert planning.parse_cuda_archs("120a,86") == ["86", "120a"]
    assert planning.cuda_variant(["89", "90"]) == "cuda-sm89-sm90"
    with pytest.raises(ConfigError, match=r"--cuda-arch 89,sm90: expected compute capabilities"):
        planning.parse_cuda_archs("89,sm90")


def test_bad_arch_list_is_one_sentence_and_exit_78(tmp_path: Path) -> None:
    r = run_cli("build", "--cuda-arch", "89,ninety", "--configure-only",
                env=cli_env(MTPWRAP_HOME=str(tmp_path)))
    assert r.returncode == 78, r.stderr
    assert "--cuda-arch 89,ninety" in r.stderr and "comma-separated" in r.stderr
    assert "Traceback" not in r.stderr


def test_without_a_driver_library_the_plan_links_with_no_vmm_and_says_what_it_costs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, isolated_home: Path
) -> None:
    tk = _toolkit(tmp_path)
    monkeypatch.setattr(toolchain, "cuda_toolkit", lambda: tk)
    plan = planning.plan_build(cuda_arch="90,89")
    assert plan.variant == "cuda-sm89-sm90"
    assert plan.options["CMAKE_CUDA_ARCHITECTURES"] == "89;90"
    assert plan.options["GGML_CUDA_NO_VMM"] == "ON"
    assert plan.cuda is not None
    assert plan.cuda["architectures"] == ["89", "90"]
    assert plan.cuda["driver_link"]["how"] == "GGML_CUDA_NO_VMM=ON"
    assert "cudaMalloc" in plan.cuda["driver_link"]["runtime_cost"]
    # CMake looks for libcublas.so; the wheel has libcublas.so.13 only: the links fill the gap.
    links = Path(plan.options["CMAKE_LIBRARY_PATH"])
    assert links.is_relative_to(isolated_home)
    for lib in ("libcublas.so", "libcublasLt.so"):
        assert (links / lib).resolve() == (tk.cublas_wheel.lib / f"{lib}.13").resolve()
    assert plan.options["CMAKE_BUILD_RPATH"] == str(tk.cublas_wheel.lib)
    assert plan.cuda["cublas"]["package"] == "nvidia-cublas==13.10.0.20"


def test_with_the_toolkit_stub_vmm_stays_on(tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            isolated_home: Path) -> None:
    stub = tmp_path / "cuda" / "lib64" / "stubs" / "libcuda.so"
    stub.parent.mkdir(parents=True)
    stub.write_bytes(b"")
    monkeypatch.setattr(toolchain, "cuda_toolkit", lambda: _toolkit(tmp_path, driver=stub,
                                                                     wheel=False))
    plan = planning.plan_build(cuda_arch="89")
    assert "GGML_CUDA_NO_VMM" not in plan.options
    assert "CMAKE_LIBRARY_PATH" not in plan.options  # the toolkit has its own cuBLAS
    assert plan.cuda is not None and plan.cuda["driver_link"]["how"] == "toolkit stub"
    assert plan.cuda["driver_link"]["library"] == str(stub)


def test_the_toolkit_finds_its_stub_as_cmake_would(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "cuda-13.0"
    (root / "bin").mkdir(parents=True)
    (root / "include").mkdir()
    (root / "include" / "cuda_runtime.h").write_text("")
    nvcc = root / "bin" / "nvcc"
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("PATH", f"{root / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_HOME", str(root))
    if toolchain._driver_lib([]) is not None:
        pytest.skip("this machine has a system libcuda.so, which is found first")
    assert toolchain.cuda_toolkit().driver_lib is None
    stub = root / "lib64" / "stubs" / "libcuda.so"
    stub.parent.mkdir(parents=True)
    stub.write_bytes(b"")
    tk = toolchain.cuda_toolkit()
    assert tk.driver_lib == stub and tk.version == "13.0"
    assert tk.compiler == str(nvcc)


def test_a_cublas_wheel_for_another_cuda_is_refused_with_the_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = _fake_wheel(tmp_path, "12.9.1.4")
    monkeypatch.setattr(toolchain, "cuda_toolkit",
                        lambda: _toolkit(tmp_path, wheel=False, cublas=False, mismatch=old))
    with pytest.raises(MissingToolError) as err:
        planning.plan_build(cuda_arch="89")
    assert ("the installed nvidia-cublas 12.9.1.4 is for CUDA 12, but nvcc is 13.0"
            in err.value.message)
    assert "nvidia-cublas==13.*" in (err.value.hint or "")


def test_a_toolkit_without_cublas_names_the_cuda_extra(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(toolchain, "cuda_toolkit",
                        lambda: _toolkit(tmp_path, wheel=False, cublas=False))
    with pytest.raises(MissingToolError, match="--cuda-arch 90: .* lacks cuBLAS") as err:
        planning.plan_build(cuda_arch="90")
    assert "pip install -e '.[cuda]'" in (err.value.hint or "")
    check = doctor.check_cuda()
    assert check.status == doctor.WARNING and ".[cuda]" in (check.fix or "")


def test_the_installed_cublas_wheel_matches_nvcc() -> None:
    tk = toolchain.cuda_toolkit()
    if tk.nvcc is None or tk.cublas_wheel is None:
        pytest.skip("needs nvcc and the `cuda` extra (pip install -e '.[cuda]')")
    w = tk.cublas_wheel
    assert w.major == tk.major
    assert (w.include / "cublas_v2.h").is_file()
    assert list(w.lib.glob(f"libcublas.so.{w.major}*")) and tk.usable


def test_fork_options_are_set_only_for_the_fork(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch,
                                                isolated_home: Path) -> None:
    tk = _toolkit(tmp_path)
    monkeypatch.setattr(toolchain, "cuda_toolkit", lambda: tk)
    fork = planning.plan_build(cuda_arch="89", fork=True)
    upstream = planning.plan_build(cuda_arch="89", fork=False)
    for name in planning.FORK_CUDA_OPTIONS:
        assert name not in upstream.options
        assert fork.options[name] == planning.FORK_CUDA_OPTIONS[name][0]
    assert fork.cuda is not None
    assert set(fork.cuda["fork_options"]) == set(planning.FORK_CUDA_OPTIONS)
    # tbq4_0's flash attention does not need FA_ALL_QUANTS (the fork's own sources); planar/iso do
    assert fork.options["GGML_CUDA_FA_ALL_QUANTS"] == "OFF"
    assert "compiled in either way" in fork.cuda["fork_options"]["GGML_CUDA_FA_ALL_QUANTS"]["why"]
    asked = planning.plan_build(cuda_arch="89", fork=True, fa_all_quants=True)
    assert asked.options["GGML_CUDA_FA_ALL_QUANTS"] == "ON"
    assert asked.options["GGML_CUDA_FA"] == "ON"
    plain = planning.plan_build(cuda_arch="89", fa_all_quants=True)
    assert plain.options["GGML_CUDA_FA_ALL_QUANTS"] == "ON" and plain.cuda is not None
    assert "--fa-all-quants" in plain.cuda["fa_all_quants"]


def test_fork_cuda_option_names_are_the_forks_own(repo_root: Path) -> None:
    tree = source.submodule_source(repo_root)
    if tree is None:
        pytest.skip(f"{source.SUBMODULE_PATH} is not initialised (needs GitHub)")
    declared = "\n".join(p.read_text(errors="replace")
                         for p in (tree.path / "ggml").rglob("CMakeLists.txt"))
    for name in planning.FORK_CUDA_OPTIONS:
        assert re.search(rf"(option|set)\s*\(\s*{name}\b", declared), name


# --------------------------------------------------------------------------- configure step


@pytest.mark.integration
def test_configure_only_refuses_options_the_tree_does_not_declare(tmp_path: Path) -> None:
    """The fake tree declares GGML_NATIVE only: CMake takes it and nothing else of ours. Like
    ggml it reads every GGML_ variable, so CMake's own "not used" list misses GGML_AVX2."""
    tree = tmp_path / "tree"
    shutil.copytree(FAKE_TREE, tree)
    env = cli_env(MTPWRAP_HOME=str(tmp_path / "home"), MTPWRAP_BUILD_DIR=str(tmp_path / "b"))
    r = run_cli("build", "--cpu", "--cpu-isa", "safe", "--source", str(tree), "--configure-only",
                "--json", env=env)
    assert r.returncode == 1, r.stderr
    result = json.loads(r.stdout)
    assert result["accepted"]["GGML_NATIVE"] == "OFF"
    assert result["accepted"]["CMAKE_BUILD_TYPE"] == "Release"
    assert result["rejected"]["LLAMA_OPENSSL"] == "CMake reported it as not used by the project"
    assert result["rejected"]["GGML_AVX2"] == "the project declares no such option"
    assert "GGML_AVX2" not in cmake.unused_variables(Path(result["log"]).read_text())
    assert "CMake did not take" in r.stderr and "LLAMA_OPENSSL" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "b").exists()  # nothing was built or installed
    cache = cmake.read_cmake_cache(Path(result["build_dir"]))
    assert cache["GGML_NATIVE"] == ("BOOL", "OFF")


@pytest.fixture
def offline_env(tmp_path: Path) -> dict[str, str]:
    """A home of its own whose sources/ is the shared, already extracted offline source, so the
    configure step neither downloads again nor waits for (or touches) a build in the shared
    cache."""
    if not toolchain.cuda_toolkit().usable:
        pytest.skip("needs nvcc with cuBLAS (pip install -e '.[cuda]')")
    real = source.offline_source().path.parents[1]  # .../sources/llama_cpp_python-VERSION
    home = tmp_path / "home"
    (home / "sources").mkdir(parents=True)
    (home / "sources" / real.name).symlink_to(real)
    return cli_env(MTPWRAP_HOME=str(home), MTPWRAP_BUILD_DIR=str(tmp_path / "build"))


@pytest.mark.integration
@pytest.mark.parametrize("archs", ["89", "89,90"])
def test_cuda_configure_of_the_offline_source_takes_every_option(
    archs: str, offline_env: dict[str, str], tmp_path: Path
) -> None:
    """CI's check of the CUDA build (seconds): CMake configures the pinned offline source with
    nvcc and cuBLAS (the toolkit's or the wheel's) and takes every option mtpwrap passes."""
    r = run_cli("build", "--cuda-arch", archs, "--source", "offline", "--configure-only",
                "--json", env=offline_env, timeout=300)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout)
    opts = result["cmake_options"]
    assert result["rejected"] == {}
    assert set(result["accepted"]) == set(opts)
    log = Path(result["log"]).read_text()
    assert not set(cmake.unused_variables(log)) & set(opts)
    # The options recorded are the ones on the command line that ran, and CMake holds them.
    argv = result["argv"]
    assert [a for a in argv if a.startswith("-D")] == [f"-D{k}={v}" for k, v in opts.items()]
    assert f"$ {' '.join(argv)}" in log.splitlines()
    cache = cmake.read_cmake_cache(Path(result["build_dir"]))
    assert cache["GGML_CUDA"][1] == "ON"
    assert cache["CMAKE_CUDA_ARCHITECTURES"][1] == archs.replace(",", ";")
    assert result["variant"] == planning.cuda_variant(archs.split(","))
    assert result["cuda"]["architectures"] == archs.split(",")
    cublas = Path(cache["CUDA_cublas_LIBRARY"][1])
    assert cublas.resolve().is_file(), cublas
    if result["cuda"]["cublas"]["from"] == "wheel":
        assert cublas.resolve().parent == Path(result["cuda"]["cublas"]["lib"]).resolve()
    assert ("GGML_CUDA_NO_VMM" in opts) == (result["cuda"]["driver_link"]["library"] is None)
    stored = json.loads((Path(result["build_dir"]) / "configure.json").read_text())
    assert stored == result
    assert result["source"]["commit"].startswith(source.OFFLINE_COMMIT)
    assert Path(result["build_dir"]).is_relative_to(tmp_path)
    assert not (tmp_path / "build").exists()  # configured only: nothing installed


@pytest.mark.integration
def test_configure_only_prints_the_options_cmake_took(offline_env: dict[str, str]) -> None:
    r = run_cli("build", "--cuda-arch", "89", "--source", "offline", "--configure-only",
                env=offline_env, timeout=300)
    assert r.returncode == 0, r.stderr
    printed = dict(line.split("=", 1) for line in r.stdout.splitlines() if "=" in line)
    assert printed["GGML_CUDA"] == "ON" and printed["CMAKE_CUDA_ARCHITECTURES"] == "89"
    assert "configured in" in r.stderr


@pytest.mark.integration
def test_log_objects_prints_one_line_per_compiled_object(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(FAKE_TREE, tree)
    model = tmp_path / "placeholder.gguf"
    model.write_bytes(b"GGUF")
    env = cli_env(MTPWRAP_HOME=str(tmp_path / "home"), MTPWRAP_BUILD_DIR=str(tmp_path / "b"),
                  MTPWRAP_DEMO_MODEL=str(model))
    r = run_cli("build", "--cpu", "--cpu-isa", "native", "--source", str(tree), "--log-objects",
                env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    objects = [line for line in r.stderr.splitlines()
               if re.search(r"build: \[\s*\d+%\] Building CXX object .*server\.cpp\.o$", line)]
    # the fake tree compiles server.cpp once for each compiled tool (all but llama-server)
    assert len(objects) == len(planning.TARGETS) - 1, r.stderr
    assert "compile (native): " not in r.stderr  # per object, not per 10 %


# --------------------------------------------------------------------------- GPU coverage


def _install(build_dir: Path, variant: str, archs: list[str]) -> None:
    """An installed, tried build of `variant` as `mtpwrap build` leaves it."""
    bin_dir = build_dir / variant / "bin"
    bin_dir.mkdir(parents=True)
    binaries = {}
    for name in planning.TARGETS:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
        binaries[name] = {"path": str(bin_dir / name), "sha256": "x"}
    m = build_manifest.Manifest(variant=variant, source={"kind": "offline", "commit": "0c1e570"},
                       cmake_options={}, compiler="g++", cuda_version="13.0", architectures=archs,
                       binaries=binaries, version_output="", build_seconds=1.0,
                       built_at=f"2026-11-30T00:00:0{len(archs)}", cache_key=variant,
                       build_dir=str(bin_dir.parent), log="",
                       smoke={"status": "skipped", "detail": "no GPU"})
    (build_dir / variant / "manifest.json").write_text(json.dumps(m.to_dict()))


def test_a_build_without_the_gpus_arch_is_refused_with_the_build_that_has_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MTPWRAP_BUILD_DIR", str(tmp_path))
    monkeypatch.delenv("MTPWRAP_BINARY", raising=False)
    _install(tmp_path, "cuda-sm89", ["89"])
    h100 = hardware.load_snapshot(SNAPSHOTS / "h100.json")
    rtx4090 = hardware.load_snapshot(SNAPSHOTS / "rtx4090.json")

    check = doctor.check_binary(h100)
    assert check.status == doctor.MISSING and check.hard
    assert "NVIDIA H100 80GB HBM3 (sm_90)" in check.detail and "sm_89 only" in check.detail
    assert check.fix == "mtpwrap build --cuda-arch 89,90"
    with pytest.raises(MissingToolError, match=r"Run `mtpwrap build --cuda-arch 89,90`"):
        binary.find_binary(snap=h100)

    assert doctor.check_binary(rtx4090).status == doctor.OK
    assert binary.find_binary(snap=rtx4090) == tmp_path / "cuda-sm89" / "bin" / "llama-server"

    # With a build for both installed, the H100 gets that one.
    _install(tmp_path, "cuda-sm89-sm90", ["89", "90"])
    assert binary.find_binary(snap=h100) == (tmp_path / "cuda-sm89-sm90" / "bin" /
                                            "llama-server")


def test_a_cpu_build_is_never_refused_for_a_gpu(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MTPWRAP_BUILD_DIR", str(tmp_path))
    _install(tmp_path, "cpu", ["x86_64"])
    m = build_manifest.load_manifest("cpu")
    assert m is not None
    assert binary.uncovered_gpus(m, hardware.load_snapshot(SNAPSHOTS / "h100.json")) == []


def test_a_cuda_build_is_smoke_tested_only_on_a_gpu_it_has_code_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = tmp_path / "llama-server"  # never started: every case below is decided before
    monkeypatch.setattr(planning, "present_gpu_archs", lambda snap=None: [])
    none = builder._smoke_test(server, "cuda-sm89", tmp_path, ["89"])
    assert none["status"] == "skipped" and "no NVIDIA GPU is visible" in none["detail"]
    monkeypatch.setattr(planning, "present_gpu_archs", lambda snap=None: ["90"])
    other = builder._smoke_test(server, "cuda-sm89", tmp_path, ["89"])
    assert other["status"] == "skipped"
    assert other["detail"] == ("the GPUs here (sm_90) are not among the build's architectures "
                               "(sm_89)")


# --------------------------------------------------------------------------- carried builds


def test_a_packed_build_installs_elsewhere_byte_for_byte(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made = packable_manifest(tmp_path)
    archive = prebuilt.pack_prebuilt(made, tmp_path / "carry" / "cuda-sm89.tar.xz")
    target = tmp_path / "there"
    monkeypatch.setenv("MTPWRAP_BUILD_DIR", str(target))
    none = hardware.load_snapshot(SNAPSHOTS / "none.json")
    installed = prebuilt.install_prebuilt(archive, snap=none)
    for name, info in installed.binaries.items():
        p = Path(info["path"])
        assert p.parent == target / "cuda-sm89" / "bin"
        assert p.read_bytes() == Path(made.binaries[name]["path"]).read_bytes()
        assert os.access(p, os.X_OK)
    assert installed.extra["prebuilt"]["archive"] == str(archive.resolve())
    found = build_manifest.load_manifest("cuda-sm89")
    assert found is not None and found.to_dict() == installed.to_dict()

    h100 = hardware.load_snapshot(SNAPSHOTS / "h100.json")
    with pytest.raises(ConfigError, match=r"mtpwrap build --cuda-arch 89,90"):
        prebuilt.install_prebuilt(archive, snap=h100)


@pytest.mark.slow
def test_the_backend_both_binaries_carry_is_packed_once(tmp_path: Path) -> None:
    """Statically linked, both binaries hold the same CUDA code; the archive holds it once."""
    made = packable_manifest(tmp_path)
    blob = os.urandom(12 * 2**20)  # incompressible, and beyond xz's default 8 MiB dictionary
    for info in made.binaries.values():
        Path(info["path"]).write_bytes(blob)
        info["sha256"] = hashing.sha256_file(Path(info["path"]))
    archive = prebuilt.pack_prebuilt(made, tmp_path / "twice.tar.xz")
    assert archive.stat().st_size < 13 * 2**20


def test_a_prebuilt_of_another_source_is_refused_in_one_sentence(tmp_path: Path) -> None:
    archive = prebuilt.pack_prebuilt(packable_manifest(tmp_path, identity="offline:0ld"),
                                  tmp_path / "old.tar.xz")
    env = cli_env(MTPWRAP_BUILD_DIR=str(tmp_path / "b"))
    r = run_cli("build", "--from-prebuilt", str(archive), env=env)
    assert r.returncode == 78, r.stderr
    assert f"built from offline source offline:0ld, but the pin is {source.offline_identity()}" \
        in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "b").exists()
    r = run_cli("build", "--from-prebuilt", str(tmp_path / "old.tar.xz.missing"), env=env)
    assert r.returncode == 78 and "not a readable archive" in r.stderr
    r = run_cli("build", "--from-prebuilt", str(archive), "--pack", "x.tar.xz", env=env)
    assert r.returncode == 78 and "exclude each other" in r.stderr


def test_a_prebuilt_whose_binary_changed_is_refused(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    archive = prebuilt.pack_prebuilt(packable_manifest(tmp_path, sha="0" * 64),
                                    tmp_path / "x.tar.xz")
    monkeypatch.setenv("MTPWRAP_BUILD_DIR", str(tmp_path / "b"))
    with pytest.raises(ConfigError, match="does not match the sha256"):
        prebuilt.install_prebuilt(archive, snap=hardware.load_snapshot(SNAPSHOTS / "none.json"))
    assert not list((tmp_path / "b").rglob("llama-server*"))


# --------------------------------------------------------------------------- the real build


@pytest.mark.integration
def test_the_cuda_build_made_here_answers_help_without_a_gpu() -> None:
    """Runs where benchmarks/cuda_build_check.sh (or `mtpwrap build --cuda-arch 89`) has
    installed a CUDA build: it links, parses its own --help, and was not smoke-tested here."""
    cuda = [m for m in build_manifest.installed_variants() if m.variant.startswith("cuda")
            and "prebuilt" not in m.extra and m.binary().is_file()]
    if not cuda:
        pytest.skip("no CUDA build installed under build/ (benchmarks/cuda_build_check.sh)")
    m = cuda[0]
    server = m.binary()
    out = subprocess.run(["ldd", str(server)], capture_output=True, text=True).stdout
    missing = [line for line in out.splitlines() if "not found" in line]
    assert all("libcuda.so" in line for line in missing), missing
    assert "libcublas" in out and "libcudart" in out
    assert m.capabilities and len(m.capabilities["options"]) > 100
    assert m.configure and m.configure["rejected"] == {}
    if not planning.present_gpu_archs():
        assert m.smoke_status == "skipped" and "no NVIDIA GPU" in (m.smoke or {})["detail"]

