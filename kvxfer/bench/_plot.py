"""The plot of a run: throughput against bytes per call, offload and load panels.

Each variant is drawn alike (colour, line style) in every panel it is in; the colours
are the Okabe-Ito palette's (readable in colour blindness).

Example:
    >>> len({v.colour for v in VARIANTS}) == len(VARIANTS), [d for _, d in PANELS]
    (True, ['d2h', 'h2d'])
"""

from __future__ import annotations

from typing import Any, NamedTuple

from kvxfer._text import format_bytes

__all__ = ["Variant", "VARIANTS", "PANELS", "figure", "plot"]


class Variant(NamedTuple):
    """One line of the plot, drawn alike (colour and style) in every panel it is in."""

    name: str
    colour: str
    linestyle: str
    #: Direction (``"d2h"``, ``"h2d"``) -> (method in a report row's ``methods``, or
    #: ``"limit"``; its legend label).
    methods: dict[str, tuple[str, str]]


#: The plot's variants; colours from the Okabe-Ito palette (readable in colour blindness).
VARIANTS: tuple[Variant, ...] = (
    Variant("limit", "#000000", "-", {"d2h": ("limit", "limit"), "h2d": ("limit", "limit")}),
    Variant("user, per page", "#E69F00", ":", {
        "d2h": ("user_device_get", "user device_get / page"),
        "h2d": ("user_put_scatter", "user device_put + donated scatter / page")}),
    Variant("user, per page, jitted gather", "#CC79A7", "-.", {
        "d2h": ("user_gather_pinned", "user jitted gather -> pinned_host / page")}),
    Variant("user, batched", "#D55E00", "--", {
        "d2h": ("user_batched_gather_pinned", "user jitted gather -> pinned_host, batched"),
        "h2d": ("user_batched_put_scatter", "user device_put + donated scatter, batched")}),
    Variant("kvxfer integrity=off", "#0072B2", "-", {
        "d2h": ("offload_off", "kvxfer integrity=off"),
        "h2d": ("load_off_all", "kvxfer integrity=off, gate=all")}),
    Variant("kvxfer integrity=page", "#009E73", "-", {
        "d2h": ("offload_page", "kvxfer integrity=page"),
        "h2d": ("load_page_all", "kvxfer integrity=page, gate=all")}),
    Variant("kvxfer integrity=page, gate=layer", "#56B4E9", "--", {
        "h2d": ("load_page_layer", "kvxfer integrity=page, gate=layer")}),
    Variant("kvxfer path=pinned, integrity=page", "#F0E442", "-", {
        "d2h": ("offload_pinned_page", "kvxfer path=pinned, integrity=page"),
        "h2d": ("load_pinned_page_all", "kvxfer path=pinned, integrity=page, gate=all")}),
)

#: The panels of the plot: (title, direction).
PANELS = (("offload (device -> host)", "d2h"), ("load (host -> device)", "h2d"))


def figure(report: dict[str, Any]) -> Any:
    """Throughput vs bytes per call, offload and load panels, from the prefix sweep.

    Returns:
      A ``matplotlib.figure.Figure`` (with an Agg canvas).

    Raises:
      ImportError: matplotlib is not installed (``pip install 'kvxfer[plot]'``).
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FixedLocator, NullLocator

    sweep = report["sweep"]
    sizes = [r["bytes"] for r in sweep]
    meta = report["meta"]
    limit_label = ("pinned copy" if meta["platform"] == "gpu" else "memcpy") + " (limit)"
    fig = Figure(figsize=(12, 6.5))
    FigureCanvasAgg(fig)
    for i, (title, direction) in enumerate(PANELS):
        ax = fig.add_subplot(1, 2, i + 1)
        for v in VARIANTS:
            if direction not in v.methods:
                continue
            key, label = v.methods[direction]
            if key == "limit":
                ax.plot(sizes, [r["limit"][direction]["gbps"] for r in sweep], v.linestyle,
                        color=v.colour, lw=2, label=limit_label)
                continue
            pts = [(r["bytes"], r["methods"][key]["gbps"]) for r in sweep if key in r["methods"]]
            if pts:
                ax.plot(*zip(*pts), v.linestyle, color=v.colour, marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(FixedLocator(sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xticklabels([format_bytes(n) for n in sizes], rotation=30, ha="right")
        ax.set_xlabel("bytes per call")
        ax.set_ylabel("GB/s (best repeat)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2)
    fig.suptitle(f"kvxfer bench {meta['date']}: {meta['platform']} ({meta['device']}), "
                 f"{sweep[0]['layers']} layers x {format_bytes(sweep[0]['block_bytes'])} "
                 "bfloat16 blocks")
    fig.tight_layout()
    return fig


def plot(report: dict[str, Any], path: str) -> str | None:
    """Writes ``figure(report)`` as a PNG at ``path``; None (nothing written) without matplotlib."""
    try:
        fig = figure(report)
    except ImportError:
        return None
    fig.savefig(path, dpi=110)
    return path
