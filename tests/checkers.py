"""Shared checkers: an independent brute-force granularity scan over physical offsets;
the operations of a lowered program that compute on host memory."""

from __future__ import annotations

import re

import numpy as np

from kvxfer import testing

from kvxfer.layout import Layout, dtype_of


def _explicit(shape, layout, block_dim):
    """A tile with more dims than the shape acts on leading size-1 dims: make them
    explicit so that their padding is enumerated like any other."""
    layout = layout if isinstance(layout, Layout) else Layout.parse(layout)
    extra = max([len(t) for t in layout.tiles] + [len(shape)]) - len(shape)
    if extra:
        shape = (1,) * extra + tuple(shape)
        layout = Layout(tuple(d + extra for d in layout.minor_to_major) +
                        tuple(range(extra - 1, -1, -1)), layout.tiles,
                        layout.element_size_bits, layout.memory_space)
        block_dim += extra
    return tuple(shape), layout, block_dim


def _check_bijection(geo):
    padded = geo.padded_shape
    idx = np.indices(padded, dtype=np.int64).reshape(len(padded), -1).T
    elem = geo.element_index(idx)
    assert np.array_equal(np.sort(elem), np.arange(geo.num_elements)), "offsets not a bijection"
    return idx, elem


def byte_owners(shape, dtype, layout, block_dim):
    """For every physical byte, the min and max padded block index that touches it.

    Enumerates every index of the padded logical box (padding included, each
    padding element owned by its padded block index), maps it through the
    geometry's offsets, and checks the map is a bijection onto the tiled shape.
    """
    shape, layout, block_dim = _explicit(shape, layout, block_dim)
    geo = layout.geometry(shape, dtype_of(dtype))
    padded = geo.padded_shape
    idx, elem = _check_bijection(geo)
    bits = geo.element_bits
    first = elem * bits // 8
    last = (elem * bits + bits - 1) // 8
    owner = idx[:, block_dim]
    nbytes = geo.physical_bytes
    lo = np.full(nbytes, np.iinfo(np.int64).max)
    hi = np.full(nbytes, -1)
    span = (last - first).max() + 1
    for j in range(span):
        b = np.minimum(first + j, last)
        np.minimum.at(lo, b, owner)
        np.maximum.at(hi, b, owner)
    assert (hi >= 0).all(), "a byte belongs to no element"
    return lo, hi, padded[block_dim], nbytes


def padded_granularity(shape, dtype, layout, block_dim=0):
    """(granularity, group_bytes) if padding belonged to its padded block index.

    Stricter than the definition: it also asks every padding byte to lie in the
    range of the block whose padded index it has, so groups must tile the whole
    buffer. Whatever it accepts, ``brute_force_granularity`` accepts too.
    """
    lo, hi, vpad, nbytes = byte_owners(shape, dtype, layout, block_dim)
    n = shape[block_dim]
    pos = np.arange(nbytes)
    for g in range(1, n):
        glo, ghi = lo // g, hi // g
        if (glo != ghi).any():
            continue
        ngroups = -(-vpad // g)
        first = np.full(ngroups, nbytes)
        last = np.full(ngroups, -1)
        np.minimum.at(first, glo, pos)
        np.maximum.at(last, glo, pos)
        count = np.bincount(glo, minlength=ngroups)
        size = last - first + 1
        if (count == size).all() and (size == size[0]).all():
            return g, int(size[0])
    return n, None


def block_bit_offsets(shape, dtype, layout, block_dim=0):
    """``(bits[n, m], geometry)``: the bit offset of every element of every block.

    Row ``r`` lists block ``r``'s elements in one fixed order (the other dims'
    indices, row-major), so that row ``r`` and row ``s`` pair up like elements.
    Only the array's own elements appear: padding belongs to no block.
    """
    shape, layout, block_dim = _explicit(shape, layout, block_dim)
    geo = layout.geometry(shape, dtype_of(dtype))
    _check_bijection(geo)
    n = shape[block_dim]
    idx = np.moveaxis(np.indices(shape, dtype=np.int64), 0, -1)
    idx = np.moveaxis(idx, block_dim, 0).reshape(n, -1, len(shape))
    return geo.element_index(idx) * geo.element_bits, geo


def brute_force_granularity(shape, dtype, layout, block_dim=0):
    """(granularity, group_bytes) by definition, scanning g = 1, 2, ...

    Groups of ``g`` consecutive blocks qualify when, for one ``T``, group ``j`` is
    group 0 moved by ``j * T`` bytes, bit for bit (so a raw copy of the range moves
    the group), group 0 lies inside ``[0, T)``, and all groups fit in the buffer
    (the last group's range may hold padding). Bytes no element occupies are
    padding. Returns ``(n, None)`` when no ``g < n`` qualifies.
    """
    n = shape[block_dim]
    if 0 in tuple(shape):
        return 1, 0
    off, geo = block_bit_offsets(shape, dtype, layout, block_dim)
    bits = geo.element_bits
    last = (off.max(axis=1) + bits - 1) // 8
    r = np.arange(n)
    for g in range(1, n):
        d = int(off[g, 0] - off[0, 0])
        if d % 8 or d <= 0:
            continue
        t = d // 8
        if last[:g].max() >= t or -(-n // g) * t > geo.physical_bytes:
            continue
        shift = (r // g) * d
        if (off[:, 0] - off[r % g, 0] == shift).all() and \
                (off - off[r % g] == shift[:, None]).all():
            return g, t
    return n, None


# TPU tiling conventions by element width (XLA text after the colon).
TPU_TILINGS = {
    "float32": ["", "T(8,128)", "T(8,128)", "T(2,128)"],
    "bfloat16": ["", "T(8,128)(2,1)", "T(16,128)(2,1)"],
    "float16": ["", "T(8,128)(2,1)", "T(16,128)(2,1)"],
    "int8": ["", "T(32,128)(4,1)", "T(8,128)(4,1)"],
    "float8_e4m3fn": ["", "T(32,128)(4,1)", "T(8,128)(4,1)"],
    "int4": ["E(4)", "T(8,128)(8,1)E(4)", "T(64,128)(8,1)E(4)", ""],
}
RANK1_TILINGS = {"float32": ["T(1024)", "T(256)"], "bfloat16": ["T(512)"],
                 "float16": ["T(512)"], "int8": ["T(1024)"], "float8_e4m3fn": ["T(1024)"],
                 "int4": ["T(1024)E(4)"]}
SIZES = [1, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 32, 33, 64, 130, 256]


def random_case(rng: np.random.Generator, max_elems: int = 1 << 16):
    """A random (shape, dtype, layout text, block_dim) under TPU tiling conventions."""
    while True:
        rank = int(rng.integers(1, 6))
        shape = tuple(int(rng.choice(SIZES)) for _ in range(rank))
        dtype = str(rng.choice(list(TPU_TILINGS)))
        tilings = TPU_TILINGS[dtype] + (RANK1_TILINGS[dtype] if rank == 1 else [])
        tiling = str(rng.choice(tilings))
        m2m = [int(d) for d in rng.permutation(rank)]
        if rng.random() < 0.4:  # keep the common row-major case well represented
            m2m = list(range(rank - 1, -1, -1))
        layout = "{" + ",".join(map(str, m2m)) + (":" + tiling if tiling else "") + "}"
        geo = Layout.parse(layout).geometry(shape, dtype_of(dtype))
        if geo.num_elements <= max_elems:
            return shape, dtype, layout, int(rng.integers(0, rank))


# Random bits and bit comparisons are kvxfer.testing's (one helper, one place).
def random_array(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """``testing.random_bits`` drawn from ``rng`` (the sweeps' argument order)."""
    return testing.random_bits(shape, dtype, rng)


same_bits = testing.same_bits


# The padding family: a block dim smaller than its tile, beside a partner dim that
# fits inside one sub-tile, so most of each tile is padding that no block owns.
FAMILY_DTYPES = ["int8", "bfloat16", "float16", "float32", "int4", "float8_e4m3fn"]
FAMILY_TILINGS = ["T(8,128)", "T(8,128)(2,1)", "T(16,128)(2,1)", "T(32,128)(4,1)",
                  "T(8,128)(4,1)", "T(64,128)(8,1)", "T(8,128)(8,1)", "T(2,128)",
                  "T(8,8)(4,4)(2,2)"]
FAMILY_BLOCKS = [2, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 64, 130]
FAMILY_PARTNERS = [1, 1, 2, 3, 4, 5, 8]


def random_padding_case(rng: np.random.Generator, max_elems: int = 1 << 16):
    """A random (shape, dtype, layout text, block_dim) from the padding family.

    The block dim is usually one of the two most minor physical dims (those the
    tile covers), its size often below the tile's; the other tiled dim is small
    enough to fit inside one sub-tile; minor-to-major is a random permutation.
    """
    while True:
        rank = int(rng.integers(1, 5))
        m2m = [int(d) for d in rng.permutation(rank)]
        tiling = str(rng.choice(FAMILY_TILINGS))
        dtype = str(rng.choice(FAMILY_DTYPES))
        if dtype == "int4" and rng.random() < 0.5:
            tiling += "E(4)"
        minor = m2m[:2]
        block_dim = int(rng.choice(minor)) if rng.random() < 0.85 else int(rng.integers(rank))
        shape = [int(rng.choice([1, 1, 2, 3])) for _ in range(rank)]
        for d in minor:
            shape[d] = int(rng.choice(FAMILY_PARTNERS))
        shape[block_dim] = int(rng.choice(FAMILY_BLOCKS))
        layout = "{" + ",".join(map(str, m2m)) + ":" + tiling + "}"
        geo = Layout.parse(layout).geometry(tuple(shape), dtype_of(dtype))
        if geo.num_elements <= max_elems:
            return tuple(shape), dtype, layout, block_dim


# -- which operations of a lowered program touch host memory ---------------------------

_HOST_KINDS = ("pinned_host", "unpinned_host")


def _moves(op: str, rest: str) -> bool:
    """Whether an operation only moves a value (XLA's host offloader accepts a placement
    annotation, a sharding constraint on the way, and handing it back)."""
    return (op == "stablehlo.custom_call" and "@annotate_device_placement(" in rest
            or op.startswith("sdy.sharding_constraint")
            or op in ("return", "func.return", "stablehlo.return"))


def _memory_kind_of(attrs: str) -> str | None:
    m = re.search(r'mhlo\.memory_kind = "(\w+)"', attrs)
    return m.group(1) if m else None


def host_arithmetic(text: str) -> list[str]:
    """The operations of a lowered program (StableHLO text) that read a value placed in
    host memory other than to move it: each would be host compute on XLA:GPU ("Found an
    instruction ... which does device compute in host memory space").

    A value is in host memory when it is an argument of ``@main`` whose memory kind is
    ``pinned_host`` or ``unpinned_host``, or the result of a placement annotation to one
    of them (what ``jax.device_put`` inside a program and ``out_shardings`` lower to);
    a sharding constraint passes that on.
    """
    out: list[str] = []
    host: set[str] = set()
    in_main = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("func.func"):
            in_main = "@main(" in stripped
            host = set()
            if in_main:
                signature = stripped[stripped.index("(") + 1:]
                for part in re.split(r"(?=%arg\d+:)", signature)[1:]:
                    name = part.split(":")[0]
                    if _memory_kind_of(part.split("->")[0]) in _HOST_KINDS:
                        host.add(name)
            continue
        if not in_main:
            continue
        m = re.match(r"(?:(%[\w#:]+)\s*=\s*)?(.*)", stripped)
        results, rest = m.group(1), m.group(2)
        used = {u.split("#")[0] for u in re.findall(r"%[\w.]+(?:#\d+)?", rest)}
        op = rest.split("(")[0].split()[0].strip('"') if rest else ""
        if used & host and not _moves(op, rest):
            out.append(f"{op}: {stripped[:160]}")
        if results is None:
            continue
        name = results.split(":")[0]
        placement = re.search(r'_xla_buffer_placement = "(\w+)"', rest)
        if "annotate_device_placement" in rest and placement:
            if placement.group(1) in _HOST_KINDS:
                host.add(name)
        elif op.startswith("sdy.sharding_constraint") and used & host:
            host.add(name)
    return out
