"""Write docs/reference/cli.md from the commands' own `--help`.

    python docs/gen_cli_reference.py          # rewrite docs/reference/cli.md
    python docs/gen_cli_reference.py --check  # exit 1 when the file is not current

The help is rendered at a fixed width with no `MTPWRAP_*` variable set, so the page is the same
on every machine; tests/test_docs.py fails when it is out of date.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

REPO = Path(__file__).resolve().parent.parent
TARGET = REPO / "docs" / "reference" / "cli.md"
WIDTH = 100

HEADER = """# Command-line reference

Generated from each command's `--help` by `python docs/gen_cli_reference.py`; do not edit by
hand (`tests/test_docs.py` fails when this page is not current). Every option that names an
environment variable reads it when the flag is not given; see also
[configuration](configuration.md) and [exit codes](exit-codes.md).
"""


def _walk(cmd: click.Command, path: list[str],
          parent: click.Context | None) -> Iterator[tuple[list[str], click.Command,
                                                          click.Context]]:
    settings = {**cmd.context_settings, "terminal_width": WIDTH, "max_content_width": WIDTH}
    ctx = cmd.context_class(cmd, info_name=path[-1], parent=parent, **settings)
    yield path, cmd, ctx
    if isinstance(cmd, click.Group):
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                yield from _walk(sub, [*path, name], ctx)


def _envvars(cmd: click.Command) -> list[str]:
    rows = []
    for p in cmd.params:
        if isinstance(p, click.Option) and p.envvar:
            names = [p.envvar] if isinstance(p.envvar, str) else list(p.envvar)
            flag = max(p.opts, key=len)
            rows.append(f"| `{flag}` | {', '.join(f'`{n}`' for n in names)} |")
    return rows


def render() -> str:
    for key in [k for k in os.environ if k.startswith("MTPWRAP_")]:
        del os.environ[key]
    from mtpwrap.cli import cli

    out = [HEADER]
    for path, cmd, ctx in _walk(cli, ["mtpwrap"], None):
        title = " ".join(path)
        out.append(f"## {title}\n")
        out.append("```text\n" + cmd.get_help(ctx).rstrip() + "\n```\n")
        env = _envvars(cmd)
        if env:
            out.append("| option | environment variable |\n| --- | --- |")
            out.append("\n".join(env) + "\n")
    return "\n".join(out)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        current = TARGET.read_text() if TARGET.is_file() else ""
        if current != text:
            print(f"{TARGET.relative_to(REPO)} is not current: run "
                  "`python docs/gen_cli_reference.py`", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
