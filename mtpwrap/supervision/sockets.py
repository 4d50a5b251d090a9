"""The place of llama-server's UNIX socket, and its care: a 0700 directory owned by the service
user (systemd's `RuntimeDirectory=` under systemd, else under MTPWRAP_HOME), a short place when
that path is too long for a socket, a stale socket removed before a start, and the socket made
0600 once llama-server has bound it.

The directory is the lock: connecting to a UNIX socket needs search permission on every
directory above it and write permission on the socket, so no other local user gets in."""

from __future__ import annotations

import os
import socket
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from mtpwrap import paths
from mtpwrap.decide.endpoint import SOCKET_NAME
from mtpwrap.errors import RuntimeFailure
from mtpwrap.upstream import SUN_PATH_MAX, fits


@dataclass(frozen=True)
class SocketPlace:
    """Where the socket goes, and why there."""

    path: Path
    why: str


def socket_place(env: Mapping[str, str] | None = None, name: str = SOCKET_NAME
                 ) -> SocketPlace:
    """systemd's runtime directory (`$RUNTIME_DIRECTORY`, set by the unit's RuntimeDirectory=),
    else `MTPWRAP_HOME/run`; when that path is longer than a socket path may be, a short one
    of this user's own (`/run/user/UID/mtpwrap`, else `/tmp/mtpwrap-UID`). `name`: the
    socket's file name (a companion's is `companion-NAME.sock`)."""
    env = os.environ if env is None else env
    runtime = (env.get("RUNTIME_DIRECTORY") or "").split(":")[0]
    if runtime:
        wanted, where = Path(runtime) / name, "systemd's RuntimeDirectory"
    else:
        wanted, where = paths.home() / "run" / name, "under MTPWRAP_HOME"
    if fits(wanted):
        return SocketPlace(wanted, f"{wanted.parent}, {where}")
    uid = os.getuid()
    user_run = Path(f"/run/user/{uid}")
    short = (user_run / "mtpwrap" if user_run.is_dir() and user_run.stat().st_uid == uid
             else Path(f"/tmp/mtpwrap-{uid}")) / name
    length = len(os.fsencode(str(wanted)))
    return SocketPlace(short, f"{short.parent}: {wanted} is {length} bytes, longer than the "
                              f"{SUN_PATH_MAX} a UNIX socket path may be")


def prepare(path: Path) -> None:
    """Make the socket's directory (0700, owned by this user, not a link) and remove a socket
    a crashed llama-server left behind (it would refuse to bind). A socket something still
    answers on is not removed: another llama-server holds it."""
    d = path.parent
    try:
        d.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(d)
    except OSError as exc:
        raise RuntimeFailure(f"cannot make the directory {d} for llama-server's socket "
                             f"({exc.strerror}).",
                             hint="Set MTPWRAP_HOME to a directory this user can write.") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise RuntimeFailure(f"{d} (llama-server's socket directory) is not a directory.",
                             hint="Remove it; mtpwrap makes the directory itself.")
    if st.st_uid != os.getuid():
        raise RuntimeFailure(f"{d} (llama-server's socket directory) belongs to uid "
                             f"{st.st_uid}, not to this user ({os.getuid()}).",
                             hint="Remove it, or set MTPWRAP_HOME to a directory of your own.")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(d, 0o700)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise RuntimeFailure(f"{path} is in the place of llama-server's socket but is not a "
                             "socket.", hint="Remove it.")
    if answers(path):
        raise RuntimeFailure(f"another process listens on {path}, llama-server's socket.",
                             hint="Stop the other mtpwrap (`mtpwrap down`), or give this one "
                                  "its own MTPWRAP_HOME.")
    os.unlink(path)


def answers(path: Path) -> bool:
    """Whether something accepts connections on the UNIX socket `path`."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.settimeout(1.0)
        s.connect(str(path))
    except TimeoutError:
        return True  # bound and listening, but its backlog is full: held all the same
    except OSError:
        return False  # ECONNREFUSED: nobody listens; the file is a crashed server's leftover
    finally:
        s.close()
    return True


def seal(path: Path) -> None:
    """Make the bound socket 0600 (llama-server leaves it at what the umask gives, 0700)."""
    try:
        if stat.S_IMODE(os.lstat(path).st_mode) != 0o600:
            os.chmod(path, 0o600)
    except FileNotFoundError:
        pass


def remove(path: Path) -> None:
    """Remove the socket after its llama-server stopped (it never removes it itself)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
