"""`git clone --recursive` then `mtpwrap build`: the submodule path, without GitHub.

A copy of this checkout (its own git repository, so the product finds its source tree where it
runs from) pins a fork-shaped tree as `vendor/llama.cpp-mtp` through a real gitlink, and
`git submodule update --init` checks it out from a local bare repository. The tree has the
fork's shape where patch 0001 looks (no tools/server/server-schema.cpp, speculative code of its
own) and builds in seconds (tests/data/fake-llama-tree); its llama-server is the real CPU build
behind a relay that drops `speculative.*`, as the fork ignores a request's draft depth. Then:
the checkout's own `mtpwrap build` takes the submodule as the pin, records patch 0001 as not for
this source (no patch error), smoke-tests and installs; `doctor` and `/healthz` say what the
build lacks; `up` serves a chat through the official `openai` client; a submodule moved off its
pin is refused unless --allow-unpinned.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from mtpwrap import proc
from mtpwrap.build import source
from tests.helpers import DATA, REPO, ignoring_draft_depth, wait_ready

pytestmark = pytest.mark.integration

GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.invalid",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.invalid",
           "GIT_CONFIG_NOSYSTEM": "1"}


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **GIT_ENV, "HOME": str(cwd)}
    done = subprocess.run(["git", "-c", "protocol.file.allow=always", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout.strip()


def _fork_shaped_tree(dest: Path, real_server: Path) -> str:
    """A git repository shaped like the fork where patch 0001 looks; returns its commit."""
    shutil.copytree(DATA / "fake-llama-tree", dest)
    (dest / "common").mkdir()
    (dest / "common" / "speculative.cpp").write_text(
        "// the fork's own speculative decoding (MTP), not upstream 0c1e570's\n")
    (dest / "tools" / "server").mkdir(parents=True)
    (dest / "tools" / "server" / "server-context.cpp").write_text("// the fork's server\n")
    (dest / "real-server").write_text(f"{real_server}\n")
    _git(dest, "init", "-q", "-b", "master")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "a fork-shaped tree")
    return _git(dest, "rev-parse", "HEAD")


def _checkout(dest: Path) -> None:
    """This checkout's tracked files as they are on disk, committed into a repository of its
    own (the gitlink left out: the test sets its own)."""
    files = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file() and not src.is_symlink():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    _git(dest, "init", "-q", "-b", "main")
    _git(dest, "add", "-A")
    _git(dest, "commit", "-q", "-m", "the checkout")


@pytest.fixture(scope="module")
def clone(llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A checkout pinning the fork-shaped tree, cloned recursively from local repositories."""
    base = tmp_path_factory.mktemp("submodule")
    real = ignoring_draft_depth(llama_server_bin, base / "ignoring")
    commit = _fork_shaped_tree(base / "fork-src", real)
    _git(base, "clone", "-q", "--bare", str(base / "fork-src"), str(base / "fork.git"))
    upstream = base / "upstream"
    _checkout(upstream)
    _git(upstream, "update-index", "--add", "--cacheinfo",
         f"160000,{commit},{source.SUBMODULE_PATH}")
    _git(upstream, "config", "-f", ".gitmodules", f"submodule.{source.SUBMODULE_PATH}.url",
         str(base / "fork.git"))
    _git(upstream, "add", ".gitmodules")  # not `commit -a`: it would drop the gitlink
    _git(upstream, "commit", "-q", "-m", "pin the fork-shaped tree")
    # as a user would: git clone --recursive
    _git(base, "clone", "-q", "--recursive", str(upstream), str(base / "clone"))
    return {"root": base / "clone", "commit": commit, "home": base / "home"}


def _env(clone: dict, demo_model: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MTPWRAP_")}
    env.update({"PYTHONPATH": str(clone["root"]), "MTPWRAP_HOME": str(clone["home"]),
                "MTPWRAP_DEMO_MODEL": str(demo_model), "XDG_CONFIG_HOME":
                str(clone["home"] / "xdg-config"), "NO_COLOR": "1", "COLUMNS": "200"})
    return env


def _cli(clone: dict, env: dict[str, str], *args: str, timeout: float = 300
         ) -> proc.Completed:
    return proc.run([sys.executable, "-m", "mtpwrap", *args], env=env, timeout=timeout,
                    cwd=clone["root"])


def test_the_clone_builds_its_pinned_submodule_without_the_patch_meant_for_upstream(
        clone: dict, demo_model: Path) -> None:
    root = clone["root"]
    assert (root / source.SUBMODULE_PATH / "real-server").is_file()  # --recursive checked it out
    env = _env(clone, demo_model)
    r = _cli(clone, env, "build", "--cpu")
    assert r.returncode == 0, r.stderr
    assert "does not apply" not in r.stderr and "Traceback" not in r.stderr
    assert f"source: submodule — {source.SUBMODULE_PATH}" in r.stderr, r.stderr
    assert "patch 0001-per-request-speculative is not for this source" in r.stderr, r.stderr
    assert "per-request draft depth unsupported" in r.stderr
    assert "smoke test: passed" in r.stderr
    manifest = json.loads((root / "build" / "cpu" / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "submodule"
    assert manifest["source"]["commit"] == clone["commit"] and manifest["source"]["pinned"]
    patch = manifest["patches"][0]
    assert {p["status"] for p in manifest["patches"]} == {"not-for-source"}, manifest["patches"]
    assert patch["for"] == ["offline@0c1e570"] and "submodule" in patch["why"]
    assert manifest["spec_depth"]["status"] == "ignored", manifest["spec_depth"]
    doctor = _cli(clone, env, "doctor", "--json", timeout=120)
    checks = [c for c in json.loads(doctor.stdout)["checks"] if c["name"] == "patch set"]
    patches = list((REPO / "patches" / "llama.cpp").glob("*.patch"))
    assert len(checks) == len(manifest["patches"]) == len(patches), checks
    assert all("not for this source" in c["detail"] for c in checks), checks


def test_up_serves_a_chat_from_the_submodule_build(clone: dict, demo_model: Path) -> None:
    env = _env(clone, demo_model)
    if not (clone["root"] / "build" / "cpu" / "manifest.json").is_file():
        assert _cli(clone, env, "build", "--cpu").returncode == 0
    port = proc.free_loopback_port()
    log = clone["home"] / "up.log"
    clone["home"].mkdir(parents=True, exist_ok=True)
    started = proc.start([sys.executable, "-m", "mtpwrap", "up", "--profile", "cpu-demo",
                          "--model", str(demo_model), "--port", str(port)],
                         env=env, cwd=clone["root"], stdout=log.open("w"), stderr=proc.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base, started.popen, log.read_text, timeout=180)
        health = httpx.get(base + "/healthz", timeout=10).json()
        assert health["binary"] == str(clone["root"] / "build" / "cpu" / "bin" / "llama-server")
        assert health["commit"] == clone["commit"]
        assert any("0001-per-request-speculative is not for this source" in s
                   for s in health["build_lacks"]), health["build_lacks"]
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model="demo", max_tokens=8, temperature=0.0,
            messages=[{"role": "user", "content": "Say hello."}])
        assert out.choices[0].message.content and out.usage is not None
        assert out.usage.completion_tokens > 0
    finally:
        started.popen.send_signal(signal.SIGTERM)
        try:
            started.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            started.kill()


def test_a_submodule_moved_off_its_pin_is_refused_unless_allowed(clone: dict,
                                                                 demo_model: Path) -> None:
    sub = clone["root"] / source.SUBMODULE_PATH
    _git(sub, "commit", "-q", "--allow-empty", "-m", "not the pin")
    moved = _git(sub, "rev-parse", "HEAD")
    env = _env(clone, demo_model)
    try:
        r = _cli(clone, env, "build", "--cpu")
        assert r.returncode != 0
        assert f"holds {moved}, not the pinned fork commit {clone['commit']}" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr
    finally:
        _git(sub, "checkout", "-q", clone["commit"])
