#!/usr/bin/env bash
# One device check on an accelerator machine with no network (an NVIDIA H200 here):
# installs kvxfer from wheels placed beside the checkout, records the machine, runs the
# tests that can use the device (the pinned mover's first), the pinned mover's two
# modes side by side, one `kvxfer bench` run (on GPU path=auto is the pinned mover),
# the layout capture and the bandwidth probe, and writes everything under OUTDIR. Each
# step has its own time limit and the limits add up to 8 minutes; a failing step is
# recorded and the next one still runs. Exit status: 0 when every step ran to its end,
# else 1.
#
# Usage (from the repository root):  bash benchmarks/device_check.sh OUTDIR
#
# Wheels: the machine's image already has jax (with its CUDA plugin), numpy, absl-py,
# pytest, matplotlib, torch and cupy. kvxfer itself travels as its own wheel, built
# here with
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip wheel --no-deps --wheel-dir .whl .
# and carried as `.whl`, rebuilt for every change (a wheel whose modules differ from the
# checkout's is not used: the log says so). Without .whl/ the script uses the checkout
# (PYTHONPATH).
#
# What comes back (at most 8 files, at most two folders deep):
#   OUTDIR/log.txt            every step's output, with its time and exit status
#   OUTDIR/env.txt            nvidia-smi, python, jax and its devices, kvxfer version
#   OUTDIR/tests.xml          JUnit report of the device tests (absent if cut short)
#   OUTDIR/pinned_modes.json  the pinned mover in place vs through a host copy: one
#                             byte-exact round trip and offload/load GB/s for each
#                             (decides kvxfer.engine._pinned.IN_PLACE_PLATFORMS for the backend)
#   OUTDIR/bench/bench.json   the bench report (and bench/bench.png with matplotlib)
#   OUTDIR/captured.json      the layouts XLA chose on this device (a catalogue)
#   OUTDIR/bandwidth.json     the bandwidth probe's report
set -u
out=${1:?usage: bash benchmarks/device_check.sh OUTDIR}
cd "$(dirname "$0")/.."
mkdir -p "$out/bench"
log="$out/log.txt"
: > "$log"
py=${PYTHON:-python3}
# The JAX platform to check (KVXFER_PLATFORM=cpu dry-runs the script on a CPU machine).
platform=${KVXFER_PLATFORM:-cuda}
status=0
export PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: runs one step under a time limit, logging it
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (limit ${limit} s): $*" | tee -a "$log"
  timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
  rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s" | tee -a "$log"
  [ "$rc" -eq 0 ] || status=1
  return 0
}

if ls .whl/kvxfer-*.whl > /dev/null 2>&1; then
  step "install kvxfer" 60 "$py" -m pip install -q --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/kvxfer-site .whl/*.whl
  export PYTHONPATH=/tmp/kvxfer-site
  # A wheel built from another tree than this checkout would test stale code: compare
  # every module the wheel installed with the checkout's, and use the checkout if any
  # differs (the log says which).
  if ! "$py" - <<'EOF' >> "$log" 2>&1
import hashlib, pathlib, sys
site, here = pathlib.Path("/tmp/kvxfer-site/kvxfer"), pathlib.Path("kvxfer")
def digest(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()
ours = {p.relative_to(here): digest(p) for p in here.rglob("*.py")}
theirs = {p.relative_to(site): digest(p) for p in site.rglob("*.py")}
stale = sorted(str(k) for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
if stale:
    print("== the wheel in .whl/ differs from this checkout in", stale[:5],
          "(and more)" if len(stale) > 5 else "", "- rebuild it; using the checkout")
    sys.exit(1)
print("== the wheel matches this checkout")
EOF
  then
    export PYTHONPATH=$PWD
    status=1
  fi
else
  echo "== no .whl/kvxfer-*.whl: using the checkout" | tee -a "$log"
  export PYTHONPATH=$PWD
fi

{
  date -u
  nvidia-smi || true
  JAX_PLATFORMS=$platform "$py" - <<'EOF'
import sys
import jax
import kvxfer
print("python", sys.version.split()[0])
print("jax", jax.__version__, "backend", jax.default_backend())
print("devices", jax.devices())
print("memories", jax.devices()[0].addressable_memories())
print("kvxfer", kvxfer.__version__, "from", kvxfer.__file__)
EOF
} > "$out/env.txt" 2>&1 || status=1
cat "$out/env.txt" >> "$log"

# The tests run on the device: conftest.py only sets JAX_PLATFORMS when it is unset.
# Tests written for the CPU backend's raw path report their failures here; that list
# is part of what the check measures.
# -v: one line per test in the log, so a run cut short by its limit still says which
# tests passed.
# The pinned mover's tests first (auto takes it on GPU), then the zero-dma fault on it
# (one device: not the sharded case), then the rest.
step "device tests" 150 env JAX_PLATFORMS=$platform "$py" -m pytest -v -p no:cacheprovider \
  --junitxml="$out/tests.xml" tests/test_pinned.py \
  "tests/test_faults.py::test_zero_dma_is_caught_on_every_mover[pinned-layer]" \
  "tests/test_faults.py::test_zero_dma_is_caught_on_every_mover[pinned-all]" \
  tests/test_value_semantics.py tests/test_engine_loop.py tests/test_integrity.py \
  tests/test_manager.py

step "pinned modes" 45 bash -c "JAX_PLATFORMS='$platform' '$py' benchmarks/pinned_modes.py \
  --sizes-mib 8,256 --repeats 3 > '$out/pinned_modes.json'"

step "kvxfer bench" 150 env JAX_PLATFORMS=$platform "$py" -m kvxfer bench --quick --no-check \
  --out "$out/bench"

step "capture layouts" 30 env JAX_PLATFORMS=$platform "$py" tpu_probes/capture_layouts.py \
  --out "$out/captured.json"

step "bandwidth probe" 45 bash -c "JAX_PLATFORMS='$platform' '$py' \
  tpu_probes/bandwidth_probe.py --json > '$out/bandwidth.json'"

echo "== done: status $status" | tee -a "$log"
exit "$status"
