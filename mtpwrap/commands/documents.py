"""`mtpwrap documents`: read documents into the running instance ahead of the questions, list
what was read and what the document store keeps, and forget documents.

`warm` sends each file as a message of its own (the layout docs/documents.md recommends) at the
batch class (`X-Mtpwrap-Class: batch`: people's requests go first), with one token to answer:
llama-server reads it, and keeps it in its slot, then in its RAM prompt cache. What was warmed is
listed by name, hash and tokens in the state directory's `documents.json` (also on `/status`),
never its text.
`forget NAME` removes kept states from the store; `forget --all` restarts llama-server cold and
empties the store: no document is left in llama-server's slots, its RAM cache or on disk.
llama-server offers no way to drop one document from its RAM cache, so that is for all of them.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import click

from mtpwrap.config.options import shared_option


def _running() -> dict[str, Any]:
    from mtpwrap.errors import RuntimeFailure
    from mtpwrap.supervision import instance

    data = instance.read_instance()
    if not instance.instance_running(data):
        raise RuntimeFailure(f"no mtpwrap instance is running (no live state file at "
                             f"{instance.instance_path()}).", hint="Start one with `mtpwrap up`.")
    assert data is not None
    return data


@click.group("documents")
def command() -> None:
    """Read documents ahead of the questions, list what is warm, forget every document."""


@command.command("warm")
@click.argument("files", nargs=-1, required=True,
                type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--system", default=None,
              help="The system prompt the questions will come with (it precedes the "
                   "document, so it must be the same, byte for byte).")
@shared_option("MTPWRAP_API_KEY", help="API key of the running instance (when it has keys).")
@click.option("--timeout", "timeout_s", type=click.IntRange(1, 86_400), default=3600,
              show_default=True, help="Seconds one document may take to read.")
def warm(files: tuple[Path, ...], system: str | None, api_key: str | None,
         timeout_s: int) -> None:
    """Read each FILE into the running instance, at the batch class, so the first question
    on it finds it read. The files' text goes to llama-server only; the record keeps the name,
    a hash and the tokens."""
    import httpx

    from mtpwrap import console
    from mtpwrap.errors import ConfigError, RuntimeFailure
    from mtpwrap.supervision import instance

    texts = []
    for f in files:
        try:
            texts.append((f, f.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            raise ConfigError(f"{f}: not UTF-8 text; give the document as a UTF-8 text file "
                              "(convert a PDF or Word file to text first).") from None
        except OSError as exc:
            raise ConfigError(f"{f}: cannot be read ({exc.strerror}).") from None
    url = _running()["url"]
    headers = {"x-mtpwrap-class": "batch"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    entries = {e.get("sha256"): e for e in instance.read_warmed()}
    rows = []
    with httpx.Client(base_url=url, headers=headers, timeout=timeout_s,
                      trust_env=False) as client:
        for f, text in texts:
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": text}]
            t0 = time.monotonic()
            try:
                r = client.post("/v1/chat/completions", json={
                    "messages": messages, "max_tokens": 1, "temperature": 0})
            except httpx.HTTPError as exc:
                raise RuntimeFailure(f"{f}: the running instance at {url} did not answer "
                                     f"({exc}).") from None
            if r.status_code != 200:
                raise RuntimeFailure(f"{f}: the running instance answered {r.status_code}: "
                                     f"{_message(r)}")
            doc = r.json()
            took = time.monotonic() - t0
            sha = hashlib.sha256(((system or "") + "\0" + text).encode()).hexdigest()
            tokens = int((doc.get("usage") or {}).get("prompt_tokens") or 0)
            read = (doc.get("timings") or {}).get("prompt_n")
            entries[sha] = {"name": f.name, "path": str(f.resolve()), "sha256": sha,
                            "tokens": tokens, "read": read, "seconds": round(took, 2),
                            "system": bool(system), "warmed_at": time.time()}
            rows.append([f.name, sha[:12], f"{tokens:,}",
                         "-" if read is None else f"{int(read):,}", f"{took:.1f}"])
    instance.write_warmed(sorted(entries.values(), key=lambda e: e.get("warmed_at", 0)))
    console.table("documents read", ["file", "sha256", "tokens", "read now", "seconds"], rows)


def _message(r: Any) -> str:
    from mtpwrap.front.replies import error_message

    return error_message(r.content) or r.text[:200]


def _shelf(directory: str | None) -> Any:
    """The document store of the running instance, else the configured one."""
    import os

    from mtpwrap.config.objects import PersistConfig
    from mtpwrap.config.table import env_name
    from mtpwrap.front.store import Shelf

    return Shelf(PersistConfig(dir=directory or os.environ.get(env_name("persist.dir"))))


@command.command("list")
@shared_option("MTPWRAP_JSON")
def list_(as_json: bool) -> None:
    """What was warmed (name, hash, tokens) and what the document store keeps (name, tokens,
    size, last use: what a question after a restart, a crash or on another node finds). Never
    a document's text."""
    from mtpwrap import console
    from mtpwrap.supervision import instance

    data = instance.read_instance() or {}
    shelf = _shelf(data.get("persist_dir"))
    kept = [{"name": e.name, "tokens": e.tokens, "bytes": e.size, "last_use": e.used}
            for e in reversed(shelf.entries())]
    warmed = instance.read_warmed()
    if as_json:
        console.print_json({"warmed": warmed, "store": str(shelf.directory), "kept": kept})
        return
    now = time.time()
    console.table("documents warmed (llama-server keeps them in its slots and RAM cache, oldest "
                  "out first)", ["file", "sha256", "tokens", "warmed"],
                  [[e.get("name"), str(e.get("sha256", ""))[:12], f"{e.get('tokens', 0):,}",
                    instance.human_duration(now - e.get("warmed_at", now)) + " ago"]
                   for e in warmed])
    console.table(f"document store ({shelf.directory}), most recently used first",
                  ["name", "tokens", "MiB", "last use"],
                  [[k["name"], f"{k['tokens']:,}", f"{k['bytes'] / 2**20:.1f}",
                    instance.human_duration(now - k["last_use"]) + " ago"] for k in kept])


@command.command("forget")
@click.argument("names", nargs=-1)
@click.option("--all", "everything", is_flag=True,
              help="Every document: llama-server restarts cold and the store is emptied.")
@shared_option("MTPWRAP_RELOAD_TIMEOUT")
def forget(names: tuple[str, ...], everything: bool, timeout: float) -> None:
    """Remove the kept states NAMES (from `documents list`) from the document store, or with
    --all every document: llama-server restarts cold (its slots and RAM cache empty) and the
    store is emptied; requests wait in the front's queue meanwhile, and it exits 0 once the new
    llama-server is ready."""
    from mtpwrap import console
    from mtpwrap.commands.reload import finish
    from mtpwrap.errors import ConfigError
    from mtpwrap.supervision import instance

    if everything == bool(names):
        raise ConfigError("documents forget: name the kept states to remove (see `mtpwrap "
                          "documents list`) or give --all, not both.")
    if names:
        shelf = _shelf((instance.read_instance() or {}).get("persist_dir"))
        known = {e.name for e in shelf.entries()}
        if missing := [n for n in names if n not in known]:
            raise ConfigError(f"documents forget: {', '.join(missing)}: no such kept state in "
                              f"{shelf.directory} (see `mtpwrap documents list`).")
        for name in names:
            shelf.remove(name)
        console.info(f"removed {len(names)} kept state(s) from {shelf.directory}; a copy "
                     "llama-server holds in its slot or RAM cache goes with its next restart "
                     "(`documents forget --all`)")
        return
    _running()
    finish("forget", timeout)
    instance.write_warmed([])
