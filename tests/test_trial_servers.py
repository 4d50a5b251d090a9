"""The build's temporary llama-servers (the smoke test, the draft-depth probe, the buffer
measurement) listen where the supervised one does: on their own UNIX socket in a fresh 0700
directory when the binary can bind one — no TCP port open while they run, read from the running
process — and on loopback TCP for a binary whose --help names no socket; the directory is gone
afterwards."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

from mtpwrap.build import calibrate, smoke, spec_probe, trial
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.decide.endpoint import SOCKET_NAME
from mtpwrap.decide.planner import PlanConfig
from tests.helpers import DATA, listening, without_socket_help


@dataclass
class Seen:
    """What the temporary servers started under `watch` listened on while they ran."""

    pids: set[int] = field(default_factory=set)
    tcp: set[tuple[str, int]] = field(default_factory=set)
    #: socket path -> the mode of its directory, as seen while the server ran
    unix: dict[str, int] = field(default_factory=dict)


def _look(seen: Seen) -> None:
    for child in psutil.Process().children(recursive=True):
        try:
            if not child.name().startswith("llama-server"):
                continue
            seen.pids.add(child.pid)
            tcp, unix = listening(child.pid)
            seen.tcp.update(tcp)
            for path in unix:
                if path not in seen.unix:
                    seen.unix[path] = stat.S_IMODE(os.stat(Path(path).parent).st_mode)
        except (psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
            continue


def watch(fn: Callable[[], Any]) -> tuple[Any, Seen]:
    """Run fn in a thread; meanwhile read the listening sockets of every llama-server this
    process started, every 20 ms."""
    seen, out = Seen(), {}

    def body() -> None:
        try:
            out["result"] = fn()
        except BaseException as exc:  # re-raised below
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    while t.is_alive():
        _look(seen)
        t.join(0.02)  # the next look, or the end of fn
    if "error" in out:
        raise out["error"]
    return out["result"], seen


def _assert_own_socket_only(seen: Seen) -> None:
    assert seen.pids, "no llama-server was seen running"
    assert seen.tcp == set(), f"a temporary llama-server listened on TCP: {seen.tcp}"
    assert len(seen.unix) == 1, seen.unix
    path, mode = next(iter(seen.unix.items()))
    assert Path(path).name == SOCKET_NAME and mode == 0o700, (path, oct(mode))
    assert len(os.fsencode(path)) <= 107
    assert not Path(path).parent.exists(), "the socket's directory was left behind"


@pytest.fixture(scope="module")
def no_socket_binary(llama_server_bin: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real llama-server behind a script whose --help is that of a llama-server from
    before socket support; everything else reaches the real binary."""
    import subprocess

    d = tmp_path_factory.mktemp("old-server")
    real_help = subprocess.run([str(llama_server_bin), "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    (d / "help.txt").write_text(without_socket_help(real_help))
    script = d / "llama-server"
    script.write_text(f'#!/bin/sh\nif [ "$1" = "--help" ]; then cat "{d}/help.txt"; exit 0; fi\n'
                      f'exec "{llama_server_bin}" "$@"\n')
    script.chmod(0o755)
    return script


@pytest.mark.integration
def test_the_smoke_test_of_a_socket_capable_binary_opens_no_tcp_port(
        llama_server_bin: Path, demo_model: Path) -> None:
    result, seen = watch(lambda: smoke.run(llama_server_bin, demo_model))
    assert result.status == "passed" and result.tokens > 0, result
    _assert_own_socket_only(seen)
    assert any("listening on unix://" in ln for ln in result.log_tail), result.log_tail


@pytest.mark.integration
def test_the_smoke_test_of_a_binary_without_socket_support_uses_loopback_tcp(
        no_socket_binary: Path, demo_model: Path) -> None:
    result, seen = watch(lambda: smoke.run(no_socket_binary, demo_model))
    assert result.status == "passed" and result.tokens > 0, result
    assert seen.pids and seen.unix == {}, seen
    assert len(seen.tcp) == 1 and next(iter(seen.tcp))[0] == "127.0.0.1", seen.tcp


@pytest.mark.integration
def test_the_draft_depth_probe_opens_no_tcp_port(llama_server_bin: Path,
                                                  demo_model: Path) -> None:
    result, seen = watch(lambda: spec_probe.probe(llama_server_bin, demo_model))
    # it talked to the server: the model drafting for itself drafts without the field
    assert result["status"] in ("honoured", "ignored"), result
    assert result["draft_n"]["default"] > 0
    _assert_own_socket_only(seen)


@pytest.mark.integration
def test_the_buffer_measurement_opens_no_tcp_port(llama_server_bin: Path, demo_model: Path
                                                  ) -> None:
    cfg = PlanConfig(backend="cpu", n_ctx=1024, type_k="f16", type_v="f16", cpu_repack=False)
    (alloc, log), seen = watch(lambda: calibrate.measure_server(llama_server_bin, demo_model,
                                                                  cfg))
    assert alloc.kv_total > 0 and "listening on unix://" in log
    _assert_own_socket_only(seen)


def test_a_binary_without_socket_support_gets_a_free_loopback_port() -> None:
    text = (DATA / "help" / "upstream-0c1e570.txt").read_text()
    old = Capabilities.from_help(without_socket_help(text), binary=Path("old-llama-server"))
    with trial.endpoint(old) as ep:
        assert ep.socket is None and ep.host == "127.0.0.1" and ep.port
        assert "cannot bind a UNIX socket" in ep.why
    new = Capabilities.from_help(text, binary=Path("llama-server"))
    with trial.endpoint(new) as ep:
        assert ep.socket is not None and ep.port is None
        folder = Path(ep.socket).parent
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert not folder.exists()


@pytest.mark.integration
def test_a_benchmark_server_listens_on_its_own_socket_unless_given_by_url(
        llama_server_bin: Path, demo_model: Path, tmp_path: Path) -> None:
    from mtpwrap.bench.runner import BenchConfig, Client, launch_config

    srv = launch_config(BenchConfig("tokenize"), binary=llama_server_bin, model=demo_model,
                        ctx_size=512, threads=1, log_path=tmp_path / "unix.log")
    try:
        tcp, unix = listening(srv.pid)
        assert tcp == [] and unix == [srv.socket], (tcp, unix)
        client = Client.of(srv)
        try:
            assert client.tokenize("Article 1")
        finally:
            client.close()
    finally:
        srv.stop()
    assert srv.socket is not None and not Path(srv.socket).parent.exists()

    srv = launch_config(BenchConfig("tokenize"), binary=llama_server_bin, model=demo_model,
                        ctx_size=512, threads=1, log_path=tmp_path / "tcp.log", tcp=True)
    try:
        tcp, unix = listening(srv.pid)
        assert srv.socket is None and unix == []
        assert tcp == [("127.0.0.1", int(srv.base_url.rsplit(":", 1)[1]))]
    finally:
        srv.stop()


def test_a_temporary_folder_too_deep_for_a_socket_moves_it_under_tmp(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from mtpwrap import upstream

    deep = tmp_path / ("d" * 90)
    deep.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(deep))
    folder = upstream.private_socket_dir(SOCKET_NAME)
    try:
        assert folder.parent == Path("/tmp") and upstream.fits(folder / SOCKET_NAME)
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    finally:
        folder.rmdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder = upstream.private_socket_dir(SOCKET_NAME)
    try:
        assert folder.parent == tmp_path  # short enough: the temporary folder itself
    finally:
        folder.rmdir()
