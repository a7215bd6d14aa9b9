#!/usr/bin/env bash
# Does one built wheel work on the oldest torch it claims and on the newest torch on the index?
#
#   bench/torch_versions.sh WHEEL [TORCH_VERSION...]     (default versions: 2.10.0 newest)
#   bench/torch_versions.sh --summary                    (only rewrite summary.md from the torch-*.txt there)
#
# For each torch version: a fresh venv (under $REDFUSER_TORCH_VENVS, default /tmp/redfuser-torch-venvs), torch
# from the package index, the wheel installed with --no-deps, the test requirements of the op tests, then the op
# contract tests (CPU path; GPU tests skip where there is no GPU) run from the repository root against the
# installed wheel. "newest" is resolved with `pip index versions torch`. pip's configuration on the development
# machines caps torch (a constraints file); every pip call here runs with PIP_CONFIG_FILE=/dev/null so that the
# index's own versions install (each torch is a few GB with its CUDA packages: not for CI).
#
# Writes bench/results/torch-versions/torch-<version>.txt (versions, wheel, pytest summary) and
# bench/results/torch-versions/summary.md (one row per version, rewritten from every torch-*.txt there).
# Environment: REDFUSER_TORCH_REUSE=1 keeps a venv that already has that torch (reinstalls the wheel);
# REDFUSER_TORCH_TESTS_K: a pytest -k selection (recorded in the result).
# Exit status: 0 when every version passed.
set -u -o pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WHEEL=${1:?usage: bench/torch_versions.sh WHEEL [TORCH_VERSION...]   (or --summary: only rewrite summary.md)}
shift
VERSIONS=("$@")
if [ "$WHEEL" = --summary ]; then
  VERSIONS=()
else
  WHEEL=$(cd "$(dirname "$WHEEL")" && pwd)/$(basename "$WHEEL")
  [ ${#VERSIONS[@]} -eq 0 ] && VERSIONS=(2.10.0 newest)
fi
VENVS=${REDFUSER_TORCH_VENVS:-/tmp/redfuser-torch-venvs}
OUTDIR=$REPO/bench/results/torch-versions
PY=${PYTHON:-python3}
TESTS=(tests/test_moe_route.py tests/test_fused_attention.py tests/test_mla_fp8_cpu.py tests/test_library.py)
SELECT=${REDFUSER_TORCH_TESTS_K:-}  # a pytest -k expression (e.g. on a loaded machine: "not matches_reference")
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
mkdir -p "$OUTDIR" "$VENVS"

newest() {
  "$PY" -m pip index versions torch 2>/dev/null | sed -n 's/^torch (\([^)]*\)).*/\1/p' | head -1
}

status=0
for v in ${VERSIONS[@]+"${VERSIONS[@]}"}; do
  if [ "$v" = newest ]; then
    v=$(newest)
    [ -n "$v" ] || { echo "cannot resolve the newest torch on the index" >&2; status=1; continue; }
  fi
  venv=$VENVS/torch-$v
  out=$OUTDIR/torch-$v.txt
  echo "== torch $v: $venv"
  pip_() { "$venv/bin/python" -m pip install -q "$@"; }
  if [ "${REDFUSER_TORCH_REUSE:-0}" = 1 ] && "$venv/bin/python" -c \
      "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$v')" 2>/dev/null; then
    echo "   reusing the venv's torch $v"
  else
    rm -rf "$venv"
    "$PY" -m venv "$venv"
    pip_ "torch==$v" || { echo "torch $v: installing torch failed" | tee "$out"; status=1; continue; }
  fi
  if ! pip_ --no-deps --force-reinstall "$WHEEL" \
      || ! pip_ "pytest>=7" "hypothesis>=6" numpy "pyyaml>=6" "sympy>=1.13"; then
    echo "torch $v: installing failed" | tee "$out"
    status=1
    continue
  fi
  {
    echo "wheel: $(basename "$WHEEL")"
    # from / : the repository root would put the source tree's redfuser_ops first on sys.path
    (cd / && "$venv/bin/python" - <<'EOF'
import platform, torch, redfuser_ops
info = redfuser_ops.info()
print(f"torch: {torch.__version__} (CUDA build {torch.version.cuda}, cuda available: {torch.cuda.is_available()})")
print(f"python: {platform.python_version()}, {platform.machine()}, glibc {platform.libc_ver()[1]}")
print(f"redfuser-ops: {info['version']} built with torch {info['torch_built_with']}, "
      f"targets torch {info['torch_target']}, families {info['families'] or 'none (CPU only)'}")
EOF
    )
    echo "tests: ${TESTS[*]}${SELECT:+ -k \"$SELECT\"}"
  } >"$out" 2>&1
  # the tests import the installed package (tests/conftest.py keeps the source tree's redfuser_ops out)
  (cd "$REPO" && nice "$venv/bin/python" -m pytest -q -p no:cacheprovider "${TESTS[@]}" ${SELECT:+-k "$SELECT"} 2>&1) \
    >"$out.log"
  rc=$?
  {
    echo "pytest exit: $rc"
    echo "pytest summary: $(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed|error)' "$out.log" | tail -1)"
    grep -E '^(FAILED|ERROR) ' "$out.log" | head -20
  } >>"$out"
  rm -f "$out.log"
  [ $rc -eq 0 ] || status=1
  cat "$out"
done

{
  echo "# The wheel on other torch versions (bench/torch_versions.sh)"
  echo
  echo "| torch | CUDA build | python / glibc | wheel | result |"
  echo "|---|---|---|---|---|"
  for f in "$OUTDIR"/torch-*.txt; do
    [ -e "$f" ] || continue
    t=$(sed -n 's/^torch: \([^ ]*\) (CUDA build \([^,]*\),.*/\1 \2/p' "$f")
    p=$(sed -n 's/^python: \([^,]*\), [^,]*, glibc \(.*\)/\1 \/ \2/p' "$f")
    w=$(sed -n 's/^wheel: //p' "$f")
    r=$(sed -n 's/^pytest summary: //p' "$f" | tr -d '=' | sed 's/^ *//; s/ *$//')
    echo "| ${t% *} | ${t#* } | $p | $w | ${r:-install failed} |"
  done
} >"$OUTDIR/summary.md"
exit $status
