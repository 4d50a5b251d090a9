"""llama-server behind a UNIX socket only the service user can open: where the socket goes,
its directory and mode, a stale one after a crash, the fall-back to loopback TCP for a binary
that cannot bind one, and (integration) the real llama-server on the demo model."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from mtpwrap import upstream
from mtpwrap.decide import launch
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.endpoint import Endpoint, binds_unix_socket, listen_on
from mtpwrap.errors import ConfigError, RuntimeFailure
from mtpwrap.supervision import sockets
from tests.helpers import DATA, listening, until, without_socket_help

HELP = DATA / "help"
PLAIN = launch.plain("m.gguf", context=512, why="test")


def _caps(name: str) -> Capabilities:
    return Capabilities.from_help((HELP / name).read_text(), binary=Path("llama-server"))


def _without_socket_help(name: str = "upstream-0c1e570.txt") -> str:
    """The recorded help with the `--host` entry of a llama-server from before socket support."""
    return without_socket_help((HELP / name).read_text())


@pytest.mark.parametrize("name", ["upstream-0c1e570.txt", "fork-0bc0a27.txt", "fork-1c6e4ea.txt"])
def test_recorded_binaries_bind_unix_sockets(name: str) -> None:
    assert binds_unix_socket(_caps(name))


def test_a_binary_without_socket_support_keeps_loopback_and_says_why() -> None:
    caps = Capabilities.from_help(_without_socket_help(), binary=Path("old-llama-server"))
    assert caps.has("--host") and not binds_unix_socket(caps)
    ep = listen_on(caps, "/run/mtpwrap/llama.sock", port=4242)
    assert ep.socket is None and ep.transport == "tcp"
    assert "cannot bind a UNIX socket" in ep.why and "old-llama-server" in ep.why
    argv = launch.render(PLAIN, caps, endpoint=ep).argv
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--port" in argv
    # a socket endpoint is refused for such a binary rather than rendered into a bind failure
    with pytest.raises(ConfigError, match="cannot bind a UNIX socket"):
        launch.render(PLAIN, caps,
                      endpoint=Endpoint(socket="/run/mtpwrap/llama.sock"))


def test_a_socket_endpoint_renders_host_and_no_port() -> None:
    caps = _caps("upstream-0c1e570.txt")
    ep = listen_on(caps, "/run/mtpwrap/llama.sock")
    spec = launch.render(PLAIN, caps, endpoint=ep, api_key="k")
    assert spec.argv[spec.argv.index("--host") + 1] == "/run/mtpwrap/llama.sock"
    assert "--port" not in spec.argv
    assert spec.env == {"LLAMA_API_KEY": "k"}  # the key stays, a second lock


def test_the_socket_goes_to_systemds_runtime_directory(tmp_path: Path) -> None:
    place = sockets.socket_place({"RUNTIME_DIRECTORY": f"{tmp_path}/rt:/other"})
    assert place.path == tmp_path / "rt" / "llama.sock"
    assert "RuntimeDirectory" in place.why


def test_a_path_too_long_for_a_socket_falls_back_to_a_short_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    monkeypatch.setenv("MTPWRAP_HOME", str(deep))
    place = sockets.socket_place({})
    assert len(os.fsencode(str(place.path))) <= sockets.SUN_PATH_MAX
    assert str(os.getuid()) in str(place.path)
    assert "longer than the 107" in place.why and str(deep) in place.why
    short = sockets.socket_place({})
    assert short == place  # the same place each time: a restart finds its stale socket


def test_prepare_makes_the_directory_0700_and_removes_only_a_dead_socket(tmp_path: Path) -> None:
    path = tmp_path / "run" / "llama.sock"
    sockets.prepare(path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    path.parent.chmod(0o755)
    # a live listener is someone else's: refused, not removed
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(path))
    live.listen(1)
    with pytest.raises(RuntimeFailure, match="another process listens"):
        sockets.prepare(path)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    live.close()  # closed, not unlinked: what a crash leaves
    assert path.exists()
    sockets.prepare(path)
    assert not path.exists()
    path.write_text("not a socket")
    with pytest.raises(RuntimeFailure, match="is not a socket"):
        sockets.prepare(path)


# --------------------------------------------------------------------------- the real server


def _uid_nobody() -> int:
    import pwd

    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return 65534


def _client(up):
    """A blocking client for what the supervisor reports (`status().upstream`), key included."""
    return upstream.client(up.socket, base_url=up.base_url, api_key=up.api_key)


async def _wait_state(sup, want, timeout: float = 120.0) -> None:
    await until(f"state {want}", lambda: sup.status().state.value == want, timeout, every=0.05)


@pytest.mark.integration
def test_real_llama_server_listens_on_a_socket_only_this_user_opens(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path) -> None:
    import asyncio

    from mtpwrap.build.probe import probe
    from mtpwrap.config.objects import SupervisorConfig
    from mtpwrap.supervision.child import ChildCommand
    from mtpwrap.supervision.supervisor import Supervisor

    caps = probe(llama_server_bin)
    sock = tmp_path / "run" / "llama.sock"
    cfg = launch.plain(demo_model, context=512, slots=1, threads=1, why="socket test")

    def factory(endpoint: Endpoint, api_key: str, step: int) -> ChildCommand | None:
        if step:
            return None
        spec = launch.render(cfg, caps, binary=llama_server_bin, endpoint=endpoint,
                             api_key=api_key)
        return ChildCommand(argv=spec.argv, env=spec.env)

    async def scenario() -> None:
        sup = Supervisor(factory, SupervisorConfig(backoff_initial_s=1.0, stop_grace_s=5),
                         socket=sock)
        await sup.start()
        try:
            await _wait_state(sup, "ready")
            st = sup.status()
            assert st.upstream is not None and st.upstream.socket == str(sock)
            assert st.pid is not None and listening(st.pid)[0] == []
            assert stat.S_ISSOCK(sock.lstat().st_mode)
            assert stat.S_IMODE(sock.lstat().st_mode) == 0o600
            assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700
            with _client(st.upstream) as c:
                r = c.post("/completion", json={"prompt": "Hi", "n_predict": 2})
                assert r.status_code == 200 and r.json()["tokens_predicted"] >= 1
                # the key is a second lock behind the socket
                bare = c.post("/completion", json={"prompt": "Hi", "n_predict": 1},
                              headers={"Authorization": "Bearer wrong"})
                assert bare.status_code == 401

            # another local user cannot even connect
            probe_code = (
                "import os, socket, sys\n"
                f"os.setgid({_uid_nobody()}); os.setuid({_uid_nobody()})\n"
                "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
                "try:\n"
                f"    s.connect({str(sock)!r})\n"
                "except PermissionError:\n"
                "    sys.exit(13)\n"
                "sys.exit(0)\n")
            if os.getuid() == 0:
                other = subprocess.run([sys.executable, "-c", probe_code], timeout=30)
                assert other.returncode == 13
            # the same check as the service user itself: it connects
            own = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            own.connect(str(sock))
            own.close()

            # a crash leaves the socket file behind; the next start removes it and binds again
            first_pid, first_gen = st.pid, st.upstream.generation
            os.kill(first_pid, signal.SIGKILL)
            await _wait_state(sup, "backoff", 30)
            assert stat.S_ISSOCK(sock.lstat().st_mode)  # the stale file is there
            await _wait_state(sup, "ready")
            st2 = sup.status()
            assert st2.pid != first_pid and st2.upstream is not None
            assert st2.upstream.generation > first_gen
            with _client(st2.upstream) as c:
                assert c.get("/health").status_code == 200
        finally:
            await sup.stop()
        assert not sock.exists()  # a clean stop leaves no socket behind

    asyncio.run(scenario())
