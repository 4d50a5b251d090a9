"""KV snapshots: a long context survives a restart of llama-server.

With `persist.checkpoints` a snapshot is also taken while serving (a checkpoint): once
llama-server has prefilled `persist.checkpoint_tokens` tokens since the last one and has been
idle for CHECKPOINT_IDLE_S; after a crash the last checkpoint is restored like a planned one.

Before a planned restart (reload, restart, recycle) every slot of the old child is saved with
llama-server's `POST /slots/{id}?action=save` into mtpwrap's own directory (`--slot-save-path`);
slots holding fewer than `persist.min_tokens` tokens are dropped at once. After the new child has
answered its first token, and before it is READY, each snapshot is restored into the same slot
when the new launch is compatible (same model file, same KV types, a per-slot context at least
as large); with `cache_prompt` a request that starts with the restored tokens only processes
the new suffix.

A snapshot holds the prompt in another form, so it is treated like the client's documents: the
directory is 0700, each file 0600, the names are mtpwrap's own (never a client's), the total
size is bounded (oldest first out), and a file is deleted once restored and on a clean stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtpwrap.config.objects import PersistConfig
from mtpwrap.decide.launch import LaunchConfig
from mtpwrap.units import MiB

log = logging.getLogger("mtpwrap.persist")

PREFIX = "mtpwrap-slot"
SUFFIX = ".bin"
#: llama-server (patch 0004) writes a slot's context checkpoints and draft context beside its
#: file, under the file's name with this suffix (through SIDECAR + ".tmp", renamed): the two are
#: kept and removed together. The sidecar names the slot file's tokens; llama-server uses it only
#: beside the slot file it was written with, and removes an older one before it saves a slot.
SIDECAR = ".ckpt"
#: what a sidecar write cut short leaves
SIDECAR_TMP = SIDECAR + ".tmp"
#: idle seconds before a checkpoint is taken
CHECKPOINT_IDLE_S = 3.0
#: share of the free disk the snapshots may take when persist.max_mb is 0 (auto)
AUTO_SHARE = 0.25




# --------------------------------------------------------------------------- compatibility


def fingerprint(launch: LaunchConfig | None) -> dict[str, Any]:
    """What a slot snapshot depends on, read from the child's launch: the model file (its
    pinned sha256 when one is recorded beside it, else its size and modification time), the K
    and V cache types and the context of one slot. None: a command of unknown launch, whose
    snapshots fit nothing."""
    if launch is None:
        return {"model": None, "model_id": None, "type_k": None, "type_v": None,
                "slot_ctx": 0, "slots": 1, "known": False}
    p = Path(launch.model)
    stamp = p.with_name(p.name + ".sha256")
    try:
        ident: str | None = stamp.read_text().split()[0] if stamp.is_file() else None
    except (OSError, IndexError):
        ident = None
    if ident is None:
        with contextlib.suppress(OSError):
            st = p.stat()
            ident = f"size {st.st_size}, mtime {st.st_mtime_ns}"
    slots = max(1, launch.slots)
    return {
        "model": str(p.resolve()), "model_id": ident,
        "type_k": launch.cache_k, "type_v": launch.cache_v,
        "slot_ctx": launch.context // slots, "slots": slots, "known": True,
    }


def incompatibility(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """Why snapshots taken under `old` cannot go into a child launched as `new`; None if they
    can."""
    if not (old.get("known") and new.get("known")):
        return "the launch of one of the two commands is not known"
    if old.get("model") != new.get("model") or old.get("model_id") != new.get("model_id"):
        return f"the model changed ({old.get('model')} -> {new.get('model')})"
    for key, what in (("type_k", "K cache type"), ("type_v", "V cache type")):
        if old.get(key) != new.get(key):
            return f"the {what} changed ({old.get(key)} -> {new.get(key)})"
    if int(new.get("slot_ctx") or 0) < int(old.get("slot_ctx") or 0):
        return (f"the context per slot shrank ({old.get('slot_ctx')} -> "
                f"{new.get('slot_ctx')} tokens)")
    return None


# --------------------------------------------------------------------------- the directory


def directory_problems(directory: Path) -> list[str]:
    """What is wrong with a snapshot directory's permissions (for `doctor` and start-up)."""
    problems: list[str] = []
    try:
        st = directory.stat()
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{directory}: cannot read ({exc.strerror})"]
    if st.st_uid != os.geteuid():
        problems.append(f"{directory}: owned by uid {st.st_uid}, not by the service user "
                        f"(uid {os.geteuid()})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        problems.append(f"{directory}: mode {stat.S_IMODE(st.st_mode):04o}, expected 0700")
    with contextlib.suppress(OSError):
        for entry in directory.iterdir():
            mode = stat.S_IMODE(entry.lstat().st_mode)
            if mode & 0o077:
                problems.append(f"{entry}: mode {mode:04o}, expected 0600")
    return problems


@dataclass
class Snapshot:
    slot: int
    name: str
    tokens: int
    size: int


class SnapshotStore:
    """mtpwrap's snapshot directory: names, modes, the size bound, removal."""

    def __init__(self, config: PersistConfig) -> None:
        self.config = config
        self.directory = config.directory
        self.max_bytes = config.max_bytes

    def open(self) -> None:
        """Create the directory 0700 (tighten it if it exists) and drop what an earlier run
        left there: those snapshots belong to a child that no longer exists."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        self.clear()
        if self.max_bytes <= 0:
            free = shutil.disk_usage(self.directory).free
            self.max_bytes = int(free * AUTO_SHARE)

    def new_name(self, slot: int) -> str:
        """A name of mtpwrap's own: no client ever picks or learns it."""
        return f"{PREFIX}{slot}-{int(time.time())}-{secrets.token_hex(8)}{SUFFIX}"

    def path(self, name: str) -> Path:
        return self.directory / name

    def files(self) -> list[Path]:
        try:
            return [p for p in self.directory.iterdir()
                    if p.name.startswith(PREFIX) and p.name.endswith(SUFFIX)]
        except OSError:
            return []

    def secure(self, name: str) -> int:
        """Make a freshly written snapshot (and its sidecar, when llama-server wrote one) 0600;
        its size in bytes (0 when it is gone)."""
        try:
            os.chmod(self.path(name), 0o600)
        except OSError:
            return 0
        with contextlib.suppress(OSError):
            os.chmod(self.path(name + SIDECAR), 0o600)
        return self.size(name)

    def size(self, name: str) -> int:
        """A snapshot's bytes with its sidecar's."""
        total = 0
        for p in (self.path(name), self.path(name + SIDECAR)):
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def forget(self, names: list[str]) -> None:
        """`remove` each of `names`."""
        for name in names:
            self.remove(name)

    def remove(self, name: str) -> None:
        """A snapshot's slot file, its sidecar and what a sidecar write cut short left."""
        for p in (self.path(name), self.path(name + SIDECAR), self.path(name + SIDECAR_TMP)):
            with contextlib.suppress(OSError):
                p.unlink()

    def clear(self) -> int:
        """Delete every snapshot with its sidecar, and what a write cut short left; the number
        of snapshots deleted."""
        n = len(self.files())
        try:
            leftovers = [p for p in self.directory.iterdir() if p.name.startswith(PREFIX)]
        except OSError:
            return 0
        for p in leftovers:
            with contextlib.suppress(OSError):
                p.unlink()
        return n

    def evict(self) -> list[str]:
        """Delete the oldest snapshots until the total fits `max_bytes`; the names removed."""
        entries = []
        for p in self.files():
            with contextlib.suppress(OSError):
                entries.append((p.stat().st_mtime_ns, p.name, self.size(p.name)))
        entries.sort()
        total = sum(size for _, _, size in entries)
        gone: list[str] = []
        for _, name, size in entries:
            if total <= self.max_bytes:
                break
            self.remove(name)
            total -= size
            gone.append(name)
        if gone:
            log.warning("snapshot directory above %d MiB: removed %d oldest snapshot(s)",
                        self.max_bytes // MiB, len(gone))
        return gone


# --------------------------------------------------------------------------- save / restore


@dataclass
class Carried:
    """Snapshots taken from one child, waiting for the next."""

    fingerprint: dict[str, Any]
    snapshots: list[Snapshot]
    save_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"slots": [s.slot for s in self.snapshots],
                "tokens": sum(s.tokens for s in self.snapshots),
                "bytes": sum(s.size for s in self.snapshots), "save_s": round(self.save_s, 3)}


async def save_slots(child: Any, store: SnapshotStore, launch: LaunchConfig | None) -> Carried:
    """Save every slot of `child` (launched as `launch`) holding at least `min_tokens`
    tokens."""
    t0 = time.perf_counter()
    # every file step (a stat, a chmod, an unlink, a model's stamp read) in a thread: a slow
    # or hung disk never holds the loop, its streams and the watchdog
    fp = await asyncio.to_thread(fingerprint, launch)
    kept: list[Snapshot] = []
    for slot in range(int(fp["slots"])):
        name = store.new_name(slot)
        ok, data = await child.slot_action(slot, "save", name)
        if not ok:
            log.warning("slot %d not saved: %s", slot, data.get("message"))
            await asyncio.to_thread(store.remove, name)
            continue
        size = await asyncio.to_thread(store.secure, name)
        tokens = int(data.get("n_saved") or 0)
        if tokens < max(1, store.config.min_tokens):
            await asyncio.to_thread(store.remove, name)
            continue
        kept.append(Snapshot(slot, name, tokens, size))
    carried = Carried(fp, kept, time.perf_counter() - t0)
    gone = set(await asyncio.to_thread(store.evict))
    carried.snapshots = [s for s in kept if s.name not in gone]
    if carried.snapshots:
        mb = sum(s.size for s in carried.snapshots) / MiB
        log.info("saved %d slot(s), %d tokens, %.1f MiB in %.3fs",
                 len(carried.snapshots), sum(s.tokens for s in carried.snapshots), mb,
                 carried.save_s)
    return carried


async def restore_slots(child: Any, store: SnapshotStore, carried: Carried,
                        launch: LaunchConfig | None, *, keep: bool = False) -> dict[str, Any]:
    """Put carried snapshots into `child`; every file is deleted afterwards, restored or not
    (`keep`: those restored are kept, named in the report's `kept`: they are the new child's
    first checkpoint)."""
    t0 = time.perf_counter()
    report: dict[str, Any] = {"restored": 0, "tokens": 0, "skipped": None}
    kept: list[str] = []
    try:
        why = incompatibility(carried.fingerprint, await asyncio.to_thread(fingerprint, launch))
        if why is not None:
            report["skipped"] = why
            if carried.snapshots:
                log.info("not restoring %d slot snapshot(s): %s", len(carried.snapshots), why)
            return report
        for snap in carried.snapshots:
            if not await asyncio.to_thread(store.path(snap.name).exists):
                continue  # evicted meanwhile
            ok, data = await child.slot_action(snap.slot, "restore", snap.name)
            if not ok:
                log.warning("slot %d not restored: %s", snap.slot, data.get("message"))
                continue
            report["restored"] += 1
            report["tokens"] += int(data.get("n_restored") or 0)
            if keep:
                kept.append(snap.name)
    finally:
        await asyncio.to_thread(store.forget, [s.name for s in carried.snapshots
                                                if s.name not in kept])
        if kept:
            report["kept"] = kept
        report["restore_s"] = round(time.perf_counter() - t0, 3)
    if report["restored"]:
        log.info("restored %d slot(s), %d tokens in %.3fs", report["restored"],
                 report["tokens"], report["restore_s"])
    return report
