"""The seed corpus: one JSON file per case in tests/fuzz/seeds/, replayed as regression tests.

A seed file holds the route, the body (`body`: a JSON value, sent as compact JSON; or
`body_text`: the exact text; or `body_hex`: the exact bytes; `body_repeat` builds a large body
from a pattern: `{"pattern": "(", "times": 60000, "prefix": …, "suffix": …}`), the status class
the front must answer (`expect`: "4xx" or "2xx"), an optional `needle` the error message must
hold, `why` (the trap, and where it was reported), and `what` when the campaign found it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SEEDS = Path(__file__).resolve().parent / "seeds"


@dataclass(frozen=True)
class Seed:
    name: str
    route: str
    body: bytes
    expect: str
    needle: str
    why: str


def body_of(doc: dict[str, Any]) -> bytes:
    if "body_hex" in doc:
        return bytes.fromhex(doc["body_hex"])
    if "body_text" in doc:
        return str(doc["body_text"]).encode("utf-8", "surrogatepass")
    if "body_repeat" in doc:
        r = doc["body_repeat"]
        return (r.get("prefix", "") + r["pattern"] * int(r["times"]) + r.get("middle", "")
                + r.get("close", "") * int(r["times"]) + r.get("suffix", "")).encode()
    if "body" in doc:
        return json.dumps(doc["body"], separators=(",", ":"), ensure_ascii=False).encode(
            "utf-8", "surrogatepass")
    return b""


def load(folder: Path = SEEDS) -> list[Seed]:
    out = []
    for f in sorted(folder.glob("*.json")):
        doc = json.loads(f.read_text(encoding="utf-8"))
        out.append(Seed(f.stem, doc["route"], body_of(doc), doc.get("expect", "4xx"),
                        doc.get("needle", ""), doc.get("why", "")))
    return out


def save_found(folder: Path, klass: str, seed: dict[str, Any]) -> Path:
    """Write a failure the campaign found (shrunk) as a new seed; returns its path."""
    slug = re.sub(r"[^a-z0-9]+", "-", klass.lower()).strip("-")[:60] or "case"
    path = folder / f"found-{slug}.json"
    doc = {"expect": "4xx", **seed, "why": f"found by the campaign: {klass}"}
    path.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path
