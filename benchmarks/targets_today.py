"""Which targets committed runs meet, judged again by today's targets table.

Prints the markdown table at the top of BENCHMARKS.md: one row per row of
``kvxfer.bench.TARGET_TABLE``, one column of CPU runs (each given run judged again with
``evaluate_targets``, the newest first) and one for accelerators, which kvxfer has
not measured (every GPU or TPU target reads "not measured").

    python benchmarks/targets_today.py benchmarks/cpu-2026-12-04-quick-dma-2 \\
        benchmarks/cpu-2026-12-04-quick-dma benchmarks/cpu-2026-12-02-cache-batch

A target no given run measured reads "not measured".
"""

from __future__ import annotations

import json
import pathlib
import sys
from typing import Any

from kvxfer import bench


def _worst(lines: list[dict[str, Any]]) -> float:
    op = lines[0]["op"]
    if op == ">=":
        return min(t["value"] for t in lines)
    if op == "<=":
        return max(t["value"] for t in lines)
    return max((t["value"] for t in lines), key=lambda v: abs(v - 1))


def _cell(runs: list[tuple[str, dict[str, Any]]], field: str) -> str:
    said = []
    for label, report in runs:
        lines = [t for t in report["targets"] if t["target"] == field and t["status"] != "N/A"]
        if not lines:
            continue
        missed = sum(t["status"] == "MISS" for t in lines)
        verdict = "met" if not missed else \
            ("**missed**" if len(lines) == 1 else f"**missed** {missed} of {len(lines)}")
        said.append(f"{verdict}: {_worst(lines):.3g} ({label})")
    return "; ".join(said) or "not measured"


def main(paths: list[str]) -> str:
    runs = []
    for p in paths:
        path = pathlib.Path(p)
        report = json.loads((path / "bench.json" if path.is_dir() else path).read_text())
        if report["meta"]["platform"] != "cpu":
            raise SystemExit(f"{p}: a {report['meta']['platform']} run; this table's runs "
                             "are CPU runs")
        report = {**report, "targets": bench.evaluate_targets(report)}
        git = report["meta"]["source"].rsplit("git ", 1)[-1].split()[0]
        runs.append((f"{report['meta']['date']} {git}", report))
    rows = ["| hardware | target | CPU (worst line; run) | GPU, TPU |", "| --- | --- | --- | --- |"]
    for t in bench.TARGET_TABLE:
        cpu = _cell(runs, t.field) if t.applies("cpu") else "n/a"
        accel = "not measured" if t.applies("gpu") or t.applies("tpu") else "n/a"
        rows.append(f"| {t.hardware_label} | {t.statement()} | {cpu} | {accel} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(main(sys.argv[1:]))
