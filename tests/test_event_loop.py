"""mtpwrap.front.loop: the one choice of event loop for `up`, the benchmarks and the tests."""

from __future__ import annotations

import asyncio

import pytest

from mtpwrap.front import loop


async def _loop_module() -> str:
    return type(asyncio.get_running_loop()).__module__


def test_uvloop_is_installed_and_chosen() -> None:
    # a dependency on Linux: a missing install is a failure here, not a slower front
    assert loop.name() == "uvloop"
    assert loop.run(_loop_module()).startswith("uvloop")


def test_asyncio_can_be_asked_for() -> None:
    assert loop.name("asyncio") == "asyncio"
    assert loop.run(_loop_module(), kind="asyncio").startswith("asyncio")


def test_an_unknown_kind_is_one_sentence() -> None:
    with pytest.raises(ValueError, match="expected one of auto, uvloop, asyncio"):
        loop.name("trio")
