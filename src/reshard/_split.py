"""Split sharded arrays along a mesh axis into sub-mesh parts, and join them again.

A mesh axis of size ``n`` can be cut into parts ``[lo, hi)``; part ``k`` lives on the
sub-mesh ``mesh.devices[..., lo:hi, ...]`` (same axis names, that axis shortened). An
array whose spec names the axis in some dimension keeps, in each part, only the shards
its devices hold, so that dimension shrinks by ``(hi - lo) / n``; an array replicated
along the axis keeps its full shape in every part.

No byte moves and nothing is copied: every shard of a part *is* a shard of the input
(the same device buffer), regrouped under a new ``NamedSharding`` with
``jax.make_array_from_single_device_arrays``. ``concatenate_by_mesh_axis`` is the exact
inverse. Leaves may also be ``jax.ShapeDtypeStruct``s with a ``NamedSharding``: they get
the part's shape and sharding, which lets a plan be built for a part without arrays.

Donation: a part shares buffers with its input, and ``jax.Array.delete`` frees buffers
for every array that holds them, so "consuming" an input cannot mean deleting it. It
means donating the input to a jitted identity, which XLA answers by handing the same
buffers to a fresh array and marking the input deleted; the parts are then built from
that fresh array. (A buffer XLA does not own outright, such as one that still aliases
the numpy array it was ``device_put`` from, is copied by that identity instead: still
correct, just not free. The CPU executors' outputs are such buffers; they are copied
before any input is consumed, see ``_prepare_consume``.) The parts are first built
from the untouched inputs, so any failure happens before an input is invalidated.
Arrays in unpinned host memory are not consumed: XLA runs nothing on them (the
donating call aborts the process, jax 0.10 on CPU), so they stay valid and the result aliases them, as without donation; nor are
pinned-host arrays that JAX types as device memory (``_compat.may_donate``). Nor are
inputs that share buffers with a live array outside the call that this library made
so (``_sharing``: the parts of a split without donation and the array they came from,
say), whose buffers would be freed under it; inputs that share buffers with each
other are copied, then consumed (see ``_prepare_consume``).
"""

from __future__ import annotations

import collections
import functools
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar, cast

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from . import _buffers, _compat, _sharing
from ._mesh_surgery import describe_grid

__all__ = ["concatenate_by_mesh_axis", "split_by_mesh_axis"]

Leaf = jax.Array | jax.ShapeDtypeStruct
_R = TypeVar("_R")


# --------------------------------------------------------------------------- helpers


def _entry_axes(entry: Any) -> tuple[Any, ...]:
    """The mesh axes one ``PartitionSpec`` entry shards a dimension over, major first."""
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, tuple | list):
        return tuple(entry)
    return (entry,)


def _sharded_dim(spec: PartitionSpec, mesh_axis: Any) -> int | None:
    """The array dimension whose spec entry names ``mesh_axis``; ``None`` if replicated."""
    for dim, entry in enumerate(_compat.spec_entries(spec)):
        if mesh_axis in _entry_axes(entry):
            return dim
    return None


def shard_count(mesh: Mesh | AbstractMesh, entry: Any) -> int:
    """How many shards a spec entry cuts its dimension into on ``mesh``."""
    return math.prod(mesh.shape[axis] for axis in _entry_axes(entry))


@functools.lru_cache(maxsize=4096)
def _named_sharding(mesh: Mesh, spec: PartitionSpec, memory_kind: str | None) -> NamedSharding:
    # Shardings are hashable and rebuilding them per leaf costs more than the lookup;
    # reusing one object per (mesh, spec, memory kind) also keeps jit caches warm.
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


@functools.lru_cache(maxsize=1024)
def _submesh(mesh: Mesh, axis_index: int, lo: int, hi: int) -> Mesh:
    index = [slice(None)] * mesh.devices.ndim
    index[axis_index] = slice(lo, hi)
    return Mesh(mesh.devices[tuple(index)], mesh.axis_names, axis_types=mesh.axis_types)


def _flatten_named(tree: Any, what: str) -> tuple[list[str], list[Leaf], Any]:
    """Flattens ``tree``; every leaf must be an array (or struct) with a NamedSharding."""
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, leaves = [], []
    for path, leaf in with_paths:
        where = f"{what}{jax.tree_util.keystr(path)}"
        if isinstance(leaf, jax.core.Tracer):
            # (Its .sharding would raise an AttributeError that names no leaf.)
            raise jax.errors.ConcretizationTypeError(
                leaf,
                f"{where} is a tracer: split_by_mesh_axis and concatenate_by_mesh_axis "
                "hand over the shards of concrete arrays and cannot be traced (jax.jit, "
                "vmap, grad, shard_map...). Call them outside the traced function.",
            )
        if not isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
            raise ValueError(
                f"{where} is a {type(leaf).__name__}, expected a jax.Array with a "
                "NamedSharding. Put it on a mesh first, e.g. with reshard.reshard(x, "
                "NamedSharding(mesh, spec))."
            )
        sharding = _compat.sharding_of(leaf, where)
        if not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"{where} has sharding {sharding!r}; only NamedSharding can be split "
                "or concatenated along a mesh axis. Reshard it to a NamedSharding first."
            )
        ids = getattr(sharding, "_logical_device_ids", None)
        if ids is not None and tuple(ids) != tuple(range(sharding.mesh.size)):
            # The shards of such a sharding are not laid out by the mesh's device array,
            # so cutting the mesh would hand out the wrong shards (the identity order
            # is the mesh's own).
            raise ValueError(
                f"{where} has a NamedSharding with _logical_device_ids set; only "
                "shardings laid out by their mesh can be split or concatenated along a "
                "mesh axis. Reshard it to NamedSharding(mesh, spec) first."
            )
        if not isinstance(sharding.mesh, Mesh):
            raise ValueError(
                f"{where} is on the abstract mesh {sharding.mesh!r}; splitting and "
                "concatenating need a Mesh of devices."
            )
        if isinstance(leaf, jax.Array) and leaf.is_deleted():
            raise ValueError(f"{where} has been deleted (was it donated earlier?).")
        if isinstance(leaf, jax.ShapeDtypeStruct):
            if PartitionSpec.UNCONSTRAINED in _compat.spec_entries(leaf.sharding.spec):
                # Whether that dimension is cut along the mesh axis is not known, so
                # neither is a part's shape.
                raise ValueError(
                    f"{where} has spec {leaf.sharding.spec} with an UNCONSTRAINED entry; "
                    "name mesh axes or None for every dimension."
                )
            # (An array's shape always fits its sharding; a struct's is not checked.)
            try:
                leaf.sharding.shard_shape(leaf.shape)
            except Exception as e:
                raise ValueError(
                    f"{where}: shape {tuple(leaf.shape)} does not fit its sharding: {e}"
                ) from None
        paths.append(where)
        leaves.append(leaf)
    return paths, leaves, treedef


def _named(leaf: Leaf) -> NamedSharding:
    """A leaf's sharding, which ``_flatten_named`` has checked to be a NamedSharding."""
    return cast(NamedSharding, leaf.sharding)


def _mesh_of(leaf: Leaf) -> Mesh:
    """A leaf's mesh, which ``_flatten_named`` has checked to be a concrete Mesh."""
    return cast(Mesh, _named(leaf).mesh)


def _one_mesh(paths: Sequence[str], leaves: Sequence[Leaf], who: str, fix: str = "") -> Mesh:
    """The mesh every leaf is on; a ValueError naming two leaves when they differ."""
    mesh = _mesh_of(leaves[0])
    for path, leaf in zip(paths, leaves, strict=True):
        other = _mesh_of(leaf)
        if other != mesh:
            a, b = (
                describe_grid(mesh.devices, mesh.axis_names),
                describe_grid(other.devices, other.axis_names),
            )
            if a == b:  # same devices in the same order: the axis types differ
                a, b = f"{a}, axis types {mesh.axis_types}", f"{b}, axis types {other.axis_types}"
            raise ValueError(
                f"{who} must be on one mesh; {paths[0]} is on a {a} but {path} is on a {b}.{fix}"
            )
    return mesh


def _axis_index(mesh: Mesh, mesh_axis: Any) -> int:
    if mesh_axis not in mesh.axis_names:
        raise ValueError(
            f"mesh_axis={mesh_axis!r} is not an axis of the mesh; its axes are {dict(mesh.shape)}."
        )
    return mesh.axis_names.index(mesh_axis)


def _is_bool(x: Any) -> bool:
    return isinstance(x, bool | np.bool_) or getattr(x, "dtype", None) == np.bool_


def _sections(sections: int | Sequence[int]) -> int | list[int]:
    """The part count, or the list of boundaries, after checking their form."""
    if not _is_bool(sections):
        try:  # an int, or any integer scalar: numpy's, 0-d arrays, jax's
            return operator.index(sections)  # type: ignore[arg-type]
        except TypeError:
            pass
    if isinstance(sections, jax.Array):
        sections = np.asarray(sections)  # (boundaries in a jax array, as in numpy's)
    if isinstance(sections, str | bytes) or not isinstance(sections, Sequence | np.ndarray):
        raise ValueError(
            f"mesh_axis_indices_or_sections={sections!r} must be None, an int or a "
            "sequence of ints."
        )
    try:
        if any(_is_bool(b) for b in sections):
            raise TypeError
        return [operator.index(b) for b in sections]
    except TypeError:
        raise ValueError(f"mesh_axis_indices_or_sections={sections!r} must hold ints.") from None


def _part_bounds(sections: int | Sequence[int] | None, size: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` positions along the mesh axis for each part, in order."""
    if sections is None:
        return [(k, k + 1) for k in range(size)]
    checked = _sections(sections)
    if isinstance(checked, int):
        if checked <= 0 or size % checked:
            raise ValueError(
                f"mesh_axis_indices_or_sections={checked} does not divide the mesh axis of "
                f"size {size} into equal parts; pass a divisor of {size}, or a sequence "
                "of boundaries for unequal parts."
            )
        step = size // checked
        return [(k * step, (k + 1) * step) for k in range(checked)]
    if any(not 0 < b < size for b in checked) or any(
        a >= b for a, b in itertools.pairwise(checked)
    ):
        raise ValueError(
            f"mesh_axis_indices_or_sections={checked} must be strictly increasing interior "
            f"boundaries, each in (0, {size}) for a mesh axis of size {size}, so that no "
            "part is empty."
        )
    edges = [0, *checked, size]
    return list(itertools.pairwise(edges))


def _part_count_unsized(sections: int | Sequence[int]) -> int:
    """The number of parts where the axis size is unknown (no leaves): what can be checked."""
    checked = _sections(sections)
    if isinstance(checked, int):
        if checked <= 0:
            raise ValueError(
                f"mesh_axis_indices_or_sections={checked} must be a positive number of parts."
            )
        return checked
    if any(b <= 0 for b in checked) or any(a >= b for a, b in itertools.pairwise(checked)):
        raise ValueError(
            f"mesh_axis_indices_or_sections={checked} must be strictly increasing interior "
            "boundaries, each above 0, so that no part is empty."
        )
    return len(checked) + 1


def _prepare_consume(
    arrays: Sequence[jax.Array], once: _sharing.OneCollection | None = None
) -> Callable[[], list[jax.Array]]:
    """Prepares to donate ``arrays``; the returned call donates them and returns arrays
    on the same buffers, the inputs then deleted. Preparing copies what must be copied
    and compiles the donating program, and consumes nothing: a caller donating on
    several device sets prepares them all first (see ``_build_then_consume``).

    All ``arrays`` must live on one device set (one jit call). An array listed twice is
    donated once. Where JAX declines a donation, for some buffers or all (a numpy view
    of a shard alive, say), it copies those instead: the fresh array replaces the
    input, and the input is deleted all the same, as on every other process. Arrays a
    donating program must not take (``_compat.may_donate``: unpinned host memory, or
    pinned host memory that JAX itself describes as device memory) are returned as
    they are: on CPU, jax 0.10, the donating call aborts the process.
    ``once``: shared by the calls of one donation (``_sharing.sharing``).

    So are arrays that share buffers with a live array outside the call (a part of a
    split while the split array lives): consuming them would free buffers under it.
    Arrays that share buffers only with others of the call (one array's parts at two
    leaves, an array and what was handed its buffers) cannot go through one donating
    call, nor one after the other (the first would free the buffers under the
    second): they are copied, and then all deleted. Which arrays share is read from
    what this library made (``_sharing``), not from this process's buffers, so that
    every process of a multi-process job consumes the same arrays whichever buffers
    it holds; sharing seen here without that record (handles made by hand on one
    array's shards, arrays made zero-copy from one host array) is handled the same
    way, here only: with an array that stays, the array stays too, else both are
    copied.

    Nothing is deleted before the copies and the donating call have run: a failure of
    either leaves every input as it was.
    """
    distinct = {id(a): a for a in arrays}
    donatable = [a for a in distinct.values() if _compat.may_donate(a)]
    spared, linked = _sharing.sharing(donatable, once=once)
    keys = {id(a): _compat.buffer_keys(a).keys() for a in donatable}
    spared = _sharing.with_handles(spared, keys)
    rest = [a for a in donatable if id(a) not in spared]
    holders = collections.Counter(k for a in rest for k in keys[id(a)])
    # Tied too: arrays over host buffers XLA does not own (the CPU executors' outputs),
    # which a donating program would copy, allocating after other device sets'
    # inputs were consumed (``_build_then_consume``): given new handles here, before
    # any is consumed, over the same memory where they can be (``new_handles``).
    on_lease = _buffers.lease_test()
    is_tied = {
        id(a): id(a) in linked
        or any(holders[k] > 1 for k in keys[id(a)])
        or on_lease(k[1] for k in keys[id(a)])
        for a in rest
    }
    tied = [a for a in rest if is_tied[id(a)]]
    alone = [a for a in rest if not is_tied[id(a)]]
    # Of those, the ones tied only by their buffers on lease (not key arrays) take new
    # handles over the same memory where they can (``new_handles``), the rest copies.
    leased = {
        id(a)
        for a in tied
        if id(a) not in linked
        and all(holders[k] == 1 for k in keys[id(a)])
        and not jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
    }
    copied = iter(_compat.fresh_copies([a for a in tied if id(a) not in leased]))
    copies = [
        _compat.with_buffers(a, _compat.new_handles(list(_compat.device_buffers(a).values())))
        if id(a) in leased
        else next(copied)
        for a in tied
    ]
    donate: Callable[[], list[jax.Array]] = (
        _compat.prepare_donating_identity(alone) if alone else lambda: []
    )

    def commit() -> list[jax.Array]:
        fresh = donate()
        swap: dict[int, jax.Array] = {}
        for a, b in zip([*tied, *alone], [*copies, *fresh], strict=True):
            # Copied; declined (some buffers copied); or nothing here to donate (no
            # device of it on this process): deleted all the same, as on every process.
            # A donated key array is deleted too: it reads as deleted, but indexing it
            # then crashed the process (jax 0.10) where a deleted one raises.
            if not a.is_deleted() or jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
                a.delete()
            swap[id(a)] = b
        return [swap.get(id(a), a) for a in arrays]

    return commit


def _build_then_consume(
    groups: Sequence[Sequence[Leaf]],
    build: Callable[[Sequence[Sequence[Leaf]]], _R],
    donate: bool,
) -> _R:
    """Runs ``build`` on ``groups``; with ``donate``, then consumes the inputs.

    ``build`` must only regroup buffers. It runs once on the untouched inputs (so a
    failure loses nothing) and, when donating, once more on the donated replacements,
    since the first result shares buffers the donation retires. Every group's copies
    and donating program are made before any group is donated, so a failure to make
    them leaves every input as it was.

    Args:
      groups: leaves, one list per device set (each list is donated in one call).
      build: makes the result from ``groups``.
      donate: whether the inputs are consumed.
    """
    # 64-bit arrays with jax_enable_x64 off are assembled and donated whole.
    with _compat.wide_types_whole(x.dtype for g in groups for x in g):
        return _build_then_consume_whole(groups, build, donate)


def _build_then_consume_whole(
    groups: Sequence[Sequence[Leaf]],
    build: Callable[[Sequence[Sequence[Leaf]]], _R],
    donate: bool,
) -> _R:
    # Read (and their sharing recorded) while no other thread's call deletes them, and
    # consumed while no other thread's call reads them (``_sharing.readers``).
    readers = _sharing.readers
    with readers.reading():
        result = build(groups)
    if not donate or not any(isinstance(x, jax.Array) for g in groups for x in g):
        return result
    del result  # holds the buffers the donation is about to hand over
    arrays = [[x for x in g if isinstance(x, jax.Array)] for g in groups]
    for attempt in range(_PREPARE_ATTEMPTS):
        version = _sharing.version()
        # Every group's copies and program first: a failure there consumes nothing.
        with readers.reading():
            once = _sharing.OneCollection()  # (the garbage collected once, not per group)
            commits = [_prepare_consume(a, once) for a in arrays]
        with readers.deleting():
            # Sharing recorded meanwhile by another thread (a may_alias=True output of
            # one of them, say) may spare some: prepared again (rarely; at last as is).
            if _sharing.version() != version and attempt + 1 < _PREPARE_ATTEMPTS:
                continue
            replaced = []
            for group, commit in zip(groups, commits, strict=True):
                fresh = iter(commit())
                replaced.append([next(fresh) if isinstance(x, jax.Array) else x for x in group])
        return build(replaced)
    raise AssertionError("unreachable")  # pragma: no cover


_PREPARE_ATTEMPTS = 4


def _assemble(
    template: Leaf,
    shape: tuple[int, ...],
    sharding: NamedSharding,
    by_device: Mapping[jax.Device, jax.Array],
) -> Leaf:
    """A leaf like ``template`` of ``shape``/``sharding`` from existing per-device shards."""
    if isinstance(template, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(
            shape, template.dtype, sharding=sharding, weak_type=template.weak_type
        )
    # In mesh order: key arrays (unlike plain ones) are not re-sorted by JAX and must
    # arrive in the sharding's device-assignment order, which for a NamedSharding is
    # the mesh's.
    local = sharding.addressable_devices
    shards = [by_device[device] for device in sharding.mesh.devices.flat if device in local]
    if math.prod(shape) == 0:  # see _compat.empty_as
        block = sharding.shard_shape(shape)
        shards = [_compat.empty_as(s, block, sharding.memory_kind) for s in shards]
    # dtype= lets a process that holds none of the devices still build its handle.
    out = jax.make_array_from_single_device_arrays(shape, sharding, shards, dtype=template.dtype)
    if jax.dtypes.issubdtype(template.dtype, jax.dtypes.prng_key):
        return out  # (key arrays have no weak type, and JAX makes their avals)
    aval = _compat.device_put_aval(shape, template.dtype, sharding, template.weak_type)
    return _compat.finish(out, aval, fresh=True)


def _shards_by_device(leaf: Leaf) -> dict[jax.Device, jax.Array]:
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return {}
    return {shard.device: shard.data for shard in _compat.addressable_shards(leaf)}


# --------------------------------------------------------------------------- split


@_compat.moving_bytes()
def split_by_mesh_axis(
    arrays: Any,
    mesh_axis: str,
    mesh_axis_indices_or_sections: int | Sequence[int] | None = None,
    *,
    donate: bool = False,
) -> list[Any]:
    """Splits a pytree of arrays into parts, one per slice of a mesh axis.

    Part ``k`` lives on the sub-mesh ``mesh.devices[..., lo:hi, ...]`` (``lo:hi`` taken
    along ``mesh_axis``) with the same axis names, spec and memory kind. An array
    sharded along ``mesh_axis`` keeps only the shards on the part's devices, so the
    dimension that names the axis shrinks to ``size * (hi - lo) / n``; an array
    replicated along it keeps its shape (one ``unreduced`` along it too, each part
    then holding the addends of its own devices). No data crosses devices and
    nothing is copied: the parts' shards are the input's buffers.

    Args:
      arrays: a pytree of ``jax.Array``s (or ``jax.ShapeDtypeStruct``s), all with a
        ``NamedSharding`` on one identical mesh.
      mesh_axis: the mesh axis to split.
      mesh_axis_indices_or_sections: ``None`` for one part per position along the
        axis; an int ``N`` for ``N`` equal parts (``N`` must divide the axis size);
        or a sequence of strictly increasing interior boundaries in ``(0, size)``:
        ``[2, 3]`` on an axis of size 4 gives parts ``[0:2]``, ``[2:3]``, ``[3:4]``.
      donate: consume the inputs: they are marked deleted once the parts are built
        (not those in unpinned host memory or that ``_compat.may_donate`` refuses,
        nor inputs that share buffers with a live array outside the call, such as
        the parts of an earlier split: those stay valid). No buffer is copied,
        except those of inputs that share buffers with another input of the call
        (one array and its ``may_alias=True`` copy, say): they are copied, then
        consumed. By default the parts alias the inputs, which then stay valid
        however the parts are used here
        (``reshard``, ``split_by_mesh_axis`` and ``concatenate_by_mesh_axis`` do not
        consume a part while its input lives; donating one to your own ``jax.jit``
        frees its buffers under the input too).

    Returns:
      A list with one pytree per part, each of the structure of ``arrays``.

    Raises:
      ValueError: a leaf is not an array with a ``NamedSharding`` (or has one with
        ``_logical_device_ids`` set), the leaves' meshes differ, ``mesh_axis`` is not a
        mesh axis, or the sections are invalid.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from reshard import split_by_mesh_axis
      >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("stage", "fsdp"))
      >>> x = jax.device_put(np.arange(16.0), NamedSharding(mesh, P(("stage", "fsdp"))))
      >>> first, second = split_by_mesh_axis({"w": x}, "stage")
      >>> first["w"].shape, dict(first["w"].sharding.mesh.shape)
      ((8,), {'stage': 1, 'fsdp': 4})
      >>> np.asarray(second["w"]).tolist()
      [8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0]
    """
    paths, leaves, treedef = _flatten_named(arrays, "arrays")
    if not leaves:
        # No mesh to read the axis size from: honour an explicit count, else refuse.
        if mesh_axis_indices_or_sections is None:
            raise ValueError(
                "arrays has no leaves, so the size of mesh_axis cannot be read; pass "
                "mesh_axis_indices_or_sections explicitly."
            )
        count = _part_count_unsized(mesh_axis_indices_or_sections)
        return [jax.tree_util.tree_unflatten(treedef, []) for _ in range(count)]

    mesh = _one_mesh(paths, leaves, "all arrays", " Split each group of arrays separately.")
    axis_index = _axis_index(mesh, mesh_axis)
    size = mesh.devices.shape[axis_index]
    bounds = _part_bounds(mesh_axis_indices_or_sections, size)
    submeshes = [_submesh(mesh, axis_index, lo, hi) for lo, hi in bounds]

    # Per leaf and part: the output shape and sharding (pure, done once).
    layouts: list[list[tuple[tuple[int, ...], NamedSharding]]] = []
    for leaf in leaves:
        sharding = _named(leaf)
        dim = _sharded_dim(sharding.spec, mesh_axis)
        per_part = []
        for (lo, hi), submesh in zip(bounds, submeshes, strict=True):
            shape = list(leaf.shape)
            if dim is not None:
                shape[dim] = shape[dim] // size * (hi - lo)
            part_sharding = _named_sharding(submesh, sharding.spec, sharding.memory_kind)
            per_part.append((tuple(shape), part_sharding))
        layouts.append(per_part)

    def build(groups: Sequence[Sequence[Leaf]]) -> list[list[Leaf]]:
        flat_parts: list[list[Leaf]] = [[] for _ in bounds]
        for leaf, per_part in zip(groups[0], layouts, strict=True):
            by_device = _shards_by_device(leaf)
            for k, (shape, sharding) in enumerate(per_part):
                flat_parts[k].append(_assemble(leaf, shape, sharding, by_device))
        return flat_parts

    flat_parts = _build_then_consume([leaves], build, donate)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, jax.Array):  # (consumed or not: see _sharing)
            _sharing.note_shared(leaf, [part[i] for part in flat_parts])
    return [jax.tree_util.tree_unflatten(treedef, part) for part in flat_parts]


# --------------------------------------------------------------------------- concatenate


def _check_meshes(meshes: Sequence[Mesh], axis_index: int, mesh_axis: Any) -> None:
    first = meshes[0]
    for k, mesh in enumerate(meshes[1:], start=1):
        if mesh.axis_names != first.axis_names:
            raise ValueError(
                f"array_trees[{k}] is on a mesh with axes {mesh.axis_names}, but "
                f"array_trees[0] on one with axes {first.axis_names}; all meshes need the "
                "same axis names in the same order."
            )
        if mesh.axis_types != first.axis_types:
            raise ValueError(
                f"array_trees[{k}] is on a mesh with axis types {mesh.axis_types}, but "
                f"array_trees[0] on one with {first.axis_types}; all meshes need the same "
                "axis types."
            )
        others = [i for i in range(len(first.axis_names)) if i != axis_index]
        if any(mesh.devices.shape[i] != first.devices.shape[i] for i in others):
            raise ValueError(
                f"array_trees[{k}] is on a mesh of sizes {dict(mesh.shape)}, but "
                f"array_trees[0] on {dict(first.shape)}; the meshes may differ only along "
                f"{mesh_axis!r}."
            )
    uses = collections.Counter(d for mesh in meshes for d in mesh.devices.flat)
    if any(n > 1 for n in uses.values()):
        repeated = sorted(d.id for d, n in uses.items() if n > 1)
        raise ValueError(
            f"the meshes share devices {repeated}; concatenated meshes must be disjoint."
        )


def _joined_shape(
    k_paths: Sequence[str], group: Sequence[Leaf], meshes: Sequence[Mesh], mesh_axis: Any
) -> tuple[int, ...]:
    """The shape of one concatenated leaf, after checking the parts fit together."""
    first = group[0]
    spec, kind = _named(first).spec, _named(first).memory_kind
    for path, leaf in zip(k_paths[1:], group[1:], strict=True):
        if isinstance(leaf, jax.Array) != isinstance(first, jax.Array):
            what = {True: "a jax.Array", False: "a jax.ShapeDtypeStruct"}
            raise ValueError(
                f"{path} is {what[isinstance(leaf, jax.Array)]} but {k_paths[0]} is "
                f"{what[isinstance(first, jax.Array)]}; the parts of one array must be all "
                "arrays or all ShapeDtypeStructs."
            )
        if _named(leaf).spec != spec or _named(leaf).memory_kind != kind:
            raise ValueError(
                f"{path} has spec {_named(leaf).spec} in memory {_named(leaf).memory_kind!r}"
                f", but {k_paths[0]} has spec {spec} in memory {kind!r}; the parts of one "
                "array must share spec and memory kind."
            )
        if leaf.dtype != first.dtype or len(leaf.shape) != len(first.shape):
            raise ValueError(
                f"{path} is {leaf.dtype}{list(leaf.shape)} but {k_paths[0]} is "
                f"{first.dtype}{list(first.shape)}; the parts of one array must share "
                "dtype and rank."
            )
    dim = _sharded_dim(spec, mesh_axis)
    for d in range(len(first.shape)):
        if d == dim:
            # Every device must hold a shard of one extent, or the result is not a
            # valid NamedSharding layout.
            extents = [
                leaf.shape[d] // shard_count(mesh, _compat.spec_entries(spec)[d])
                for leaf, mesh in zip(group, meshes, strict=True)
            ]
            if len(set(extents)) != 1:
                raise ValueError(
                    f"dimension {d} of {', '.join(k_paths)} is sharded along {mesh_axis!r} "
                    f"with shard extents {extents}; they must be equal to concatenate."
                )
        elif len({leaf.shape[d] for leaf in group}) != 1:
            raise ValueError(
                f"dimension {d} of {', '.join(k_paths)} has sizes "
                f"{[leaf.shape[d] for leaf in group]}; dimensions not sharded along "
                f"{mesh_axis!r} must be equal."
            )
    shape = list(first.shape)
    if dim is not None:
        shape[dim] = sum(leaf.shape[dim] for leaf in group)
    return tuple(shape)


@_compat.moving_bytes()
def concatenate_by_mesh_axis(array_trees: Iterable[Any], mesh_axis: str) -> Any:
    """Joins pytrees living on adjacent sub-meshes into one pytree on their union.

    The inverse of :func:`split_by_mesh_axis`: the meshes (same axis names, same sizes
    on every axis but ``mesh_axis``) are concatenated along ``mesh_axis`` in the order
    given; an array sharded along ``mesh_axis`` has its parts concatenated along the
    dimension that names the axis (where that dimension is sharded over several axes
    with ``mesh_axis`` not the first, the parts' blocks interleave instead, as the
    joined layout orders them: still the exact inverse of the split); an array replicated along it keeps its shape (its
    parts are assumed equal, as a replicated array's are; nothing is compared). No data
    crosses devices and nothing is copied (but inputs that share buffers with another
    input of the call: copied, then consumed). The inputs are donated: they are marked
    deleted once the result is built (not those in unpinned host memory or that
    ``_compat.may_donate`` refuses, nor inputs that share buffers with a live array
    outside the call, such as the parts of ``split_by_mesh_axis`` without donation
    while the split array lives: those stay valid, and the result aliases them).

    Args:
      array_trees: a sequence (or any other iterable, such as a generator) of pytrees
        of one structure; each holds ``jax.Array``s (or ``jax.ShapeDtypeStruct``s)
        with a ``NamedSharding`` on one mesh per pytree.
      mesh_axis: the mesh axis to concatenate along.

    Returns:
      One pytree of the shared structure, on the concatenated mesh.

    Raises:
      ValueError: no trees, different tree structures, a leaf without a
        ``NamedSharding`` (or with ``_logical_device_ids`` set), meshes with different
        axis names or different sizes off ``mesh_axis`` or shared devices, or parts of
        one array that do not fit.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from reshard import concatenate_by_mesh_axis, split_by_mesh_axis
      >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("stage", "tp"))
      >>> x = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("stage")))
      >>> parts = split_by_mesh_axis(x, "stage", [1])
      >>> [p.shape for p in parts]
      [(2,), (6,)]
      >>> y = concatenate_by_mesh_axis(parts, "stage")
      >>> y.sharding == x.sharding, np.asarray(y).tolist()
      (True, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    """
    if isinstance(array_trees, str | bytes | Mapping | jax.Array | np.ndarray) or not (
        isinstance(array_trees, Iterable)
    ):
        raise ValueError(
            f"array_trees must be a sequence of pytrees, got {type(array_trees).__name__}."
        )
    # Any other iterable (a generator, say) is taken in order, as a list would be.
    array_trees = list(array_trees)
    if not array_trees:
        raise ValueError("array_trees is empty; there is nothing to concatenate.")
    flats = [_flatten_named(tree, f"array_trees[{k}]") for k, tree in enumerate(array_trees)]
    treedef = flats[0][2]
    for k, (_, _, other) in enumerate(flats[1:], start=1):
        if other != treedef:
            raise ValueError(
                f"array_trees[{k}] has structure {other}, but array_trees[0] has "
                f"{treedef}; all trees must have one structure."
            )
    if not flats[0][1]:
        return jax.tree_util.tree_unflatten(treedef, [])

    meshes = [_one_mesh(paths, leaves, "all arrays of one tree") for paths, leaves, _ in flats]
    axis_index = _axis_index(meshes[0], mesh_axis)
    _check_meshes(meshes, axis_index, mesh_axis)
    joined_mesh = Mesh(
        np.concatenate([m.devices for m in meshes], axis=axis_index),
        meshes[0].axis_names,
        axis_types=meshes[0].axis_types,
    )

    # Per leaf position: the joined shape and sharding.
    layouts = []
    for i, first in enumerate(flats[0][1]):
        k_paths = [paths[i] for paths, _, _ in flats]
        group = [leaves[i] for _, leaves, _ in flats]
        shape = _joined_shape(k_paths, group, meshes, mesh_axis)
        sharding = _named_sharding(joined_mesh, _named(first).spec, _named(first).memory_kind)
        layouts.append((shape, sharding))

    def build(groups: Sequence[Sequence[Leaf]]) -> list[Leaf]:
        out = []
        for i, (shape, sharding) in enumerate(layouts):
            by_device: dict[jax.Device, jax.Array] = {}
            for group in groups:
                by_device.update(_shards_by_device(group[i]))
            out.append(_assemble(groups[0][i], shape, sharding, by_device))
        return out

    joined = _build_then_consume([leaves for _, leaves, _ in flats], build, donate=True)
    for _, leaves, _ in flats:
        for leaf, out in zip(leaves, joined, strict=True):
            if isinstance(leaf, jax.Array):  # (consumed or not: see _sharing)
                _sharing.note_shared(leaf, [out])
    return jax.tree_util.tree_unflatten(treedef, joined)
