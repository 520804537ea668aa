#!/usr/bin/env bash
# One device check on an accelerator machine with no network (an NVIDIA H100 or H200):
# installs kvxfer from wheels placed beside the checkout, records the machine, then
# runs the short check (kvxfer.bench.first_check) in two parts, each step's figures
# written to first.jsonl as soon as they exist, so a run cut short still reports.
#
# First, within the run's first 4 minutes and under a limit of its own (a hang there
# costs nothing after it), what broke in the DMA mover before (kvxfer.bench._hazards):
# versions and driver ABI, a spy in the DMA callback, then
#   - several-group loads: classes whose layer groups hold several layers (8 layers of
#     16 KiB blocks, 32 layers of 4 KiB), integrity off and on, compared byte for byte
#     (a group scattered from staging its copies had not reached passes its digests
#     when there are none);
#   - a partial-enqueue failure: a CUDA driver call failing after some copies were
#     enqueued (kvxfer.testing.driver_fault: the second cuMemcpyAsync of a copy loop,
#     the second cuMemcpyBatchAsync of a several-group load, the second cuEventRecord),
#     each direction: TransferError, the caches alive, the next transfer exact, and
#     device arrays allocated right after the failure left as written once every copy
#     ended (skipped, saying why, without the hook or without a CUDA driver);
#   - allocator reuse under copies in flight: prefetch()/release() and load cycles
#     with fresh device arrays allocated between them, never overwritten;
#   - a load behind a large offload: load() to its last layer ready while a 1 GiB
#     offload is in flight, against the load alone and the link's time for its bytes;
#   - a busy Python thread: loads while a thread spins in Python, exact, and timed.
# No time is judged there: figures stand beside the link's, measured in the same run.
#
# Then the rest of the short check (exact bf16 and fp8 round trips with relayout never
# and always, in-place loads, no copy of the caches in the load program, throughput
# per copy size against a large pinned copy, the caller's time per call, how long a
# matmul dispatched right after an offload (or a prefetch) waits, and when a
# layer-gated load's last layer is ready against the copy time); a round trip and
# fault check through the public API on path=auto (the DMA mover on a GPU with
# cuda-bindings) and path=pinned (the pure-JAX pages route), the tests that can use
# the device, and one `kvxfer bench --quick` run (plain-JAX routes and the copy-size
# sweep included), then counts XLA's host-compute warnings in the log. Each step has
# its own time limit, sized for XLA:GPU's compiles (each new program costs seconds
# there); the limits add up to under 10 minutes (one device command's limit): install
# 30 s, what broke 120 s (so it has ended by about 2.5 minutes in), the rest of the
# short check 160 s, the public API 50 s, the device tests 120 s, the bench 110 s. A
# failing step is recorded and the next one still runs. Exit status: 0 when every
# step ran to its end and no host-compute warning was printed, else 1.
#
# Usage (from the repository root):  bash benchmarks/device_check.sh OUTDIR
# A dry run on a CPU machine:  KVXFER_PLATFORM=cpu KVXFER_FIRST_CHECK_ARGS=--small \
#   bash benchmarks/device_check.sh OUTDIR
#
# Wheels: the machine's image already has jax (with its CUDA plugin), numpy, absl-py,
# pytest, matplotlib, cuda-bindings, torch and cupy. kvxfer itself travels as its own
# wheel, built here with
#     echo /.whl/ >> .git/info/exclude
#     python3 -m pip wheel --no-deps --wheel-dir .whl .
# and carried as `.whl`, rebuilt for every change (a wheel whose modules differ from the
# checkout's is not used: the log says so). Without .whl/ the script uses the checkout
# (PYTHONPATH).
#
# What comes back (at most 8 files, at most two folders deep):
#   OUTDIR/log.txt            every step's output, with its time and exit status, and
#                             the count of "does device compute in host memory space"
#   OUTDIR/env.txt            nvidia-smi, python, jax and its devices, kvxfer version,
#                             the CUDA driver and the copy engine kvxfer uses
#   OUTDIR/first.jsonl        the short check, both parts: one JSON object a step, as
#                             it ended
#   OUTDIR/check.json         the public-API check (benchmarks/device_check.py)
#   OUTDIR/tests.xml          JUnit report of the device tests (absent if cut short)
#   OUTDIR/bench/bench.json   the bench report (and bench/bench.png with matplotlib)
#   OUTDIR/bench/bench.txt    the bench report as text
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
  step "install kvxfer" 30 "$py" -m pip install -q --no-index --no-deps --no-compile \
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
from kvxfer.engine import copy_engine, dma_refusal
import jax.numpy as jnp
why = dma_refusal(jnp.zeros((8, 128), jnp.bfloat16))
print("dma mover:", "available" if why is None else f"refused: {why}")
if why is None:
    engine = copy_engine(jax.devices()[0])
    driver = getattr(engine, "driver", None)
    print("copy engine", engine.name, "mode", getattr(engine, "mode", "-"),
          "driver", getattr(driver, "version", "-"), "batch ABI",
          getattr(driver, "batch_abi", "-"), "NUMA node", engine.numa_node())
EOF
} > "$out/env.txt" 2>&1 || status=1
cat "$out/env.txt" >> "$log"

# What broke before, first; then every other step of the short check.
first=versions,callback_spy,several_groups,partial_enqueue,allocator_reuse,load_behind_offload,busy_thread
step "first check: what broke" 120 env JAX_PLATFORMS=$platform "$py" -m kvxfer.bench.first_check \
  "$out" --steps "$first" ${KVXFER_FIRST_CHECK_ARGS:-}
step "first check: the rest" 160 env JAX_PLATFORMS=$platform "$py" -m kvxfer.bench.first_check \
  "$out" --skip "$first" ${KVXFER_FIRST_CHECK_ARGS:-}

step "public API check" 50 bash -c "JAX_PLATFORMS='$platform' '$py' \
  benchmarks/device_check.py > '$out/check.json'"

# The tests run on the device: conftest.py only sets JAX_PLATFORMS when it is unset.
# Tests written for XLA:CPU facts (4 CPU devices, the raw path) skip with their reason.
# -v: one line per test in the log, so a run cut short by its limit still says which
# tests passed.
step "device tests" 120 env JAX_PLATFORMS=$platform "$py" -m pytest -v -p no:cacheprovider \
  -rs --junitxml="$out/tests.xml" tests/test_dma.py tests/test_dma_faults.py tests/test_lowering.py \
  "tests/test_faults.py::test_zero_dma_is_caught_on_every_mover[dma-layer]" \
  "tests/test_faults.py::test_zero_dma_is_caught_on_every_mover[pinned-all]" \
  tests/test_manager.py::test_a_load_that_moves_nothing_keeps_the_sharing_scan \
  tests/test_integration_sglang.py::test_a_plain_host_pool_has_no_sharding_in_the_slots_view \
  tests/test_value_semantics.py tests/test_engine_loop.py

step "kvxfer bench" 110 bash -c "env JAX_PLATFORMS=$platform '$py' -m kvxfer bench --quick \
  --no-check --out '$out/bench' > '$out/bench/bench.txt'"

# XLA prints one warning per instruction it turns into host compute.
warnings=$(grep -c "does device compute in host memory space" "$log")
echo "== host-compute warnings: $warnings" | tee -a "$log"
[ "$warnings" -eq 0 ] || status=1

echo "== done: status $status" | tee -a "$log"
exit "$status"
