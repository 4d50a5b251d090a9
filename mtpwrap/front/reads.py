"""The prompts llama-server is reading now: for each slot, the tokens of the prompt in it, the
rate and the time left.

llama-server's `GET /slots` (its metrics form: counts only, never a prompt's text) says, per
slot, whether it works, how many tokens of the prompt are in it so far (`n_prompt_tokens`), how
many of them were read rather than found in its cache, and how many tokens it has generated (0:
it is still reading). The prompt's length is not in it: the front counts the prompt of the
request it forwarded with llama-server's own tokenizer (`usage.count_prompt`), once per request.
The rate is measured between two samples of the same request; a sample is taken when a request
starts to wait in the queue, when its wait ends, and when the status page asks.

A person queued behind a long document is told from this how long: the 503 of a queue timeout
says how far the read is and carries `Retry-After` from its own progress; `/status` shows each
read. The relay's stall check asks it when llama-server last took a step on a slot (a token of a
prompt read or of an answer generated), whichever sample saw it, the status page's included.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from mtpwrap.supervision.state import SupervisorPort
from mtpwrap.upstream import UpstreamClients

log = logging.getLogger("mtpwrap.front")

#: seconds one `GET /slots` may take (llama-server answers it between two batches)
SLOTS_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class Read:
    """One slot reading a prompt."""

    slot: int
    done: int  #: tokens of the prompt in the slot: found in its cache or read so far
    cached: int  #: of them, found in its cache
    total: int | None  #: tokens of the prompt (None: not counted)
    rate: float | None  #: tokens read per second since the previous sample of this request
    eta_s: float | None  #: seconds left at that rate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class _Sample:
    task: int
    read: int  #: n_prompt_tokens_processed
    at: float
    rate: float | None


class Reads:
    """Samples llama-server's slots; keeps the last sample per slot for the rate.

    `totals`: the prompt lengths of the requests forwarded now, longest first (the front's
    counts); with one slot the one request's, with several matched longest read to longest
    prompt."""

    def __init__(self, supervisor: SupervisorPort, clients: UpstreamClients,
                 totals: Callable[[], Awaitable[list[int]]]) -> None:
        self.supervisor = supervisor
        self.clients = clients
        self.totals = totals
        self._last: dict[int, _Sample] = {}
        #: per working slot: (task, tokens read + generated, when that count was first seen)
        self._steps: dict[int, tuple[int, int, float]] = {}
        #: the reads of the last sample
        self.reads: list[Read] = []

    async def sample(self) -> list[Read]:
        """The reads in progress now (empty when none, or when llama-server does not say)."""
        up = self.supervisor.status().upstream
        slots: Any = None
        if up is not None:
            try:
                r = await self.clients.get(up).get(
                    up.base_url + "/slots", headers={"authorization": f"Bearer {up.api_key}"},
                    timeout=SLOTS_TIMEOUT_S)
                slots = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                slots = None
        reading = self._reading(slots if isinstance(slots, list) else [], time.monotonic())
        try:
            totals = await self.totals() if reading else []
        except Exception as exc:  # a count that failed leaves the read's total unknown
            log.warning("reads: the prompts in flight could not be counted (%r)", exc)
            totals = []
        reads = []
        padded: list[int | None] = [*totals[:len(reading)]]
        padded += [None] * (len(reading) - len(padded))
        for (slot, done, cached, rate), total in zip(
                sorted(reading, key=lambda r: -r[1]), padded, strict=True):
            left = None if total is None else max(0, total - done)
            reads.append(Read(slot=slot, done=done, cached=cached, total=total,
                              rate=None if rate is None else round(rate, 1),
                              eta_s=round(left / rate, 1) if left is not None and rate else None))
        self.reads = sorted(reads, key=lambda r: r.slot)
        return self.reads

    def _reading(self, slots: list[Any], now: float
                 ) -> list[tuple[int, int, int, float | None]]:
        """(slot, tokens in it, cached, rate) of each slot still reading its prompt."""
        out = []
        for s in slots:
            try:
                slot = int(s["id"])
                if not s.get("is_processing"):
                    self._last.pop(slot, None)
                    self._steps.pop(slot, None)
                    continue  # idle
                task = int(s["id_task"])
                decoded = int(s["next_token"][0]["n_decoded"])
                read = int(s["n_prompt_tokens_processed"])
                step = self._steps.get(slot)
                if step is None or step[:2] != (task, read + decoded):
                    self._steps[slot] = (task, read + decoded, now)
                if decoded > 0:
                    self._last.pop(slot, None)
                    continue  # answering: the read is over
                in_slot = int(s["n_prompt_tokens"])
                cached = int(s["n_prompt_tokens_cache"])
            except (KeyError, IndexError, TypeError, ValueError):
                continue
            last = self._last.get(slot)
            rate = last.rate if last is not None and last.task == task else None
            if last is not None and last.task == task and read > last.read:
                rate = (read - last.read) / (now - last.at)
            if last is None or last.task != task or read != last.read:
                self._last[slot] = _Sample(task, read, now, rate)
            out.append((slot, in_slot, cached, rate))
        return out

    async def advanced_ago(self) -> float | None:
        """Seconds since llama-server last made a step on a working slot, a token of a prompt
        read or of an answer generated, as this sample or any earlier one saw it (None: no slot
        working). The status page's and the queue's samples count too: a step taken between
        two of theirs was taken. A slot seen working for the first time counts as a step now:
        nothing says it stopped."""
        await self.sample()
        if not self._steps:
            return None
        return time.monotonic() - max(at for _, _, at in self._steps.values())

    def retry_after(self) -> int | None:
        """Seconds until the first read in progress ends, from the last sample (None: no read
        with a known end)."""
        left = [r.eta_s for r in self.reads if r.eta_s is not None]
        return max(1, math.ceil(min(left))) if left else None

    def describe(self) -> str | None:
        """The longest read in progress, in one clause, for a refusal's message."""
        if not self.reads:
            return None
        r = max(self.reads, key=lambda r: r.done)
        of = f" of {r.total:,}" if r.total is not None else ""
        rate = f" at {r.rate:,.0f} tokens/s" if r.rate else ""
        left = f", about {math.ceil(r.eta_s):,} s left" if r.eta_s is not None else ""
        return f"llama-server is reading a prompt ({r.done:,}{of} tokens{rate}{left})"
