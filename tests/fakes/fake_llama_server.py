#!/usr/bin/env python3
"""A small stand-in for llama-server that can misbehave on demand (standard library only).

Same shape as the real server where the supervisor and the front look: `--host`, `--port`,
`--api-key` or `LLAMA_API_KEY` from the environment, `/health` 503 "Loading model" then 200,
`/completion` and `/v1/chat/completions` (plain JSON and SSE streaming), `/v1/models`, `/metrics`
(Prometheus text with `llamacpp:*` counters), log lines like `loading model` / `model loaded` /
`server is listening on http://HOST:PORT`, graceful exit on SIGTERM/SIGINT.

Faults come from `--fault KEY=VALUE` (repeatable) or `FAKE_LLAMA_FAULTS="KEY=VALUE,KEY=VALUE"`:

  exit=N               exit at once with code N (before binding the port)
  segv=1               die of SIGSEGV at once, as a crashing binary does
  generate_fail=1      /health says 200, but every completion answers 500 (a model that
                       loads and cannot generate); these requests are not logged
  load_s=S             take S seconds to load (default 0), printing a progress line every
                       progress_s (default 0.2) unless silent_load=1
  silent_load=1        print nothing while loading (a load that looks stuck)
  hold_until=PATH      go on loading (with load_s's progress lines) until PATH exists, and
                       for load_s at least (a test pins "still loading" as long as it needs)
  oom=1                print a CUDA out-of-memory message while loading and exit 1
  crash_after_chunks=N SIGKILL itself after N streamed chunks
  wedge_after_chunks=N stop producing tokens after N streamed chunks; /health stays 200 and
                       /metrics stops counting decodes
  busy_s=S             before answering a completion, compute on the CPU for S seconds
                       without counting a decode (one long prompt batch on a slow CPU)
  ignore_sigterm=1     ignore SIGTERM (and SIGINT)
  grandchild=1         spawn a sleeping grandchild in the same process group; its pid is
                       printed as `grandchild pid N`
  rss_mb=M             allocate M MiB at start
  grow_mb_per_s=M      keep allocating M MiB per second while serving
  token_delay_s=S      delay between streamed tokens (default 0.01)
  stream_hold=PATH     a streamed answer stops after its first chunk until PATH exists (a
                       test pins "the stream is still open" as long as it needs)
  counter=PATH         count starts in PATH; with fault_starts=K the faults above apply only
                       to the first K starts (a crash that goes away after a restart)
  later_hold=PATH      with fault_starts=K: each start after the first K loads until PATH
                       exists (hold_until=PATH for the restarts, not the first K starts)

Run: `python tests/fakes/fake_llama_server.py --host 127.0.0.1 --port 8080`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

OPEN_PATHS = {"/health", "/v1/health", "/models", "/v1/models", "/"}
WORDS = ["The", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", "."]


def log(msg: str) -> None:
    sys.stdout.write(f"0.00.{int(time.monotonic() * 1000) % 1000:03d}.000 I {msg}\n")
    sys.stdout.flush()


def parse_faults(items: list[str]) -> dict[str, str]:
    raw = [p for p in os.environ.get("FAKE_LLAMA_FAULTS", "").split(",") if p.strip()]
    faults: dict[str, str] = {}
    for item in raw + items:
        key, _, value = item.partition("=")
        faults[key.strip()] = value.strip() or "1"
    return faults


class State:
    def __init__(self, faults: dict[str, str]) -> None:
        self.faults = faults
        self.loaded = False
        self.lock = threading.Lock()
        self.n_decode = 0
        self.tokens_predicted = 0
        self.prompt_tokens = 0
        self.processing = 0
        self.wedged = False
        self.ballast: list[bytearray] = []

    def num(self, key: str, default: float = 0.0) -> float:
        return float(self.faults.get(key, default))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "fake-llama-server"
    st: State
    api_key: str | None

    def log_message(self, format: str, *args: Any) -> None:
        if self.path.split("?")[0] in ("/health", "/v1/health", "/metrics"):
            return  # like llama-server: polling endpoints are not logged
        if self.st.faults.get("generate_fail"):
            return  # the supervisor's load-stall timer must not see progress in these
        status = args[1] if len(args) > 1 else ""
        log(f"srv  log_server_r: request: {self.command} {self.path} {status}")

    # --- helpers -------------------------------------------------------------------------
    def _json(self, code: int, body: Any) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json; charset=utf-8")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _authorized(self) -> bool:
        if not self.api_key or self.path.split("?")[0] in OPEN_PATHS:
            return True
        return self.headers.get("Authorization", "") == f"Bearer {self.api_key}"

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    # --- routes --------------------------------------------------------------------------
    def do_GET(self) -> None:
        path = self.path.split("?")[0]
        if path in ("/health", "/v1/health"):
            if not self.st.loaded:
                self._json(503, {"error": {"message": "Loading model", "type": "unavailable_error",
                                           "code": 503}})
            else:
                self._json(200, {"status": "ok"})
            return
        if not self._authorized():
            self._json(401, {"error": {"message": "Invalid API Key", "type": "authentication_error",
                                       "code": 401}})
            return
        if path in ("/v1/models", "/models"):
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        elif path == "/metrics":
            st = self.st
            body = "".join(
                f"# TYPE llamacpp:{k} {t}\nllamacpp:{k} {v}\n"
                for k, t, v in (
                    ("prompt_tokens_total", "counter", st.prompt_tokens),
                    ("tokens_predicted_total", "counter", st.tokens_predicted),
                    ("n_decode_total", "counter", st.n_decode),
                    ("requests_processing", "gauge", st.processing),
                    ("requests_deferred", "gauge", 0),
                )
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self._json(404, {"error": {"message": "File Not Found", "type": "not_found_error",
                                       "code": 404}})

    def do_POST(self) -> None:
        path = self.path.split("?")[0]
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b"{}"
        if not self.st.loaded:
            self._json(503, {"error": {"message": "Loading model", "type": "unavailable_error",
                                       "code": 503}})
            return
        if not self._authorized():
            self._json(401, {"error": {"message": "Invalid API Key", "type": "authentication_error",
                                       "code": 401}})
            return
        try:
            req = json.loads(raw or b"{}")
        except ValueError:
            self._json(400, {"error": {"message": "invalid JSON", "type": "invalid_request_error",
                                       "code": 400}})
            return
        if self.st.faults.get("generate_fail"):
            self._json(500, {"error": {"message": "fault: generation fails",
                                       "type": "server_error", "code": 500}})
            return
        chat = path in ("/v1/chat/completions", "/chat/completions")
        if path not in ("/completion", "/completions", "/v1/completions") and not chat:
            self._json(404, {"error": {"message": "File Not Found", "type": "not_found_error",
                                       "code": 404}})
            return
        n = int(req.get("max_tokens") or req.get("n_predict") or 16)
        if n < 0:
            n = 16
        with self.st.lock:
            self.st.processing += 1
            self.st.prompt_tokens += 4
            self.st.n_decode += 1
        try:
            busy_until = time.monotonic() + self.st.num("busy_s")
            while time.monotonic() < busy_until:
                sum(range(10_000))  # CPU work, no decode counted
            if req.get("stream"):
                self._stream(chat, n)
            else:
                self._whole(chat, n)
        finally:
            with self.st.lock:
                self.st.processing -= 1

    def _tokens(self, n: int) -> list[str]:
        return [WORDS[i % len(WORDS)] for i in range(n)]

    def _whole(self, chat: bool, n: int) -> None:
        if self.st.wedged:
            while True:
                time.sleep(3600)  # the fault: a wedged child never answers
        text = "".join(self._tokens(n))
        with self.st.lock:
            self.st.tokens_predicted += n
            self.st.n_decode += n
        usage = {"prompt_tokens": 4, "completion_tokens": n, "total_tokens": 4 + n}
        if chat:
            self._json(200, {"id": "chatcmpl-fake", "object": "chat.completion", "model": "fake",
                             "created": int(time.time()),
                             "choices": [{"index": 0, "finish_reason": "length",
                                          "message": {"role": "assistant", "content": text}}],
                             "usage": usage})
        else:
            self._json(200, {"content": text, "tokens_predicted": n, "stop": True,
                             "model": "fake", "timings": {"predicted_n": n}})

    def _stream(self, chat: bool, n: int) -> None:
        st = self.st
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        crash_at = int(st.num("crash_after_chunks", -1))
        wedge_at = int(st.num("wedge_after_chunks", -1))
        delay = st.num("token_delay_s", 0.01)
        hold = st.faults.get("stream_hold")
        for i, tok in enumerate(self._tokens(n)):
            while i == 1 and hold and not os.path.exists(hold):
                time.sleep(0.02)  # held by the test, not a pace
            if i == crash_at:
                log("srv  fault: crashing (SIGKILL self)")
                os.kill(os.getpid(), signal.SIGKILL)
            if i == wedge_at or st.wedged:
                st.wedged = True
                log("srv  fault: wedged, no more tokens")
                while True:
                    time.sleep(3600)  # the fault: no more tokens, ever
            if chat:
                ev = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake",
                      "created": int(time.time()),
                      "choices": [{"index": 0, "delta": {"content": tok}, "finish_reason": None}]}
            else:
                ev = {"content": tok, "stop": False}
            self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
            with st.lock:
                st.tokens_predicted += 1
                st.n_decode += 1
            time.sleep(delay)  # the fake's pace between tokens
        if chat:
            ev = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "model": "fake",
                  "created": int(time.time()),
                  "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
            self._chunk(b"data: " + json.dumps(ev).encode() + b"\n\n")
            self._chunk(b"data: [DONE]\n\n")
        else:
            self._chunk(b"data: " + json.dumps({"content": "", "stop": True}).encode() + b"\n\n")
        self._chunk(b"")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="fake llama-server")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--fault", action="append", default=[])
    ap.add_argument("-m", "--model", default=None)
    args, _unknown = ap.parse_known_args(argv)
    faults = parse_faults(args.fault)

    counter = faults.get("counter")
    if counter:
        try:
            starts = int(open(counter).read().strip() or 0) + 1  # noqa: SIM115
        except (OSError, ValueError):
            starts = 1
        with open(counter, "w") as fh:
            fh.write(str(starts))
        if starts > int(faults.get("fault_starts", 1 << 30)):
            hold = faults.get("later_hold")
            faults = {k: v for k, v in faults.items() if k in ("counter", "token_delay_s")}
            if hold:
                faults["hold_until"] = hold

    st = State(faults)
    log(f"main: fake llama-server pid {os.getpid()} starting")
    if faults.get("segv"):
        log("main: fault: SIGSEGV")
        os.kill(os.getpid(), signal.SIGSEGV)
    if "exit" in faults:
        log(f"main: fault: exiting with code {faults['exit']}")
        return int(faults["exit"])
    if faults.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if faults.get("grandchild"):
        gc = subprocess.Popen([sys.executable, "-c",
                               "import time; time.sleep(3600)  # alive until its group is killed"])
        log(f"main: grandchild pid {gc.pid}")
    if "rss_mb" in faults:
        st.ballast.append(bytearray(os.urandom(1)) * int(float(faults["rss_mb"]) * 2**20))

    Handler.st = st
    Handler.api_key = args.api_key or os.environ.get("LLAMA_API_KEY") or None
    try:
        httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    except OSError as exc:
        log(f"srv    start: couldn't bind HTTP server socket, hostname: {args.host}, "
            f"port: {args.port}: {exc}")
        return 1
    httpd.daemon_threads = True
    log(f"srv  start: server is listening on http://{args.host}:{args.port} - starting main loop")
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    stop = threading.Event()
    if not faults.get("ignore_sigterm"):
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())

    log("llama_model_load: loading model")
    if faults.get("oom"):
        time.sleep(0.05)  # the fake's load pace: a moment of loading, then the failure
        log("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 20480.00 MiB on device 0: "
            "cudaMalloc failed: out of memory")
        log("llama_model_load: error loading model: unable to allocate CUDA0 buffer")
        return 1
    load_s = st.num("load_s", 0.0)
    progress_s = st.num("progress_s", 0.2)
    hold = st.faults.get("hold_until")
    t0 = time.monotonic()
    while not stop.is_set():
        took = time.monotonic() - t0
        if took >= load_s and not (hold and not os.path.exists(hold)):
            break
        if not faults.get("silent_load"):
            pct = min(99, int(100 * took / load_s)) if load_s else 0
            log(f"load_tensors: loading model tensors ... {pct}%")
        time.sleep(min(progress_s, load_s) if took < load_s else progress_s)  # the load's pace
    st.loaded = True
    log("main: model loaded")
    oom_after = st.num("oom_after_s", 0.0)
    if oom_after:  # out of memory while serving (a long request), not while loading
        time.sleep(oom_after)  # the fault: serving for a while, then out of memory
        log("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0: "
            "cudaMalloc failed: out of memory")
        return 1

    grow = st.num("grow_mb_per_s", 0.0)
    while not stop.is_set():
        if grow:
            st.ballast.append(bytearray(os.urandom(1)) * int(grow * 2**20 / 10))
        stop.wait(0.1)
    log("srv    operator(): cleaning up before exit...")
    httpd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
