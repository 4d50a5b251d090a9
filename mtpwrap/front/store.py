"""The document store: the state of every document llama-server read, kept on disk and put back
into the slot before a request that shares it is forwarded (`persist.*`; docs/documents.md).

A prompt, tokenized by llama-server (its chat template applied), is named by blocks of BLOCK
tokens, each a BLAKE2b digest of the name before it and its tokens; a state is kept under its
prompt's last name, with the chain in its record, never a word of text. After the answer to a
prompt of `min_tokens` or more that no kept state holds all but `min_tokens` of, the slot is
saved before the next request is forwarded; before such a prompt is forwarded, the state that
shares the longest prefix with it is restored when that saves `min_tokens` more than
llama-server's child holds (its slot, or a recent prompt in its RAM cache). One slot only.

Files, 0600 in a 0700 `persist.dir` (llama-server's --slot-save-path, shareable by nodes):
`<name>.bin` (the slot file), `<name>.bin.ckpt` (the checkpoints, patches 0004/0005) and
`<name>.json`, the record: the launch's header (model, binary, KV types, context), the chain,
the tokens and the files' sizes. llama-server writes `tmp-*.bin`; a thread links it to its name
(the first writer wins), then writes the record (renamed into place): a record means a whole
state. A state is restored only under its header; a broken record (or files not of its sizes)
is removed. The least recently used go first past `max_mb`, and any unused `retention_days`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import json
import logging
import os
import secrets
import shutil
import stat
import time
from array import array
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from mtpwrap.config.objects import PersistConfig
from mtpwrap.front.info import ServeInfo
from mtpwrap.hashing import sha256_file
from mtpwrap.units import MiB

log = logging.getLogger("mtpwrap.documents")
T = TypeVar("T")

#: tokens in a block of the chain
BLOCK = 256
STATE, SIDECAR, RECORD = ".bin", ".bin.ckpt", ".json"
TMP = "tmp-"
#: share of the free disk the store may take when persist.max_mb is 0
AUTO_SHARE = 0.25
#: a temporary file older than this is what a killed write left (another node may be writing
#: a younger one)
STALE_S = 3600.0
VERSION = 1
#: seconds a save or a restore may take (a 9 GiB state over a slow network mount)
TIMEOUT_S = 600.0

#: POST a path of llama-server's with a JSON body: (status, the answer's object)
Ask = Callable[[str, Mapping[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]


def chain(tokens: Sequence[int]) -> list[str]:
    """The names of a prompt's whole blocks, each a digest of the one before and its tokens."""
    names: list[str] = []
    h = b""
    for i in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hashlib.blake2b(h + array("i", tokens[i:i + BLOCK]).tobytes(),
                            digest_size=16).digest()
        names.append(h.hex())
    return names


def header(model: str | None, binary: str | None, kv: str | None,
           context: int | None) -> dict[str, Any]:
    """What a state depends on: the model (its pinned sha256 when recorded beside it, else
    its name and size), the binary's sha256, the KV types and the context. Reads files: call
    it in a thread."""
    return {"v": VERSION, "model": _model_id(model), "binary": _sha256(binary), "kv": kv,
            "context": context}


def _model_id(model: str | None) -> str | None:
    if not model:
        return None
    p = Path(model)
    with contextlib.suppress(OSError, IndexError):
        stamp = p.with_name(p.name + ".sha256")
        if stamp.is_file():
            return stamp.read_text().split()[0]
    with contextlib.suppress(OSError):
        return f"{p.name} {p.stat().st_size}"
    return None


def _sha256(path: str | None) -> str | None:
    with contextlib.suppress(OSError):
        return sha256_file(Path(path)) if path else None
    return None


def directory_problems(directory: Path) -> list[str]:
    """What is wrong with the store's permissions (for `doctor`)."""
    try:
        st = directory.stat()
    except FileNotFoundError:
        return []
    except OSError as exc:
        return [f"{directory}: cannot read ({exc.strerror})"]
    problems: list[str] = []
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


@dataclass(frozen=True)
class Entry:
    """One kept state, as its record says."""

    name: str
    chain: tuple[str, ...]
    #: the prompt's tokens, and those in the slot file (the prompt and its answer)
    tokens: int
    saved: int
    #: its files' bytes, and when it was last written or restored (the record's mtime)
    size: int
    used: float
    header: Mapping[str, Any]


class Shelf:
    """The directory: records, files, the size bound. Every method reads or writes files:
    the front calls them in threads."""

    def __init__(self, config: PersistConfig) -> None:
        self.config = config
        self.directory = config.directory
        self.max_bytes = config.max_bytes

    def open(self) -> None:
        """Create the directory 0700 (tighten it if it exists); drop what killed writes left."""
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.directory, 0o700)
        self.sweep()
        if self.max_bytes <= 0:
            self.max_bytes = int(shutil.disk_usage(self.directory).free * AUTO_SHARE)

    def sweep(self) -> None:
        """Remove what a killed write left, once older than STALE_S (another node may be
        writing a younger one): temporary files, and files of a state with no record (which
        would keep its name from being written again)."""
        now = time.time()
        for p in self._listing():
            orphan = p.name.startswith(TMP) or (p.suffix in (STATE, ".ckpt") and not self.path(
                p.name.split(".", 1)[0], RECORD).exists())
            with contextlib.suppress(OSError):
                if orphan and now - p.stat().st_mtime > STALE_S:
                    p.unlink()

    def stamp(self) -> int:
        """Changes when a file is added or removed (another node's included)."""
        with contextlib.suppress(OSError):
            return self.directory.stat().st_mtime_ns
        return 0

    def path(self, name: str, suffix: str = STATE) -> Path:
        return self.directory / (name + suffix)

    def _listing(self) -> list[Path]:
        with contextlib.suppress(OSError):
            return list(self.directory.iterdir())
        return []

    def entries(self) -> list[Entry]:
        """Every whole state, least recently used first; a broken record is removed."""
        out: list[Entry] = []
        for p in self._listing():
            if p.suffix == RECORD and not p.name.startswith(TMP):
                entry = self.load(p.name[:-len(RECORD)])
                if entry is not None:
                    out.append(entry)
        return sorted(out, key=lambda e: e.used)

    def load(self, name: str) -> Entry | None:
        """A state's record, checked against its files (None: gone, or broken and removed)."""
        rec = self.path(name, RECORD)
        try:
            data = json.loads(rec.read_bytes())
            used = rec.stat().st_mtime
            sizes = data["bytes"]
            entry = Entry(name, tuple(str(h) for h in data["chain"]), int(data["tokens"]),
                          int(data["saved"]), int(sizes[STATE]) + int(sizes[SIDECAR]), used,
                          dict(data["header"]))
            for suffix in (STATE, SIDECAR):
                if int(sizes[suffix]) and self.path(name, suffix).stat().st_size \
                        != int(sizes[suffix]):
                    raise ValueError(f"{name}{suffix} is not {sizes[suffix]} bytes")
            if not entry.chain or entry.chain[-1] != name:
                raise ValueError("its chain does not end in its name")
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("document state %s is broken and is removed: %s", name, exc)
            self.remove(name)
            return None
        return entry

    def commit(self, tmp: str, names: Sequence[str], tokens: int, saved: int,
               head: Mapping[str, Any]) -> Entry | None:
        """Keep what llama-server wrote to `tmp` under the chain's last name; None when another
        writer kept it first (this copy goes) or the file is gone."""
        name = names[-1]
        src = self.directory / tmp
        sizes = {STATE: 0, SIDECAR: 0}
        try:
            for suffix, p in ((STATE, src), (SIDECAR, src.with_name(src.name + ".ckpt"))):
                with contextlib.suppress(FileNotFoundError):
                    os.chmod(p, 0o600)
                    sizes[suffix] = p.stat().st_size
            os.link(src, self.path(name))  # EEXIST: another writer's whole state is there
            with contextlib.suppress(FileNotFoundError):
                os.replace(src.with_name(src.name + ".ckpt"), self.path(name, SIDECAR))
            record = {"v": VERSION, "header": dict(head), "chain": list(names), "tokens": tokens,
                      "saved": saved, "bytes": sizes, "written": time.time()}
            part = self.directory / f"{TMP}{secrets.token_hex(8)}{RECORD}"
            fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(record, f)
            os.replace(part, self.path(name, RECORD))
        except FileExistsError:
            return None
        finally:
            for p in (src, src.with_name(src.name + ".ckpt")):
                with contextlib.suppress(OSError):
                    p.unlink()
        return self.load(name)

    def touch(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self.path(name, RECORD))

    def remove(self, name: str) -> None:
        """A state's record first (without it the files are no state), then its files."""
        for suffix in (RECORD, STATE, SIDECAR):
            with contextlib.suppress(OSError):
                self.path(name, suffix).unlink()

    def evict(self) -> list[str]:
        """Remove the states unused for `retention_days`, then the least recently used until
        the total fits `max_bytes`, and what killed writes left; the names removed."""
        self.sweep()
        entries = self.entries()
        horizon = time.time() - self.config.retention_days * 86400.0
        total = sum(e.size for e in entries)
        gone: list[str] = []
        for e in entries:
            if e.used >= horizon and total <= self.max_bytes:
                break
            self.remove(e.name)
            total -= e.size
            gone.append(e.name)
        if gone:
            log.info("document store: removed %d state(s) past %d MiB or %d days",
                     len(gone), self.max_bytes // MiB, self.config.retention_days)
        return gone

    def forget(self) -> int:
        """Remove every state and every temporary file; how many states there were."""
        n = len(self.entries())
        for p in self._listing():
            if p.suffix in (RECORD, STATE, ".ckpt") or p.name.startswith(TMP):
                with contextlib.suppress(OSError):
                    p.unlink()
        return n


class Index:
    """The kept states written under one header, by each name of their chains."""

    def __init__(self, entries: Sequence[Entry], head: Mapping[str, Any]) -> None:
        self.entries = [e for e in entries if e.header == head]
        self._at: dict[str, tuple[Entry, int]] = {}
        # a shared name goes to the shortest state that holds it (its checkpoints end nearest
        # to it: on a hybrid model the others may not reach back that far), the newest of those
        for e in sorted(self.entries, key=lambda e: (-len(e.chain), e.used)):
            for depth, name in enumerate(e.chain, 1):
                self._at[name] = (e, depth)

    def best(self, names: Sequence[str]) -> tuple[Entry | None, int]:
        """The state sharing the most blocks with `names`, and how many (a chain: a name
        found means every one before it is)."""
        lo, hi = 0, len(names)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if names[mid - 1] in self._at:
                lo = mid
            else:
                hi = mid - 1
        return (self._at[names[lo - 1]][0], lo) if lo else (None, 0)


def shared(a: Sequence[str], b: Sequence[str]) -> int:
    """How many leading names two chains share."""
    return len(os.path.commonprefix([list(a), list(b)]))


@dataclass
class Read:
    """A request with a document-sized prompt, from before it is forwarded to after."""

    chain: list[str]
    tokens: int
    generation: int
    restored: dict[str, Any] | None = None


class Documents:
    """The store's decisions for the chat model's one slot (see the module docstring)."""

    def __init__(self, shelf: Shelf) -> None:
        self.shelf = shelf
        self.min_tokens = shelf.config.min_tokens
        #: the header of the launch served (set by `launch`, before the first request)
        self.head: Mapping[str, Any] | None = None
        self._index = Index((), {})
        self._stamp: int | None = None
        #: chains llama-server's child holds, newest last: its slot's and those its RAM cache
        #: still keeps (as many as the plan says it holds)
        self._held: collections.deque[list[str]] = collections.deque(maxlen=2)
        #: a full-context document's state, as the plan sizes it (0: not known)
        self.full_bytes = 0
        #: how far back from its end a held or kept prompt can be cut (a hybrid or sliding
        #: window model: its checkpoints' span; None: anywhere)
        self.reach: int | None = None
        self._generation: int | None = None
        #: the last restore and save, and the totals (the state file, /healthz)
        self.report: dict[str, Any] = {"restored": 0, "saved": 0}

    async def launch(self, info: ServeInfo) -> None:
        """Serve the launch `info` describes: its states only."""
        self.head = await asyncio.to_thread(header, info.model, info.binary, info.kv,
                                            info.context)
        plan = info.documents or {}
        self._held = collections.deque(self._held, maxlen=int(plan.get("documents") or 0) + 1)
        self.full_bytes = int(plan.get("entry_bytes") or 0)
        span = int(plan.get("checkpoints") or 0) * int(plan.get("min_step") or 0)
        self.reach = (span or 8192) if plan.get("needs_checkpoints") else None
        self._stamp = None

    async def _fresh(self) -> Index:
        stamp = await asyncio.to_thread(self.shelf.stamp)
        if stamp != self._stamp and self.head is not None:
            self._stamp = stamp
            self._index = Index(await asyncio.to_thread(self.shelf.entries), self.head)
        return self._index

    async def before(self, ask: Ask, generation: int, tokens: Sequence[int]) -> Read | None:
        """Restore the kept state that shares the longest prefix with `tokens` when it saves
        `min_tokens` more than llama-server holds; what to do after the answer (None: the
        prompt is too short for the store). A failing disk or link costs only the restore."""
        return await _tried("no restore", self._before(ask, generation, tokens))

    async def _before(self, ask: Ask, generation: int, tokens: Sequence[int]) -> Read | None:
        names = chain(tokens)
        if len(names) * BLOCK < self.min_tokens:
            return None
        if generation != self._generation:  # a new child holds nothing yet
            self._generation = generation
            self._held.clear()
        read = Read(names, len(tokens), generation)
        entry, depth = (await self._fresh()).best(names)
        near = max((n for h in self._held if self._reaches(h, n := shared(h, names))),
                   default=0)
        if entry is None or (depth - near) * BLOCK < self.min_tokens \
                or not self._reaches(entry.chain, depth):
            return read
        t = time.perf_counter()
        checked = await asyncio.to_thread(self.shelf.load, entry.name)
        if checked is None or checked.header != self.head:
            self._stamp = None
            return read
        status, answer = await ask("/slots/0?action=restore",
                                   {"filename": entry.name + STATE})
        ms = round((time.perf_counter() - t) * 1000)
        if status != 200:
            log.warning("document state %s not restored (%d tokens): HTTP %d %s", entry.name,
                        entry.tokens, status, answer.get("error") or "")
            return read
        await asyncio.to_thread(self.shelf.touch, entry.name)
        if self._held:  # what the slot held is gone: a restore does not cache it
            self._held.pop()
        self._hold(list(entry.chain))
        read.restored = {"tokens": int(answer.get("n_restored") or entry.saved),
                         "shared": depth * BLOCK, "ms": ms, "bytes": entry.size}
        self.report = {**self.report, "restored": self.report["restored"] + 1,
                       "last_restore": {**read.restored, "at": time.time()}}
        return read

    async def after(self, ask: Ask, read: Read) -> dict[str, Any] | None:
        """The answer to `read` went out: keep the slot's state unless a kept one covers its
        prompt; what was saved (tokens, bytes, ms), or None. A failure costs only the save."""
        return await _tried("not kept", self._after(ask, read))

    def _hold(self, names: list[str]) -> None:
        """The slot holds `names` now; a prompt it extends was extended in place (llama-server
        keeps no copy of it at its old length)."""
        kept = [h for h in self._held if h != names[:len(h)]]
        self._held.clear()
        self._held.extend([*kept, names])

    def _reaches(self, held: Sequence[str], depth: int) -> bool:
        """Whether llama-server can cut a prompt of chain `held` back to `depth` blocks
        (an edit of an early turn of a long chat: only a state that ends near it can)."""
        return self.reach is None or (len(held) - depth) * BLOCK <= self.reach

    async def _after(self, ask: Ask, read: Read) -> dict[str, Any] | None:
        if read.generation != self._generation or self.head is None:
            return None
        self._hold(read.chain)
        index = await self._fresh()
        entry, depth = index.best(read.chain)
        if entry is not None and (len(read.chain) - depth) * BLOCK < self.min_tokens:
            # a kept state holds all but a question of it: one state per document, not one
            # per question
            await asyncio.to_thread(self.shelf.touch, entry.name)
            return None
        t = time.perf_counter()
        tmp = f"{TMP}{secrets.token_hex(8)}{STATE}"
        status, answer = await ask("/slots/0?action=save", {"filename": tmp})
        if status != 200:
            log.warning("document not kept (%d tokens): HTTP %d %s", read.tokens, status,
                        answer.get("error") or "")
            await asyncio.to_thread(self.shelf.remove, tmp[:-len(STATE)])
            return None
        kept = await asyncio.to_thread(self.shelf.commit, tmp, read.chain, read.tokens,
                                       int(answer.get("n_saved") or 0), self.head)
        self._stamp = None
        await asyncio.to_thread(self.shelf.evict)
        if kept is None:
            return None
        saved = {"tokens": kept.saved, "bytes": kept.size,
                 "ms": round((time.perf_counter() - t) * 1000)}
        self.report = {**self.report, "saved": self.report["saved"] + 1,
                       "last_save": {**saved, "at": time.time()}}
        return saved

    def summary(self) -> dict[str, Any]:
        """For /healthz and the state file: where, how much, how many fit."""
        entries = self._index.entries
        return {"dir": str(self.shelf.directory), "states": len(entries),
                "bytes": sum(e.size for e in entries), "max_bytes": self.shelf.max_bytes,
                "full_context_documents": self.shelf.max_bytes // self.full_bytes
                if self.full_bytes else None, **self.report}


async def _tried(what: str, work: Awaitable[T]) -> T | None:
    """`work`'s result; None, logged, where the disk or llama-server's link failed."""
    try:
        return await work
    except (httpx.HTTPError, OSError) as exc:
        log.warning("document store: %s (%s)", what, exc)
        return None
