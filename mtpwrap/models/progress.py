"""Transfer progress for a person: a bar on a terminal, timestamped lines on a pipe.

`Report.bar_class()` is handed to huggingface_hub's downloader as its `tqdm_class`: the library
creates one bar per file (`desc`, `total`, `initial`, `unit`…), calls `update(n)` per chunk and
closes it as a context manager; a bar is reused across the library's own retries.
"""

from __future__ import annotations

import time
from typing import Any

from mtpwrap import console


def _mb(n: float) -> str:
    return f"{n / 1e6:,.0f} MB"


class Report:
    """Where a pull's messages go. `secrets` are never written, whatever a message holds."""

    def __init__(self, *, tty: bool | None = None, every_s: float = 10.0,
                 secrets: tuple[str, ...] = ()) -> None:
        self.tty = console.err.is_terminal if tty is None else tty
        self.every_s = every_s
        self.secrets = tuple(s for s in secrets if s)

    def clean(self, text: str) -> str:
        for s in self.secrets:
            text = text.replace(s, "<token>")
        return text

    def line(self, text: str) -> None:
        console.err.print(f"{time.strftime('%H:%M:%S')} {self.clean(text)}",
                          markup=False, highlight=False)

    def bar_class(self, verb: str = "received") -> type[Any]:
        report = self

        class Bar:
            def __init__(self, *, desc: str = "", total: int | None = None, initial: int = 0,
                         **_: Any) -> None:
                self.desc, self.total, self.n = desc, total, initial
                self.start, self.last, self.last_n = time.monotonic(), time.monotonic(), initial
                self.prog: Any = None
                if report.tty:
                    self.prog = console.progress()
                    self.prog.__enter__()
                    self.task = self.prog.add_task(desc, total=total, completed=initial)
                elif initial:
                    report.line(f"{desc}: resuming at {self._where()}")

            def _where(self) -> str:
                if not self.total:
                    return _mb(self.n)
                return f"{_mb(self.n)} of {_mb(self.total)} ({100 * self.n / self.total:.0f} %)"

            def update(self, n: int = 1) -> None:
                self.n += n
                if self.prog is not None:
                    self.prog.update(self.task, completed=self.n)
                    return
                now = time.monotonic()
                if now - self.last >= report.every_s:
                    rate = (self.n - self.last_n) / max(now - self.last, 1e-9)
                    report.line(f"{self.desc}: {self._where()}, {rate / 1e6:.1f} MB/s")
                    self.last, self.last_n = now, self.n

            def close(self) -> None:
                if self.prog is not None:
                    self.prog.__exit__(None, None, None)
                    self.prog = None
                else:
                    report.line(f"{self.desc}: {self._where()} {verb} in "
                                f"{time.monotonic() - self.start:.0f} s")

            def __enter__(self) -> Bar:
                return self

            def __exit__(self, *exc: object) -> None:
                self.close()

        return Bar
