"""A profile's (or the command line's) extra llama-server arguments: what they may not do.

They may not take over what mtpwrap owns (`RESERVED`), use flags llama.cpp removed or the binary
lacks, log what users send, open an unauthenticated remote backend, or give the model tools that
act on the machine — the last three unless the profile opts in (`log_prompts`, `allow_rpc`,
`allow_tools`), and then with a warning.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from mtpwrap.decide.vocab import DEFAULT_VERBOSITY, RESERVED, TOOL_FLAGS, VERBOSE, VERBOSITY
from mtpwrap.errors import ConfigError

if TYPE_CHECKING:
    from mtpwrap.decide.capabilities import Capabilities


def _flags(args: Sequence[str]) -> list[tuple[str, str, str]]:
    """(argument, flag, value) for each flag among args; the value is the next argument when
    the flag has no `=`."""
    out: list[tuple[str, str, str]] = []
    args = list(args)
    for i, a in enumerate(args):
        if not a.startswith("-") or len(a) < 2 or a[1].isdigit():
            continue  # a value, or a negative number
        flag, eq, value = a.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        out.append((a, flag, value))
    return out


def check_extra(caps: Capabilities, source: str, args: Sequence[str]) -> None:
    """Extra arguments may not take over what mtpwrap owns, nor use removed or unknown flags."""
    for _, flag, _ in _flags(args):
        if flag in RESERVED:
            raise ConfigError(f"{source}: {flag} is set by mtpwrap ({RESERVED[flag]}); "
                              "remove it.")
        if caps.is_removed(flag):
            raise ConfigError(f"{source}: {flag} has been removed from llama.cpp and aborts "
                              f"{caps.describe()}; see its --help for the replacement.")
        if not caps.has(flag):
            raise ConfigError(f"{source}: {caps.describe()} does not accept {flag}.")


def check_exposure(source: str, args: Sequence[str], *, log_prompts: bool,
                   allow_rpc: bool, allow_tools: bool = False) -> list[str]:
    """Extra arguments that log what users send, open an unauthenticated remote backend, or let
    the model act on the machine only where the profile says so (log_prompts, allow_rpc,
    allow_tools); the warnings to show when it does."""
    warnings: list[str] = []
    for a, flag, value in _flags(args):
        if flag in VERBOSE or (flag in VERBOSITY and not (
                value.isdigit() and int(value) <= DEFAULT_VERBOSITY)):
            if not log_prompts:
                raise ConfigError(
                    f"{source}: {a} raises llama-server's log verbosity above its default "
                    f"({DEFAULT_VERBOSITY}), which writes prompts and answers to the logs.",
                    hint="Remove it, or set log_prompts: true in the profile if these logs may "
                         "hold what users send.")
            warnings.append(f"prompts and answers are logged ({source}: {a}; the profile sets "
                            "log_prompts: true)")
        elif flag == "--rpc":
            if not allow_rpc:
                raise ConfigError(
                    f"{source}: --rpc sends work to llama.cpp RPC servers, which have no "
                    "authentication and have had remote-code-execution bugs.",
                    hint="Remove it, or set allow_rpc: true in the profile once the RPC "
                         "servers sit on a network only this machine can reach.")
            warnings.append(f"--rpc {value}: llama.cpp's RPC servers accept anyone who reaches "
                            "them; keep them on a private network (the profile sets "
                            "allow_rpc: true)")
        elif flag in TOOL_FLAGS:
            if not allow_tools:
                raise ConfigError(
                    f"{source}: {flag} lets the model act on this machine (llama-server's "
                    "built-in tools read and write files and run shell commands; MCP servers "
                    "and the agent loop reach further), on behalf of whoever sends a prompt.",
                    hint="Remove it, or set allow_tools: true in the profile if every client "
                         "may have shell and file access as the service user.")
            warnings.append(f"{a}: the model may act on this machine (shell and file access as "
                            "the service user; the profile sets allow_tools: true)")
    return warnings
