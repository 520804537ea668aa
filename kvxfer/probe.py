"""``kvxfer probe``: registration plus a permuted per-block round trip.

Builds a model's caches (random bits) on the current backend, registers them with a
``KVCacheManager``, offloads a random permutation of blocks, clobbers device blocks,
loads the pages back into other blocks, and checks every layer byte for byte: the
moved blocks must equal their sources and every other block must be untouched.

Example:
    >>> from kvxfer.probe import run_probe
    >>> report = run_probe("tiny", num_pages=8)      # doctest: +SKIP
    >>> report["ok"]                                 # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer import _interrupt
from kvxfer import config as _config
from kvxfer._check import check_int
from kvxfer._text import format_bytes, table
from kvxfer.layout import LayoutError

if TYPE_CHECKING:
    import jax

    from kvxfer.manager import KVCacheManager

__all__ = ["run_probe", "round_trip"]


def _clobber(a: jax.Array, blocks: np.ndarray) -> jax.Array:
    """A copy of ``a`` whose ``blocks`` hold inverted bits (same layout and sharding)."""
    import jax

    from kvxfer import testing

    x = np.array(testing.bits(a))
    x[blocks] = ~x[blocks]
    if a.dtype.name in ("int4", "uint4"):
        x &= 0x0F
    return jax.device_put(x.view(a.dtype), a.format)  # same layout and sharding


def round_trip(mgr: KVCacheManager, caches: list[jax.Array], num_pages: int, *,
               seed: int = 0, gate: str = "all", inject: str | None = None
               ) -> tuple[list[jax.Array], list[dict[str, Any]], dict[str, Any]]:
    """Offload ``num_pages`` permuted blocks, clobber, load elsewhere, compare.

    With ``inject`` (a ``kvxfer.faults`` name), the middle page is damaged on the
    host before the load; the pages before it must still load byte-exact, and the
    summary says whether the fault was detected at that page.

    Returns:
      ``(new_caches, per-layer rows, summary)``; each row has ``byte_exact``. At most
      the caches' blocks per layer move (``run_probe`` refuses more).
    """
    from kvxfer import testing
    from kvxfer.engine import TransferError

    rng = np.random.default_rng(seed)
    n = caches[0].shape[0]
    k = min(num_pages, n)
    src = rng.permutation(n)[:k]
    dst = rng.permutation(n)[:k]
    before = [testing.bits(c) for c in caches]
    t0 = time.perf_counter()
    pages = mgr.offload(caches, src, keys=[int(x) for x in rng.integers(0, 2**63, k)]).wait()
    t_off = time.perf_counter() - t0
    clobbered = [_clobber(c, dst) for c in caches]
    expected = []
    for b in before:
        e = np.array(b)
        e[dst] = b[src]
        expected.append(e)
    keys, bad, injected = None, None, {}
    if inject is not None:
        bad, layer = k // 2, len(caches) // 2
        if inject == "one-shard":
            layer = next((i for i in range(len(caches))
                          if mgr.plan.class_of_layer(i)[0].num_shards > 1), None)
            if layer is None:
                raise ValueError("--inject one-shard needs a sharded layer (use --devices 2+)")
        injected = {"fault": inject, "page": bad, "layer": layer}
        pages, keys = testing.inject(inject, mgr, clobbered, pages, bad, layer, seed=seed,
                                     device_blocks=dst)
    t0 = time.perf_counter()
    if inject == "transfer":
        new, handle = mgr.load(clobbered, pages, dst, keys=keys, gate=gate)
        try:
            handle.result()
            injected["detected"] = False
        except TransferError as e:
            injected.update(detected=True, error=str(e))
        t_load = time.perf_counter() - t0
        return new, [], {"pages": k, "verified_prefix": 0, "reasons": {}, "offload_s": t_off,
                         "load_s": t_load, "bytes_moved": 0, "injected": injected}
    new, handle = mgr.load(clobbered, pages, dst, keys=keys, gate=gate)
    result = handle.result()
    t_load = time.perf_counter() - t0
    mgr.free(pages[:result.verified_prefix])
    if inject is not None:
        mgr.free([p for p in pages[result.verified_prefix:] if inject != "stale-slot"
                  or p is not pages[bad]])
        injected.update(detected=result.verified_prefix == bad and bad in result.reasons,
                        reason=result.reasons.get(bad, ""),
                        consumed_before_failure=result.consumed_before_failure)
    rows = []
    for i, (a, e) in enumerate(zip(new, expected)):
        got = testing.bits(a)
        good = dst[:result.verified_prefix]
        moved = bool(np.array_equal(got[good], e[good]))
        rest = np.ones(n, bool)
        rest[dst] = False
        untouched = bool(np.array_equal(got[rest], e[rest]))
        rows.append({"layer": i, "byte_exact": moved and untouched, "moved_exact": moved,
                     "others_untouched": untouched})
    moved_bytes = sum(mgr.plan.class_of_layer(i)[0].bytes_per_block for i in range(len(new))) * k
    summary = {"pages": k, "verified_prefix": result.verified_prefix,
               "reasons": {str(j): r for j, r in result.reasons.items()},
               "offload_s": t_off, "load_s": t_load, "bytes_moved": moved_bytes}
    if inject is not None:
        summary["injected"] = injected
    return new, rows, summary


def _check_size(spec: _config.ModelSpec, num_pages: int, num_blocks: int | None,
                devices: int, emulate_tpu: bool, integrity: str = "off",
                inject: str | None = None) -> None:
    """Refuses, before JAX is imported and anything is allocated: a fault without page
    digests, ``one-shard`` with no sharded layer, pages above the device blocks and a
    probe whose caches (held about five times: the caches, their clobbered copies, the
    expected and loaded bits, the result), host pool and per-device runtime exceed the
    host memory available now (``BudgetError``, naming the sizes)."""
    from kvxfer.plan import RUNTIME_BYTES_PER_DEVICE, BudgetError, available_host_memory

    if inject is not None and integrity != "page":
        raise ValueError(f"--inject {inject} needs --integrity page")
    layers = spec.layer_specs(num_blocks, num_devices=devices, emulate_tpu=emulate_tpu)
    if inject == "one-shard" and not any(s.num_shards > 1 for s in layers):
        raise ValueError("--inject one-shard needs a sharded layer (use --devices 2+)")
    n = layers[0].num_blocks if layers else 0
    if num_pages > n:
        raise ValueError(f"--pages {num_pages} is more than the {n} device blocks per layer "
                         f"of {spec.name} (raise --num-blocks or lower --pages)")
    caches = sum(s.num_blocks * s.logical_block_bytes for s in layers)
    pool = num_pages * sum(s.logical_block_bytes for s in layers)
    runtime = devices * RUNTIME_BYTES_PER_DEVICE
    need, have = 5 * caches + 2 * pool + runtime, available_host_memory()
    if need > have:
        raise BudgetError(f"probing {spec.name} with {n} blocks per layer and {num_pages} "
                          f"pages on {devices} device{'s' if devices != 1 else ''} needs "
                          f"about {format_bytes(need)} of host memory (caches "
                          f"{format_bytes(caches)} held five times, host pool "
                          f"{format_bytes(pool)}, runtime {format_bytes(runtime)}); "
                          f"{format_bytes(have)} is available")


def run_probe(config: str, *, num_pages: int = 16, num_blocks: int | None = None,
              devices: int = 1, path: str = "auto", integrity: str = "off",
              emulate_tpu: bool = True, gate: str = "all", seed: int = 0,
              inject: str | None = None) -> dict[str, Any]:
    """Runs the round trip over one config; see the module docstring.

    With ``path="raw"`` and emulated TPU layouts, classes the inspector rejects
    are refused by the manager (a ``LayoutError`` naming the layout); the probe then
    records the refusal and checks the same caches round-trip on the staged path.
    """
    spec = _config.load_builtin(config)
    devices = check_int(devices, "devices", minimum=1)
    num_pages = check_int(num_pages, "num_pages", minimum=1)
    _check_size(spec, num_pages, num_blocks, devices, emulate_tpu, integrity, inject)
    import jax

    from kvxfer.manager import KVCacheManager

    devs = jax.devices()[:devices] if devices > 1 else None
    if devices > len(jax.devices()):
        raise ValueError(f"--devices {devices}: only {len(jax.devices())} devices present")
    caches = spec.build_caches(num_blocks, devices=devs, seed=seed)
    layouts = spec.tpu_layouts(num_blocks) if emulate_tpu else None
    names = spec.layer_names()
    geos = [g for _, g in spec.inspect_layers(num_blocks)]
    refusal = None
    try:
        mgr = KVCacheManager(caches, num_host_blocks=num_pages, layouts=layouts,
                             integrity=integrity, path=path)
    except LayoutError as e:
        if path != "raw":
            raise
        refusal = str(e)
        mgr = KVCacheManager(caches, num_host_blocks=num_pages, layouts=layouts,
                             integrity=integrity, path="staged")
    with mgr:
        _, rows, summary = round_trip(mgr, caches, num_pages, seed=seed, gate=gate,
                                      inject=inject)
        paths = mgr.paths
        plan = mgr.plan
    disagreements = []
    for i, row in enumerate(rows):
        g = geos[i]
        cls, _ = plan.class_of_layer(i)
        row.update({"name": names[i], "addressable": g.addressable,
                    "granularity": g.granularity, "path": paths[i],
                    "host_bytes_per_block": cls.bytes_per_block,
                    "device_bytes_per_block": g.bytes_per_block})
    if refusal is not None and all(g.addressable for g in geos):
        disagreements.append("the raw path refused layouts the inspector accepts")
    ok = all(r["byte_exact"] for r in rows) and not disagreements
    if inject is not None:
        ok = ok and summary["injected"].get("detected", False)
    return {"config": spec.name, "backend": jax.devices()[0].platform,
            "devices": devices, "path_requested": path, "integrity": integrity,
            "tpu_layouts": emulate_tpu,
            "raw_refused": refusal, "layers": rows, "summary": summary,
            "disagreements": disagreements, "ok": ok}


def _layer_table(report: dict[str, Any]) -> str:
    """The per-layer table; its TPU-layout columns only where the layouts were applied."""
    tpu = report.get("tpu_layouts", True)
    rows = []
    for r in report["layers"]:
        exact = "yes" if r["byte_exact"] else "NO"
        if not tpu:
            rows.append([r["name"], r["path"], format_bytes(r["host_bytes_per_block"]), exact])
            continue
        verdict = "addressable" if r["addressable"] else f"NOT addressable (g={r['granularity']})"
        rows.append([r["name"], verdict, r["path"], format_bytes(r["host_bytes_per_block"]),
                     format_bytes(r["device_bytes_per_block"]), exact])
    if not tpu:
        return table(rows, ["layer", "path", "bytes/block", "byte-exact"])
    return table(rows, ["layer", "verdict (TPU layout)", "path", "host bytes/block",
                        "device bytes/block (TPU layout)", "byte-exact"])


def _print_human(report: dict[str, Any]) -> None:
    print(_layer_table(report))
    s = report["summary"]
    if report["raw_refused"]:
        print(f"raw path refused (expected for rejected layouts): {report['raw_refused']}")
    if "injected" in s:
        inj = s["injected"]
        print(f"injected {inj['fault']} into page {inj['page']} layer {inj['layer']}: "
              + ("detected" if inj.get("detected") else "NOT DETECTED")
              + (f" ({inj.get('reason') or inj.get('error')})"))
    print(f"{report['config']} on {report['backend']} x{report['devices']}: {s['pages']} pages, "
          f"{format_bytes(s['bytes_moved'])} each way, offload {s['offload_s'] * 1e3:.1f} ms, "
          f"load {s['load_s'] * 1e3:.1f} ms, verified prefix {s['verified_prefix']}: "
          + ("OK" if report["ok"] else "MISMATCH"))


def _cmd_probe(args: argparse.Namespace) -> int:
    """``kvxfer probe`` (its options: ``kvxfer._probe_cli``)."""
    configs = args.config or ["tiny"]
    if args.seeds:
        configs = ["seed-good", "seed-interleaved"]
    integrity = args.integrity or ("page" if args.inject else "off")
    # Pages above a config's device blocks are refused from its TOML alone: no dtype is
    # parsed for it, so neither ml_dtypes nor JAX starts.
    for name in configs:
        blocks = args.num_blocks or _config.device_blocks(name)
        if blocks is not None and args.pages > blocks:
            raise ValueError(f"--pages {args.pages} is more than the {blocks} device blocks "
                             f"per layer of {name} (raise --num-blocks or lower --pages)")
    # Every config's argument errors before the first one's run (and before JAX).
    for name in configs:
        _check_size(_config.load_builtin(name), args.pages, args.num_blocks, args.devices,
                    not args.no_tpu_layouts, integrity, args.inject)
    reports = []
    for name in configs:
        _interrupt.check()  # between configs: where the command line's Ctrl-C stops it
        report = run_probe(name, num_pages=args.pages, num_blocks=args.num_blocks,
                           devices=args.devices, path=args.path, integrity=integrity,
                           emulate_tpu=not args.no_tpu_layouts, gate=args.gate, seed=args.seed,
                           inject=args.inject)
        reports.append(report)
        if args.json:
            print(json.dumps(report))
        else:
            _print_human(report)
    bad = [r["config"] for r in reports if not r["ok"]]
    if bad:
        print(f"kvxfer probe: mismatch in {', '.join(bad)}", file=sys.stderr)
        return 1
    return 0
