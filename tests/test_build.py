"""`mtpwrap build`: source choice, options, cache, manifest, and every bad-input path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from mtpwrap import build, hashing, source, toolchain
from mtpwrap.errors import ConfigError, MissingToolError
from tests.conftest import cli_env, run_cli

FAKE_TREE = Path(__file__).parent / "data" / "fake-llama-tree"


@pytest.fixture
def build_env(tmp_path: Path) -> dict[str, str]:
    """An isolated home and build root, so these tests never touch the shared cache."""
    return cli_env(MTPWRAP_HOME=str(tmp_path / "home"), MTPWRAP_BUILD_DIR=str(tmp_path / "build"))


def test_cpu_plan_has_the_recipe_options() -> None:
    plan = build.plan_build(cpu=True)
    assert plan.variant == "cpu"
    assert plan.options["CMAKE_BUILD_TYPE"] == "Release"
    assert plan.options["LLAMA_CURL"] == "OFF"
    assert "GGML_CUDA" not in plan.options


def test_cuda_plan_uses_the_arch_and_recipe_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        toolchain,
        "cuda_toolkit",
        lambda: toolchain.CudaToolkit("/opt/cuda/bin/nvcc", "12.8", Path("/opt/cuda"), True),
    )
    plan = build.plan_build(cuda_arch="89")
    assert plan.variant == "cuda-sm89"
    assert plan.options["GGML_CUDA"] == "ON"
    assert plan.options["GGML_CUDA_F16"] == "ON"
    assert plan.options["CMAKE_CUDA_ARCHITECTURES"] == "89"


def test_cuda_arch_without_cublas_is_refused_with_the_reason() -> None:
    if toolchain.cuda_toolkit().usable:
        pytest.skip("this machine has a usable CUDA toolkit")
    with pytest.raises(MissingToolError, match="--cuda-arch 90"):
        build.plan_build(cuda_arch="90")


def test_bad_cuda_arch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--cuda-arch sm89x"):
        build.plan_build(cuda_arch="sm89x")


def test_cache_key_follows_options_but_not_the_launcher() -> None:
    opts = build.plan_build(cpu=True).options
    k1 = build.cache_key("offline:x", opts, "g++ 12")
    assert k1 == build.cache_key(
        "offline:x", {**opts, "CMAKE_CXX_COMPILER_LAUNCHER": "/x"}, "g++ 12"
    )
    assert k1 != build.cache_key("offline:x", {**opts, "GGML_NATIVE": "OFF"}, "g++ 12")
    assert k1 != build.cache_key("offline:y", opts, "g++ 12")
    assert k1 != build.cache_key("offline:x", opts, "clang 18")


def test_source_path_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such directory"):
        source.resolve(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="no CMakeLists.txt"):
        source.resolve(str(tmp_path))


def test_wrong_source_path_cli(build_env: dict[str, str], tmp_path: Path) -> None:
    r = run_cli("build", "--cpu", "--source", str(tmp_path / "missing"), env=build_env)
    assert r.returncode == 78, r.stderr
    assert "--source" in r.stderr and "no such directory" in r.stderr
    assert "Traceback" not in r.stderr


def test_offline_sha_mismatch_is_refused(build_env: dict[str, str]) -> None:
    downloads = Path(build_env["MTPWRAP_HOME"]) / "downloads"
    downloads.mkdir(parents=True)
    (downloads / source.OFFLINE_SDIST).write_bytes(b"not the pinned release")
    r = run_cli("build", "--cpu", "--source", "offline", env=build_env)
    assert r.returncode == 78, r.stderr
    assert "sha256" in r.stderr and source.OFFLINE_SHA256 in r.stderr
    assert "Traceback" not in r.stderr


def test_no_cmake_is_named(build_env: dict[str, str], tmp_path: Path) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    r = run_cli("build", "--cpu", "--source", str(FAKE_TREE), env={**build_env, "PATH": str(empty)})
    assert r.returncode == 69, r.stderr
    assert "cmake is not installed" in r.stderr


def test_build_from_a_path_writes_a_complete_manifest(
    build_env: dict[str, str], tmp_path: Path
) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(FAKE_TREE, tree)
    r = run_cli("build", "--cpu", "--source", str(tree), "--json", env=build_env, timeout=300)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    installed = Path(build_env["MTPWRAP_BUILD_DIR"]) / "cpu" / "manifest.json"
    assert json.loads(installed.read_text()) == manifest
    assert manifest["source"]["kind"] == "path"
    assert manifest["source"]["location"] == str(tree.resolve())
    assert manifest["version_output"].startswith("version: 42 (fake000)")
    assert manifest["cmake_options"]["CMAKE_BUILD_TYPE"] == "Release"
    assert manifest["compiler"] and manifest["built_at"] and manifest["architectures"]
    for name in build.TARGETS:
        info = manifest["binaries"][name]
        assert Path(info["path"]).is_file()
        assert info["sha256"] == hashing.sha256_file(Path(info["path"]))


def test_failed_compile_shows_the_compiler_error_and_log(
    build_env: dict[str, str], tmp_path: Path
) -> None:
    tree = tmp_path / "broken"
    shutil.copytree(FAKE_TREE, tree)
    (tree / "server.cpp").write_text("int main( { this is not C++ }\n")
    r = run_cli("build", "--cpu", "--source", str(tree), env=build_env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "compiling llama-server, llama-fit-params failed" in r.stderr
    assert "server.cpp" in r.stderr  # the compiler's own lines are shown
    log = r.stderr.split("Full log: ")[1].split()[0]
    assert "error" in Path(log).read_text()
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_offline_build_is_complete_and_a_second_run_is_a_no_op(cpu_manifest: dict) -> None:
    assert cpu_manifest["source"]["kind"] in ("offline", "submodule")
    if cpu_manifest["source"]["kind"] == "offline":
        assert cpu_manifest["source"]["commit"].startswith(source.OFFLINE_COMMIT)
        assert "0c1e570" in cpu_manifest["version_output"]
    log = Path(cpu_manifest["log"])
    before = log.stat().st_mtime_ns
    r = run_cli("build", "--cpu", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "reused" in r.stderr
    assert log.stat().st_mtime_ns == before  # nothing was configured or compiled again
    server = Path(cpu_manifest["binaries"]["llama-server"]["path"])
    assert hashing.sha256_file(server) == cpu_manifest["binaries"]["llama-server"]["sha256"]
