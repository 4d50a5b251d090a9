"""`mtpwrap build`: source choice, options, cache, manifest, and every bad-input path."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
from pathlib import Path

import pytest

from mtpwrap import hashing
from mtpwrap.build import planning, source, toolchain
from mtpwrap.errors import ConfigError
from tests.helpers import cli_env, run_cli

FAKE_TREE = Path(__file__).parent / "data" / "fake-llama-tree"


@pytest.fixture
def build_env(tmp_path: Path) -> dict[str, str]:
    """An isolated home and build root, so these tests never touch the shared cache. The fake
    tree's llama-server does not read its model, so its smoke test gets a placeholder file."""
    model = tmp_path / "placeholder.gguf"
    model.write_bytes(b"GGUF")
    return cli_env(MTPWRAP_HOME=str(tmp_path / "home"), MTPWRAP_BUILD_DIR=str(tmp_path / "build"),
                   MTPWRAP_DEMO_MODEL=str(model))


def _fake_tree(tmp_path: Path, *markers: str) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(FAKE_TREE, tree)
    for marker in markers:
        (tree / marker).write_text("")
    return tree


def test_cpu_plan_has_the_recipe_options() -> None:
    plan = planning.plan_build(cpu=True)
    assert plan.variant == "cpu"
    assert plan.options["CMAKE_BUILD_TYPE"] == "Release"
    assert plan.options["LLAMA_OPENSSL"] == "OFF"
    assert "GGML_CUDA" not in plan.options


def test_cuda_plan_uses_the_arch_and_the_toolkits_own_nvcc(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    root = tmp_path / "cuda"
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("")
    (root / "bin" / "nvcc").chmod(0o755)
    monkeypatch.setattr(
        toolchain,
        "cuda_toolkit",
        lambda: toolchain.CudaToolkit("/usr/local/bin/nvcc", "12.8", root, True),
    )
    plan = planning.plan_build(cuda_arch="89")
    assert plan.variant == "cuda-sm89"
    assert plan.options["GGML_CUDA"] == "ON"
    assert plan.options["CMAKE_CUDA_ARCHITECTURES"] == "89"
    # a wrapper script on PATH is not what CMake should probe as the CUDA compiler
    assert plan.options["CMAKE_CUDA_COMPILER"] == str(root / "bin" / "nvcc")


def test_bad_cuda_arch_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="--cuda-arch sm89x"):
        planning.plan_build(cuda_arch="sm89x")


def test_cache_key_follows_options_but_not_the_launcher() -> None:
    opts = planning.plan_build(cpu=True).options
    k1 = planning.cache_key("offline:x", opts, "g++ 12")
    assert k1 == planning.cache_key(
        "offline:x", {**opts, "CMAKE_CXX_COMPILER_LAUNCHER": "/x"}, "g++ 12"
    )
    assert k1 != planning.cache_key("offline:x", {**opts, "GGML_NATIVE": "OFF"}, "g++ 12")
    assert k1 != planning.cache_key("offline:y", opts, "g++ 12")
    assert k1 != planning.cache_key("offline:x", opts, "clang 18")


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


@pytest.mark.integration
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
    for name in planning.TARGETS:
        info = manifest["binaries"][name]
        assert Path(info["path"]).is_file()
        assert info["sha256"] == hashing.sha256_file(Path(info["path"]))


@pytest.mark.integration
def test_failed_compile_shows_the_compiler_error_and_log(
    build_env: dict[str, str], tmp_path: Path
) -> None:
    tree = tmp_path / "broken"
    shutil.copytree(FAKE_TREE, tree)
    (tree / "server.cpp").write_text("int main( { this is not C++ }\n")
    r = run_cli("build", "--cpu", "--source", str(tree), env=build_env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert f"compiling {', '.join(planning.TARGETS)} failed" in r.stderr
    assert "server.cpp" in r.stderr  # the compiler's own lines are shown
    log = r.stderr.split("Full log: ")[1].split()[0]
    assert "error" in Path(log).read_text()
    assert "Traceback" not in r.stderr


@pytest.mark.integration
def test_a_tree_without_the_web_ui_bundle_builds_without_the_ui(
    build_env: dict[str, str], tmp_path: Path
) -> None:
    """Like a fork snapshot (no tools/server/public/bundle.js): LLAMA_BUILD_WEBUI=OFF, and the
    manifest says the binary has no web UI; with the bundle, the UI is built in and served."""
    tree = _fake_tree(tmp_path)
    r = run_cli("build", "--cpu", "--source", str(tree), "--json", env=build_env, timeout=300)
    assert r.returncode == 0, r.stderr
    without = json.loads(r.stdout)
    assert without["webui"]["in_binary"] is False
    assert "bundle.js is missing" in without["webui"]["why"]
    assert without["cmake_options"]["LLAMA_BUILD_WEBUI"] == "OFF"
    assert without["configure"]["accepted"]["LLAMA_BUILD_WEBUI"] == "OFF"
    assert _root_status(without) == 404
    (tree / "tools" / "server" / "public").mkdir(parents=True)
    (tree / "tools" / "server" / "public" / "bundle.js").write_text("/* ui */\n")
    r = run_cli("build", "--cpu", "--source", str(tree), "--json", env=build_env, timeout=300)
    assert r.returncode == 0, r.stderr
    with_ui = json.loads(r.stdout)
    assert with_ui["webui"]["in_binary"] is True
    assert with_ui["cmake_options"]["LLAMA_BUILD_WEBUI"] == "ON"
    assert _root_status(with_ui) == 200


def _root_status(manifest: dict) -> int:
    """What the built llama-server answers to GET / (its web UI, if it has one)."""
    import httpx

    from mtpwrap import proc

    port = proc.free_loopback_port()
    base = f"http://127.0.0.1:{port}"
    server = manifest["binaries"]["llama-server"]["path"]
    with proc.running_server([server, "--port", str(port)], base_url=base, timeout=60):
        return httpx.get(base + "/", trust_env=False).status_code


@pytest.mark.integration
def test_a_cached_build_without_a_new_target_gets_only_that_target(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache entry recorded before llama-perplexity was a target is topped up in its own
    folder: only the missing tool is compiled, and the tried server keeps its smoke result."""
    from mtpwrap.build import builder

    tree = _fake_tree(tmp_path)
    model = tmp_path / "placeholder.gguf"
    model.write_bytes(b"GGUF")
    for key, value in (("MTPWRAP_HOME", tmp_path / "home"),
                       ("MTPWRAP_BUILD_DIR", tmp_path / "build"), ("MTPWRAP_DEMO_MODEL", model)):
        monkeypatch.setenv(key, str(value))
    pinned = source.Source("offline", tree, "fake000", source.offline_identity(), str(tree),
                           "the pinned offline source (here: the fake tree)")
    monkeypatch.setattr(source, "offline_source", lambda reason="": pinned)
    first, reused, _ = builder.build("offline", cpu=True, cpu_isa="safe", no_patches=True)
    assert not reused and first.smoke_status == "passed"
    # as an older mtpwrap left it: no llama-perplexity, in the record or the folder
    record = Path(first.build_dir) / "manifest.json"
    older = json.loads(record.read_text())
    del older["binaries"]["llama-perplexity"]
    record.write_text(json.dumps(older))
    Path(first.build_dir, "bin", "llama-perplexity").unlink()
    tried_at = older["smoke"]["seconds"]
    again, reused, _ = builder.build("offline", cpu=True, cpu_isa="safe", no_patches=True)
    assert not reused and again.build_dir == first.build_dir
    assert again.extra["added_targets"]["targets"] == ["llama-perplexity"]
    assert Path(again.binaries["llama-perplexity"]["path"]).is_file()
    assert again.smoke is not None and again.smoke["seconds"] == tried_at  # not tried again
    log = Path(again.log).read_text()
    assert "Linking CXX executable bin/llama-perplexity" in log
    assert "Building CXX object" not in log  # nothing else was compiled again
    third, reused, _ = builder.build("offline", cpu=True, cpu_isa="safe", no_patches=True)
    assert reused and third.cache_key == first.cache_key


def test_trees_without_a_web_ui_option_are_given_none(tmp_path: Path) -> None:
    options, record = planning.webui_options(tmp_path)
    assert options == {} and record["in_binary"] is None
    (tmp_path / "CMakeLists.txt").write_text(
        'option(LLAMA_BUILD_UI        "llama: build the embedded Web UI for server" OFF)\n')
    options, record = planning.webui_options(tmp_path)
    assert options == {} and record["in_binary"] is False  # upstream: no prebuilt dist here
    (tmp_path / "tools" / "ui" / "dist").mkdir(parents=True)
    (tmp_path / "tools" / "ui" / "dist" / "index.html").write_text("<html></html>")
    assert planning.webui_options(tmp_path)[1]["in_binary"] is True


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
    assert set(planning.TARGETS) <= set(cpu_manifest["binaries"])  # llama-perplexity too
    assert cpu_manifest["webui"]["in_binary"] is False, cpu_manifest["webui"]
    assert log.stat().st_mtime_ns == before  # nothing was configured or compiled again
    server = Path(cpu_manifest["binaries"]["llama-server"]["path"])
    assert hashing.sha256_file(server) == cpu_manifest["binaries"]["llama-server"]["sha256"]


# --------------------------------------------------------------------------- tried builds


def test_safe_isa_names_this_cpus_instruction_sets_and_turns_amx_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(planning, "_is_x86", lambda: True)
    flags = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_vnni",
             "amx_tile", "amx_int8", "amx_bf16"}
    safe = planning.isa_options("safe", flags)
    assert safe["GGML_NATIVE"] == "OFF"
    assert safe["GGML_AVX512"] == "ON" and safe["GGML_AVX512_VNNI"] == "ON"
    assert safe["GGML_AVX512_BF16"] == "OFF"  # not in this CPU's flags
    assert all(safe[o] == "OFF" for o in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16"))
    base = planning.isa_options("baseline", flags)
    assert base["GGML_AVX2"] == "ON" and base["GGML_FMA"] == "ON"
    assert base["GGML_AVX512"] == "OFF" and base["GGML_AMX_INT8"] == "OFF"
    assert planning.isa_options("native", flags) == {"GGML_NATIVE": "ON"}
    with pytest.raises(ConfigError, match="--cpu-isa fastest"):
        planning.isa_options("fastest", flags)


def test_compiler_flags_from_the_environment_are_part_of_the_cache_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    opts = planning.plan_build(cpu=True).options
    monkeypatch.delenv("CFLAGS", raising=False)
    k1 = planning.cache_key("offline:x", opts, "g++ 12")
    monkeypatch.setenv("CFLAGS", "-march=x86-64-v3")
    assert planning.cache_key("offline:x", opts, "g++ 12") != k1


@pytest.mark.integration
def test_a_build_that_crashes_is_never_installed_and_the_safe_one_is_kept(
    build_env: dict[str, str], tmp_path: Path
) -> None:
    tree = _fake_tree(tmp_path, "crash-when-native")
    r = run_cli("build", "--cpu", "--source", str(tree), "--json", env=build_env, timeout=300)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert manifest["cpu_isa"] == "safe"
    assert manifest["cmake_options"]["GGML_NATIVE"] == "OFF"
    assert manifest["smoke"]["status"] == "passed"
    native, safe = manifest["attempts"]
    assert native["cpu_isa"] == "native" and native["smoke"] == "crashed"
    assert native["signal"] == "SIGSEGV"
    assert any("about to crash" in line for line in native["log_tail"])
    assert safe["cpu_isa"] == "safe" and safe["smoke"] == "passed"
    assert "trying the safe configuration" in r.stderr
    installed = Path(manifest["binaries"]["llama-server"]["path"])
    # The installed binary is the safe one, byte for byte, and not the crashing native one.
    assert manifest["binaries"]["llama-server"]["cache_path"].startswith(safe["build_dir"])
    crashed = Path(native["build_dir"]) / "bin" / "llama-server"
    assert "FAKE_CRASH" not in installed.read_text()
    assert "CRASH = 1" in crashed.read_text() and "CRASH = 0" in installed.read_text()
    # The crashing build's own record says so, so it is never taken from the cache.
    cached = json.loads((Path(native["build_dir"]) / "manifest.json").read_text())
    assert cached["smoke"]["status"] == "crashed"
    # A second build of the same tree on this CPU goes straight to safe: no native compile.
    native_log = Path(native["build_dir"]) / "build.log"
    before = native_log.stat().st_mtime_ns
    again = run_cli("build", "--cpu", "--source", str(tree), "--json", env=build_env,
                    timeout=300)
    assert again.returncode == 0, again.stderr
    second = json.loads(again.stdout)
    assert [a["cpu_isa"] for a in second["attempts"]] == ["native", "safe"]
    assert second["attempts"][0]["smoke"] == "crashed"
    assert "remembered" in second["attempts"][0]["detail"]
    assert "native build crashed here before" in again.stderr
    assert "configure (native)" not in again.stderr
    assert native_log.stat().st_mtime_ns == before
    # --cpu-isa native still tries it
    forced = run_cli("build", "--cpu", "--cpu-isa", "native", "--source", str(tree),
                     env=build_env, timeout=300)
    assert forced.returncode == 1 and "native: llama-server ended with signal 11" in forced.stderr


@pytest.mark.integration
def test_when_every_configuration_crashes_nothing_is_installed(
    build_env: dict[str, str], tmp_path: Path
) -> None:
    tree = _fake_tree(tmp_path, "crash-always")
    r = run_cli("build", "--cpu", "--source", str(tree), env=build_env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "every CPU configuration tried crashed" in r.stderr
    # a CPU whose instruction sets are exactly the AVX2 floor has no separate baseline build
    same = planning.isa_options("safe") == planning.isa_options("baseline")
    for isa in ("native", "safe") if same else ("native", "safe", "baseline"):
        assert f"{isa}: llama-server ended with signal 11 (SIGSEGV)" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (Path(build_env["MTPWRAP_BUILD_DIR"]) / "cpu" / "manifest.json").exists()


@pytest.mark.integration
def test_cpu_isa_forces_one_configuration(build_env: dict[str, str], tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path, "crash-when-native")
    r = run_cli("build", "--cpu", "--cpu-isa", "native", "--source", str(tree), env=build_env,
                timeout=300)
    assert r.returncode == 1, r.stderr
    assert "native: llama-server ended with signal 11 (SIGSEGV)" in r.stderr
    r = run_cli("build", "--cpu", "--cpu-isa", "baseline", "--source", str(tree), "--json",
                env=build_env, timeout=300)
    assert r.returncode == 0, r.stderr
    manifest = json.loads(r.stdout)
    assert [a["cpu_isa"] for a in manifest["attempts"]] == ["baseline"]
    assert manifest["extra"]["isa_reason"] == "--cpu-isa baseline asked for it"


@pytest.mark.integration
def test_piped_build_prints_one_line_per_phase(build_env: dict[str, str], tmp_path: Path) -> None:
    tree = _fake_tree(tmp_path)
    r = run_cli("build", "--cpu", "--source", str(tree), env=build_env, timeout=300)
    assert r.returncode == 0, r.stderr
    lines = r.stderr.splitlines()
    for phase in ("configure (native)", "compile (native)", "smoke test (native)", "built"):
        assert any(line.endswith(f"build: {phase}") for line in lines), r.stderr
    assert "━" not in r.stderr  # no progress bar drawn into a log
    assert "smoke test: passed" in r.stderr


def test_the_fork_pin_is_a_real_gitlink(repo_root: Path) -> None:
    out = subprocess.run(["git", "-C", str(repo_root), "ls-files", "-s", source.SUBMODULE_PATH],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out[:2] == ["160000", source.SUBMODULE_COMMIT], out


def _git(cwd: Path, *args: str) -> str:
    env = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "PATH": os.environ["PATH"], "HOME": str(cwd)}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_submodule_at_another_commit_is_refused_unless_allowed(tmp_path: Path) -> None:
    fork = tmp_path / "super" / source.SUBMODULE_PATH
    shutil.copytree(FAKE_TREE, fork)
    _git(fork, "init", "-q")
    _git(fork, "add", "-A")
    _git(fork, "commit", "-q", "-m", "not the pin")
    head = _git(fork, "rev-parse", "HEAD")
    root = tmp_path / "super"
    with pytest.raises(ConfigError, match=f"holds {head}, not the pinned fork commit"):
        source.resolve(None, root=root)
    with pytest.raises(ConfigError, match="--allow-unpinned"):
        source.resolve("submodule", root=root)
    allowed = source.resolve(None, root=root, allow_unpinned=True)
    assert allowed.kind == "submodule" and allowed.commit == head
    assert "--allow-unpinned" in allowed.reason
    assert source.pin_status(root) == (source.SUBMODULE_COMMIT, head)


@pytest.mark.integration
def test_the_real_build_passed_its_smoke_test_on_this_cpu(cpu_manifest: dict,
                                                          demo_model: Path) -> None:
    assert cpu_manifest["smoke"]["status"] == "passed", cpu_manifest["smoke"]
    assert cpu_manifest["smoke"]["tokens"] > 0
    assert cpu_manifest["cpu_isa"] in planning.CPU_ISAS
    kept = cpu_manifest["attempts"][-1]
    assert kept["cpu_isa"] == cpu_manifest["cpu_isa"] and kept["smoke"] == "passed"
    assert all(a["smoke"] == "crashed" for a in cpu_manifest["attempts"][:-1])
    r = run_cli("doctor", "--json", timeout=120)
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    assert cpu_manifest["cpu_isa"] in checks["CPU configuration"]["detail"]
    assert source.SUBMODULE_COMMIT[:12] in checks["fork pin"]["detail"]
    assert "smoke test passed" in checks["llama-server build"]["detail"]


@pytest.mark.integration
def test_the_tiny_smoke_model_runs_quantized_kernels(cpu_manifest: dict, tmp_path: Path) -> None:
    """Without the demo model the build tries its binary on a tiny q8_0 model the project
    writes: it must pass on the kept build and crash every build that crashed on the demo
    model here (on a CPU with AMX, the native build does: the quantized matmul runs there)."""
    from mtpwrap.build import smoke, tiny_gguf

    model = tiny_gguf.write_tiny_random(tmp_path / "tiny-q8_0.gguf", arch="llama", mtp=False,
                                          ftype="q8_0")
    kept = smoke.run(Path(cpu_manifest["binaries"]["llama-server"]["path"]), model)
    assert kept.status == "passed" and kept.tokens > 0, kept
    for attempt in cpu_manifest["attempts"][:-1]:
        binary = Path(attempt["build_dir"]) / "bin" / "llama-server"
        if binary.is_file():
            tried = smoke.run(binary, model)
            assert tried.crashed, (attempt["cpu_isa"], tried)


def test_a_cpu_with_amx_starts_the_pinned_sources_at_the_safe_configuration() -> None:
    """The pinned sources' AMX kernels crash on such CPUs: native is not compiled first there
    (only when asked for); a PATH tree, and every CPU without AMX, still starts at native."""
    amx = {"avx2", "avx512f", "amx_tile", "amx_int8"}
    order, why = planning.isa_order(pinned=True, flags=amx)
    if platform.machine() not in ("x86_64", "AMD64"):
        assert order == planning.CPU_ISAS and why is None
        return
    assert order == ("safe", "baseline") and why is not None and "--cpu-isa native" in why
    assert planning.isa_order(pinned=False, flags=amx) == (planning.CPU_ISAS, None)
    assert planning.isa_order(pinned=True, flags={"avx2", "avx512f"}) == (planning.CPU_ISAS,
                                                                          None)


def test_the_pin_is_the_checkouts_own_gitlink(tmp_path: Path) -> None:
    """A checkout pins what its gitlink says; without a git checkout, the shipped pin."""
    assert source.pinned_commit(tmp_path) == source.SUBMODULE_COMMIT
    root = tmp_path / "super"
    fork = root / source.SUBMODULE_PATH
    shutil.copytree(FAKE_TREE, fork)
    _git(fork, "init", "-q")
    _git(fork, "add", "-A")
    _git(fork, "commit", "-q", "-m", "another fork commit")
    head = _git(fork, "rev-parse", "HEAD")
    _git(root, "init", "-q")
    _git(root, "update-index", "--add", "--cacheinfo", f"160000,{head},{source.SUBMODULE_PATH}")
    assert source.pinned_commit(root) == head
    held = source.resolve(None, root=root)
    assert held.kind == "submodule" and held.pinned and held.commit == head
    assert source.pin_status(root) == (head, head)


def test_the_ui_download_is_turned_off_only_where_the_tree_declares_it(tmp_path: Path) -> None:
    """Upstream 0c1e570 downloads a prebuilt UI unless LLAMA_USE_PREBUILT_UI is off; the fork
    does not declare it, and CMake would call the option unused (configure-only fails then)."""
    upstream, fork = tmp_path / "upstream", tmp_path / "fork"
    for tree in (upstream, fork):
        tree.mkdir()
    (upstream / "CMakeLists.txt").write_text(
        'option(LLAMA_BUILD_UI        "llama: build the embedded Web UI for server" OFF)\n'
        'option(LLAMA_USE_PREBUILT_UI "llama: use prebuilt UI from HF Bucket" ON)\n')
    (fork / "CMakeLists.txt").write_text('option(LLAMA_BUILD_WEBUI "Build the Web UI" ON)\n')
    assert planning.webui_options(upstream)[0] == {"LLAMA_USE_PREBUILT_UI": "OFF"}
    assert planning.webui_options(fork)[0] == {"LLAMA_BUILD_WEBUI": "OFF"}  # no bundle.js
    assert "LLAMA_USE_PREBUILT_UI" not in planning.plan_build(cpu=True).options


def test_two_builds_writing_one_manifest_at_once_both_succeed(tmp_path: Path) -> None:
    """Two builds that finish together (two `mtpwrap build`, two test workers) each replace
    the manifest whole: a temporary name they shared made one's rename fail."""
    import sys
    import time

    path = tmp_path / "manifest.json"
    script = ("import sys, time\nfrom pathlib import Path\n"
              "from mtpwrap.build.manifest import write_json\n"
              "while time.time() < float(sys.argv[3]): pass\n"  # both start at once
              "for i in range(2000): write_json(Path(sys.argv[1]), {'by': sys.argv[2], 'i': i})")
    start = str(time.time() + 2)
    writers = [subprocess.Popen([sys.executable, "-c", script, str(path), w, start],
                                stderr=subprocess.PIPE, text=True, env=cli_env())
               for w in "ab"]
    errors = [w.communicate(timeout=120)[1] for w in writers]
    assert [w.returncode for w in writers] == [0, 0], errors
    assert json.loads(path.read_text())["i"] == 1999
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]  # no temporary left


def test_a_write_that_fails_leaves_the_file_as_it_was_and_nothing_beside_it(
        tmp_path: Path) -> None:
    from mtpwrap import paths

    path = tmp_path / "state.json"
    path.write_text("before")
    with pytest.raises(UnicodeEncodeError):  # fails mid-write, as a full disk would
        paths.replace_text(path, "after \ud800")
    assert path.read_text() == "before"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
