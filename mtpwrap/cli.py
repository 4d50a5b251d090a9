"""The `mtpwrap` command line.

Commands live in `mtpwrap/commands/` and are imported only when invoked, so `mtpwrap --help`
stays instant. Each command parses, calls one library function and renders; errors from the
library (`MtpwrapError`) become one sentence on stderr and a distinct exit code.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import click

#: command name -> "module:attribute" of a click command, imported on first use.
COMMANDS: dict[str, tuple[str, str]] = {
    "args": ("mtpwrap.commands.args", "Show the llama-server command line for a profile, and why."),
    "bench": ("mtpwrap.commands.bench",
              "Benchmark speed, acceptance, KV, documents; write a report."),
    "build": ("mtpwrap.commands.build",
              "Build llama-server from the pinned source for this machine."),
    "bundle": ("mtpwrap.commands.bundle",
               "Carry mtpwrap to a machine with no network: make, check, install a bundle."),
    "doctor": ("mtpwrap.commands.doctor", "Check driver, GPUs, toolchain, binary and model."),
    "fleet": ("mtpwrap.commands.fleet", "HAProxy and Prometheus configuration for several nodes."),
    "hw": ("mtpwrap.commands.hw", "Show GPUs, CPU and RAM (NVML and psutil)."),
    "models": ("mtpwrap.commands.models", "Fetch and list models (the demo model included)."),
    "plan": ("mtpwrap.commands.plan", "Will a model fit a GPU at a context? Memory per buffer."),
    "profiles": ("mtpwrap.commands.profiles", "List and show profiles."),
    "tune": ("mtpwrap.commands.tune", "Sweep speculation settings, pick the fastest."),
    "usage": ("mtpwrap.commands.usage", "Requests and tokens per key, day or route (audit)."),
    "up": ("mtpwrap.commands.up", "Launch, supervise and serve llama-server for a profile."),
    "status": ("mtpwrap.commands.status", "Report on the running instance."),
    "down": ("mtpwrap.commands.down", "Stop the running instance cleanly."),
    "reload": ("mtpwrap.commands.reload",
               "Apply a changed configuration: keys at once, llama-server if its command "
               "changed."),
    "restart": ("mtpwrap.commands.restart", "Restart llama-server behind the front."),
    "documents": ("mtpwrap.commands.documents",
                  "Read documents ahead of the questions, list what is warm, forget them all."),
    "service": ("mtpwrap.commands.service", "Print, install or remove the systemd unit."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        return None if entry is None else importlib.import_module(entry[0]).command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help text comes from the table, so listing commands imports none of them.
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mtpwrap")
def cli() -> None:
    """Build, size, launch and supervise a llama.cpp MTP + TurboQuant server.

    Typical use: `mtpwrap build`, then `mtpwrap up --profile auto`.
    """


def main(argv: list[str] | None = None) -> Any:
    from mtpwrap.errors import MtpwrapError

    try:
        return cli.main(args=argv, prog_name="mtpwrap", standalone_mode=False)
    except MtpwrapError as exc:
        from mtpwrap import console

        console.error(str(exc))
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        from mtpwrap.errors import EXIT_CONFIG

        sys.exit(EXIT_CONFIG if exc.exit_code == 2 else exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
