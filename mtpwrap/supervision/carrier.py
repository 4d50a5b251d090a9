"""The slot carrier: a child's KV slots carried into the next one (persist.py does the files).

Saved before a planned restart when the next command can take them, checkpointed while the
child is idle (with `persist.checkpoints`; after a crash the last checkpoint is carried like a
planned save), restored after the new child's first token and before READY. With
checkpoints on, what was restored stays as the new child's first checkpoint (until it reads
enough for one of its own), so a crash soon after a restart brings the documents back again.
Snapshot files that will not be restored are deleted at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from mtpwrap.supervision.child import ChildCommand, ChildProcess
from mtpwrap.supervision.persist import (
    CHECKPOINT_IDLE_S,
    Carried,
    SnapshotStore,
    fingerprint,
    incompatibility,
    restore_slots,
    save_slots,
)

log = logging.getLogger("mtpwrap.supervisor")


class SlotCarrier:
    def __init__(self, store: SnapshotStore | None) -> None:
        #: where slots are saved (None: persistence off; every method is then a no-op)
        self.store = store
        #: the last save, restore and checkpoint, for the state file and /healthz
        self.report: dict[str, Any] = {}
        #: called after `report` changed (the service rewrites its state file)
        self.on_report: Callable[[], None] | None = None
        self._carried: Carried | None = None  # saved from the last child, for the next
        self._checkpoint: Carried | None = None  # the last one taken from the current child
        self._checkpoint_mark = 0.0  # prompt tokens processed when it was taken
        self._idle_since: float | None = None

    @property
    def checkpoints(self) -> bool:
        return self.store is not None and self.store.config.checkpoints

    def new_child(self) -> None:
        self._checkpoint_mark, self._idle_since = 0.0, None

    def crashed(self) -> None:
        """The child ended unplanned: its last checkpoint goes into the next one."""
        if self._checkpoint is not None:
            self._forget(self._carried)
            self._carried, self._checkpoint = self._checkpoint, None

    async def save(self, child: ChildProcess, spec: ChildCommand, nxt: ChildCommand | None) -> None:
        """Save the child's slots when the next command (`nxt`) can take them back."""
        if self.store is None:
            return
        self._drop_checkpoint()  # the slots are saved afresh now
        why = None if nxt is None else incompatibility(
            *await asyncio.gather(asyncio.to_thread(fingerprint, spec.launch),
                                  asyncio.to_thread(fingerprint, nxt.launch)))
        if why is not None:
            log.info("slots not saved: %s", why)
            self._set_report({"saved": None, "skipped": why})
            return
        try:
            carried = await save_slots(child, self.store, spec.launch)
        except OSError as exc:
            log.warning("slots not saved: %s", exc)
            return
        self._forget(self._carried)
        self._carried = carried if carried.snapshots else None
        self._set_report({"saved": carried.to_dict()})

    async def maybe_checkpoint(self, child: ChildProcess, spec: ChildCommand,
                               forwarding: int) -> None:
        """Save the slots in the background once enough new prompt has been processed and
        llama-server (and the front: `forwarding` requests) has been idle for a while; the new
        checkpoint replaces the last."""
        if self.store is None:
            return
        m = await child.metrics()
        if m is None:
            return
        now = time.monotonic()
        busy = m.get("requests_processing", 0) + m.get("requests_deferred", 0) + forwarding
        if busy > 0:
            self._idle_since = None
            return
        if self._idle_since is None:
            self._idle_since = now
        processed = m.get("prompt_tokens_total", 0.0)
        if (now - self._idle_since < CHECKPOINT_IDLE_S
                or processed - self._checkpoint_mark < self.store.config.checkpoint_tokens):
            return
        self._checkpoint_mark = processed
        try:
            taken = await save_slots(child, self.store, spec.launch)
        except OSError as exc:
            log.warning("checkpoint not taken: %s", exc)
            return
        old, self._checkpoint = self._checkpoint, taken if taken.snapshots else None
        self._forget(old)
        self._set_report({**self.report, "checkpoint": taken.to_dict()})

    async def restore(self, child: ChildProcess, spec: ChildCommand | None) -> None:
        """Put what was carried into the new child (once; the files go after)."""
        carried, self._carried = self._carried, None
        if carried is None or self.store is None or spec is None:
            return
        try:
            report = await restore_slots(child, self.store, carried, spec.launch,
                                         keep=self.checkpoints)
        except OSError as exc:
            log.warning("slots not restored: %s", exc)
            return
        if kept := report.pop("kept", None):
            # what was restored is the new child's state until it reads more: a crash before
            # its first checkpoint brings it back again
            self._drop_checkpoint()
            self._checkpoint = Carried(carried.fingerprint,
                                       [s for s in carried.snapshots if s.name in kept])
        self._set_report({**self.report, "restored": report})

    def _set_report(self, report: dict[str, Any]) -> None:
        self.report = {**report, "at": time.time()}
        if self.on_report is not None:
            try:
                self.on_report()
            except Exception:  # a broken listener must not take the owner down
                log.exception("persist listener failed")

    def drop_all(self) -> None:
        """Forget every snapshot: the last checkpoint and what was carried, files and all."""
        self._drop_checkpoint()
        old, self._carried = self._carried, None
        self._forget(old)
        self._set_report({"dropped": True})

    def _drop_checkpoint(self) -> None:
        old, self._checkpoint = self._checkpoint, None
        self._forget(old)

    def _forget(self, carried: Carried | None) -> None:
        """Delete the files of snapshots that will not be restored."""
        if carried is not None and self.store is not None:
            # an unlink may wait on a slow disk: never on the loop
            asyncio.get_running_loop().run_in_executor(
                None, self.store.forget, [snap.name for snap in carried.snapshots])
