"""Catalogues of XLA layouts (``layouts/*.json``) and their expected verdicts.

A catalogue is one JSON object::

    {"description": "...",
     "provenance": {"backend": "tpu", "device_kind": "...", ...},   # optional
     "arrays": [
        {"name": "seed-interleaved",
         "shape": [512, 3, 2048], "dtype": "bfloat16",
         "layout": "{2,0,1:T(8,128)(2,1)}", "block_dim": 0,
         "source": "observed on tpu7x (upstream report)",
         "expected": {"addressable": false, "granularity": 512,
                      "bytes_per_block": null}}]}

``source`` says where the layout comes from: ``observed on <device> (...)`` for a
layout seen on hardware, ``derived`` for one built from the TPU tiling
conventions, ``captured on <backend>`` for ``tpu_probes/capture_layouts.py``.
``expected`` may hold any subset of ``addressable``, ``granularity``,
``bytes_per_block``, ``physical_bytes`` and ``padding_factor``. ``tpu_default`` (optional)
says whether the real TPU compiler picks this layout for this shape by itself
(``python tools/tpu_catalog.py`` sets it); an entry it does not pick is a layout chosen
on purpose, and ``tpu_default_note`` must say why it is kept.

Example:
    >>> cat = load("seeds")
    >>> all(r.agrees for r in cat.check()), len(cat.entries)
    (True, 6)
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from kvxfer import _resources
from kvxfer.layout import LayoutError, SliceGeometry, dtype_name, inspect

__all__ = ["Entry", "Catalog", "CheckResult", "load", "builtin_names", "entry_from_geometry"]

_EXPECTED_KEYS = ("addressable", "granularity", "bytes_per_block", "physical_bytes",
                  "padding_factor")


@dataclasses.dataclass(frozen=True, slots=True)
class Entry:
    """One array of a catalogue."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    layout: str
    block_dim: int
    source: str
    expected: dict[str, Any]
    tpu_default: bool | None = None
    tpu_default_note: str = ""

    def inspect(self) -> SliceGeometry:
        return inspect(self.shape, self.dtype, self.layout, block_dim=self.block_dim)

    def as_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
               "layout": self.layout, "block_dim": self.block_dim, "source": self.source,
               "expected": dict(self.expected)}
        if self.tpu_default is not None:
            out["tpu_default"] = self.tpu_default
        if self.tpu_default_note:
            out["tpu_default_note"] = self.tpu_default_note
        return out


@dataclasses.dataclass(frozen=True, slots=True)
class CheckResult:
    entry: Entry
    geometry: SliceGeometry
    disagreement: str  # empty when the verdict agrees

    @property
    def agrees(self) -> bool:
        return not self.disagreement


@dataclasses.dataclass(frozen=True, slots=True)
class Catalog:
    """A loaded catalogue: entries plus free-form description and provenance."""

    entries: tuple[Entry, ...]
    description: str = ""
    provenance: dict[str, Any] = dataclasses.field(default_factory=dict)

    def check(self) -> list[CheckResult]:
        """Inspects every entry and compares with its expected verdict."""
        out = []
        for e in self.entries:
            g = e.inspect()
            got = {k: getattr(g, k) for k in _EXPECTED_KEYS}
            wrong = []
            for k, want in e.expected.items():
                have = got[k]
                same = (math.isclose(have, want, rel_tol=1e-9) if k == "padding_factor"
                        else have == want)
                if not same:
                    wrong.append(f"{k} is {have!r}, expected {want!r}")
            out.append(CheckResult(e, g, "; ".join(wrong)))
        return out

    def to_json(self) -> str:
        return json.dumps({"description": self.description, "provenance": self.provenance,
                           "arrays": [e.as_dict() for e in self.entries]}, indent=1) + "\n"


def _entry(raw: Any, where: str) -> Entry:
    if not isinstance(raw, dict):
        raise LayoutError(f"{where}: expected an object, got {type(raw).__name__}")
    missing = [k for k in ("shape", "dtype", "layout", "source") if k not in raw]
    if missing:
        raise LayoutError(f"{where}: missing key(s) {', '.join(missing)}")
    try:
        return _entry_of(raw, where)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, LayoutError):
            raise
        raise LayoutError(f"{where}: {e}") from None


def _entry_of(raw: dict[str, Any], where: str) -> Entry:
    expected = dict(raw.get("expected", {}))
    unknown = sorted(set(expected) - set(_EXPECTED_KEYS))
    if unknown:
        raise LayoutError(f"{where}: unknown expected key(s) {unknown}; "
                          f"known: {list(_EXPECTED_KEYS)}")
    shape = tuple(int(d) for d in raw["shape"])
    name = str(raw.get("name") or f"{raw['dtype']}{list(shape)}")
    default = raw.get("tpu_default")
    if default is not None and not isinstance(default, bool):
        raise LayoutError(f"{where}: tpu_default must be true or false, got {default!r}")
    note = raw.get("tpu_default_note", "")
    if not isinstance(note, str):
        raise LayoutError(f"{where}: tpu_default_note must be a string, got {note!r}")
    if default is False and not note.strip():
        raise LayoutError(f"{where}: tpu_default is false (the TPU compiler chooses "
                          f"another layout for this shape), so tpu_default_note must say "
                          "why the entry keeps this one")
    return Entry(name, shape, dtype_name(raw["dtype"]), str(raw["layout"]),
                 int(raw.get("block_dim", 0)), str(raw["source"]), expected, default, note)


def builtin_names() -> list[str]:
    """Names of the built-in catalogues (``seeds``, ``tpu_kv_derived``, ...), sorted."""
    return _resources.builtin_names("layouts")


def load(path: str | os.PathLike) -> Catalog:
    """Reads a catalogue: a built-in name (``"seeds"``) or a JSON file.

    Raises:
      UnknownNameError (a ValueError): no such file or built-in name, listing the
        built-in ones.
      LayoutError: the file is not a catalogue (naming the file and entry).
      OSError: the file cannot be read.
    """
    path, data = _resources.read("layouts", path)
    try:
        raw = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise LayoutError(f"{path}: not UTF-8 text (byte {e.start}): not a JSON "
                          "catalogue") from None
    except json.JSONDecodeError as e:
        raise LayoutError(f"{path}: not valid JSON ({e})") from None
    except RecursionError:
        raise LayoutError(f"{path}: not a catalogue: JSON nested too deeply") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("arrays"), list):
        raise LayoutError(f"{path}: expected an object with an 'arrays' list")
    entries = tuple(_entry(a, f"{path}: arrays[{i}]") for i, a in enumerate(raw["arrays"]))
    provenance = raw.get("provenance", {})
    if not isinstance(provenance, dict):
        raise LayoutError(f"{path}: 'provenance' must be an object")
    return Catalog(entries, str(raw.get("description", "")), dict(provenance))


def entry_from_geometry(name: str, g: SliceGeometry, source: str) -> Entry:
    """A catalogue entry whose expected verdict is the inspector's own."""
    return Entry(name, g.shape, g.dtype, str(g.layout), g.block_dim, source,
                 {"addressable": g.addressable, "granularity": g.granularity,
                  "bytes_per_block": g.bytes_per_block})
