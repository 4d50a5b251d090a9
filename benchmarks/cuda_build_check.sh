#!/usr/bin/env bash
# The full CUDA compile of llama-server on this machine (nvcc and cuBLAS, no GPU needed),
# measured: wall time, binary sizes (raw and xz), what `ldd` cannot find, and whether the binary
# answers `--help` and `--version`. Too slow for CI (about 30 minutes for sm_89 on 2 cores), so
# it is run once per source pin and the README records its figures; CI checks only the
# configure step (tests/test_build_cuda.py).
#
# usage: benchmarks/cuda_build_check.sh [RESULT_DIR]
#   CUDA_CHECK_ARCH      compute capabilities, comma-separated (default 89)
#   CUDA_CHECK_SOURCE    submodule, offline or a PATH (default offline)
#   CUDA_CHECK_JOBS      parallel compile jobs (default: all cores)
#   CUDA_CHECK_FORCE=1   compile even when a cached build of the same options exists
#   PYTHON               interpreter with mtpwrap and its `cuda` extra (default .venv/bin/python)
# In the background, at low priority, one line per compiled object in the log:
#   setsid nohup nice -n 19 benchmarks/cuda_build_check.sh /tmp/cuda-check \
#       >/tmp/cuda-check.log 2>&1 &
# The result folder gets summary.json, manifest.json, build.log (the progress lines) and ldd.txt.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="${1:-$PWD/cuda-build-check-$(date +%Y%m%d-%H%M%S)}"
py="${PYTHON:-$repo/.venv/bin/python}"
arch="${CUDA_CHECK_ARCH:-89}"
src="${CUDA_CHECK_SOURCE:-offline}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
say() { echo "[cuda_build_check $(date +%H:%M:%S)] $*"; }
cd "$repo"

args=(build --cuda-arch "$arch" --source "$src" --log-objects --json)
[[ -n "${CUDA_CHECK_JOBS:-}" ]] && args+=(--jobs "$CUDA_CHECK_JOBS")
[[ "${CUDA_CHECK_FORCE:-0}" == 1 ]] && args+=(--force)
say "mtpwrap ${args[*]} on $(nproc) cores; results in $out"
start=$(date +%s)
rc=0
"$py" -m mtpwrap "${args[@]}" >"$out/manifest.json" 2> >(tee "$out/build.log" >&2) || rc=$?
wall=$(( $(date +%s) - start ))
if (( rc != 0 )); then
    say "the build failed with exit code $rc after ${wall}s (see $out/build.log)"
    exit "$rc"
fi
server="$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["binaries"]["llama-server"]["path"])' "$out/manifest.json")"
bindir="$(dirname "$server")"
say "built in ${wall}s: $server"

ldd "$server" >"$out/ldd.txt" 2>&1 || true
help_rc=0; "$server" --help >"$out/help.txt" 2>"$out/help.stderr" || help_rc=$?
version_rc=0; "$server" --version >"$out/version.txt" 2>&1 || version_rc=$?
say "compressing llama-server with xz to measure what a carried copy weighs"
xz_bytes=$(xz -T0 -6 -c "$server" | wc -c)

"$py" - "$out" "$server" "$bindir" "$wall" "$help_rc" "$version_rc" "$xz_bytes" <<'PY'
import json, os, sys
from pathlib import Path
out, server, bindir = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3])
wall, help_rc, version_rc, xz_bytes = map(int, sys.argv[4:8])
manifest = json.loads((out / "manifest.json").read_text())
ldd = (out / "ldd.txt").read_text().splitlines()
help_text = (out / "help.txt").read_text()
summary = {
    "command": "benchmarks/cuda_build_check.sh",
    "cores": os.cpu_count(),
    "wall_seconds": wall,
    "build_seconds": manifest["build_seconds"],
    "reused": "nothing changed since the last build" in (out / "build.log").read_text(),
    "variant": manifest["variant"],
    "architectures": manifest["architectures"],
    "source": {k: manifest["source"].get(k) for k in ("kind", "commit", "location")},
    "cuda": manifest.get("cuda"),
    "objects_compiled": sum(" object " in l for l in (out / "build.log").read_text().splitlines()),
    "llama_server_bytes": server.stat().st_size,
    "llama_server_xz_bytes": xz_bytes,
    "bin_bytes": sum(p.stat().st_size for p in bindir.iterdir() if p.is_file()),
    "ldd_not_found": [l.strip() for l in ldd if "not found" in l],
    "ldd_cuda": [l.strip() for l in ldd if "cuda" in l or "cublas" in l],
    "help_exit": help_rc,
    "help_options": sum(1 for l in help_text.splitlines() if l.startswith("-")),
    "version_exit": version_rc,
    "version": (out / "version.txt").read_text().strip(),
    "smoke": manifest.get("smoke"),
}
(out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
print(json.dumps(summary, indent=2))
PY
say "done; summary: $out/summary.json"
