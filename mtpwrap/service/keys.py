"""The front's key table kept current without a restart: the key file watched, and a reload's
keys swapped in, both through `KeyWatch.swap`.

The file is polled (its device, inode, size and modification time, read off the event loop)
every `POLL_S`; a change is read once it has held for one poll, so that a file caught half
written is not served. The new table is built whole, then swapped for the old one in one step
(`Front.swap_keys`): a request already let in finishes, the next one is checked against the new
keys. A file that cannot be read, or holds a bad line, is logged (one sentence naming the file
and the line) and the keys in use stay. The log names keys, never shows one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Protocol

from mtpwrap.config.apikeys import KeyTable, checked_table, configured_keys, table_change
from mtpwrap.config.settings import Settings
from mtpwrap.errors import ConfigError

log = logging.getLogger("mtpwrap.keys")

#: how often the key file is looked at: a key taken out of it is refused within two of these
POLL_S = 0.5

#: what identifies one version of the file: (device, inode, size, mtime in ns)
Signature = tuple[int, int, int, int]
#: the signature of a file that is not there (no real one has a negative size)
MISSING: Signature = (0, 0, -1, 0)


class KeyHolder(Protocol):
    def swap_keys(self, keys: KeyTable) -> KeyTable:
        """Serve `keys` from the next request on; the table it replaces."""


def _signature(path: str) -> Signature:
    try:
        st = os.stat(path)
    except OSError:
        return MISSING
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class KeyWatch:
    """The key file (`path`, None: none is configured) of one front (`holder`), and the keys of
    `MTPWRAP_API_KEYS` (`env`) beside it."""

    def __init__(self, holder: KeyHolder, path: str | None, where: str,
                 env: Mapping[str, str] | None = None) -> None:
        self.holder = holder
        self.env = os.environ if env is None else env
        self.path, self.where = path, where
        #: the version last read (or reported unreadable), and the one the last poll saw
        self._read: Signature | None = None
        self._seen: Signature | None = None

    @classmethod
    def for_settings(cls, holder: KeyHolder, settings: Settings) -> KeyWatch:
        watch = cls(holder, None, "")
        watch.follow(settings)
        return watch

    def follow(self, settings: Settings) -> None:
        """Watch the key file `settings` name from now on (a reload may name another), and
        read it at the next poll, whatever a reload swapped in meanwhile."""
        self.path = settings.api_key_file
        self.where = settings.keys_where
        self._read = self._seen = None

    def swap(self, keys: KeyTable, why: str) -> str | None:
        """Serve `keys` from the next request on; what changed, by key name (None: nothing),
        also logged with `why`."""
        old = self.holder.swap_keys(keys)
        change = table_change(old, keys)
        if change is not None:
            log.info("API keys changed (%s): %s", why, change)
            if not keys:
                log.warning("no API keys any more: the front takes every request without one")
        return change

    async def run(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            await self.poll()

    async def poll(self) -> None:
        """Read the key file when it changed and has held still since the previous poll."""
        path = self.path
        if path is None:
            return
        sig = await asyncio.to_thread(_signature, path)
        settled = sig == self._seen
        self._seen = sig
        if not settled or sig == self._read:
            return
        try:
            keys = await asyncio.to_thread(self._load, path)
        except ConfigError as exc:
            log.error("%s; the API keys in use stay until the file is fixed", exc.message)
            self._read = sig
            return
        if path != self.path:  # a reload named another file while this one was read
            return
        self._read = sig
        self.swap(keys, f"{path} changed")

    def _load(self, path: str) -> KeyTable:
        return checked_table(configured_keys(self.env, path, self.where), self.where)
