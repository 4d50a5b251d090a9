"""`models pull` with the real huggingface_hub client against a local hub (tests/hub_server.py)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mtpwrap.errors import ConfigError, RuntimeFailure
from mtpwrap.models import pull
from tests.helpers import cli_env, gguf_bytes, pull_env, run_cli
from tests.hub_server import FakeHub, serve

REPO = "acme/Tiny-GGUF"
TOKEN = "hf_TestSecretToken0123456789abcdef"
MB = 1 << 20


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with serve() as h:
        yield h


def leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_resumes_after_the_server_cuts_the_connection_half_way(hub: FakeHub,
                                                                tmp_path: Path) -> None:
    # The library reads 10 MiB chunks: a cut at 14 MiB of 24 leaves 10 MiB to resume from.
    data = gguf_bytes(24 * MB)
    hub.add(REPO, "Tiny-Q4_K_M.gguf", data, cut_after=14 * MB, cuts=1)
    r = run_cli("models", "pull", REPO, "Q4_K_M", env=pull_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    final = tmp_path / "models" / "Tiny-Q4_K_M.gguf"
    assert r.stdout.strip() == str(final)
    assert final.read_bytes() == data
    gets = hub.requests("cdn", "GET")
    assert [g.headers.get("range") for g in gets] == [None, f"bytes={10 * MB}-"]
    rec = json.loads((tmp_path / "models" / "Tiny-Q4_K_M.gguf.json").read_text())
    assert rec["sha256"] == hashlib.sha256(data).hexdigest() and rec["size"] == len(data)
    assert rec["repo"] == REPO and rec["revision"] == hub.commit
    assert "hf_xet not used" in r.stderr
    assert leftovers(tmp_path / "models") == ["Tiny-Q4_K_M.gguf", "Tiny-Q4_K_M.gguf.json"]


def test_a_run_that_broke_off_is_resumed_by_the_next(hub: FakeHub, tmp_path: Path) -> None:
    data = gguf_bytes(24 * MB, seed=1)
    # the first GET and the library's five retries are all cut: the run ends, the part stays
    hub.add(REPO, "Tiny-Q8_0.gguf", data, cut_after=14 * MB, cuts=6)
    env = pull_env(hub, tmp_path)
    first = run_cli("models", "pull", REPO, "Tiny-Q8_0.gguf", env=env)
    assert first.returncode == 1, first.stderr
    assert "kept breaking off" in first.stderr and "Run the same command again" in first.stderr
    assert "Traceback" not in first.stderr
    assert not (tmp_path / "models" / "Tiny-Q8_0.gguf").exists()
    hub.seen.clear()
    second = run_cli("models", "pull", REPO, "Tiny-Q8_0.gguf", env=env)
    assert second.returncode == 0, second.stderr
    assert [g.headers.get("range") for g in hub.requests("cdn", "GET")] == [f"bytes={10 * MB}-"]
    assert (tmp_path / "models" / "Tiny-Q8_0.gguf").read_bytes() == data
    assert "resuming at 10 MB" in second.stderr


def test_bytes_that_do_not_match_the_advertised_sha256_are_refused(hub: FakeHub,
                                                                   tmp_path: Path) -> None:
    data = gguf_bytes(2 * MB, seed=2)
    hub.add(REPO, "Tiny-Q4_0.gguf", data, advertise=gguf_bytes(2 * MB, seed=3))
    r = run_cli("models", "pull", REPO, "Q4_0", env=pull_env(hub, tmp_path))
    assert r.returncode == 78, r.stderr
    assert "have sha256 " + hashlib.sha256(data).hexdigest() in r.stderr
    assert "hub's LFS metadata says" in r.stderr and "Traceback" not in r.stderr
    assert leftovers(tmp_path / "models") == []


def test_a_file_that_is_not_a_gguf_is_refused(hub: FakeHub, tmp_path: Path) -> None:
    hub.add(REPO, "Tiny-F16.gguf", b"PK\x03\x04" + bytes(4096))
    hub.add(REPO, "model.safetensors", b"{}")
    env = pull_env(hub, tmp_path)
    r = run_cli("models", "pull", REPO, "F16", env=env)
    assert r.returncode == 78, r.stderr
    assert "not a GGUF file (it starts with b'PK\\x03\\x04')" in r.stderr
    assert leftovers(tmp_path / "models") == []
    r = run_cli("models", "pull", REPO, "model.safetensors", env=env)
    assert r.returncode == 78 and "model.safetensors is not a GGUF file" in r.stderr


def test_a_split_gguf_arrives_as_a_whole_set(hub: FakeHub, tmp_path: Path) -> None:
    parts = {f"Q4_K_M/Big-Q4_K_M-{i:05d}-of-00003.gguf": gguf_bytes(MB + i, seed=10 + i)
             for i in (1, 2, 3)}
    for path, data in parts.items():
        hub.add(REPO, path, data)
    hub.add(REPO, "Big-Q8_0.gguf", gguf_bytes(MB, seed=20))
    r = run_cli("models", "pull", REPO, "Q4_K_M", env=pull_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    d = tmp_path / "models"
    assert r.stdout.strip() == str(d / "Big-Q4_K_M-00001-of-00003.gguf")
    for path, data in parts.items():
        name = Path(path).name
        assert (d / name).read_bytes() == data
        assert json.loads((d / f"{name}.json").read_text())["file"] == path
    assert not (d / "Big-Q8_0.gguf").exists()
    # a second pull finds the set recorded and fetches nothing
    hub.seen.clear()
    again = run_cli("models", "pull", REPO, "Big-Q4_K_M-00002-of-00003.gguf",
                    env=pull_env(hub, tmp_path))
    assert again.returncode == 0, again.stderr
    assert hub.requests("cdn") == [] and again.stderr.count("already here") == 3


def test_an_incomplete_split_set_and_an_ambiguous_choice_are_refused() -> None:
    f = [pull.RemoteFile(f"M-Q4_K_M-0000{i}-of-00003.gguf", 1, "a" * 64) for i in (1, 3)]
    f += [pull.RemoteFile("M-Q4_K_S.gguf", 1, "b" * 64), pull.RemoteFile("README.md", 1, None)]
    with pytest.raises(ConfigError, match=r"lists 2 of its 3 parts"):
        pull.choose(f, "Q4_K_M", "r@c")
    with pytest.raises(ConfigError, match=r"2 GGUF models match Q4_K \(M-Q4_K_M-\*-of-00003"):
        pull.choose(f, "Q4_K", "r@c")
    with pytest.raises(ConfigError, match=r"2 GGUF models \(.*\); name one"):
        pull.choose(f, None, "r@c")
    assert [x.path for x in pull.choose(f, "q4_k_s", "r@c")] == ["M-Q4_K_S.gguf"]
    with pytest.raises(ConfigError, match=r"r@c has no GGUF file for IQ2_XS \(it has: "):
        pull.choose(f, "IQ2_XS", "r@c")


def test_the_token_is_sent_to_the_hub_only_and_never_written(hub: FakeHub,
                                                             tmp_path: Path) -> None:
    hub.token = TOKEN
    data = gguf_bytes(12 * MB, seed=4)
    hub.add(REPO, "Tiny-Q5_K_M.gguf", data, cut_after=11 * MB, cuts=1)
    no_token = run_cli("models", "pull", REPO, env=pull_env(hub, tmp_path))
    assert no_token.returncode == 78
    assert "no such repository" in no_token.stderr and "HF_TOKEN" in no_token.stderr
    # verbose library logging on, and a cut transfer so that its retry warnings are logged
    hub.seen.clear()
    r = run_cli("models", "pull", REPO, env=pull_env(hub, tmp_path, HF_TOKEN=TOKEN,
                                                     HF_DEBUG="1"))
    assert r.returncode == 0, r.stderr
    assert "Trying to resume" in r.stderr
    assert TOKEN not in r.stdout + r.stderr
    for f in (tmp_path / "models").iterdir():
        assert TOKEN.encode() not in f.read_bytes()
    assert hub.requests("hub") and all(s.headers.get("authorization") == f"Bearer {TOKEN}"
                                       for s in hub.requests("hub"))
    # nothing but the file API is asked for (no telemetry request carrying the token)
    assert all(s.path.startswith(f"/api/models/{REPO}/revision/") or "/resolve/" in s.path
               for s in hub.requests("hub"))
    # the signed storage URL is another origin: the token stays on the hub
    assert len(hub.requests("cdn", "GET")) == 2
    assert all("authorization" not in s.headers for s in hub.requests("cdn"))
    # the same token from a file
    (tmp_path / "models" / "Tiny-Q5_K_M.gguf").unlink()
    tok = tmp_path / "token"
    tok.write_text(TOKEN + "\n")
    r = run_cli("models", "pull", REPO, "--token-file", str(tok), "--dir", str(tmp_path / "o"),
                env=pull_env(hub, tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "o" / "Tiny-Q5_K_M.gguf").read_bytes() == data


def test_no_network_is_one_sentence(tmp_path: Path) -> None:
    from mtpwrap.proc import free_loopback_port

    env = cli_env(MTPWRAP_HOME=str(tmp_path), HF_HOME=str(tmp_path / "hf"),
                  HF_ENDPOINT=f"http://127.0.0.1:{free_loopback_port()}")
    r = run_cli("models", "pull", REPO, env=env)
    assert r.returncode == 1, r.stderr
    assert "cannot reach the hub at http://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


class _FullDisk:
    """A partial file on a disk that fills up after `room` bytes (ENOSPC on demand)."""

    def __init__(self, path: Path, room: int) -> None:
        self.f = path.open("ab")
        self.room = room

    def write(self, b: bytes) -> int:
        if self.f.tell() + len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(b)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def test_a_full_disk_is_one_sentence(hub: FakeHub, tmp_path: Path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    data = gguf_bytes(24 * MB, seed=5)
    hub.add(REPO, "Tiny-Q6_K.gguf", data)
    monkeypatch.setattr(pull, "_open_part", lambda p: _FullDisk(p, 12 * MB))
    with pytest.raises(RuntimeFailure) as err:
        pull.pull(REPO, endpoint=hub.hub_url, dest=tmp_path)
    assert str(err.value).startswith(
        f"no space left in {tmp_path} while writing Tiny-Q6_K.gguf (10 MB of 25 MB written).")
    assert not (tmp_path / "Tiny-Q6_K.gguf").exists()
    # the space check before a transfer: nothing is written at all
    monkeypatch.undo()
    for p in tmp_path.iterdir():
        p.unlink()
    monkeypatch.setattr(pull.shutil, "disk_usage", lambda p: type("U", (), {"free": MB})())
    with pytest.raises(RuntimeFailure, match=r"not enough space in .*: 25 MB needed, 1 MB free"):
        pull.pull(REPO, endpoint=hub.hub_url, dest=tmp_path)
    assert leftovers(tmp_path) == []


def test_unknown_repository_and_revision(hub: FakeHub, tmp_path: Path) -> None:
    hub.add(REPO, "Tiny-Q4_K_M.gguf", gguf_bytes(MB))
    env = pull_env(hub, tmp_path)
    r = run_cli("models", "pull", "acme/Nope", env=env)
    assert r.returncode == 78 and "acme/Nope: no such repository on " + hub.hub_url in r.stderr
    r = run_cli("models", "pull", REPO, "--revision", "v9", env=env)
    assert r.returncode == 78 and f"{REPO} on {hub.hub_url} has no revision v9." in r.stderr
    r = run_cli("models", "pull", "no-slash", env=env)
    assert r.returncode == 78 and "a repository is OWNER/NAME" in r.stderr


def test_a_bar_on_a_terminal_timestamped_lines_on_a_pipe(hub: FakeHub, tmp_path: Path) -> None:
    import pty
    import re
    import subprocess
    import sys

    from tests.helpers import REPO as CHECKOUT

    hub.add(REPO, "Tiny-Q3_K_M.gguf", gguf_bytes(12 * MB, seed=6))
    piped = run_cli("models", "pull", REPO, env=pull_env(hub, tmp_path / "a"))
    assert piped.returncode == 0, piped.stderr
    lines = piped.stderr.strip().splitlines()
    assert lines and all(re.match(r"\d\d:\d\d:\d\d ", line) for line in lines), lines
    assert any("Tiny-Q3_K_M.gguf: 13 MB of 13 MB (100 %) received in" in x for x in lines)
    env = pull_env(hub, tmp_path / "b")
    env.pop("NO_COLOR", None)
    leader, follower = pty.openpty()
    p = subprocess.Popen([sys.executable, "-m", "mtpwrap", "models", "pull", REPO],
                         stdin=follower, stdout=follower, stderr=follower, env=env,
                         cwd=str(CHECKOUT))
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert p.wait(timeout=60) == 0, seen[-2000:]
    text = seen.decode(errors="replace")
    assert "━" in text and "100%" in text  # rich's bar, redrawn in place
    assert "received in" not in text
