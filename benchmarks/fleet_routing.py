"""Fleet routing: the tokens each question re-reads of its document, by how HAProxy picks a node.

Three nodes on loopback, each one `mtpwrap up` with one llama-server of one slot and one thread
(the tiny hybrid qwen35 with its MTP head, 32K context), behind the real HAProxy configured by
`mtpwrap fleet haproxy`. Three users, each with a document of its own (~8K tokens, distinct
text), ask four questions each as one growing conversation, interleaved: every round each user
asks once, in an order shuffled per round with a fixed seed (the same order for every policy).
Each user sends its own chat id in `X-OpenWebUI-Chat-Id`, as Open WebUI does with
ENABLE_FORWARD_USER_INFO_HEADERS=true. The requests go one at a time, with the `openai` client.

Policies, each on fresh nodes (empty slots, RAM caches and stores):

- leastconn: `--affinity-header none` (the configuration before affinity was the default);
- affinity: the stick table on the chat id (`mtpwrap fleet haproxy`'s default): a chat's first
  request goes by leastconn, the next ones to the node that served it;
- hash: the rendered configuration with `balance hdr(X-OpenWebUI-Chat-Id)` and `hash-type
  consistent` in place of leastconn and the stick table (not something `mtpwrap fleet`
  renders: the candidate measured against it);
- each `+shared`: the same with one `persist.dir` for the three nodes, as a network mount
  gives several machines, so a node restores a document another node read;
- each `+stop`: after the second round, node n1 is stopped as `systemctl stop` does (SIGTERM:
  it drains and exits), and the next rounds begin once HAProxy has it DOWN: its chat moves.

"re-read" is llama-server's own `timings.prompt_n` of each answer: the prompt tokens it computed.
A first question reads its document whole on every policy; what differs is the three after it.

    nice -n 10 .venv/bin/python benchmarks/fleet_routing.py [--policies leastconn,affinity,...]
        [--order shuffled|round-robin] [--seed 3] [--binary PATH]
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import openai  # noqa: E402
import yaml  # noqa: E402

from mtpwrap.front.audit import read_records  # noqa: E402
from mtpwrap.proc import free_loopback_port  # noqa: E402
from tests.fleet_harness import start_haproxy, stop  # noqa: E402
from tests.helpers import Instance, run_cli, tiny_hybrid_profile, wait_for  # noqa: E402

HEADER = "X-OpenWebUI-Chat-Id"
USERS = ("alice", "bob", "carol")
DOCS = {"alice": "Alpha", "bob": "Bravo", "carol": "Charlie"}
QUESTIONS = ("Which clause names day 9?", "Who delivers item 70?",
             "What is due on day 3?", "Name the last clause.")
POLICIES = ("leastconn", "leastconn+shared", "affinity", "affinity+shared", "hash", "hash+shared",
            "affinity+stop", "affinity+shared+stop")
#: the node stopped after the second round in a `+stop` policy: the one that read first
STOPPED = "n1"


def document(name: str, clauses: int = 200) -> str:
    """About 8K tokens of contract, different for each name (tests/test_documents_real.py)."""
    return " ".join(f"{name} clause {i}: the party of part {i % 5} shall deliver item {i * 7} "
                    f"by day {i % 28 + 1}." for i in range(clauses))


def haproxy_config(policy: str, nodes: dict[str, Instance], port: int, stats: int,
                   out: Path) -> None:
    """haproxy.cfg for `policy` from `mtpwrap fleet haproxy` (hash: edited from it)."""
    base = policy.split("+")[0]
    flags = [f"{name}=127.0.0.1:{inst.port},slots=1" for name, inst in nodes.items()]
    extra = ["--affinity-header", "none"] if base == "leastconn" else []
    r = run_cli("fleet", "haproxy", *flags, "--bind", f"127.0.0.1:{port}", "--metrics-bind",
                "none", "--stats-bind", f"127.0.0.1:{stats}", *extra, "--check", "-o", str(out))
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    if base == "hash":  # the candidate: consistent hashing of the header instead of the table
        lines = [ln for ln in text.splitlines()
                 if not ln.lstrip().startswith(("stick", "# A chat (", "# document while"))]
        text = "\n".join(lines).replace(
            "    balance leastconn",
            f"    balance hdr({HEADER})\n    hash-type consistent") + "\n"
        assert "stick" not in text, text
        out.write_text(text)
    assert ("stick on" in text) == (base == "affinity"), text


def run_policy(policy: str, work: Path, binary: Path, profile: Path, model: Path,
               orders: list[list[str]]) -> dict[str, Any]:
    work.mkdir(parents=True)
    env = {"MTPWRAP_PERSIST_DIR": str(work / "shared-store")} if "+shared" in policy else {}
    nodes = {f"n{i}": Instance(work / f"n{i}", free_loopback_port(), binary, model,
                               log=work / f"n{i}.log", profile=str(profile), **env)
             for i in (1, 2, 3)}
    haproxy = None
    try:
        for inst in nodes.values():
            inst.wait_ready(240)
        port, stats = free_loopback_port(), free_loopback_port()
        cfg = work / "haproxy.cfg"
        haproxy_config(policy, nodes, port, stats, cfg)
        haproxy = start_haproxy(cfg, work / "haproxy.log",
                                f"http://127.0.0.1:{port}/haproxy-livez")

        def status() -> dict[str, str]:
            text = httpx.get(f"http://127.0.0.1:{stats}/stats;csv", timeout=5).text
            return {r["svname"]: r["status"] for r in csv.DictReader(io.StringIO(text.lstrip("# ")))
                    if r["pxname"] == "mtpwrap" and r["svname"] in nodes}

        wait_for("HAProxy sees every node UP", lambda: set(status().values()) == {"UP"}, 30)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        chats: dict[str, list[dict[str, str]]] = {u: [] for u in USERS}
        rows: list[dict[str, Any]] = []
        t0 = time.monotonic()
        for rnd, order in enumerate(orders):
            if rnd == 2 and policy.endswith("+stop"):
                nodes[STOPPED].stop(60)
                wait_for(f"HAProxy takes {STOPPED} out",
                         lambda: status()[STOPPED].startswith("DOWN"), 30)
            for user in order:
                msgs = chats[user]
                q = QUESTIONS[rnd]
                msgs.append({"role": "user", "content": (
                    f"{document(DOCS[user])}\n\nQuestion: {q}" if rnd == 0 else q)})
                t = time.monotonic()
                raw = client.chat.completions.with_raw_response.create(
                    model="tiny", messages=msgs, max_tokens=1, temperature=0,  # type: ignore[arg-type]
                    extra_headers={HEADER: f"chat-{user}", "X-OpenWebUI-User-Id": user})
                answer = raw.parse()
                timings = (answer.model_extra or {})["timings"]
                assert answer.usage is not None
                msgs.append({"role": "assistant",
                             "content": answer.choices[0].message.content or ""})
                rows.append({"round": rnd, "user": user, "node": raw.headers["x-mtpwrap-node"],
                             "read": int(timings["prompt_n"]),
                             "prompt": int(answer.usage.prompt_tokens),
                             "s": time.monotonic() - t})
        wall = time.monotonic() - t0
        restores = sum(1 for inst in nodes.values()
                       for rec in read_records(inst.home / "audit") if rec.get("restored"))
        return {"rows": rows, "wall": wall, "restores": restores}
    finally:
        stop(haproxy)
        for inst in nodes.values():
            inst.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--order", choices=("shuffled", "round-robin"), default="shuffled")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--binary", type=Path)
    args = ap.parse_args()
    policies = [p for p in args.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        ap.error(f"unknown policies {bad}; known: {', '.join(POLICIES)}")
    binary = args.binary or Path(os.environ.get("MTPWRAP_BINARY", ""))
    if not args.binary and not os.environ.get("MTPWRAP_BINARY"):
        from mtpwrap.build import builder

        binary = Path(builder.ensure_built(variant="cpu").to_dict()
                      ["binaries"]["llama-server"]["path"])
    rng = random.Random(args.seed)
    orders = []
    for _ in QUESTIONS:
        order = list(USERS)
        if args.order == "shuffled":
            rng.shuffle(order)
        orders.append(order)

    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text()
                .splitlines() if ln.startswith("model name")), platform.processor())
    load0 = os.getloadavg()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="mtpwrap-fleet-routing-") as tmp:
        work = Path(tmp)
        profile = tiny_hybrid_profile(work, "tiny-fleet")
        model = Path(yaml.safe_load(profile.read_text())["model"])
        for policy in policies:
            t = time.monotonic()
            results[policy] = run_policy(policy, work / policy.replace("+", "-"), binary,
                                         profile, model, orders)
            print(f"{policy}: done in {time.monotonic() - t:.0f} s", file=sys.stderr)
    load1 = os.getloadavg()

    print(f"\nmachine: {cpu}, {os.cpu_count()} cores; load average before "
          f"{' '.join(f'{x:.2f}' for x in load0)}, after {' '.join(f'{x:.2f}' for x in load1)}")
    print(f"order of each round ({args.order}, seed {args.seed}): "
          + " | ".join(" ".join(o) for o in orders))
    print("tokens re-read per question (node that answered)\n")
    width = 22
    print(f"{'question':<16}" + "".join(f"{p:>{width}}" for p in policies))
    first = results[policies[0]]["rows"]
    for i, row in enumerate(first):
        label = f"{row['user']} q{row['round'] + 1}"
        cells = []
        for p in policies:
            r = results[p]["rows"][i]
            cells.append(f"{r['read']:>{width - 5}} ({r['node']})")
        print(f"{label:<16}" + "".join(f"{c:>{width}}" for c in cells))

    def total(p: str, later: bool) -> int:
        return sum(r["read"] for r in results[p]["rows"] if not later or r["round"] > 0)

    print(f"{'total':<16}" + "".join(f"{total(p, False):>{width}}" for p in policies))
    print(f"{'q2-q4 total':<16}" + "".join(f"{total(p, True):>{width}}" for p in policies))
    print(f"{'q2-q4 worst':<16}" + "".join(
        f"{max(r['read'] for r in results[p]['rows'] if r['round'] > 0):>{width}}"
        for p in policies))
    print(f"{'restores':<16}" + "".join(f"{results[p]['restores']:>{width}}" for p in policies))
    print(f"{'nodes used':<16}" + "".join(
        f"{len({r['node'] for r in results[p]['rows']}):>{width}}" for p in policies))
    print(f"{'wall s':<16}" + "".join(f"{results[p]['wall']:>{width}.1f}" for p in policies))


if __name__ == "__main__":
    main()
