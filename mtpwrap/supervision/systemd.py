"""systemd integration: the unit file mtpwrap runs under, and sd_notify messages.

sd_notify is a datagram to the AF_UNIX socket named by `NOTIFY_SOCKET` (a path, or an abstract
name written with a leading `@`). With `NotifyAccess=main` only mtpwrap's own pid may send, so
the child never sees the variable (the supervisor drops it from the child's environment).
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from mtpwrap import proc
from mtpwrap.config.table import SUPERVISOR, TOP
from mtpwrap.errors import EXIT_CONFIG, ConfigError, RuntimeFailure

UNIT_NAME = "mtpwrap.service"
UNIT_DIR = Path("/etc/systemd/system")
ETC_DIR = Path("/etc/mtpwrap")


class Notifier:
    """Sends sd_notify datagrams; silently does nothing when not started by systemd."""

    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        raw = env.get("NOTIFY_SOCKET") or ""
        self.address: str | None = None
        if raw.startswith("@"):
            self.address = "\0" + raw[1:]  # abstract namespace
        elif raw.startswith("/"):
            self.address = raw
        self._watchdog_usec = 0
        usec, wpid = env.get("WATCHDOG_USEC"), env.get("WATCHDOG_PID")
        if usec and usec.isdigit() and (not wpid or wpid == str(os.getpid())):
            self._watchdog_usec = int(usec)
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def watchdog_interval(self) -> float | None:
        """How often to send WATCHDOG=1: half the period systemd allows, or None when off."""
        return self._watchdog_usec / 2e6 if self._watchdog_usec else None

    def send(self, *fields: str) -> bool:
        if self.address is None:
            return False
        msg = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(msg, self.address)
            return True
        except OSError:
            # systemd gone or the socket vanished: service management must not crash serving.
            return False

    def ready(self, status: str) -> bool:
        return self.send("READY=1", f"STATUS={_one_line(status)}", f"MAINPID={os.getpid()}")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={_one_line(text)}")

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def stopping(self, status: str = "draining") -> bool:
        return self.send("STOPPING=1", f"STATUS={_one_line(status)}")

    def extend_timeout(self, seconds: float) -> bool:
        return self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _one_line(text: str) -> str:
    return " ".join(text.split())[:400]


@dataclass(frozen=True)
class UnitOptions:
    exec_start: Sequence[str]
    user: str = "mtpwrap"
    group: str = "mtpwrap"
    description: str = "mtpwrap: supervised llama-server with an authenticated HTTP front"
    environment_file: str = "/etc/mtpwrap/env"
    environment: Mapping[str, str] = field(default_factory=dict)
    watchdog_s: int = 30
    start_timeout_s: int = 300  # extended by EXTEND_TIMEOUT_USEC while the model loads
    drain_s: float = TOP["drain_s"].default
    drain_grace_s: float = TOP["drain_grace_s"].default
    stop_grace_s: float = SUPERVISOR["stop_grace_s"].default
    state_dir: str = "/var/lib/mtpwrap"
    log_dir: str = "/var/log/mtpwrap"
    read_only_paths: Sequence[str] = ()
    memlock_unlimited: bool = True  # --mlock keeps weights resident


def stop_timeout_s(opts: UnitOptions) -> int:
    """TimeoutStopSec must cover the drain grace, the drain, the child's grace and the final
    kill."""
    return int(opts.drain_grace_s + opts.drain_s + opts.stop_grace_s + 15)


def reload_command(exec_start: Sequence[str]) -> list[str]:
    """`mtpwrap reload` run the way ExecStart runs `mtpwrap up`."""
    argv = list(exec_start)
    head = argv[:argv.index("up")] if "up" in argv else argv[:1]
    return [*head, "reload"]


def render_unit(opts: UnitOptions) -> str:
    env = {"MTPWRAP_HOME": opts.state_dir, "MTPWRAP_LOG_DIR": opts.log_dir,
           "MTPWRAP_STATE_DIR": "/run/mtpwrap", "PYTHONUNBUFFERED": "1", **opts.environment}
    env_lines = "\n".join(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in env.items())
    ro = "".join(f"ReadOnlyPaths=-{p}\n" for p in opts.read_only_paths)
    memlock = "LimitMEMLOCK=infinity\n" if opts.memlock_unlimited else ""
    return f"""\
[Unit]
Description={opts.description}
Documentation=man:systemd.service(5)
After=network-online.target nvidia-persistenced.service
Wants=network-online.target
# A llama-server that keeps crashing (supervisor.max_failures in failure_window_s) makes
# mtpwrap exit 1 (supervisor.exit_on_failed: auto); Restart= starts it again, and after
# StartLimitBurst starts within StartLimitIntervalSec the unit stays failed.
StartLimitIntervalSec=600
StartLimitBurst=5

[Service]
Type=notify
NotifyAccess=main
ExecStart={shlex.join(opts.exec_start)}
# Re-reads the settings and the profile and swaps llama-server behind the front; an invalid
# configuration is refused (exit {EXIT_CONFIG}) and the running one stays.
ExecReload={shlex.join(reload_command(opts.exec_start))}
EnvironmentFile=-{opts.environment_file}
{env_lines}
User={opts.user}
Group={opts.group}
SupplementaryGroups=video render
Restart=on-failure
RestartSec=5
# Configuration errors exit {EXIT_CONFIG}: restarting would fail the same way.
RestartPreventExitStatus={EXIT_CONFIG}
# SIGTERM to mtpwrap only: it drains, stops llama-server itself, then exits; whatever is left
# in the cgroup after that gets SIGKILL.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStartSec={opts.start_timeout_s}
TimeoutStopSec={stop_timeout_s(opts)}
WatchdogSec={opts.watchdog_s}
StateDirectory=mtpwrap
LogsDirectory=mtpwrap
# llama-server's UNIX socket lives here ($RUNTIME_DIRECTORY/llama.sock): 0700, so no other
# local user can connect to it
RuntimeDirectory=mtpwrap
RuntimeDirectoryMode=0700
{memlock}NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
ReadWritePaths=-{opts.state_dir} -{opts.log_dir} -/run/mtpwrap
{ro}PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes
DevicePolicy=closed
DeviceAllow=/dev/nvidiactl rw
DeviceAllow=/dev/nvidia-uvm rw
DeviceAllow=/dev/nvidia-uvm-tools rw
DeviceAllow=char-nvidia* rw

[Install]
WantedBy=multi-user.target
"""


def default_exec_start(config: str | None = None, profile: str | None = None) -> list[str]:
    argv = [sys.executable, "-m", "mtpwrap", "up"]
    if profile:
        argv += ["--profile", profile]
    if config:
        argv += ["--config", config]
    return argv


EXAMPLE_ENV = """\
# Read by mtpwrap.service (EnvironmentFile=). Every `mtpwrap up` option has an MTPWRAP_* twin.
# MTPWRAP_PROFILE=4090-262k
# MTPWRAP_HOST=0.0.0.0
# MTPWRAP_PORT=8080
# MTPWRAP_API_KEYS=change-me-1,change-me-2
"""


def install(opts: UnitOptions, *, unit_dir: Path = UNIT_DIR, etc_dir: Path = ETC_DIR,
            create_user: bool = True, reload: bool = True) -> list[Path]:
    """Write the unit (and an example env file if none exists); returns the files written."""
    if not unit_dir.is_dir():
        raise ConfigError(f"{unit_dir}: no such directory; is this a systemd machine?")
    written = []
    unit = unit_dir / UNIT_NAME
    try:
        unit.write_text(render_unit(opts))
        written.append(unit)
        etc_dir.mkdir(parents=True, exist_ok=True)
        env_file = etc_dir / "env"
        if not env_file.exists():
            env_file.write_text(EXAMPLE_ENV)
            env_file.chmod(0o640)
            written.append(env_file)
    except PermissionError as exc:
        raise ConfigError(f"{exc.filename}: permission denied; run `mtpwrap service install` "
                          "as root (sudo).") from exc
    if create_user:
        ensure_user(opts.user)
    if reload and booted():
        _systemctl("daemon-reload")
    return written


def uninstall(*, unit_dir: Path = UNIT_DIR, reload: bool = True) -> Path | None:
    unit = unit_dir / UNIT_NAME
    if not unit.exists():
        return None
    if reload and booted():
        _systemctl("disable", "--now", UNIT_NAME, check=False)
    try:
        unit.unlink()
    except PermissionError as exc:
        raise ConfigError(f"{unit}: permission denied; run `mtpwrap service uninstall` as root "
                          "(sudo).") from exc
    if reload and booted():
        _systemctl("daemon-reload", check=False)
    return unit


def ensure_user(user: str) -> None:
    import pwd

    try:
        pwd.getpwnam(user)
        return
    except KeyError:
        pass
    useradd = shutil.which("useradd")
    if not useradd:
        raise RuntimeFailure(f"user {user!r} does not exist and useradd is not available; "
                             "create a system user for the service first.")
    proc.run([useradd, "--system", "--home-dir", "/var/lib/mtpwrap", "--no-create-home",
              "--shell", "/usr/sbin/nologin", "--user-group", user], timeout=60, check=True)


def booted() -> bool:
    """True when systemd is the init system (sd_booted): only then can systemctl work."""
    return Path("/run/systemd/system").is_dir() and shutil.which("systemctl") is not None


def _systemctl(*args: str, check: bool = True) -> None:
    r = proc.run(["systemctl", *args], timeout=120)
    if check and r.returncode != 0:
        raise RuntimeFailure(f"systemctl {' '.join(args)} failed: {r.stderr.strip()[:200]}")


def verify(unit_text: str, workdir: Path) -> proc.Completed:
    """Run `systemd-analyze verify` on a unit text (written to `workdir`)."""
    path = workdir / UNIT_NAME
    path.write_text(unit_text)
    exe = shutil.which("systemd-analyze")
    if not exe:
        raise RuntimeFailure("systemd-analyze is not installed (Debian: apt-get install systemd).")
    return proc.run([exe, "verify", str(path)], timeout=60)
