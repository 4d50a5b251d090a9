"""A local stand-in for a Hugging Face hub's file API, on 127.0.0.1, serving files a test wrote.

It speaks what `huggingface_hub` asks of a hub when it downloads: the model listing at a revision
with LFS metadata (`/api/models/OWNER/NAME/revision/REV?blobs=true`), `HEAD`/`GET` on
`/OWNER/NAME/resolve/REV/PATH` answering like the hub does for an LFS file (302 to a storage host
with `X-Repo-Commit`, `ETag`, `X-Linked-Etag` (the sha256), `X-Linked-Size`), and a second origin
standing for the CDN that serves the bytes with `Range` requests (206, `Content-Range`). Errors
carry the hub's `X-Error-Code`. Faults on demand: advertise a sha256 other than the bytes', cut a
transfer after N bytes, require a token.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit


@dataclass
class Blob:
    data: bytes
    advertised_sha256: str
    #: cut the connection after this many bytes of a transfer, `cuts` times
    cut_after: int | None = None
    cuts: int = 0

    @property
    def git_oid(self) -> str:
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()


@dataclass
class Seen:
    host: str  # "hub" or "cdn"
    method: str
    path: str
    headers: dict[str, str]  # names in lower case


@dataclass
class FakeHub:
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    token: str | None = None
    repos: dict[str, dict[str, Blob]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    hub_url: str = ""
    cdn_url: str = ""

    def add(self, repo: str, path: str, data: bytes, *, advertise: bytes | None = None,
            cut_after: int | None = None, cuts: int = 0) -> Blob:
        """A file of the repository; `advertise`: other bytes whose sha256 and size the hub
        announces instead of this file's own."""
        shown = advertise if advertise is not None else data
        blob = Blob(data, hashlib.sha256(shown).hexdigest(), cut_after, cuts)
        self.repos.setdefault(repo, {})[path] = blob
        return blob

    def blob_by_sha(self, sha: str) -> Blob | None:
        for files in self.repos.values():
            for b in files.values():
                if b.advertised_sha256 == sha:
                    return b
        return None

    def requests(self, host: str, method: str | None = None) -> list[Seen]:
        return [s for s in self.seen if s.host == host and (method is None or s.method == method)]


def _handler(hub: FakeHub, host: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
                  *, length: int | None = None) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            self.end_headers()
            if self.command != "HEAD" and body:
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str) -> None:
            self._send(status, json.dumps({"error": message}).encode(),
                       {"X-Error-Code": code, "X-Error-Message": message,
                        "Content-Type": "application/json"})

        def _authorised(self) -> bool:
            if hub.token is None:
                return True
            return self.headers.get("Authorization") == f"Bearer {hub.token}"

        def do_HEAD(self) -> None:
            self._route()

        def do_GET(self) -> None:
            self._route()

        def _route(self) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.seen.append(Seen(host, self.command, path,
                                {k.lower(): v for k, v in self.headers.items()}))
            if host == "cdn":
                return self._cdn(path)
            m = re.fullmatch(r"/api/models/([^/]+/[^/]+)/revision/([^/]+)", path)
            if m:
                return self._listing(m[1], m[2])
            m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
            if m:
                return self._resolve(m[1], m[2], m[3])
            self._error(404, "NotFound", "no such route")

        def _repo(self, repo: str, rev: str) -> dict[str, Blob] | None:
            if repo not in hub.repos or not self._authorised():
                # what the hub answers for a missing repository and for a private one alike
                self._error(401 if hub.token else 404, "RepoNotFound", "Repository not found")
                return None
            if rev not in ("main", hub.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return hub.repos[repo]

        def _listing(self, repo: str, rev: str) -> None:
            files = self._repo(repo, rev)
            if files is None:
                return
            siblings = [{"rfilename": p, "size": len(b.data), "blobId": b.git_oid,
                         "lfs": {"size": len(b.data), "sha256": b.advertised_sha256,
                                 "pointerSize": 134}} for p, b in sorted(files.items())]
            body = json.dumps({"id": repo, "modelId": repo, "sha": hub.commit,
                               "private": hub.token is not None, "siblings": siblings}).encode()
            self._send(200, body, {"Content-Type": "application/json"})

        def _resolve(self, repo: str, rev: str, name: str) -> None:
            files = self._repo(repo, rev)
            if files is None:
                return
            blob = files.get(name)
            if blob is None:
                self._error(404, "EntryNotFound", f"{name} does not exist at {rev}")
                return
            self._send(302, b"", {
                "Location": f"{hub.cdn_url}/blobs/{blob.advertised_sha256}?X-Signature=abc",
                "X-Repo-Commit": hub.commit,
                "ETag": f'"{blob.git_oid}"',
                "X-Linked-Etag": f'"{blob.advertised_sha256}"',
                "X-Linked-Size": str(len(blob.data)),
            })

        def _cdn(self, path: str) -> None:
            m = re.fullmatch(r"/blobs/([0-9a-f]{64})", path)
            blob = hub.blob_by_sha(m[1]) if m else None
            if blob is None:
                self._send(404)
                return
            size, start = len(blob.data), 0
            rng = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
            headers = {"Accept-Ranges": "bytes", "Content-Type": "application/octet-stream",
                       "ETag": f'"{blob.advertised_sha256}"'}
            if rng:
                start = int(rng[1])
                headers["Content-Range"] = f"bytes {start}-{size - 1}/{size}"
            body = blob.data[start:]
            if blob.cut_after is not None and blob.cuts > 0 and self.command == "GET":
                blob.cuts -= 1
                # announce the whole rest, send part of it, then drop the connection
                self._send(206 if rng else 200, b"", headers, length=len(body))
                self.wfile.write(body[: max(blob.cut_after - start, 0)])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self._send(206 if rng else 200, body, headers)

    return Handler


@contextmanager
def serve(hub: FakeHub | None = None) -> Iterator[FakeHub]:
    """The hub and its CDN, each on a free loopback port, for the length of the block."""
    hub = hub or FakeHub()
    servers = []
    for host in ("hub", "cdn"):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub, host))
        srv.daemon_threads = True
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        url = f"http://127.0.0.1:{srv.server_address[1]}"
        if host == "hub":
            hub.hub_url = url
        else:
            hub.cdn_url = url
    try:
        yield hub
    finally:
        for srv in servers:
            srv.shutdown()
            srv.server_close()
