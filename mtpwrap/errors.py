"""The exception family and the exit codes.

Exit codes are part of the systemd contract: a configuration error must not be restarted
(`RestartPreventExitStatus=`), a runtime failure may be.
"""

from __future__ import annotations

EXIT_RUNTIME = 1
#: bad input: a flag, a file, a profile key, a model path. systemd is told not to restart on it.
EXIT_CONFIG = 78  # EX_CONFIG from sysexits.h
#: a required external tool (cmake, a compiler, a built binary) is missing.
EXIT_UNAVAILABLE = 69  # EX_UNAVAILABLE


class MtpwrapError(Exception):
    """Base class. The message is one sentence a person can act on."""

    exit_code = EXIT_RUNTIME

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} {self.hint}"
        return self.message


class ConfigError(MtpwrapError):
    """Bad input: a flag, a config file, a profile, a model path. Not worth a restart."""

    exit_code = EXIT_CONFIG


class MissingToolError(MtpwrapError):
    """A required tool (cmake, a C++ compiler, a built llama-server) is not there."""

    exit_code = EXIT_UNAVAILABLE


class MissingExtra(ConfigError):
    """What a command needs is in one of mtpwrap's extras, which this installation lacks."""

    def __init__(self, extra: str, what: str, module: str) -> None:
        super().__init__(f"{what} needs {module}, from mtpwrap's `{extra}` extra, which this "
                         f"installation lacks: install it with pip install 'mtpwrap[{extra}]'.")


def require_extra(module: str, extra: str, what: str) -> None:
    """MissingExtra when `module` cannot be imported."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise MissingExtra(extra, what, module) from None


class IntegrityError(ConfigError):
    """A download or file did not match its pinned sha256."""


class BuildError(MtpwrapError):
    """CMake configure or build failed. `tail` holds the compiler's last relevant lines."""

    tail: list[str] = []

    def with_tail(self, lines: list[str]) -> BuildError:
        self.tail = list(lines)
        return self


class RuntimeFailure(MtpwrapError):
    """Something failed while running: the server would not start, a request failed."""
