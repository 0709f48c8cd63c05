"""Geometry of sharded arrays: boxes, their intersections and differences.

Vocabulary (used across the package):

* **box** -- an axis-aligned block of a global array, stored as a tuple with one
  ``(start, stop)`` pair per dimension (half-open). A rank-0 array has the empty box
  ``()``, whose volume is 1.
* **shard** -- the box one device holds; for a ``jax.sharding.Sharding`` it comes from
  ``sharding.devices_indices_map(shape)``.

Everything here is pure Python on integers: no devices, no arrays. The planner relies
on these functions being exact; they are tested against numpy slicing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

Box = tuple[tuple[int, int], ...]


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole array of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def box_from_index(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """Converts a tuple of slices (as in ``devices_indices_map``) into a box.

    Args:
      index: one slice per dimension; ``slice(None)`` means the whole dimension. Slices
        with a step other than 1 are rejected, since no JAX sharding produces them.
      shape: the global array shape.

    Returns:
      The box with concrete, clipped bounds.
    """
    if len(index) != len(shape):
        raise ValueError(
            f"index {index!r} has rank {len(index)}, shape {tuple(shape)} has rank {len(shape)}"
        )
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(int(n))
        if step != 1:
            raise ValueError(f"strided shard index {s!r} is not a box")
        out.append((start, max(start, stop)))
    return tuple(out)


def volume(box: Box) -> int:
    """Number of elements in ``box``."""
    return math.prod(stop - start for start, stop in box)


def box_shape(box: Box) -> tuple[int, ...]:
    """Shape of the block a box describes."""
    return tuple(stop - start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The intersection of two boxes, or ``None`` when it is empty."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b, strict=True):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def relative_slices(inner: Box, outer: Box) -> tuple[slice, ...]:
    """Slices that select ``inner`` out of an array holding exactly ``outer``."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer, strict=True))


def relative_offsets(inner: Box, outer: Box) -> tuple[int, ...]:
    """Start offsets of ``inner`` within ``outer``."""
    return tuple(i0 - o0 for (i0, _), (o0, _) in zip(inner, outer, strict=True))


def subtract(box: Box, hole: Box | None) -> list[Box]:
    """Disjoint boxes covering ``box`` minus ``hole`` (slab decomposition).

    Dimension by dimension, the parts of ``box`` before and after the hole are cut off
    as slabs and the remainder narrowed to the hole's extent, so at most ``2 * rank``
    boxes come out and they never overlap.
    """
    if hole is None:
        return [box]
    hole = intersect(box, hole)
    if hole is None:
        return [box]
    out: list[Box] = []
    rest = list(box)
    for d, ((b0, b1), (h0, h1)) in enumerate(zip(box, hole, strict=True)):
        if b0 < h0:
            out.append(tuple(rest[:d]) + ((b0, h0),) + tuple(rest[d + 1 :]))
        if h1 < b1:
            out.append(tuple(rest[:d]) + ((h1, b1),) + tuple(rest[d + 1 :]))
        rest[d] = (h0, h1)
    return out


def subtract_many(box: Box, holes: Iterable[Box]) -> list[Box]:
    """Disjoint boxes covering ``box`` minus the union of ``holes``."""
    parts = [box]
    for hole in holes:
        parts = [p for part in parts for p in subtract(part, hole)]
        if not parts:
            break
    return parts


def try_merge(a: Box, b: Box) -> Box | None:
    """The union of two boxes when it is itself a box (they touch along one dimension)."""
    diff = -1
    for d, (ia, ib) in enumerate(zip(a, b, strict=True)):
        if ia != ib:
            if diff >= 0:
                return None
            diff = d
    if diff < 0:
        return a
    (a0, a1), (b0, b1) = a[diff], b[diff]
    if a1 == b0:
        return a[:diff] + ((a0, b1),) + a[diff + 1 :]
    if b1 == a0:
        return a[:diff] + ((b0, a1),) + a[diff + 1 :]
    return None


def merge_boxes(boxes: Sequence[Box]) -> list[Box]:
    """Greedily merges disjoint boxes whose union is a box, until none can merge.

    The result covers exactly the same elements with as few or fewer boxes. Inputs are
    small (the pieces between one pair of locations), so the quadratic loop is fine.
    """
    out = sorted(boxes)
    merged = True
    while merged and len(out) > 1:
        merged = False
        for i in range(len(out)):
            for j in range(i + 1, len(out)):
                m = try_merge(out[i], out[j])
                if m is not None:
                    out[i] = m
                    del out[j]
                    merged = True
                    break
            if merged:
                break
    return sorted(out)


def named_shard_boxes(
    shape: Sequence[int],
    mesh_shape: Sequence[int],
    axis_names: Sequence[str],
    spec: Sequence[str | Sequence[str] | None],
) -> dict[tuple[int, ...], Box]:
    """Boxes of a ``NamedSharding`` computed without devices.

    Args:
      shape: global array shape; every sharded dimension must divide evenly.
      mesh_shape: the mesh's size per axis.
      axis_names: the mesh's axis names, in order.
      spec: one entry per (leading) array dimension: ``None``, an axis name, or a
        sequence of axis names (major to minor), as in ``PartitionSpec``.

    Returns:
      A map from mesh position (a tuple of indices, one per mesh axis) to the box the
      device at that position holds. Used to plan for synthetic device ids.
    """
    sizes = dict(zip(axis_names, mesh_shape, strict=True))
    spec = list(spec) + [None] * (len(shape) - len(spec))
    if len(spec) > len(shape):
        raise ValueError(f"spec {tuple(spec)} is longer than the array rank {len(shape)}")
    entries: list[tuple[str, ...]] = []
    for e in spec:
        if e is None:
            entries.append(())
        elif isinstance(e, str):
            entries.append((e,))
        else:
            entries.append(tuple(e))
    for d, (axes, n) in enumerate(zip(entries, shape, strict=True)):
        count = math.prod(sizes[a] for a in axes)
        if n % count:
            raise ValueError(
                f"dimension {d} of size {n} is not divisible by {count} shards (mesh axes {axes})"
            )
    out: dict[tuple[int, ...], Box] = {}
    positions = _grid(mesh_shape)
    index_of = {a: i for i, a in enumerate(axis_names)}
    for pos in positions:
        box = []
        for axes, n in zip(entries, shape, strict=True):
            k, count = 0, 1
            for a in axes:
                k = k * sizes[a] + pos[index_of[a]]
                count *= sizes[a]
            step = n // count
            box.append((k * step, (k + 1) * step))
        out[pos] = tuple(box)
    return out


def _grid(shape: Sequence[int]) -> list[tuple[int, ...]]:
    positions: list[tuple[int, ...]] = [()]
    for n in shape:
        positions = [p + (i,) for p in positions for i in range(n)]
    return positions
