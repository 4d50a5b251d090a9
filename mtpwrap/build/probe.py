"""Asking a built binary what it accepts: `--help` and `--version`, parsed by
`mtpwrap.decide.capabilities` (which only reads text and never starts a process)."""

from __future__ import annotations

import mmap
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from mtpwrap import proc
from mtpwrap.decide.capabilities import Capabilities
from mtpwrap.errors import MissingToolError, RuntimeFailure


class _Ran(Protocol):
    @property
    def returncode(self) -> int: ...
    @property
    def stdout(self) -> str: ...
    @property
    def stderr(self) -> str: ...


#: how a command is run: proc.run, or a stand-in that returns or raises what a binary can
Runner = Callable[[list[str], float], _Ran]


def _run_proc(argv: list[str], timeout: float) -> _Ran:
    return proc.run(argv, timeout=timeout)


def probe(binary: Path | str, *, timeout: float = 30.0, runner: Runner = _run_proc
          ) -> Capabilities:
    """Run `binary --help` and `binary --version` and parse what they print."""
    path = Path(binary)
    if not path.is_file():
        raise MissingToolError(f"llama-server binary {path} does not exist.",
                               hint="Run `mtpwrap build`, or pass --binary PATH.")

    def run(arg: str) -> _Ran:
        try:
            done = runner([str(path), arg], timeout)
        except (subprocess.TimeoutExpired, proc.CommandTimedOut) as exc:
            raise RuntimeFailure(f"{path} {arg} did not finish within {timeout:g} s.") from exc
        except proc.CommandMissing as exc:
            raise MissingToolError(f"cannot run {path}: {exc.message}",
                                   hint="Check that it is an executable llama-server.") from exc
        except OSError as exc:
            raise MissingToolError(f"cannot run {path}: {exc.strerror or exc}.",
                                   hint="Check that it is an executable llama-server.") from exc
        if done.returncode != 0:
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-1:] or [""]
            raise RuntimeFailure(f"{path} {arg} exited with code {done.returncode}: {tail[0]}")
        return done

    # --help goes to stdout; backend-loading chatter goes to stderr and is not part of it.
    help_done = run("--help")
    help_text = help_done.stdout if (help_done.stdout or "").strip() else (help_done.stderr or "")
    version_done = run("--version")
    version_text = (version_done.stdout or "") + (version_done.stderr or "")
    caps = Capabilities.from_help(help_text, version_text, binary=path)
    if not caps.infos:
        raise RuntimeFailure(f"{path} --help listed no options; is it a llama-server?")
    caps.outputs_capped = outputs_capped(path)
    return caps


#: llama_context's log line for the cap on reserved logits rows (src/llama-context.cpp of
#: upstream 0c1e570: "n_outputs_max_per_seq = %u"); a llama.cpp without the cap has no such text
OUTPUTS_CAP_MARKER = b"n_outputs_max_per_seq"


def outputs_capped(binary: Path | str) -> bool:
    """Whether the binary's llama.cpp caps the logits rows a context reserves: its own strings
    (or those of the libllama beside it, for a shared build) hold the cap's log line."""
    path = Path(binary)
    for cand in (path, *sorted(path.parent.glob("libllama.so*")),
                 *sorted(path.parent.parent.glob("lib*/libllama.so*"))):
        try:
            with cand.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                if m.find(OUTPUTS_CAP_MARKER) >= 0:
                    return True
        except (OSError, ValueError):  # unreadable, or empty (mmap of 0 bytes)
            continue
    return False
