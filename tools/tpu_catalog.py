"""The compiled TPU catalogue: what the real compiler chooses for every shipped cache.

A maintainer's tool, outside the wheel: ``python tools/tpu_catalog.py`` compiles
(deviceless, ``kvxfer.tpu``, in this script's own process) the cache of every layer
group of every built-in config, replicated and split over 2, 4 and 8 devices where its
shard dim divides, at every block count from 1 to 65536 (or the most the generation's
HBM holds), and every array of the derived catalogues at its
own shape, on v4, v5e, v5p, v6e and tpu7x. It writes:

* ``layouts/tpu_compiled.json``: a catalogue (``kvxfer.catalog`` format) with one
  entry per array, shard count and range of block counts over which the compiler's
  choice holds, with its provenance (jax, libtpu, topologies);
* each config's ``tpu_compiled`` list (``configs/*.toml``): the same choices, which
  ``kvxfer plan`` and the emulated layouts use (``LayerGroup.layout_for``);
* each derived catalogue entry's ``tpu_default`` mark: whether the compiler picks
  that layout for that shape (an entry it does not pick must say why it is kept).

``--check`` compares instead of writing: it says what changed (the libtpu that made the
shipped files and this one, each range whose layout changed, each range end that moved:
under a newer libtpu a largest count may no longer fit HBM), exit 1 on a difference.

Block counts are probed at powers of two and the config's own count; wherever two
probes disagree the interval is bisected, so each range's ends are exact.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

try:  # an installed kvxfer comes first; a plain checkout uses the package beside tools/
    import kvxfer  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvxfer import _resources  # noqa: E402
from kvxfer import catalog as _catalog  # noqa: E402
from kvxfer import config as _config  # noqa: E402
from kvxfer import tpu  # noqa: E402
from kvxfer.layout import inspect  # noqa: E402

__all__ = ["Choice", "block_count_choices", "group_choices", "build", "choice_changes",
           "main", "MAX_BLOCKS"]

MAX_BLOCKS = 65536
"""Block counts are probed up to this many (or what the HBM holds, if fewer)."""

_DERIVED = ("seeds", "tpu_kv_derived", "engines_derived")


@dataclasses.dataclass(frozen=True, slots=True)
class Choice:
    """The compiler's layout for one shard over a range of block counts (inclusive)."""

    shards: int
    first: int
    last: int
    layout: str

    def as_toml(self) -> str:
        return (f'{{ shards = {self.shards}, blocks = [{self.first}, {self.last}], '
                f'layout = "{self.layout}" }}')


def _fits(e: ValueError) -> bool:
    return "RESOURCE_EXHAUSTED" not in str(e)


def block_count_choices(layout_at: Callable[[int], str | None], probes: Sequence[int]
                        ) -> list[tuple[int, int, str]]:
    """``(first, last, layout)`` ranges of the layouts ``layout_at(n)`` gives.

    ``layout_at`` returns None where the array does not fit; the probes above the
    last that fits are dropped and the largest count that fits is bisected for.
    Wherever two neighbouring probes disagree the interval is bisected, so every
    range's ends are counts that were compiled.

    Example:
        >>> block_count_choices(lambda n: "a" if n < 100 else "b", [1, 64, 256])
        [(1, 99, 'a'), (100, 256, 'b')]
        >>> block_count_choices(lambda n: None if n > 1000 else "a", [1, 512, 4096])
        [(1, 1000, 'a')]
    """
    memo: dict[int, str | None] = {}

    def at(n: int) -> str | None:
        if n not in memo:
            memo[n] = layout_at(n)
        return memo[n]

    probes = sorted(set(probes))
    fitting = [n for n in probes if at(n) is not None]
    if not fitting:
        return []
    top = fitting[-1]
    above = [n for n in probes if n > top]
    if above:  # the largest count that fits, between the last fit and the next probe
        lo, hi = top, above[0]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if at(mid) is not None else (lo, mid)
        top = lo
        fitting.append(top)

    def refine(lo: int, hi: int) -> None:
        if hi - lo <= 1 or at(lo) == at(hi):
            return
        mid = (lo + hi) // 2
        at(mid)
        refine(lo, mid)
        refine(mid, hi)

    for a, b in zip(fitting, fitting[1:]):
        refine(a, b)
    counts = sorted(n for n, v in memo.items() if v is not None and n <= top)
    out: list[tuple[int, int, str]] = []
    for n in counts:
        if out and out[-1][2] == memo[n]:
            out[-1] = (out[-1][0], n, out[-1][2])
        else:
            out.append((n, n, memo[n]))
    return out


def _probes(extra: Sequence[int] = ()) -> list[int]:
    return sorted({1 << k for k in range(17)} | set(extra))


def group_choices(group: _config.LayerGroup, target: str, probes: Sequence[int]
                  ) -> list[Choice]:
    """Every shard count's choices for one config group on one target."""
    out = []
    for shards in _shard_counts(group):
        def layout_at(n: int, shards: int = shards) -> str | None:
            try:
                c = tpu.compiled_layout((n, *group.block_shape), group.dtype, target,
                                        num_devices=shards,
                                        shard_dim=group.shard_dim if shards > 1 else None)
            except ValueError as e:
                if _fits(e):
                    raise
                return None
            return str(c.layout)
        out += [Choice(shards, a, b, layout)
                for a, b, layout in block_count_choices(layout_at, probes)]
    return out


def _shard_counts(group: _config.LayerGroup) -> list[int]:
    counts = [1]
    if group.shard_dim is not None:
        counts += [d for d in (2, 4, 8) if group.num_shards(d) == d]
    return counts


def _merge(per_target: dict[str, list[Choice]]) -> list[Choice]:
    """The choices every target agrees on, cut to the block counts all of them hold."""
    lists = list(per_target.values())
    layouts = [[(c.shards, c.first, c.layout) for c in cs] for cs in lists]
    if any(ls != layouts[0] for ls in layouts[1:]):
        raise ValueError("the generations disagree: " + "; ".join(
            f"{t}: {[c.as_toml() for c in cs]}" for t, cs in per_target.items()))
    merged = []
    for i, c in enumerate(lists[0]):
        merged.append(dataclasses.replace(c, last=min(cs[i].last for cs in lists)))
    return merged


def _entry(name: str, shape: tuple[int, ...], dtype: str, layout: str, *, source: str,
           **extra: Any) -> dict[str, Any]:
    g = inspect(shape, dtype, layout)
    return {"name": name, "shape": list(shape), "dtype": dtype, "layout": layout,
            "block_dim": 0, "source": source,
            "expected": {"addressable": g.addressable, "granularity": g.granularity,
                         "bytes_per_block": g.bytes_per_block}, **extra}


def build(targets: Sequence[str] = tpu.GENERATIONS, configs: Sequence[str] | None = None,
          log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
    """Compiles everything; returns ``{"catalogue": ..., "configs": ..., "derived": ...}``.

    ``configs``: ``{config name: {group name: [Choice, ...]}}``; ``derived``:
    ``{catalogue name: {entry name: compiler's layout}}``.
    """
    import jax

    version = tpu.require_compiler()
    source = f"compiled for {', '.join(targets)} (libtpu {version}, deviceless)"
    arrays: list[dict[str, Any]] = []
    per_config: dict[str, dict[str, list[Choice]]] = {}
    for name in configs if configs is not None else _config.builtin_names():
        spec = _config.load(name)
        per_config[spec.name] = {}
        for group in spec.groups:
            log(f"{spec.name}/{group.name}")
            probes = _probes([spec.num_device_blocks])
            choices = _merge({t: group_choices(group, t, probes) for t in targets})
            per_config[spec.name][group.name] = choices
            for c in choices:
                shard = [c.last, *group.block_shape]
                if c.shards > 1:
                    shard[group.shard_dim] //= c.shards
                arrays.append(_entry(
                    f"{spec.name}/{group.name}/shards{c.shards}/blocks{c.first}-{c.last}",
                    tuple(shard), group.dtype, c.layout, source=source,
                    config=spec.name, group=group.name, shards=c.shards,
                    shard_dim=group.shard_dim if c.shards > 1 else None,
                    blocks=[c.first, c.last]))
    derived: dict[str, dict[str, str]] = {}
    for cat_name in _DERIVED:
        derived[cat_name] = {}
        for e in _catalog.load(cat_name).entries:
            got = {t: str(tpu.compiled_layout(e.shape, e.dtype, t).layout) for t in targets}
            if len(set(got.values())) != 1:
                raise ValueError(f"{cat_name}/{e.name}: the generations disagree: {got}")
            layout = next(iter(got.values()))
            derived[cat_name][e.name] = layout
            arrays.append(_entry(f"{cat_name}/{e.name}", e.shape, e.dtype, layout,
                                 source=source, catalogue=cat_name,
                                 catalogue_layout=e.layout, blocks=[e.shape[0]] * 2))
    catalogue = {
        "description": (
            "The layouts the real XLA:TPU compiler chooses (deviceless) for the cache of "
            "every layer group of the built-in configs, one shard each (replicated, and "
            "split over 2, 4, 8 devices where the shard dim divides), over the block "
            "counts in 'blocks' (ends exact: probed at powers of two and bisected where "
            "the choice changes), and for every array of the derived catalogues at its "
            "own shape. The same on every generation listed. Regenerate with "
            "`python tools/tpu_catalog.py`."),
        "provenance": {"backend": "tpu (deviceless compile)", "jax": jax.__version__,
                       "libtpu": version,
                       "topologies": {t: tpu.topology(t, 8) for t in targets},
                       "program": "a donated one-block update; the output's layout"},
        "arrays": arrays,
    }
    return {"catalogue": catalogue, "configs": per_config, "derived": derived}


def _ranges(choices: Sequence[Choice]) -> str:
    return ", ".join(f"{c.first}-{c.last} {c.layout}" for c in choices)


def choice_changes(where: str, old: Sequence[Choice], new: Sequence[Choice]) -> list[str]:
    """What differs between the shipped choices of one group (``old``) and the
    compiler's (``new``), a line per shard count that differs: a largest count that
    moved (the layouts the same), or the ranges whose layouts changed.

    Example:
        >>> old = [Choice(1, 1, 115, "{2,1,0}"), Choice(1, 116, 4000, "{0,2,1}")]
        >>> choice_changes("mla/c0", old, old)
        []
        >>> choice_changes("mla/c0", old, old[:1] + [Choice(1, 116, 3990, "{0,2,1}")])
        ['mla/c0 x1: fits up to 3990 blocks, was 4000 (layouts unchanged)']
        >>> choice_changes("mla/c0", old, [Choice(1, 1, 4000, "{2,1,0}")])
        ['mla/c0 x1: layouts changed: 1-115 {2,1,0}, 116-4000 {0,2,1} -> 1-4000 {2,1,0}']
    """
    out = []
    for shards in sorted({c.shards for c in (*old, *new)}):
        a = [c for c in old if c.shards == shards]
        b = [c for c in new if c.shards == shards]
        if a == b:
            continue
        if a and b and a[:-1] == b[:-1] and (a[-1].first, a[-1].layout) == \
                (b[-1].first, b[-1].layout):
            out.append(f"{where} x{shards}: fits up to {b[-1].last} blocks, was {a[-1].last}"
                       " (layouts unchanged)")
        else:
            out.append(f"{where} x{shards}: layouts changed: {_ranges(a) or 'none'} -> "
                       f"{_ranges(b) or 'none'}")
    return out


def _changes(result: dict[str, Any]) -> list[str]:
    """What a run found different from the shipped files (``choice_changes`` for every
    group; the libtpu and jax that made them; derived entries the compiler now picks
    differently)."""
    out = []
    path = _resources.data_dir("layouts") / "tpu_compiled.json"
    made = json.loads(path.read_text(encoding="utf-8"))["provenance"] if path.exists() \
        else {}
    now = result["catalogue"]["provenance"]
    for key in ("libtpu", "jax"):
        if made.get(key) != now[key]:
            out.append(f"{key}: the shipped files were made with {made.get(key)}, this is "
                       f"{now[key]}")
    for name, groups in result["configs"].items():
        spec = _config.load(name)
        for group in spec.groups:
            if group.name in groups:
                out += choice_changes(f"{name}/{group.name}",
                                      [Choice(*c) for c in group.tpu_compiled],
                                      groups[group.name])
    for cat_name, layouts in result["derived"].items():
        for e in _catalog.load(cat_name).entries:
            if e.name in layouts and e.tpu_default is not (layouts[e.name] == e.layout):
                out.append(f"{cat_name}/{e.name}: the compiler's layout is now "
                           f"{layouts[e.name]} (tpu_default was {e.tpu_default})")
    return out


# -- writing into the shipped files ---------------------------------------------------

_BLOCK_RE = re.compile(r"(?m)^# The compiler's choice per shard[^\n]*\n#[^\n]*\n"
                       r"tpu_compiled = \[\n(?:  [^\n]*\n)*\]\n")


def config_text(text: str, choices: dict[str, list[Choice]], version: str,
                targets: Sequence[str] = tpu.GENERATIONS) -> str:
    """``text`` (a config file) with each group's ``tpu_compiled`` list replaced (and
    its ``tpu_layout``, unless a ``tpu_layout_note`` keeps it)."""
    sections = re.split(r"(?m)^(?=\[\[layers\]\]\n)", text)
    out = [sections[0]]
    for section in sections[1:]:
        m = re.search(r'(?m)^name = "([^"]+)"', section)
        body = _BLOCK_RE.sub("", section).rstrip("\n") + "\n"
        if m and m.group(1) in choices and "tpu_layout_note" not in body:
            engine = [c for c in choices[m.group(1)] if c.shards == 1][-1].layout
            body = re.sub(r'(?m)^tpu_layout = "([^"]*)"(.*)$',
                          lambda t: t.group(0) if t.group(1) == engine else
                          f'tpu_layout = "{engine}"  # the compiler\'s, at engine sizes',
                          body)
        if m and m.group(1) in choices:
            lines = "".join(f"  {c.as_toml()},\n" for c in choices[m.group(1)])
            same = ", ".join(targets[:-1]) + f" and {targets[-1]}" if len(targets) > 1 \
                else targets[0]
            body += (f"# The compiler's choice per shard (libtpu {version}, the same on "
                     f"{same}),\n# by block count: "
                     "`python tools/tpu_catalog.py` writes it.\n"
                     f"tpu_compiled = [\n{lines}]\n")
        out.append(body)
    return "\n".join([out[0].rstrip("\n") + "\n"] + out[1:]) if len(out) > 1 else out[0]


def _derived_text(name: str, layouts: dict[str, str]) -> str:
    path = _resources.find("layouts", name)
    raw = json.loads(path.read_text(encoding="utf-8"))
    for a in raw["arrays"]:
        key = a.get("name") or f"{a['dtype']}{a['shape']}"
        default = layouts[key] == a["layout"]
        a["tpu_default"] = default
        if default:
            a.pop("tpu_compiler_layout", None)
        else:
            a["tpu_compiler_layout"] = layouts[key]
    return json.dumps(raw, indent=1) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/tpu_catalog.py [--check] [--targets v6e,...]``."""
    p = argparse.ArgumentParser(prog="python tools/tpu_catalog.py",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true",
                   help="compare with the shipped files instead of writing them")
    p.add_argument("--targets", default=",".join(tpu.GENERATIONS),
                   help="comma-separated generations (default: all five)")
    args = p.parse_args(argv)
    targets = [t for t in args.targets.split(",") if t]
    try:
        result = build(targets, log=lambda s: print(s, file=sys.stderr, flush=True))
    except tpu.CompilerUnavailableError as e:
        print(f"tpu_catalog: error: {e}", file=sys.stderr)
        return 2
    version = result["catalogue"]["provenance"]["libtpu"]
    files: dict[Path, str] = {}
    files[_resources.data_dir("layouts") / "tpu_compiled.json"] = \
        json.dumps(result["catalogue"], indent=1) + "\n"
    for name, choices in result["configs"].items():
        path = _resources.find("configs", name)
        files[path] = config_text(path.read_text(encoding="utf-8"), choices, version,
                                  targets)
    for name, layouts in result["derived"].items():
        files[_resources.find("layouts", name)] = _derived_text(name, layouts)
    stale = []
    for path, text in files.items():
        old = path.read_text(encoding="utf-8") if path.exists() else None
        if old == text:
            continue
        if args.check:
            stale.append(path.name)
        else:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}", file=sys.stderr)
    if stale:
        print(f"tpu_catalog: out of date with the compiler: {', '.join(stale)}",
              file=sys.stderr)
        for line in _changes(result) or ["(no layout changed: the files differ in text)"]:
            print(f"  {line}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
