"""The event loop the front runs on: uvloop's (libuv) where it is installed, as it is on Linux
by the project's dependencies, else asyncio's.

One place, so that `mtpwrap up`, the benchmarks' front and the tests' front run on the same
loop. uvloop takes 8 to 23 % off the front's CPU per relayed chunk
(docs/measurements/2026-12-01-relay-uvloop.md); the rest of mtpwrap is plain asyncio and runs
on either.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

#: what `run` accepts as `kind`: "auto" (uvloop when importable), "uvloop" or "asyncio"
KINDS = ("auto", "uvloop", "asyncio")


def name(kind: str = "auto") -> str:
    """The loop `run(kind=kind)` would use: "uvloop" or "asyncio"."""
    if kind not in KINDS:
        raise ValueError(f"event loop {kind!r}: expected one of {', '.join(KINDS)}")
    if kind == "asyncio":
        return "asyncio"
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if kind == "uvloop":
            raise
        return "asyncio"
    return "uvloop"


def run(main: Coroutine[Any, Any, T], *, kind: str = "auto") -> T:
    """`asyncio.run(main)` on the loop `name(kind)` names."""
    if name(kind) == "uvloop":
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)
