"""``kvxfer bench``: kvxfer against the physical limit and what users write today.

Everything is measured side by side in one run, on the same machine, with the
variants of each case interleaved repeat by repeat (so a noisy neighbour slows
them all alike) and throughputs taken from the best repeat:

* **limit**: the physical limit for the same bytes; a numpy memcpy between
  preallocated host buffers on CPU; on GPU a pinned host<->device copy (PyTorch or
  CuPy when importable, else ``jax.device_put`` of one large ``pinned_host`` buffer);
* **user**: what users write today. Offloads: a per-page ``jax.device_get`` loop; a
  jitted per-page gather then ``jax.device_put`` to ``pinned_host``; one batched
  jitted gather then ``device_put`` to ``pinned_host``. Loads: a per-page
  ``device_put`` then a jitted donated scatter; one batched ``device_put`` and scatter;
* **kvxfer**: ``KVCacheManager`` offload and load (``path="auto"``) with
  ``integrity`` ``"off"`` / ``"page"`` and ``gate`` ``"all"`` / ``"layer"``; and the
  pinned mover (``path="pinned"``, both integrity modes, ``gate="all"``) in every
  throughput cell and sweep size where auto takes another mover (on CPU: raw; on GPU
  auto *is* the pinned mover, and its figures are reported as such).

A *block* is one layer's block; a *page* is one block index across every layer of a
slice class, what one host slot holds. Sections: throughput over block sizes and
dtypes at a fixed bytes per call; a prefix-length sweep (throughput vs bytes per
call, hit latency to the first and the last layer); concurrency (requests in flight
before waiting); per-call host overhead; integrity traffic; loading into a small vs
a large cache; memory; and what a call costs its caller's thread, on a bfloat16 cache
with ``path="staged"``, a float32 one with ``path="auto"`` (raw on XLA:CPU) and a
float16 one with ``path="pinned"``:

* **first call**: a fresh manager's first offload + wait and load + result of a
  size, without warm-up and after ``mgr.warmup(n)``, and the warm-up itself;
* **queued steps**: ``offload()`` / ``load()`` called right after dispatching donating
  jitted steps over the caches: the call alone, then ``wait()`` / ``result()``, the
  steps alone, and whether the call returned before they were done. Every device
  program of a transfer is enqueued before the call returns; a raw CPU copy runs on
  the caller's thread once the caches' writers are done, so such a call can wait
  for the steps: the section shows whether it did.

With ``models=`` (``kvxfer bench --model CONFIG``, repeatable; ``--only model`` alone), a
**models** section moves a model config's own caches (``configs/``: the engines' page
shapes, ``sglang-llama3-8b-p1`` with one token per page, ``vllm-tpu-llama3-8b``, ...):
offload and load of whole pages with integrity off and page against the limit in the
same run, with the host time per page.

The policy section (``--only policy``) replays the demo's workload and a scan-heavy
trace against a small ``HostCache`` over a disk store, once per eviction policy and
write-through setting: each policy's hit rate per tier against a cache that never
evicts, and the store bytes each setting writes (counts, the same on any machine).

The targets are one table, ``TARGET_TABLE``: each row is a threshold (a ``Targets``
field), the hardware it applies to (``cpu``, ``gpu``, ``tpu`` or ``any``) and the reason
for its number; ``kvxfer bench --targets`` prints it. A run prints every target with
its measured value: PASS, MISS, or N/A where the target is for other hardware (never
a miss). ``kvxfer bench`` exits 0 after a complete run whatever the figures;
``kvxfer bench --check`` exits 1 when a target that applies to the run's hardware misses.

Example:
    >>> from kvxfer import bench
    >>> report = bench.run_bench(config=bench.BenchConfig.smoke())
    >>> {t["status"] for t in report["targets"]} <= {"PASS", "MISS", "N/A"}
    True
    >>> text = bench.format_report(report)  # a smoke run's figures are not judged
    >>> text.startswith("kvxfer bench"), "Targets: not judged" in text
    (True, True)
    >>> judged = [t for t in report["targets"] if t["status"] != "N/A"]
    >>> met = len(judged) - len(bench.missed(report))
    >>> f"{met} of {len(judged)} targets that apply" in bench.format_report(report, judge=True)
    True
"""

from kvxfer import _lazy

_WHERE = {
    "kvxfer.bench._cli": ["register_cli"],
    "kvxfer.bench._config": ["BenchConfig"],
    "kvxfer.bench._run": ["SCHEMA", "run_bench"],
    "kvxfer.bench._sections": ["PINNED_METHODS"],
    "kvxfer.bench.report": ["TARGET_TABLE", "ZERO_OK", "Target", "Targets",
                            "evaluate_targets", "format_report", "iter_figures", "missed",
                            "targets_table"],
}
"""Where each name lives: imported from there on first use (``kvxfer --help`` starts
without JAX)."""

__getattr__, __dir__ = _lazy.exports(__name__, _WHERE)

__all__ = ["BenchConfig", "run_bench", "register_cli", "format_report", "iter_figures",
           "evaluate_targets", "missed", "Targets", "ZERO_OK", "SCHEMA", "PINNED_METHODS",
           "Target", "TARGET_TABLE", "targets_table"]
