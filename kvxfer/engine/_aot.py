"""The transfer programs of a slice class, from abstract caches, compiled and checked.

What ``kvxfer aot`` builds on: caches given as ``jax.ShapeDtypeStruct`` (a
``NamedSharding`` over devices of any backend, deviceless TPU devices included, and
the compiler's default layouts unless a ``Format`` says otherwise) are split into
their shards (``abstract_layer``), and a mover's own ``warmup`` names the programs a
transfer runs (``transfer_programs``): the same program builders a transfer calls,
lowered for those shapes, never a second copy of a program. Each compiled program is
then read (``check_program``): whether XLA turned anything on host memory into host
compute, how the payload reaches host memory (``S(5)``), and what it stages in device
memory.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from kvxfer.engine._batch import ShardedLayer, _index_key
from kvxfer.engine._mover import Mover
from kvxfer.engine._programs import collected_compiles
from kvxfer.plan import SliceClass

__all__ = ["abstract_layer", "ProgramJob", "transfer_programs", "device_free",
           "ProgramCheck", "check_program", "HOST_MEMORY_OPS", "DMA_OPS"]


def abstract_layer(array: jax.Array | jax.ShapeDtypeStruct) -> ShardedLayer:
    """One layer split into its shards and replicas, as abstract single-device values.

    A ``jax.Array`` is split as a transfer splits it (``ShardedLayer.of``); a
    ``jax.ShapeDtypeStruct`` by its sharding's map of devices to indices, each shard
    on its device with the layout the struct's ``Format`` gives (None: the compiler's
    default).

    Example:
        >>> import jax, numpy as np
        >>> d = jax.devices()[0]
        >>> x = jax.ShapeDtypeStruct((8, 128), np.float32,
        ...                          sharding=jax.sharding.SingleDeviceSharding(d))
        >>> [[s.shape for s in reps] for reps in abstract_layer(x).shards]
        [[(8, 128)]]
    """
    if isinstance(array, jax.Array):
        return ShardedLayer.of(array).abstract()
    if not isinstance(array, jax.ShapeDtypeStruct) or array.sharding is None:
        raise TypeError(f"array={array!r} of type {type(array)} must be a jax.Array or a "
                        "jax.ShapeDtypeStruct with a sharding")
    layout = array.format.layout
    groups: dict[tuple[int, ...], list[Any]] = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        groups.setdefault(_index_key(index, array.shape), []).append(device)
    shape = array.sharding.shard_shape(array.shape)

    def one(device: Any) -> jax.ShapeDtypeStruct:
        where = jax.sharding.SingleDeviceSharding(device)
        if layout is not None:
            from jax.experimental.layout import Format
            where = Format(layout, where)
        return jax.ShapeDtypeStruct(shape, array.dtype, sharding=where)

    return ShardedLayer(tuple(tuple(one(d) for d in groups[k]) for k in sorted(groups)))


@dataclasses.dataclass(frozen=True)
class ProgramJob:
    """One program a transfer runs, ready to compile.

    Attributes:
      name: the program's kind (``digest``, ``pages_offload``, ``pallas_load``, ...).
      bucket: the page count of the transfer it serves.
      key: what tells it from the class's other programs.
      compile: compiles it, returning ``jax.stages.Compiled``.
    """

    name: str
    bucket: int
    key: Hashable
    compile: Callable[[], Any]


def device_free(key: Any) -> Hashable:
    """``key`` with every device in it replaced by its kind: programs that differ only
    in which device of one kind they run on (each shard's, each replica's) compile
    alike, so ahead of time one of them stands for all."""
    if isinstance(key, (tuple, list)):
        return tuple(device_free(k) for k in key)
    if isinstance(key, jax.ShapeDtypeStruct):
        return ("struct", key.shape, str(key.dtype), device_free(key.format))
    if isinstance(key, jax.sharding.SingleDeviceSharding):
        return ("single", device_free(next(iter(key.device_set))), key.memory_kind)
    if type(key).__name__ == "Format" and hasattr(key, "sharding"):
        return ("format", device_free(key.layout), device_free(key.sharding))
    if hasattr(key, "device_kind") and hasattr(key, "platform"):
        return ("device", key.platform, key.device_kind)
    return key


def _program_name(key: Hashable) -> str:
    """A program's kind, with what tells it from the class's other programs of that
    kind: a digest's layer count (``digest_8l``: groups of ``DIGEST_CHUNK`` layers and
    the rest), a digest done inside a transfer (``pinned_write+digest``)."""
    if isinstance(key, tuple) and key and key[0] == "pallas":
        return f"pallas_{key[1]}"
    if not (isinstance(key, tuple) and key):
        return str(key)
    kind = str(key[0])
    if kind == "digest" and len(key) > 1 and isinstance(key[1], tuple):
        return f"digest_{len(key[1])}l"
    if len(key) > 3 and key[3] is True:
        return f"{kind}+digest"
    return kind


def transfer_programs(mover: type[Mover], cls: SliceClass, layers: Sequence[ShardedLayer],
                      buckets: Sequence[int], with_digest: bool = True,
                      per_device: bool = False, num_slots: int = 1) -> list[ProgramJob]:
    """Every program ``mover`` runs for transfers of ``buckets`` pages of class ``cls``.

    ``layers`` are the class's layers, abstract (``abstract_layer``). The programs
    are what the mover's ``warmup`` compiles ahead, collected rather than compiled,
    each once (a program serving several buckets is listed for the first). Unless
    ``per_device``, programs that differ only in their device (``device_free``: the
    same program on each shard's or replica's device) are listed once; their keys
    are then ``device_free`` keys. ``num_slots``: the host pool's pages (programs that
    take the pool itself are compiled for a pool of that size).

    Raises:
      TypeError: a mover that cannot name its programs without a host pool.
    """
    try:
        m = mover.naming(cls, num_slots)  # naming programs needs no pool
    except (AttributeError, TypeError) as e:
        raise TypeError(f"the {mover.name} mover needs a host pool to name its programs "
                        f"({e})") from None
    arrays = [jax.ShapeDtypeStruct(layer.shards[0][0].shape, layer.shards[0][0].dtype)
              for layer in layers]
    out: list[ProgramJob] = []
    seen: set[Hashable] = set()
    for b in buckets:
        with collected_compiles() as jobs:
            m.warmup(arrays, list(layers), b, with_digest)
        for key, job in jobs:
            key = key if per_device else device_free(key)
            if key not in seen:
                seen.add(key)
                out.append(ProgramJob(_program_name(key), b, key, job))
    return out


#: Operations that may produce a value in host memory (``S(5)``) without computing
#: on it: movement (``copy-start``/``copy-done``, the Pallas kernels' DMAs, in
#: ``tpu_custom_call``), and the plumbing that names or forwards a buffer.
HOST_MEMORY_OPS = frozenset({"parameter", "tuple", "get-tuple-element", "bitcast",
                             "copy-start", "copy-done", "custom-call", "opt-barrier",
                             "while", "dynamic-update-slice-start",
                             "dynamic-update-slice-done", "dynamic-slice-start",
                             "dynamic-slice-done"})

#: The operations among them that start a DMA to or from host memory (one a page for
#: the pinned mover's in-place programs; ``custom-call``: a Pallas kernel).
DMA_OPS = frozenset({"copy-start", "custom-call", "dynamic-update-slice-start",
                     "dynamic-slice-start"})

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


@dataclasses.dataclass(frozen=True)
class ProgramCheck:
    """What a compiled program does with host memory and device memory.

    Attributes:
      host_compute: instructions that compute on host memory, as ``name = opcode``
        (XLA's "Converting into host compute" cases, ``_xla_compute_type="host"``,
        or an operation other than movement producing an ``S(5)`` value); empty
        when clean.
      host_transfers: operations that move bytes into or out of host memory, by
        opcode (``copy-start``, ``dynamic-update-slice-start``, ``custom-call`` for
        Pallas DMA kernels, ...).
      staging_bytes: device memory the program allocates beside its arguments and
        outputs (``memory_analysis().temp_size_in_bytes``).
      argument_bytes, output_bytes: its arguments' and outputs' device bytes.
      page_dmas: DMAs the program starts for each page it moves: its
        ``dynamic-(update-)slice-start`` on ``S(5)`` inside a loop over the pages (one
        an iteration), those outside a loop divided by ``pages`` (None: it has none).
      host_pool: what it does with host-memory arguments: ``"aliased"`` (each
        host-memory output is a donated host argument, updated in place),
        ``"copied"`` (a host output that is not: a donated pool would be copied
        whole), ``"read"`` (host arguments, no host outputs), ``"new"`` (host outputs
        of its own, no host arguments) or None (no host memory).
    """

    host_compute: tuple[str, ...]
    host_transfers: dict[str, int]
    staging_bytes: int
    argument_bytes: int
    output_bytes: int
    page_dmas: float | None = None
    host_pool: str | None = None

    @property
    def clean(self) -> bool:
        """No host compute."""
        return not self.host_compute


def _top_level(text: str) -> list[str]:
    """``text`` split at its commas outside brackets, braces and parentheses."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    tail = text[start:].strip()
    return out + [tail] if tail else out


def _host_pool(header: str) -> str | None:
    """``ProgramCheck.host_pool`` from an HLO module's first line."""
    m = re.search(r"entry_computation_layout=\{\((.*?)\)->(.*?)\}(?:,\s*\w+=|$)", header)
    if m is None:
        return None
    params = [("S(5)" in p) for p in _top_level(m.group(1))]
    outs_text = m.group(2)
    outs = [("S(5)" in o) for o in _top_level(outs_text[1:-1])] \
        if outs_text.startswith("(") else ["S(5)" in outs_text]
    aliases = {(int(o.split(",")[0]) if o.strip() else 0): int(p) for o, p in
               re.findall(r"\{([\d,\s]*)\}:\s*\((\d+),", header)}
    host_outs = [i for i, h in enumerate(outs) if h]
    if not host_outs:
        return "read" if any(params) else None
    if not any(params):
        return "new"
    aliased = all(i in aliases and aliases[i] < len(params) and params[aliases[i]]
                  for i in host_outs)
    return "aliased" if aliased else "copied"


def _operands(rest: str) -> list[str]:
    """The instruction names among an HLO instruction's operands (``rest``: the text
    after its opening parenthesis)."""
    depth, end = 1, len(rest)
    for i, ch in enumerate(rest):
        depth += (ch == "(") - (ch == ")")
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", rest[:end])


_PAGE_DMA_OPS = ("dynamic-update-slice-start", "dynamic-slice-start")


def check_program(compiled: Any, pages: int = 1) -> ProgramCheck:
    """Reads a compiled program's scheduled HLO and memory analysis (``ProgramCheck``).

    Host compute is any instruction XLA marked as such, and any operation other than
    ``HOST_MEMORY_OPS`` that produces or reads a value in host memory (``S(5)``).
    ``pages``: the pages the program moves (its bucket), for ``page_dmas``.
    """
    text = compiled.as_text()
    parsed, computation, looped = [], None, set()
    for line in text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            computation = (line.split()[1] if line.startswith("ENTRY")
                           else line.split()[0]).lstrip("%")
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        parsed.append((computation, *m.groups()))
        if m.group(3) == "while":
            looped |= set(re.findall(r"(?:body|condition)=%?([\w.\-]+)", m.group(4)))
    on_host = {name for _, name, shape, _, _ in parsed if "S(5)" in shape}
    host_compute: list[str] = []
    transfers: dict[str, int] = {}
    in_loop = out_loop = 0
    for where, name, shape, opcode, rest in parsed:
        if '_xla_compute_type="host"' in rest:
            host_compute.append(f"{name} = {opcode}")
            continue
        touches = name in on_host or any(o in on_host for o in _operands(rest))
        if not touches or opcode == "parameter":
            continue
        if opcode not in HOST_MEMORY_OPS or (
                opcode == "custom-call" and 'custom_call_target="tpu_custom_call"' not in rest):
            host_compute.append(f"{name} = {opcode}")
        elif opcode in DMA_OPS:
            transfers[opcode] = transfers.get(opcode, 0) + 1
            if opcode in _PAGE_DMA_OPS:
                if where in looped or _called_from_loop(where, looped, parsed):
                    in_loop += 1
                else:
                    out_loop += 1
    memory = compiled.memory_analysis()
    page_dmas = None if not in_loop + out_loop else in_loop + out_loop / max(1, pages)
    header = text.splitlines()[0] if text else ""
    return ProgramCheck(tuple(host_compute), transfers,
                        int(getattr(memory, "temp_size_in_bytes", 0)),
                        int(getattr(memory, "argument_size_in_bytes", 0)),
                        int(getattr(memory, "output_size_in_bytes", 0)),
                        page_dmas, _host_pool(header))


def _called_from_loop(where: str | None, looped: set[str], parsed: list) -> bool:
    """Whether computation ``where`` is called (transitively) from a loop's body."""
    seen, todo = set(), [where]
    callers: dict[str, set[str]] = {}
    for comp, _, _, _, rest in parsed:
        for callee in re.findall(r"(?:calls|to_apply|body|condition|"
                                 r"called_computations)=\{?%?([\w.\-]+)", rest):
            callers.setdefault(callee, set()).add(comp)
    while todo:
        c = todo.pop()
        if c in looped:
            return True
        if c in seen or c is None:
            continue
        seen.add(c)
        todo.extend(callers.get(c, ()))
    return False
