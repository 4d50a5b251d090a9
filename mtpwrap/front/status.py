"""The status page for the people who run the machine: `/status` (HTML, a little script, no
framework, refreshing itself every few seconds from `/status.json`) and `/status.json`.

It shows the state, the model and profile, slots busy, the queue by class, tokens/s over the
last minute, each companion (embedding, rerank) with its state, each key's usage today, the
last refusals, the last prompts read again with their cause and its fix (front/rereads.py: no
text), and GPU memory and temperature (NVML).
Both need a key with the `metrics` or `admin` scope; a browser may give it as the password of
HTTP Basic authentication (the page's 401 asks for it), so the page works without a plugin.
The page's script writes text only (`textContent`), never markup, and a Content-Security-Policy
allows exactly its own script and style.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response

from mtpwrap.front.gpu import GpuView
from mtpwrap.front.ops import admin_asks, gpu_rows
from mtpwrap.front.reads import Read
from mtpwrap.supervision import instance

if TYPE_CHECKING:
    from mtpwrap.front.app import Front

REFRESH_S = 3

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1b1b1b;background:#fafafa}
h1{font-size:1.3em;margin:0 0 .2em}h2{font-size:1.05em;margin:1.2em 0 .3em}
table{border-collapse:collapse;min-width:24em}td,th{padding:.2em .8em;text-align:left;
border-bottom:1px solid #ddd}th{background:#eee}td.n{text-align:right;font-variant:tabular-nums}
.state{font-weight:bold;padding:.1em .5em;border-radius:3px;background:#ddd}
.ready{background:#cfe8cf}.starting,.backoff,.draining{background:#f3e2b3}.failed{background:#f2c4c4}
#when{color:#666}
"""

_SCRIPT = """
"use strict";
const $ = (id) => document.getElementById(id);
function cell(row, text, numeric) {
  const td = row.insertCell();
  td.textContent = text === null || text === undefined ? "-" : String(text);
  if (numeric) td.className = "n";
}
function fill(id, rows, columns) {
  const body = $(id);
  body.replaceChildren();
  for (const r of rows) {
    const tr = body.insertRow();
    for (const [name, numeric] of columns) cell(tr, r[name], numeric);
  }
  if (!rows.length) cell(body.insertRow(), "none");
}
function mib(b) { return b === null || b === undefined ? null : (b / 1048576).toFixed(0); }
async function refresh() {
  try {
    const r = await fetch("status.json", {cache: "no-store", credentials: "same-origin"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    const st = $("state");
    st.textContent = s.state + (s.reason ? " (" + s.reason + ")" : "");
    st.className = "state " + s.state;
    $("model").textContent = s.model || "-";
    $("profile").textContent = s.profile || "-";
    $("slots").textContent = s.slots.busy + " of " + s.slots.total;
    $("queue").textContent = s.queue.interactive + " interactive, " + s.queue.batch + " batch";
    $("tps").textContent = s.tokens_per_s.toFixed(1);
    $("documents").textContent = s.documents ? s.documents.summary : "-";
    $("store").textContent = s.store ? s.store.states + " kept, " + (s.store.bytes / 2 ** 30)
      .toFixed(2) + " GiB; " + s.store.restored + " restored, " + s.store.saved + " saved" : "off";
    $("warmed").textContent = s.warmed.length ? s.warmed.map((w) => w.name + " (" +
      w.tokens + " tokens)").join(", ") : "none";
    $("reads").textContent = s.reads.length ? s.reads.map((r) => "slot " + r.slot + ": " +
      r.done + (r.total === null ? "" : " of " + r.total) + " tokens" +
      (r.rate === null ? "" : ", " + Math.round(r.rate) + " tokens/s") +
      (r.eta_s === null ? "" : ", " + Math.ceil(r.eta_s) + " s left")).join("; ") : "none";
    $("command").textContent = s.command ? s.command.argv.join(" ") : "(an admin key shows it)";
    fill("companions", s.companions, [["name"], ["role"], ["state"], ["restarts", 1],
         ["forwarding", 1], ["queued", 1]]);
    fill("usage", s.usage_today, [["key"], ["requests", 1], ["refused", 1],
         ["prompt_tokens", 1], ["completion_tokens", 1]]);
    fill("refusals", s.refusals, [["time"], ["key"], ["route"], ["status", 1], ["reason"]]);
    fill("rereads", s.rereads, [["time"], ["key"], ["reread_tokens", 1], ["reread_cause"],
         ["fix"]]);
    fill("gpus", s.gpus.map((g) => ({name: g.index + ": " + (g.name || "GPU"),
         used: mib(g.memory_used_bytes), total: mib(g.memory_total_bytes),
         temp: g.temperature_c})), [["name"], ["used", 1], ["total", 1], ["temp", 1]]);
    $("when").textContent = "updated " + new Date().toLocaleTimeString();
    document.body.dataset.loaded = "1";
  } catch (err) {
    $("when").textContent = "could not update: " + err.message;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
""".replace("REFRESH_MS", str(REFRESH_S * 1000))

_HTML = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>mtpwrap status</title>
<meta name="viewport" content="width=device-width,initial-scale=1">
<style>{_STYLE}</style></head>
<body>
<h1>mtpwrap <span id="state" class="state">…</span></h1>
<div id="when"></div>
<table><tbody>
<tr><th>model</th><td id="model"></td></tr>
<tr><th>profile</th><td id="profile"></td></tr>
<tr><th>slots busy</th><td id="slots"></td></tr>
<tr><th>queued</th><td id="queue"></td></tr>
<tr><th>tokens/s (last minute)</th><td id="tps" class="n"></td></tr>
<tr><th>documents</th><td id="documents"></td></tr>
<tr><th>document store</th><td id="store"></td></tr>
<tr><th>reading now</th><td id="reads"></td></tr>
<tr><th>read in ahead</th><td id="warmed"></td></tr>
<tr><th>llama-server runs</th><td id="command"></td></tr>
</tbody></table>
<h2>Companions</h2>
<table><thead><tr><th>name</th><th>role</th><th>state</th><th>restarts</th><th>computing</th>
<th>queued</th></tr></thead><tbody id="companions"></tbody></table>
<h2>Usage today (UTC)</h2>
<table><thead><tr><th>key</th><th>requests</th><th>refused</th><th>prompt tokens</th>
<th>completion tokens</th></tr></thead><tbody id="usage"></tbody></table>
<h2>Last refusals</h2>
<table><thead><tr><th>time</th><th>key</th><th>route</th><th>status</th><th>reason</th></tr>
</thead><tbody id="refusals"></tbody></table>
<h2>Prompts read again</h2>
<table><thead><tr><th>time</th><th>key</th><th>tokens</th><th>cause</th><th>fix</th></tr>
</thead><tbody id="rereads"></tbody></table>
<h2>GPUs</h2>
<table><thead><tr><th>GPU</th><th>MiB used</th><th>MiB total</th><th>°C</th></tr></thead>
<tbody id="gpus"></tbody></table>
<script>{_SCRIPT}</script>
</body></html>
"""


def _sha(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


_CSP = (f"default-src 'none'; script-src {_sha(_SCRIPT)}; style-src {_sha(_STYLE)}; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'")
_HEADERS = {"cache-control": "no-store", "content-security-policy": _CSP,
            "x-content-type-options": "nosniff", "referrer-policy": "no-referrer"}


def document(front: Front, gpu: GpuView, reads: list[Read]) -> dict[str, Any]:
    st = front.supervisor.status()
    info = front.info
    trail = front.trail
    return {
        "time": time.time(), "state": st.state.value, "reason": st.reason,
        "model": info.model, "profile": info.profile, "context": info.context,
        "documents": info.documents,
        "store": front.documents.summary() if front.documents is not None else None,
        # each prompt llama-server is reading: tokens done of total, rate, time left
        "reads": [r.to_dict() for r in reads],
        "slots": {"busy": front.forwarding, "total": front.config.max_concurrency},
        "queue": front.admission.gate.waiting(),
        "tokens_per_s": round(trail.tokens_per_s(), 2),
        "usage_today": trail.usage_today(),
        "refusals": list(reversed(trail.refusals)),
        # the last requests that read much of their prompt again, and why (no text)
        "rereads": list(reversed(trail.rereads.recent)) if trail.rereads else [],
        "companions": [c.health() for c in front.routes.companions],
        "gpus": gpu_rows(gpu),
        "gpu_read": gpu.to_dict(),
        # the command llama-server runs: for an admin only (ops.admin_asks)
        "command": st.command if admin_asks(front) else None,
    }


def make_pages(front: Front) -> tuple[Any, Any]:
    async def page(_request: Request) -> Response:
        return HTMLResponse(_HTML, headers=_HEADERS)

    async def data(_request: Request) -> Response:
        doc = document(front, await front.gpu.view(), await front.reads.sample())
        # what `mtpwrap documents warm` read in (its record, read off the loop; never text)
        doc["warmed"] = [{k: e.get(k) for k in ("name", "sha256", "tokens", "warmed_at")}
                         for e in await asyncio.to_thread(instance.read_warmed)]
        return JSONResponse(doc, headers={"cache-control": "no-store"})

    return page, data
