"""The only module that imports rich. Everything a person reads goes through here."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape

out = Console(highlight=False, soft_wrap=True)
err = Console(stderr=True, highlight=False, soft_wrap=True)


# A message is text, never markup: `pip install 'mtpwrap[bench]'` keeps its brackets.


def info(message: str) -> None:
    err.print(escape(message))


def warn(message: str) -> None:
    err.print(f"[yellow]warning:[/yellow] {escape(message)}")


def error(message: str) -> None:
    err.print(f"[bold red]error:[/bold red] {escape(message)}", markup=True)


def print_json(data: Any) -> None:
    import json

    sys.stdout.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def table(title: str | None, columns: list[str], rows: list[list[Any]]) -> None:
    from rich.table import Table

    t = Table(title=title, show_lines=False)
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    out.print(t)


def progress(**kwargs: Any) -> Any:
    """A rich Progress with a spinner, description, bar, percentage and elapsed time."""
    from rich.progress import (
        BarColumn,
        Progress,
        SpinnerColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=False,
        **kwargs,
    )


@contextlib.contextmanager
def steps(description: str, total: int) -> Iterator[Callable[[str], None]]:
    """A progress bar of `total` steps, and the callback that names the next step and
    advances the bar by one."""
    with progress() as bar:
        task = bar.add_task(description, total=total)
        yield lambda desc: bar.update(task, description=desc, advance=1)
