"""The draft-depth probe on the patched and the unpatched build of the same source, side by side.

`make test` checks the probe against the patched llama-server and the same binary with the field
taken out of every request (tests/test_spec_depth_real.py); compiling the unpatched build is too
long for a test (about 12 minutes on 2 cores), so the real comparison is here. The unpatched build
is compiled once into the build cache (`install=False`: build/cpu/ keeps the patched one) and then
reused.

    python benchmarks/spec_depth_unpatched.py [--model PATH]

Prints one row per build: its patches, the verdict, and `timings.draft_n` without the field and
with `speculative.n_max: 0`. Exits 1 when the verdicts are not honoured and ignored.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtpwrap.build import builder, spec_probe
from mtpwrap.models import known


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="GGUF (default: the demo model)")
    args = ap.parse_args()
    model = args.model or known.ensure_demo_model()
    rows = []
    for label, no_patches in (("patched", False), ("unpatched", True)):
        manifest, reused, _ = builder.build(cpu=True, no_patches=no_patches, install=False)
        server = Path(manifest.binaries["llama-server"]["cache_path"])
        found = spec_probe.probe(server, model)
        patches = ", ".join(f"{p['name']} {p['status']}" for p in manifest.patches or []) or "-"
        rows.append((label, found, patches, "cached" if reused else "built"))
    print(f"model: {model}")
    print(f"{'build':<10} {'verdict':<9} {'draft_n':>8} {'n_max 0':>8}  patches")
    for label, found, patches, how in rows:
        d = found.get("draft_n") or {}
        print(f"{label:<10} {found['status']:<9} {d.get('default', '-'):>8} "
              f"{d.get('n_max_0', '-'):>8}  {patches} ({how})")
    ok = [r[1]["status"] for r in rows] == ["honoured", "ignored"]
    print("verdicts as expected" if ok else "verdicts NOT as expected: honoured, ignored")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
