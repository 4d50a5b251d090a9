"""`mtpwrap documents`: read documents into the running instance ahead of the questions, list
what was read and what the snapshots hold, and forget every document.

`warm` sends each file as a message of its own (the layout docs/documents.md recommends) at the
batch class (`X-Mtpwrap-Class: batch`: people's requests go first), with one token to answer:
llama-server reads it, and keeps it in its slot, then in its RAM prompt cache. What was warmed is
listed by name, hash and tokens in the state directory's `documents.json` (also on `/status`),
never its text.
`forget` restarts llama-server cold (nothing carried) and empties the snapshot directory: no
document is left in llama-server's slots, its RAM cache or on disk. llama-server offers no way
to drop one document from its RAM cache, so forgetting is for all of them.
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


@command.command("list")
@shared_option("MTPWRAP_JSON")
def list_(as_json: bool) -> None:
    """What was warmed (name, hash, tokens) and what the snapshot directory holds (what a
    restart or a crash of llama-server brings back). Never a document's text."""
    from mtpwrap import console
    from mtpwrap.supervision import instance, persist

    data = instance.read_instance() or {}
    directory = data.get("persist_dir")
    snaps: list[dict[str, Any]] = []
    if directory:
        for p in sorted(Path(directory).glob(persist.PREFIX + "*")):
            try:
                st = p.stat()
            except OSError:
                continue
            snaps.append({"file": p.name, "bytes": st.st_size, "modified": st.st_mtime})
    warmed = instance.read_warmed()
    if as_json:
        console.print_json({"warmed": warmed, "snapshot_dir": directory, "snapshots": snaps})
        return
    now = time.time()
    console.table("documents warmed (llama-server keeps them in its slots and RAM cache, oldest "
                  "out first)", ["file", "sha256", "tokens", "warmed"],
                  [[e.get("name"), str(e.get("sha256", ""))[:12], f"{e.get('tokens', 0):,}",
                    instance.human_duration(now - e.get("warmed_at", now)) + " ago"]
                   for e in warmed])
    console.table(f"snapshots ({directory or 'off'}): what a restart or a crash brings back",
                  ["file", "MiB", "written"],
                  [[s["file"], f"{s['bytes'] / 2**20:.1f}",
                    instance.human_duration(now - s["modified"]) + " ago"] for s in snaps])


@command.command("forget")
@shared_option("MTPWRAP_RELOAD_TIMEOUT")
def forget(timeout: float) -> None:
    """Forget every document: llama-server restarts cold (its slots and RAM cache empty, no
    snapshot carried) and the snapshot directory is emptied. Requests wait in the front's
    queue meanwhile. Exit 0 once the new llama-server is ready."""
    from mtpwrap.commands.reload import finish
    from mtpwrap.supervision import instance

    _running()
    finish("forget", timeout)
    instance.write_warmed([])
