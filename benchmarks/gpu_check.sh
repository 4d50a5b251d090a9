#!/usr/bin/env bash
# What only a GPU can show, in at most 10 minutes on one NVIDIA GPU, without network:
#   1. build llama-server for the present GPU (`mtpwrap build`; a no-op when cached),
#   2. write a shape-real Qwen3.6-27B-class model (sparse file of zeros: weight values do not
#      change speed) and measure decode/prefill tokens/s vs context with f16/q8_0/q4_0 KV and
#      MTP on/off through llama-server, with the planner's prediction next to CUDA's allocations,
#   3. the read cells: `mtpwrap bench docs` on the same model, the read rate by ubatch at 32K
#      and 128K tokens and a new question after `mtpwrap restart` (gpu_check.py READ_CELLS),
#      then `mtpwrap bench --quick` on the demo model,
#   4. when ADAPTIVE_SPEC_MODEL names a GGUF with an MTP head (carried to the machine): each
#      static draft depth against the adaptive per-class policy (benchmarks/adaptive_spec.py).
# Everything goes into one folder: the first argument, else $OUT, else ./gpu-check-TIMESTAMP.
#
# usage: benchmarks/gpu_check.sh [--dry-run] [RESULT_DIR]
#   --dry-run            CPU-side parts only: folder, model file, command lines, and the plan of
#                        the speed-only cells with their expected minutes; no build, no GPU
#   MTPWRAP_BINARY a llama-server to use instead of building
#   GPU_CHECK_PREBUILT   a carried build (`mtpwrap build --cuda-arch 90 --pack FILE`) to install
#                        instead of building; default: the newest .prebuilt/*.tar.xz. Refused (and
#                        built instead) when its manifest is not of the source pin or lacks the
#                        GPU's architecture
#   PYTHON               interpreter (default: python3). When it lacks mtpwrap's dependencies,
#                        they are installed from .wheelhouse (`make wheelhouse`, carried to the
#                        machine) into $GPU_CHECK_SITE (default /tmp/mtpwrap-site), no network
#   GPU_CHECK_CONTEXTS   comma-separated prompt lengths (default 1024,8192,32768)
#   GPU_CHECK_PLAN_GPU   GPU the planner predicts for (default auto: the one present)
#   ADAPTIVE_SPEC_MODEL  a real model with an MTP head for step 4 (skipped, saying so, without)
#   GPU_CHECK_READ       0: leave the read cells out
set -euo pipefail

dry_run=0
if [[ "${1:-}" == "--dry-run" ]]; then dry_run=1; shift; fi
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
out="${1:-${OUT:-$PWD/gpu-check-$(date +%Y%m%d-%H%M%S)}}"
py="${PYTHON:-python3}"
contexts="${GPU_CHECK_CONTEXTS:-1024,8192,32768}"
mkdir -p "$out"
out="$(cd "$out" && pwd)"
log="$out/gpu_check.log"
: >"$log"
say() { echo "[gpu_check $(date +%H:%M:%S)] $*" | tee -a "$log"; }
cd "$repo"
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
start=$(date +%s)

say "results: $out"
need='import click, httpx, yaml, rich, psutil, gguf, numpy, pynvml, starlette, uvicorn'
if ! "$py" -c "$need" 2>/dev/null; then
    wheels="${GPU_CHECK_WHEELHOUSE:-$repo/.wheelhouse}"
    site="${GPU_CHECK_SITE:-/tmp/mtpwrap-site}"
    if ! compgen -G "$wheels/*.whl" >/dev/null; then
        say "$py cannot import mtpwrap's dependencies and $wheels has no wheels: run" \
            "\`make wheelhouse\` (PYVER=the GPU machine's Python) and carry .wheelhouse"
        exit 69
    fi
    say "$py lacks mtpwrap's dependencies: installing $wheels into $site (no network)"
    "$py" -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
        --upgrade --target "$site" "$wheels"/*.whl >>"$log" 2>&1 \
        || { say "pip could not install the wheelhouse (see $log)"; exit 69; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    "$py" -c "$need" >>"$log" 2>&1 \
        || { say "the wheelhouse does not fit $py (see $log): make it with PYVER=" \
             "$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"; exit 69; }
fi
if (( ! dry_run )); then
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv \
        >>"$log" 2>&1 || { say "no NVIDIA GPU visible (nvidia-smi failed)"; exit 69; }
fi

server="${MTPWRAP_BINARY:-}"
prebuilt="${GPU_CHECK_PREBUILT:-$(ls -t "$repo"/.prebuilt/*.tar.xz 2>/dev/null | head -n 1 || true)}"
carried=""
if [[ -z "$server" && -n "$prebuilt" ]]; then
    say "installing the carried build $prebuilt (checked against the source pin and this GPU)"
    if "$py" -m mtpwrap build --from-prebuilt "$prebuilt" --json >"$out/prebuilt-manifest.json" \
            2>>"$log"; then
        server="$("$py" -c 'import json, sys
print(json.load(open(sys.argv[1]))["binaries"]["llama-server"]["path"])' \
            "$out/prebuilt-manifest.json")"
        # Its RPATH names the folders of the machine that built it: use this machine's.
        libs="$("$py" -c 'from mtpwrap.build import toolchain; print(":".join(toolchain.cuda_library_dirs()))')"
        export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        say "using the carried build: $server (LD_LIBRARY_PATH=$libs)"
        carried="$prebuilt"
        ldd "$server" >>"$log" 2>&1 || true
    else
        server=""
        say "the carried build was refused: $(tail -n 1 "$log")"
    fi
fi
if [[ -z "$server" ]]; then
    if (( dry_run )); then
        server="$repo/build/cuda/bin/llama-server"
        say "dry run: no build; assuming $server"
    else
        say "building llama-server for this GPU (mtpwrap build)"
        timeout 480 "$py" -m mtpwrap build 2>&1 | tail -n 20 >>"$log"
        server="$("$py" -c 'from mtpwrap.build.manifest import load_manifest; print(load_manifest().binary("llama-server"))')"
    fi
fi
say "llama-server: $server"

args=("$out" --binary "$server" --contexts "$contexts")
[[ -n "$carried" ]] && args+=(--carried "$carried")
(( dry_run )) && args+=(--dry-run)
say "shape-real model, speed matrix, planner vs allocations"
rc=0
timeout 420 "$py" "$here/gpu_check.py" "${args[@]}" >>"$log" 2>&1 || rc=$?
say "speed matrix finished with exit code $rc"
if [[ -f "$out/gpu_plan.txt" ]]; then tee -a "$log" <"$out/gpu_plan.txt"; fi

if (( ! dry_run )); then
    left=$(( 600 - ($(date +%s) - start) ))
    if [[ "${GPU_CHECK_READ:-1}" == "0" ]]; then
        say "read cells: skipped (GPU_CHECK_READ=0)"
    elif (( left > 150 )); then
        say "read cells: read rate by ubatch at 32K and 128K, a new question after a restart" \
            "(${left}s left)"
        timeout "$((left - 60))" "$py" "$here/gpu_check.py" "$out" --binary "$server" \
            --read-cells "$((left - 70))" >>"$log" 2>&1 || say "read cells failed or ran out of time"
    else
        say "no time left for the read cells"
    fi
fi
if (( ! dry_run )); then
    left=$(( 600 - ($(date +%s) - start) ))
    if (( left > 60 )); then
        say "mtpwrap bench --quick on the demo model (${left}s left)"
        timeout "$((left - 10))" "$py" -m mtpwrap bench --quick --binary "$server" \
            --out "$out/bench-quick" >>"$log" 2>&1 || say "bench --quick failed or timed out"
    else
        say "no time left for bench --quick"
    fi
fi
if (( ! dry_run )); then
    left=$(( 600 - ($(date +%s) - start) ))
    if [[ -z "${ADAPTIVE_SPEC_MODEL:-}" ]]; then
        say "adaptive speculation: skipped (set ADAPTIVE_SPEC_MODEL to a GGUF with an MTP head)"
    elif (( left > 90 )); then
        say "adaptive speculation with MTP on $ADAPTIVE_SPEC_MODEL (${left}s left)"
        MTPWRAP_BINARY="$server" timeout "$((left - 10))" "$py" "$here/adaptive_spec.py" \
            --spec mtp --model "$ADAPTIVE_SPEC_MODEL" --per-class 6 \
            --json "$out/adaptive-spec.json" >>"$log" 2>&1 \
            || say "adaptive speculation failed or timed out"
    else
        say "no time left for the adaptive speculation comparison"
    fi
fi
say "done in $(( $(date +%s) - start ))s"
exit "$rc"
