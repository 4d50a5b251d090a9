"""Named keys: the key file's fields, their one-sentence errors, and the budgets and queue
priority they give (`mtpwrap.config.apikeys`, `front.budgets`, `front.admission`), without a
server: the real-server checks are in tests/test_audit_real.py."""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path

import pytest

from mtpwrap.config.apikeys import Budget, default_name, key_table, parse_key, read_keys_file
from mtpwrap.errors import ConfigError
from mtpwrap.front.admission import PriorityGate
from mtpwrap.front.budgets import Budgets, Hold, OverBudget
from tests.helpers import until

SECRET = "s3cret-key-0123456789"


def test_the_fields_of_a_key_line() -> None:
    k = parse_key(f"{SECRET} name=contracts-app scopes=inference,metrics class=batch "
                  "rpm=30 tokens_per_day=2000000", "f")
    assert (k.name, k.scopes, k.klass) == ("contracts-app", frozenset({"inference", "metrics"}),
                                           "batch")
    assert k.budget == Budget(rpm=30, tokens_per_day=2_000_000)
    assert SECRET not in repr(k)  # a key never shows in a repr (logs, tracebacks)
    # the older forms keep working; their name is a short hash of the key
    old = parse_key(f"{SECRET} admin, inference", "f")
    assert old.scopes == frozenset({"admin", "inference"}) and old.klass == "interactive"
    assert old.name == default_name(SECRET) and old.name.startswith("key-")
    assert len(old.name) == 12 and SECRET not in old.name
    assert parse_key(SECRET, "f").scopes == frozenset({"inference", "admin", "metrics"})


@pytest.mark.parametrize(("fields", "message"), [
    ("owner=x", "unknown field 'owner'"),
    ("name=a name=b", "the field 'name' is given twice"),
    ("name=-x", "name='-x' is not a usable name"),
    ("class=urgent", "class='urgent': expected one of interactive, batch"),
    ("rpm=0", "rpm='0': expected a whole number >= 1"),
    ("tokens_per_hour=lots", "tokens_per_hour='lots': expected a whole number >= 1"),
    ("scopes=root", "unknown scope 'root'"),
    ("inference scopes=admin", "scopes are given twice"),
])
def test_a_bad_line_is_one_sentence_with_file_and_line(tmp_path: Path, fields: str,
                                                       message: str) -> None:
    f = tmp_path / "keys"
    f.write_text(f"# the team's keys\nfirst-key-0123456789 name=first\n{SECRET} {fields}\n")
    with pytest.raises(ConfigError) as err:
        read_keys_file(str(f), "api_key_file")
    text = str(err.value)
    assert text.startswith(f"api_key_file: {f} line 3: ") and message in text
    assert SECRET not in text and "\n" not in text


def test_one_name_for_two_keys_is_refused(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text(f"a-key-0123456789 name=app\n\n{SECRET} name=app\n")
    with pytest.raises(ConfigError, match=rf"{f} line 3: the name 'app' is already used on "
                                          "line 1; give each key its own name"):
        read_keys_file(str(f), "api_key_file")
    # keys from MTPWRAP_API_KEYS and the file meet in the table
    with pytest.raises(ConfigError, match="two keys are named 'app'"):
        key_table(("a-key-0123456789 name=app", f"{SECRET} name=app"), "keys")


# --------------------------------------------------------------------------- budgets

class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rpm_refuses_the_request_after_the_nth_and_resets_at_the_minute(tmp_path: Path
                                                                        ) -> None:
    clock = Clock(1_800_000_000.0 + 10)  # 10 s into a minute
    b = Budgets(None, clock)
    k = parse_key(f"{SECRET} name=app rpm=3", "f")
    assert [b.check(k) for _ in range(3)] == [None] * 3
    over = b.check(k)
    assert over is not None and over.budget == "rpm" and over.limit == 3
    assert over.retry_after_s == 50 and over.resets_at == 1_800_000_000.0 + 60
    assert "'app' has used its budget of 3 requests per minute" in over.message("app")
    clock.t += 50  # the next minute
    assert b.check(k) is None


def test_token_budgets_count_what_was_spent_and_survive_a_restart(tmp_path: Path) -> None:
    clock = Clock(1_800_000_000.0)
    path = tmp_path / "budgets.json"
    k = parse_key(f"{SECRET} name=app tokens_per_day=100", "f")
    b = Budgets(path, clock)
    assert b.check(k) is None
    b.settle(k, None, 60)  # outside an event loop: saved at once
    assert b.check(k) is None
    b.settle(k, None, 45)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    # a new process: the day's count is still there
    again = Budgets(path, clock)
    assert again.used("app", "day") == 105
    over = again.check(k)
    assert over is not None and over.budget == "tokens_per_day"
    assert "tokens per day" in over.message("app")
    clock.t += 86400
    assert again.check(k) is None  # a new day


def test_requests_in_flight_hold_their_reservation_until_they_settle() -> None:
    clock = Clock(1_800_000_000.0)
    k = parse_key(f"{SECRET} name=app tokens_per_hour=100", "f")
    b = Budgets(None, clock)
    first = b.reserve(k, 80)
    second = b.reserve(k, 80)  # 80 held is under 100: let in (it may overshoot, as one may)
    third = b.reserve(k, 80)
    assert isinstance(first, Hold) and isinstance(second, Hold)
    assert isinstance(third, OverBudget) and third.budget == "tokens_per_hour"
    assert "used or reserved (for its requests in flight, 160 tokens)" in third.message("app")
    assert b.check(k) is not None  # at the door too
    b.settle(k, first, 30)
    b.settle(k, second, 0)  # cut before llama-server had it
    assert b.held == {} and b.used("app", "hour") == 30
    assert isinstance(b.reserve(k, 80), Hold)
    assert b.reserve(parse_key(f"{SECRET}x name=free", "f"), 80) is None  # no token budget


# --------------------------------------------------------------------------- priority

def test_an_interactive_request_goes_before_queued_batch_work_which_ages_in() -> None:
    async def main() -> list[str]:
        gate = PriorityGate(1, aging_s=3600)
        order: list[str] = []
        await gate.acquire("interactive")  # the one slot is busy

        async def ask(name: str, klass: str) -> None:
            await gate.acquire(klass)
            order.append(name)
            gate.release()

        tasks = [asyncio.create_task(ask(f"batch{i}", "batch")) for i in range(5)]
        await until("5 batch requests waiting", lambda: gate.waiting()["batch"] == 5, 5)
        tasks.append(asyncio.create_task(ask("person", "interactive")))
        await until("the interactive request waiting",
                    lambda: gate.waiting()["interactive"] == 1, 5)
        gate.release()
        await asyncio.gather(*tasks)
        return order

    assert asyncio.run(main()) == ["person", "batch0", "batch1", "batch2", "batch3", "batch4"]


def test_batch_work_that_waited_past_the_aging_goes_first() -> None:
    async def main() -> list[str]:
        gate = PriorityGate(1, aging_s=0.05)
        order: list[str] = []
        await gate.acquire()

        async def ask(name: str, klass: str) -> None:
            await gate.acquire(klass)
            order.append(name)
            gate.release()

        batch = asyncio.create_task(ask("batch", "batch"))
        await until("the batch request waiting", lambda: gate.waiting()["batch"] == 1, 5)
        loop = asyncio.get_running_loop()
        aged = loop.time() + 0.05
        await until("the batch request aged", lambda: loop.time() >= aged, 5)  # it ages in
        person = asyncio.create_task(ask("person", "interactive"))
        await until("the interactive request waiting",
                    lambda: gate.waiting()["interactive"] == 1, 5)
        gate.release()
        await asyncio.gather(batch, person)
        return order

    assert asyncio.run(main()) == ["batch", "person"]


def test_a_cancelled_waiter_takes_no_permit() -> None:
    async def main() -> None:
        gate = PriorityGate(1, aging_s=30)
        await gate.acquire()
        waiter = asyncio.create_task(gate.acquire("batch"))
        await until("the batch request waiting", lambda: gate.waiting()["batch"] == 1, 5)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(waiter, 0.01)
        assert gate.waiting() == {"interactive": 0, "batch": 0}
        gate.release()
        assert gate.free == 1 and not gate.locked()

    asyncio.run(main())


def test_keys_in_the_environment_take_plus_between_scopes() -> None:
    from mtpwrap.config.objects import ProxyConfig
    from mtpwrap.config.settings import load_settings
    from mtpwrap.front.access import Access, find_key

    s = load_settings({}, env={"MTPWRAP_API_KEYS": f"{SECRET} name=app scopes=inference+metrics,"
                                                   "other-key-0123456789 name=ops"})
    k = find_key(SECRET, Access.from_config(ProxyConfig(api_keys=s.api_keys)).keys)
    assert k is not None and k.name == "app" and k.scopes == frozenset({"inference", "metrics"})


def test_the_budgets_file_is_written_off_the_serving_loop(tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that stalls holds up the budgets' writer thread, never the event loop: a save
    inside the loop returns at once, the newest counts land once the disk answers, and close
    writes the last ones before it returns."""
    import threading
    import time

    path = tmp_path / "budgets.json"
    k = parse_key(f"{SECRET} name=app tokens_per_day=1000", "f")
    b = Budgets(path, Clock(1_800_000_000.0))
    disk = threading.Event()
    write = Budgets._write

    def stalled(self: Budgets, rows: list) -> None:
        disk.wait(30)
        write(self, rows)

    monkeypatch.setattr(Budgets, "_write", stalled)

    async def serve() -> float:
        b.settle(k, None, 10)
        t0 = time.perf_counter()
        for _ in range(50):
            b.settle(k, None, 1)
            b.save()
        took = time.perf_counter() - t0
        assert not path.exists()  # the disk has not answered yet
        disk.set()
        await until("the counts on disk",
                    lambda: path.exists() and '"count": 60' in path.read_text(), 10)
        return took

    assert asyncio.run(serve()) < 0.5
    b.settle(k, None, 5)  # after the loop: close writes it before returning
    b.close()
    assert '"count": 65' in path.read_text()
