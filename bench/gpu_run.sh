#!/usr/bin/env bash
# The one prepared GPU run: bench/gpu_run.sh [--dry-run] [WHEEL|installed] [OUTDIR]
#
# On a GPU machine (made for the H200 test machine: torch 2.11+cu130, no tilelang, no network, root), from the
# repository root of a checkout that carries the wheel (default: the newest dist/*.whl), it
#   1. installs the wheel (pip --no-deps --no-build-isolation --no-index) into a fresh venv that sees the
#      machine's python packages (torch, pytest) through a .pth file;
#   2. prints what the library holds (python -m redfuser_ops --variants);
#   3. runs pytest on the GPU-relevant tests (test_library, test_sass, the op tests with their CUDA
#      parameters, tests/gpu) with every CUDA op output poisoned first (-p bench.poison), junit xml;
#   4. runs a few small cases under compute-sanitizer memcheck (where compute-sanitizer exists);
#   5. runs the benchmarks (python -m bench.run --device cuda --quick) with what is left of the time;
#   6. prints a short table last.
# Everything goes under OUTDIR (default $OUT): gpu_run.log, junit.xml, sanitizer.log, bench/results.json,
# bench/results.md, bench/*.png (7 files: the device tool brings back at most 8). Every step has a hard
# timeout and the whole run keeps within REDFUSER_GPU_RUN_SECONDS (default 540 s = 9 min); a step cut short
# still leaves its files (pytest and the benchmark get SIGINT first and write what they have).
#
# --dry-run: the host-side steps on the CPU (install into a temp venv, pytest --collect-only of the same
# selection, a tiny CPU benchmark), to check the script before spending GPU time. WHEEL "installed" skips the
# install and uses the redfuser_ops already installed for $PYTHON.
#
# Environment: PYTHON (default python3), REDFUSER_GPU_RUN_SECONDS (540), REDFUSER_PYTEST_SECONDS (240),
# REDFUSER_SANITIZER_SECONDS (100), REDFUSER_PYTEST_WORKERS (6, when pytest-xdist is there),
# REDFUSER_BENCH_ARGS (default "--quick").

set -u -o pipefail

DRY=0
POS=()
for a in "$@"; do
  case "$a" in
    --dry-run) DRY=1 ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    *) POS+=("$a") ;;
  esac
done

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
WHEEL=${POS[0]:-}
OUTDIR=${POS[1]:-${OUT:-}}
if [ -z "$OUTDIR" ]; then
  echo "gpu_run.sh: no output folder (second argument, or \$OUT)" >&2
  exit 2
fi
mkdir -p "$OUTDIR" || exit 2
OUTDIR=$(cd "$OUTDIR" && pwd)
if [ -n "$WHEEL" ] && [ "$WHEEL" != installed ] && [ -f "$WHEEL" ]; then
  WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
fi
cd "$REPO" || exit 2
if [ -z "$WHEEL" ]; then
  WHEEL=$(ls -t "$REPO"/dist/*.whl 2>/dev/null | head -n 1)
fi
LOG=$OUTDIR/gpu_run.log
: > "$LOG"
exec 3>&1 4>&2 > >(tee -a "$LOG") 2>&1
TEE_PID=$!

TOTAL=${REDFUSER_GPU_RUN_SECONDS:-540}
RESERVE=15  # for the summary
T0=$(date +%s)
WORK=$(mktemp -d /tmp/redfuser_gpu_run.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
STEPS=()
FAILED=0

elapsed() { echo $(( $(date +%s) - T0 )); }

# run_step NAME CAP_SECONDS COMMAND...: runs COMMAND with a hard limit of min(CAP, time left), records rc and time
run_step() {
  local name=$1 cap=$2
  shift 2
  local left=$(( TOTAL - $(elapsed) - RESERVE ))
  local limit=$(( cap < left ? cap : left ))
  if [ "$limit" -lt 5 ]; then
    echo "=== $name: skipped, the time budget is spent"
    STEPS+=("$name|skipped|0")
    FAILED=1
    return 0
  fi
  echo "=== $name (limit ${limit}s, at $(elapsed)s)"
  local s rc
  s=$(date +%s)
  timeout -s INT -k 20 "$limit" "$@"
  rc=$?
  [ "$rc" -eq 124 ] && rc=timeout
  [ "$rc" != 0 ] && FAILED=1
  STEPS+=("$name|$rc|$(( $(date +%s) - s ))")
  echo "=== $name: rc=$rc after $(( $(date +%s) - s ))s"
  return 0
}

echo "gpu_run.sh $([ $DRY = 1 ] && echo '--dry-run ')wheel=${WHEEL:-none} out=$OUTDIR repo=$REPO budget=${TOTAL}s"
echo "host: $(uname -srm), $(nproc) cores; python: $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
$PY -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())'
if [ $DRY = 0 ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu \
    --format=csv 2>&1 | head -n 5
fi

# ---------------------------------------------------------------------------------------------------------------
# 1. install
# ---------------------------------------------------------------------------------------------------------------
install_wheel() {
  local venv=$WORK/venv site
  "$PY" -m venv --without-pip --system-site-packages "$venv" || return 1
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
  # the machine's own packages (torch, pytest, ...) may live in another venv: make them visible, after ours
  "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
    > "$site/_redfuser_parent_site.pth" || return 1
  "$venv/bin/python" -m pip install -q --no-deps --no-build-isolation --no-index --no-compile --ignore-installed \
    --disable-pip-version-check "$WHEEL" || return 1
  local where
  where=$(cd "$WORK" && "$venv/bin/python" -c 'import redfuser_ops; print(redfuser_ops.__file__)') || return 1
  echo "installed: $where"
  case "$where" in "$venv"/*) ;; *) echo "redfuser_ops imports from $where, not from the new venv"; return 1 ;; esac
}
export -f install_wheel
export PY WHEEL WORK

if [ "$WHEEL" = installed ]; then
  VPY=$PY
  echo "=== install: skipped (using the redfuser_ops installed for $PY)"
  STEPS+=("install|installed|0")
elif [ -z "$WHEEL" ] || [ ! -f "$WHEEL" ]; then
  echo "=== install: no wheel (give its path, or put it in dist/)"
  STEPS+=("install|no wheel|0")
  VPY=$PY
  FAILED=1
else
  run_step install 120 bash -c install_wheel
  VPY=$WORK/venv/bin/python
  if ! (cd "$WORK" && "$VPY" -c 'import redfuser_ops' 2>/dev/null); then
    # fallback: no venv here; install into a folder on PYTHONPATH (test_library.py and test_sass.py, which start
    # python without PYTHONPATH to avoid the source tree, will then fail to find the package)
    echo "=== install: the venv did not work; installing with --target and PYTHONPATH instead"
    VPY=$PY
    if timeout 120 "$PY" -m pip install -q --no-deps --no-index --no-compile --ignore-installed \
         --target "$WORK/site" "$WHEEL"; then
      export PYTHONPATH=$WORK/site${PYTHONPATH:+:$PYTHONPATH}
      STEPS+=("install-target|0|0")
    else
      STEPS+=("install-target|failed|0")
    fi
  fi
fi

# ---------------------------------------------------------------------------------------------------------------
# 2. what the library holds
# ---------------------------------------------------------------------------------------------------------------
export VPY
run_step info 60 bash -c 'cd "$WORK" && "$VPY" -m redfuser_ops --variants'

# ---------------------------------------------------------------------------------------------------------------
# 3. tests
# ---------------------------------------------------------------------------------------------------------------
TESTS=(tests/test_library.py tests/test_sass.py)
for f in tests/test_fused_attention.py tests/test_moe_route.py tests/test_mla_decode.py tests/test_fp8_quant_gemm.py; do
  [ -f "$f" ] && TESTS+=("$f")
done
TESTS+=(tests/gpu)
PYTEST=("$VPY" -m pytest -p bench.poison -p no:cacheprovider -q -rfE -o junit_family=xunit1
        --junitxml="$OUTDIR/junit.xml" -k "not cpu")
if [ $DRY = 1 ]; then
  run_step pytest-collect 120 "${PYTEST[@]}" --collect-only "${TESTS[@]}"
else
  "$VPY" -c 'import pytest_timeout' 2>/dev/null && PYTEST+=(--timeout=150)
  if "$VPY" -c 'import xdist' 2>/dev/null && [ "${REDFUSER_PYTEST_WORKERS:-6}" -gt 1 ]; then
    PYTEST+=(-n "${REDFUSER_PYTEST_WORKERS:-6}")
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
  fi
  run_step pytest "${REDFUSER_PYTEST_SECONDS:-240}" "${PYTEST[@]}" "${TESTS[@]}"
  unset OMP_NUM_THREADS
fi

# ---------------------------------------------------------------------------------------------------------------
# 4. compute-sanitizer memcheck on small cases
# ---------------------------------------------------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || true)
[ -z "$SAN" ] && [ -x /usr/local/cuda/bin/compute-sanitizer ] && SAN=/usr/local/cuda/bin/compute-sanitizer
if [ $DRY = 1 ]; then
  echo "=== sanitizer: skipped (dry run)"
  STEPS+=("sanitizer|dry run|0")
elif [ -z "$SAN" ]; then
  echo "=== sanitizer: skipped, compute-sanitizer not found"
  STEPS+=("sanitizer|not found|0")
else
  run_step sanitizer "${REDFUSER_SANITIZER_SECONDS:-100}" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SAN" --tool memcheck --error-exitcode 3 --print-limit 20 --log-file "$OUTDIR/sanitizer.log" \
    "$VPY" -m bench.gpu_checks
  [ -f "$OUTDIR/sanitizer.log" ] && tail -n 5 "$OUTDIR/sanitizer.log"
fi

# ---------------------------------------------------------------------------------------------------------------
# 5. benchmarks
# ---------------------------------------------------------------------------------------------------------------
LEFT=$(( TOTAL - $(elapsed) - RESERVE ))
BUDGET=$(( LEFT - 30 ))
if [ $DRY = 1 ]; then
  BENCH=("$VPY" -m bench.run --device cpu --tiny --impls sdpa_default,eager --budget "$(( BUDGET < 60 ? BUDGET : 60 ))"
         --out "$OUTDIR/bench" --machine dry-run)
else
  # shellcheck disable=SC2206
  BENCH=("$VPY" -m bench.run --device cuda ${REDFUSER_BENCH_ARGS:---quick} --budget "$BUDGET" --out "$OUTDIR/bench")
fi
if [ "$BUDGET" -ge 20 ]; then
  run_step bench "$(( LEFT - 5 ))" "${BENCH[@]}"
else
  echo "=== bench: skipped, ${LEFT}s left"
  STEPS+=("bench|skipped|0")
  FAILED=1
fi

# ---------------------------------------------------------------------------------------------------------------
# 6. summary (last, short)
# ---------------------------------------------------------------------------------------------------------------
echo
echo "=================== summary ($(elapsed)s) ==================="
printf '%-16s %-12s %s\n' step result seconds
for s in "${STEPS[@]}"; do
  IFS='|' read -r n r d <<< "$s"
  printf '%-16s %-12s %s\n' "$n" "$r" "$d"
done
if [ -f "$OUTDIR/junit.xml" ]; then
  "$PY" - "$OUTDIR/junit.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
tot = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
print("pytest: {tests} tests, {failures} failed, {errors} errors, {skipped} skipped".format(**tot))
bad = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s.iter("testcase")
       if c.find("failure") is not None or c.find("error") is not None]
for b in bad[:15]:
    print("  FAILED", b)
if len(bad) > 15:
    print(f"  ... {len(bad) - 15} more (junit.xml)")
EOF
fi
if [ -f "$OUTDIR/sanitizer.log" ]; then
  echo "sanitizer: $(grep -E 'ERROR SUMMARY' "$OUTDIR/sanitizer.log" | tail -n 1)"
fi
if [ -f "$OUTDIR/bench/results.json" ]; then
  "$VPY" -m bench.report --summary "$OUTDIR/bench/results.json" 2>&1 | head -n 60
fi
echo "files: $(cd "$OUTDIR" && find . -type f | sort | tr '\n' ' ')"
# let tee write the last lines before the script ends
exec 1>&3 2>&4
wait "$TEE_PID" 2>/dev/null
exit $FAILED
