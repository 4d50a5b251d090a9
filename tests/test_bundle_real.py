"""The bundle's whole path with the real pieces: made outside from this checkout (the wheels from
the package index, the offline source, the CPU build `make build` made, the demo model), then
unpacked and installed by its own install.sh in a network namespace with nothing but loopback,
an empty HOME and a fresh folder; there `up` serves the carried build to the official `openai`
client, and `build` configures the carried source. No test compiles llama.cpp (the compile
guard), so `build` inside stops after CMake's configure step; docs/operations/airgap.md has a
whole build inside, measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import REPO, require_tool, run_cli

pytestmark = pytest.mark.integration


def test_a_bundle_made_outside_installs_and_serves_inside_with_no_network(
        cpu_manifest: dict, demo_model: Path, tmp_path: Path) -> None:
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    require_tool("unshare", "util-linux")
    require_tool("ip", "iproute2")
    out = tmp_path / "mtpwrap-bundle"
    made = run_cli("bundle", "create", str(out), "--model", "demo", "--with-build", "cpu",
                   "--tar", timeout=900)
    assert made.returncode == 0, made.stderr
    manifest = json.loads((out / "bundle.json").read_text())
    items = manifest["items"]
    kinds = Counter(i["kind"] for i in items)
    assert kinds["build"] == 1 and kinds["patch"] >= 1 and kinds["wheel"] >= 20, kinds
    wheels = {i["name"] for i in items if i["kind"] == "wheel"}
    assert {"mtpwrap", "uvicorn", "httpx", "gguf", "cyclonedx-python-lib"} <= wheels
    build = next(i for i in items if i["kind"] == "build")
    assert build["extra"]["binaries"]["llama-server"] == (
        cpu_manifest["binaries"]["llama-server"]["sha256"])
    assert {i["extra"].get("role") for i in items if i["kind"] == "download"} == {
        "llama.cpp source", "model"}
    sbom = (out / "sbom.cdx.json").read_text()
    assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(sbom) is None

    inside = tmp_path / "inside"
    (inside / "home").mkdir(parents=True)
    with tarfile.open(tmp_path / "mtpwrap-bundle.tar") as tar:
        tar.extractall(inside, filter="data")
    env = {"PATH": os.environ["PATH"], "HOME": str(inside / "home"), "LANG": "C.UTF-8",
           "PYTHONPATH": str(REPO)}
    r = subprocess.run(
        ["unshare", "-rn", sys.executable, "-m", "tests.bundle_inside", "--bundle",
         str(inside / "mtpwrap-bundle"), "--prefix", str(inside / "prefix")],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stderr[-4000:]
    seen = json.loads(r.stdout.splitlines()[-1])
    # nothing but loopback in there: no route anywhere
    assert [ln.split(":")[1].strip() for ln in seen["links"] if ln] == ["lo"], seen["links"]
    assert seen["routes"] == ""
    assert seen["install"]["rc"] == 0, seen["install"]
    said = seen["install"]["out"] + seen["install"]["err"]
    assert "build cpu:" in said and "smoke test passed on this machine" in said, said
    assert (inside / "prefix" / manifest["id"] / ".complete").is_file()
    assert (inside / "prefix" / "current").resolve() == inside / "prefix" / manifest["id"]
    assert "chat" in seen, seen["up_log"]
    assert seen["chat"]["content"] and seen["chat"]["completion_tokens"] > 0, seen["chat"]
    # `up` ran the carried build, installed under the empty HOME's cache
    status = json.loads(seen["status"]["out"])
    assert status["binary"] == str(
        inside / "home/.cache/mtpwrap/build/cpu/bin/llama-server"), status
    assert seen["up_rc"] == 0, seen["up_log"]
    assert seen["configure"]["rc"] == 0, seen["configure"]
    configured = json.loads(seen["configure"]["out"])
    assert configured["variant"] == "cpu" and configured["rejected"] == {}, configured
    # the carried sdist, unpacked under the empty HOME: nothing was fetched
    assert configured["source"]["kind"] == "offline"
    assert configured["source"]["path"].startswith(str(inside / "home")), configured["source"]
