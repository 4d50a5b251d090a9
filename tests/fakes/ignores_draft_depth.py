#!/usr/bin/env python3
"""A llama-server that ignores a request's own draft depth, as an unpatched build does: the real
binary behind a small HTTP relay that drops every `speculative.*` key from JSON bodies.

Run as `ignores_draft_depth.py REAL_BINARY ARGS…`. `--help` prints the real binary's help with
its `--host` entry from before socket support (so callers listen on loopback TCP); otherwise the
real binary is started with the same arguments on another loopback port and this process
listens on the `--host`/`--port` it was given, relaying each request (standard library only).
SIGTERM and SIGINT are passed on; this process exits with the real server's status.
"""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers import without_socket_help

HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _strip(body: bytes) -> bytes:
    try:
        doc = json.loads(body)
    except ValueError:
        return body
    if not isinstance(doc, dict):
        return body
    return json.dumps({k: v for k, v in doc.items() if not k.startswith("speculative.")}).encode()


def _handler(upstream_port: int) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            body = _strip(self.rfile.read(length)) if length else b""
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=600)
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            conn.request(self.command, self.path, body=body or None, headers=headers)
            answer = conn.getresponse()
            data = answer.read()
            self.send_response(answer.status)
            for k, v in answer.getheaders():
                if k.lower() not in HOP:
                    self.send_header(k, v)
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            conn.close()

        do_GET = do_POST = do_PUT = do_DELETE = _relay

        def log_message(self, format: str, *args: object) -> None:
            pass

    return Relay


def main(argv: list[str]) -> int:
    real, args = argv[0], argv[1:]
    if "--help" in args:
        text = subprocess.run([real, "--help"], capture_output=True, text=True,
                              check=True).stdout
        sys.stdout.write(without_socket_help(text))
        return 0
    host = args[args.index("--host") + 1] if "--host" in args else "127.0.0.1"
    port = int(args[args.index("--port") + 1]) if "--port" in args else 8080
    inner = _free_port()
    rest = list(args)
    if "--port" in rest:
        rest[rest.index("--port") + 1] = str(inner)
    else:
        rest += ["--port", str(inner)]
    if "--host" in rest:
        rest[rest.index("--host") + 1] = "127.0.0.1"
    child = subprocess.Popen([real, *rest])
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda s, _f: child.send_signal(s))
    server = ThreadingHTTPServer((host, port), _handler(inner))
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = child.wait()
    server.shutdown()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
