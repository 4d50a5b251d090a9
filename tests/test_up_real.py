"""`mtpwrap up` on the real llama-server and the real demo model, driven like an operator would.

up → ready → chat completion (official openai client) → SIGKILL llama-server → automatic
recovery → a working completion → SIGTERM → clean exit with no process of the group left;
`status` and `down`; llama-server dies with mtpwrap even when mtpwrap is SIGKILLed.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mtpwrap import proc
from tests.helpers import REPO, Instance, cli_env, run_cli, wait_for

pytestmark = pytest.mark.integration


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in a process group, read straight from /proc."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def alive(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    except OSError:
        return False


@pytest.fixture
def instance(tmp_path: Path, llama_server_bin: Path, demo_model: Path,
             free_port: int) -> Iterator[Instance]:
    inst = Instance(tmp_path / "home", free_port, llama_server_bin, demo_model)
    try:
        yield inst
    finally:
        inst.close()


def ask(base: str, text: str = "Say hello.") -> str:
    from openai import OpenAI

    client = OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": text}], max_tokens=8, temperature=0)
    content = reply.choices[0].message.content
    assert content and reply.usage and reply.usage.completion_tokens > 0
    return content


def test_up_serves_recovers_from_a_killed_child_and_stops_clean(instance: Instance) -> None:
    instance.wait_ready()
    ask(instance.base)
    rc, st = instance.status()
    assert rc == 0 and st["running"] and st["state"] == "ready" and st["restarts"] == 0
    assert st["responding"] is True
    assert st["pid"] == instance.proc.pid and st["profile"] == "cpu-demo"
    child = st["child_pid"]
    assert alive(child) and os.getpgid(child) == child  # llama-server leads its own group
    cmdline = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
    # on its UNIX socket, no port; the key not in argv
    host = cmdline[cmdline.index(b"--host") + 1].decode()
    assert host.endswith("/run/llama.sock") and b"--port" not in cmdline
    assert b"--api-key" not in cmdline
    # the child's files are the service user's alone, and mtpwrap runs on uvloop's loop
    assert "Umask:\t0077" in Path(f"/proc/{child}/status").read_text()
    assert "/uvloop/loop." in Path(f"/proc/{instance.proc.pid}/maps").read_text()

    os.kill(child, signal.SIGKILL)
    wait_for("readiness dropping after the crash",
             lambda: httpx.get(f"{instance.base}/readyz", timeout=2).status_code != 200, 10,
             every=0.02)
    instance.wait_ready(60)
    assert ask(instance.base)
    rc, st = instance.status()
    assert st["restarts"] == 1 and st["last_exit"] == "signal 9 (SIGKILL)"
    new_child = st["child_pid"]
    assert new_child != child and alive(new_child)

    members_before = group_members(new_child)
    assert new_child in members_before
    instance.proc.send_signal(signal.SIGTERM)
    assert instance.proc.wait(30) == 0
    out = instance.output()
    assert "Traceback" not in out
    assert group_members(new_child) == [] and not alive(new_child)
    rc, st = instance.status()
    assert rc == 3 and not st["running"]
    with socket.socket() as s:  # the public port is free again
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", instance.port))


def test_status_and_down(instance: Instance) -> None:
    instance.wait_ready()
    r = run_cli("status", env=instance.env)
    assert r.returncode == 0
    assert "ready" in r.stdout and f"{instance.base}/v1" in r.stdout and "cpu-demo" in r.stdout
    child = instance.status()[1]["child_pid"]
    r = run_cli("down", env=instance.env, timeout=60)
    assert r.returncode == 0 and f"pid {instance.proc.pid}" in r.stderr
    assert instance.proc.poll() == 0  # `down` returned only after mtpwrap exited
    assert group_members(child) == []
    r = run_cli("down", env=instance.env)
    assert r.returncode == 0 and "no instance is running" in r.stderr
    r = run_cli("status", env=instance.env)
    assert r.returncode == 3 and "not running" in r.stdout


def test_llama_server_dies_with_a_sigkilled_mtpwrap(instance: Instance,
                                                    llama_server_bin: Path,
                                                    demo_model: Path) -> None:
    instance.wait_ready()
    child = instance.status()[1]["child_pid"]
    instance.proc.kill()
    instance.proc.wait(10)
    wait_for("llama-server gone", lambda: not alive(child), 5, every=0.05)
    # The next start is not blocked by leftovers (stale state file, port, process group).
    again = Instance(instance.home, instance.port, llama_server_bin, demo_model)
    try:
        again.wait_ready()
        ask(again.base)
    finally:
        again.close()


def test_second_instance_and_busy_port_are_config_errors(instance: Instance,
                                                         llama_server_bin: Path,
                                                         demo_model: Path) -> None:
    instance.wait_ready()
    r = run_cli("up", "--binary", str(llama_server_bin), "--model", str(demo_model), "--port",
                str(instance.port), env=instance.env)
    assert r.returncode == 78 and "already running" in r.stderr and "Traceback" not in r.stderr
    other_home = instance.home.parent / "other"
    r = run_cli("up", "--binary", str(llama_server_bin), "--model", str(demo_model), "--port",
                str(instance.port), env=cli_env(MTPWRAP_HOME=str(other_home)))
    assert r.returncode == 78 and f"--port {instance.port}" in r.stderr
    assert "already in use" in r.stderr
    assert not (other_home / "state" / "instance.json").exists()  # nothing half-started


def test_sd_notify_sequence_with_the_real_server(tmp_path: Path, llama_server_bin: Path,
                                                 demo_model: Path, free_port: int) -> None:
    """Under a NOTIFY_SOCKET the test owns: READY=1 comes when the model answers (a request
    sent the moment it arrives succeeds), then WATCHDOG=1 pings, STOPPING=1 on SIGTERM."""
    import threading

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"mtpwrap-real-{os.getpid()}-{time.monotonic_ns()}"
    sock.bind("\0" + name)
    sock.settimeout(0.2)
    got: list[str] = []
    ready = threading.Event()
    done = threading.Event()

    def listen() -> None:
        while not done.is_set():
            try:
                msg = sock.recv(4096).decode()
            except TimeoutError:
                continue
            got.append(msg)
            if "READY=1" in msg:
                ready.set()

    t = threading.Thread(target=listen, daemon=True)
    t.start()
    inst = Instance(tmp_path / "home", free_port, llama_server_bin, demo_model,
                    NOTIFY_SOCKET="@" + name, WATCHDOG_USEC="1000000")
    try:
        assert ready.wait(120), inst.output()
        assert ask(inst.base)  # at READY=1 the model answers, no retry needed

        def pinged() -> bool:
            first_ready = next(i for i, m in enumerate(got) if "READY=1" in m)
            return sum(m == "WATCHDOG=1" for m in got[first_ready:]) >= 2

        wait_for("two watchdog pings after READY=1", pinged, 10)
        inst.proc.send_signal(signal.SIGTERM)
        assert inst.proc.wait(30) == 0
    finally:
        done.set()
        t.join(2)
        sock.close()
        inst.close()
    first_ready = next(i for i, m in enumerate(got) if "READY=1" in m)
    stopping = next(i for i, m in enumerate(got) if m.startswith("STOPPING=1"))
    assert first_ready < stopping
    assert any(m.startswith("EXTEND_TIMEOUT_USEC=") for m in got[:first_ready])
    assert any(m.startswith("STATUS=starting") for m in got[:first_ready])
    assert sum(m == "WATCHDOG=1" for m in got[first_ready:stopping]) >= 2
    assert got[-1] == "STATUS=stopped"


CANARY = "OKAPI-CANARY-5d21"


def _canary_logs(tmp_path: Path, binary: Path, model: Path, port: int,
                 profile: str = "cpu-demo") -> tuple[str, str, list[str]]:
    """Send the canary through every kind of request, stop, and return mtpwrap's own output
    (with llama-server's lines forwarded into it), llama-server.log and the answers."""
    log = tmp_path / f"{port}.log"
    inst = Instance(tmp_path / f"home-{port}", port, binary, model, log=log, profile=profile)
    answers = []
    try:
        inst.wait_ready()
        answers.append(ask(inst.base, f"Repeat exactly: {CANARY}"))
        with httpx.stream("POST", f"{inst.base}/v1/chat/completions", timeout=60, json={
                "messages": [{"role": "user", "content": f"Spell {CANARY}"}],
                "max_tokens": 8, "stream": True}) as r:
            assert r.status_code == 200 and "".join(r.iter_text()).count("data: ") > 2
        r = httpx.post(f"{inst.base}/completion", timeout=60,
                       json={"prompt": f"{CANARY} is", "n_predict": 8, "temperature": 0})
        answers.append(r.json()["content"])
        assert httpx.post(f"{inst.base}/tokenize", json={"content": CANARY}).status_code == 200
        bad = httpx.post(f"{inst.base}/completion", timeout=60,
                         json={"prompt": CANARY, "n_predict": "many"})
        assert bad.status_code == 400  # a refused request is logged without its prompt too
        inst.proc.send_signal(signal.SIGTERM)
        assert inst.proc.wait(30) == 0
    finally:
        inst.close()
    child_log = (inst.home / "logs" / "llama-server.log").read_text()
    return log.read_text(), child_log, [a.strip() for a in answers if len(a.strip()) > 8]


def test_prompts_and_answers_stay_out_of_both_logs_at_default_verbosity(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path, free_port: int) -> None:
    own, child, answers = _canary_logs(tmp_path, llama_server_bin, demo_model, free_port)
    # llama-server's own output went both ways, its lines about these requests included
    assert "llama-server[" in own and "verbosity = 3" in child
    assert child.count("stop processing") >= 4  # the readiness probe and three requests
    for text in (own, child):
        assert CANARY not in text
        for answer in answers:
            assert answer not in text


def test_verbose_llama_server_needs_log_prompts_and_then_logs_prompts(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path, free_port: int) -> None:
    base = (REPO / "profiles" / "cpu-demo.yaml").read_text() + "extra_args: [-v]\n"
    refused = tmp_path / "verbose.yaml"
    refused.write_text(base)
    r = run_cli("up", "--profile", str(refused), "--binary", str(llama_server_bin), "--model",
                str(demo_model), "--port", str(free_port),
                env=cli_env(MTPWRAP_HOME=str(tmp_path / "h")))
    assert r.returncode == 78 and "log_prompts: true" in r.stderr, r.stderr
    allowed = tmp_path / "verbose-ok.yaml"
    allowed.write_text(base + "log_prompts: true\n")
    own, child, _answers = _canary_logs(tmp_path, llama_server_bin, demo_model, free_port,
                                        profile=str(allowed))
    assert "warning: prompts and answers are logged" in own  # the summary says so
    assert CANARY in child  # the check above would have seen a leak through this path


def test_a_terminal_gets_warnings_and_the_log_path_the_file_gets_everything(
        tmp_path: Path, llama_server_bin: Path, demo_model: Path, free_port: int) -> None:
    """`up` on a terminal (a pty): mtpwrap's own lines and llama-server's warnings and errors;
    its load log and GGUF metadata only in llama-server.log, which the terminal names."""
    import pty
    import threading

    from mtpwrap.supervision.child import line_level

    home = tmp_path / "home"
    env = cli_env(MTPWRAP_HOME=str(home), MTPWRAP_DRAIN_S="5")
    master, slave = pty.openpty()
    up = proc.start([sys.executable, "-m", "mtpwrap", "up", "--profile", "cpu-demo",
                     "--binary", str(llama_server_bin), "--model", str(demo_model),
                     "--port", str(free_port)], env=env, cwd=REPO, stdout=slave, stderr=slave)
    os.close(slave)
    seen = bytearray()
    ready = threading.Event()

    def read() -> None:
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: every writer of the terminal has gone
                return
            if not chunk:
                return
            seen.extend(chunk)
            if b"ready in" in seen:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(180), seen.decode(errors="replace")
        up.popen.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
        reader.join(10)
    finally:
        up.kill()
        os.close(master)
    terminal = seen.decode(errors="replace").replace("\r", "")
    log_file = home / "logs" / "llama-server.log"
    assert f"its full output is in {log_file}" in terminal
    assert "llama_model_loader: - kv" not in terminal
    # The file has every line (after its time stamp); the terminal the warnings and errors.
    lines = [ln.split(" ", 2)[2] for ln in log_file.read_text().splitlines() if ln.strip()]
    info = [ln for ln in lines if line_level(ln) < logging.WARNING]
    loud = [ln for ln in lines if line_level(ln) >= logging.WARNING]
    assert any("load_model" in ln or "loading model" in ln for ln in info), lines
    assert len(info) >= 5, lines
    shown = [ln for ln in info if f"]: {ln}" in terminal]
    assert not shown, shown
    for ln in loud:
        assert f"]: {ln}" in terminal, ln
