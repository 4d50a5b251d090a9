"""The front's keys changed without a restart (`mtpwrap.service.keys`), over the fake upstream:
a key taken out of the key file is refused within a poll or two, a stream already let in
finishes, a bad file leaves the keys in use, and the log names keys but never shows one. The
same on the real llama-server, through `mtpwrap up` and `mtpwrap reload`, is in
tests/test_keys_live_real.py."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mtpwrap.config.apikeys import key_table, read_keys_file, table_change
from mtpwrap.config.objects import ProxyConfig
from mtpwrap.service import keys as keywatch
from tests.fakes.fake_upstream import FakeUpstream, sse_events
from tests.fakes.front_harness import FrontServer, serve_front
from tests.helpers import wait_for

ALICE = "alice-key-0123456789"
BOB = "bob-key-abcdefghijkl"
BOTH = f"{ALICE} name=alice\n{BOB} name=bob class=batch\n"


def test_a_change_is_told_by_key_names_only() -> None:
    old = key_table((f"{ALICE} name=alice", f"{BOB} name=bob"), "t")
    new = key_table((f"{ALICE} name=alice scopes=inference rpm=5",
                     "carol-key-0123456789 name=carol"), "t")
    change = table_change(old, new)
    assert change == ("2 key(s) -> 2: removed bob; added carol; changed alice (scopes, "
                      "budget)")
    assert table_change(old, old) is None
    assert ALICE not in str(change) and BOB not in str(change)


class Watched:
    """A front over the fake upstream with its keys from `path`, watched as `up` watches them."""

    def __init__(self, srv: FrontServer, path: Path) -> None:
        self.srv, self.path = srv, path
        self.watch = keywatch.KeyWatch(srv.front, str(path), "api_key_file", env={})

        async def start() -> asyncio.Task[None]:
            return asyncio.ensure_future(self.watch.run())

        self.task = srv.call(start)

    def status(self, key: str, path: str = "/v1/models") -> int:
        return httpx.get(f"{self.srv.url}{path}", timeout=10,
                         headers={"authorization": f"Bearer {key}"}).status_code

    def stop(self) -> None:
        assert self.srv.loop is not None
        self.srv.loop.call_soon_threadsafe(self.task.cancel)


@pytest.fixture
def watched(tmp_path: Path) -> Iterator[tuple[Watched, FakeUpstream]]:
    fake = FakeUpstream(mode="json").start()
    path = tmp_path / "keys"
    path.write_text(BOTH)
    cfg = ProxyConfig(api_keys=read_keys_file(str(path), "api_key_file"))
    try:
        with serve_front(fake.base_url, fake.api_key, cfg) as (srv, _sup):
            w = Watched(srv, path)
            try:
                yield w, fake
            finally:
                w.stop()
    finally:
        fake.stop()


def test_a_key_taken_out_of_the_file_is_refused_within_a_few_polls(
        watched: tuple[Watched, FakeUpstream], caplog: pytest.LogCaptureFixture) -> None:
    w, _fake = watched
    assert w.status(ALICE) == 200 and w.status(BOB) == 200
    caplog.set_level(logging.INFO, logger="mtpwrap.keys")
    t0 = time.monotonic()
    w.path.write_text(f"{ALICE} name=alice\n")
    took = wait_for("bob refused", lambda: w.status(BOB) == 401, 5, every=0.05)
    assert took < 6 * keywatch.POLL_S, took  # two polls, with room for a loaded machine
    assert time.monotonic() - t0 < 5
    assert w.status(ALICE) == 200
    said = [r.getMessage() for r in caplog.records if r.name == "mtpwrap.keys"]
    assert said == [f"API keys changed ({w.path} changed): 2 key(s) -> 1: removed bob"]
    # a key given back, with another scope: the table follows the file again
    w.path.write_text(f"{ALICE} name=alice\n{BOB} name=bob scopes=metrics\n")
    wait_for("bob back", lambda: w.status(BOB, "/metrics") == 200, 5, every=0.05)
    assert w.status(BOB) == 403
    assert ALICE not in caplog.text and BOB not in caplog.text


def test_a_bad_key_file_is_logged_and_the_keys_in_use_stay(
        watched: tuple[Watched, FakeUpstream], caplog: pytest.LogCaptureFixture) -> None:
    w, _fake = watched
    caplog.set_level(logging.INFO, logger="mtpwrap.keys")
    w.path.write_text(f"{ALICE} name=alice\n{BOB} name=bob class=urgent\n")
    wait_for("the bad line reported",
             lambda: any(r.levelno == logging.ERROR for r in caplog.records), 5, every=0.05)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert errors == [f"api_key_file: {w.path} line 2: class='urgent': expected one of "
                      "interactive, batch; the API keys in use stay until the file is fixed"]
    assert w.status(ALICE) == 200 and w.status(BOB) == 200
    w.path.unlink()
    wait_for("the missing file reported", lambda: len(
        [r for r in caplog.records if r.levelno == logging.ERROR]) == 2, 5, every=0.05)
    assert w.status(BOB) == 200
    w.path.write_text(f"{BOB} name=bob\n")
    wait_for("alice refused", lambda: w.status(ALICE) == 401, 5, every=0.05)
    assert w.status(BOB) == 200
    assert ALICE not in caplog.text and BOB not in caplog.text


def test_a_stream_let_in_before_its_key_went_finishes(
        watched: tuple[Watched, FakeUpstream]) -> None:
    w, fake = watched
    # the stream is held by the fake after its first events until the key is gone: it cannot
    # end before the revocation, however slowly a loaded machine gets there
    fake.mode, fake.events, fake.interval = "sse", 60, 0.01
    release = fake.hold = threading.Event()
    fake.hold_after = 5
    arrivals: list[float] = []
    body: list[bytes] = []
    status: list[int] = []

    def stream() -> None:
        with httpx.stream("POST", f"{w.srv.url}/v1/chat/completions", timeout=30,
                          headers={"authorization": f"Bearer {BOB}"},
                          json={"messages": [{"role": "user", "content": "hi"}],
                                "stream": True}) as r:
            status.append(r.status_code)
            for chunk in r.iter_raw():
                arrivals.append(time.monotonic())
                body.append(chunk)

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        wait_for("the stream under way", lambda: len(arrivals) >= 2, 10, every=0.02)
        w.path.write_text(f"{ALICE} name=alice\n")
        # /healthz is the front's own page: the probe never waits behind the fake's stream
        wait_for("bob refused", lambda: w.status(BOB, "/healthz") == 401, 5, every=0.05)
        revoked = time.monotonic()
        assert reader.is_alive(), "the stream ended before it was let go"
    finally:
        release.set()
    reader.join(30)
    assert status == [200]
    events = sse_events(b"".join(body))
    assert len(events) == 61 and events[-1] == "[DONE]", events[-3:]
    assert arrivals[-1] > revoked  # it was still streaming when the key went
