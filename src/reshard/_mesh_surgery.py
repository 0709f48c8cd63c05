"""Mesh surgery: drop or add whole slices of a device mesh along one axis.

Vocabulary (on top of box/shard/location, README.md "What it does"):

* **slice** -- along mesh axis ``a``, the sub-grid of devices at one position of ``a``
  (a mesh of shape ``{'data': 2, 'fsdp': 4}`` has two slices of four devices along
  ``'data'``). Dropping or adding whole slices keeps every other axis intact, so the
  shardings of a pytree carry over to the new mesh with the same ``PartitionSpec``s.
* **lost device** -- a device that must not be used or read any more.

The grid functions (``shrink_grid``, ``grow_grid``) work on numpy arrays of anything:
JAX devices, objects with an ``.id``, or plain integer ids. They do not need real
devices, so they are tested on meshes of thousands of synthetic ids. ``shrink_mesh``,
``grow_mesh`` and ``carry_shardings`` wrap them for ``jax.sharding.Mesh``.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from . import _compat


def device_id(d: Any, where: str = "") -> int:
    """The id of a device: ``d`` itself for an ``int``, else ``d.id``.

    Args:
      d: a ``jax.Device``, any object with an integer ``.id``, or an ``int``.
      where: what the user called, to start the error message with.

    Returns:
      The integer id.

    Example:
      >>> import jax
      >>> device_id(3), device_id(jax.devices()[0])
      (3, 0)
    """
    if isinstance(d, int | np.integer) and not isinstance(d, bool | np.bool_):
        return int(d)
    i = getattr(d, "id", None)
    if not isinstance(i, int | np.integer):
        raise ValueError(
            f"{where + ': ' if where else ''}expected a device (with an integer .id) or an "
            f"integer device id, got {type(d).__name__}: {d!r}"
        )
    return int(i)


def device_ranges(ids: Iterable[int]) -> str:
    """``[0, 1, 2, 3, 8]`` -> ``'0-3,8'``: the compact form ``reshard plan`` also reads.

    The ids keep their order, which is the layout on a mesh: ``[3, 2, 0, 1]`` ->
    ``'3,2,0-1'``, which ``--src-devices`` reads back as the same list. Only ascending
    runs become ranges (``reshard plan`` reads ``7-0`` as a mistake).
    """
    out: list[str] = []
    given = list(ids)
    i = 0
    while i < len(given):
        j = i
        while j + 1 < len(given) and given[j + 1] == given[j] + 1:
            j += 1
        out.append(str(given[i]) if i == j else f"{given[i]}-{given[j]}")
        i = j + 1
    return ",".join(out)


def grid_ids(devices: np.ndarray) -> np.ndarray:
    """The integer ids of a device grid, as an int64 array of the same shape."""
    if devices.dtype.kind in "iu":
        return devices.astype(np.int64, copy=False)
    flat = np.fromiter((device_id(d) for d in devices.flat), dtype=np.int64, count=devices.size)
    return flat.reshape(devices.shape)


def describe_grid(devices: np.ndarray, axis_names: Sequence[Any], limit: int = 64) -> str:
    """``mesh {'data': 2, 'fsdp': 4} with device ids [[0, 1, 2, 3], [4, 5, 6, 7]]``.

    Large grids are cut after ``limit`` ids so error messages stay readable.
    """
    shape = dict(zip(axis_names, devices.shape, strict=True))
    ids = grid_ids(devices)
    if ids.size <= limit:
        shown = str(ids.tolist())
    else:
        shown = f"{ids.ravel()[:limit].tolist()} ... ({ids.size} devices)"
    return f"mesh {shape} with device ids {shown}"


def axis_position(axis_names: Sequence[Any], axis: Any, where: str) -> int:
    """The position of ``axis`` among ``axis_names``; a clear error when absent."""
    names = tuple(axis_names)
    if axis not in names:
        raise ValueError(
            f"{where}: axis {axis!r} is not an axis of the mesh (axis names {names}); "
            "pass one of these names, usually the data-parallel axis"
        )
    return names.index(axis)


def repeated_ids(ids: Iterable[Any]) -> list[Any]:
    """What ``ids`` (device ids, mesh axis names) lists more than once, sorted."""
    return sorted(i for i, n in Counter(ids).items() if n > 1)


def check_distinct_devices(mesh: Mesh, where: str, what: str = "the mesh") -> None:
    """Raises ``ValueError`` when ``mesh`` lists a device more than once (JAX's ``Mesh``
    allows it; no sharding of such a mesh can be resharded). The message starts with
    ``where`` and calls the mesh ``what``."""
    twice = repeated_ids(device_id(d) for d in mesh.devices.flat)
    if twice:
        raise ValueError(
            f"{where}: {what} lists device(s) {twice} more than once; a mesh holds each device once"
        )


def not_a_collection(x: Any) -> bool:
    """Whether ``x`` is one value where a collection is wanted: text, a non-iterable (a
    number, a device) or a 0-d numpy or JAX array (which only looks iterable)."""
    return (
        isinstance(x, str | bytes) or not isinstance(x, Iterable) or getattr(x, "ndim", None) == 0
    )


def _listed(devices: Iterable[Any], where: str = "") -> Iterable[Any]:
    """``devices`` itself, once checked to be a collection and not one device or id; a
    numpy array of any shape (a block of ``mesh.devices``) as its elements."""
    if not_a_collection(devices):
        raise TypeError(
            f"{where + ': ' if where else ''}expected a list of devices or device ids, got "
            f"{type(devices).__name__}: {devices!r} (for one device, pass [device])"
        )
    if isinstance(devices, np.ndarray):
        return list(devices.ravel())
    return devices


def _ids(devices: Iterable[Any], where: str) -> list[int]:
    return [device_id(d, where) for d in _listed(devices, where)]


def check_allowed_sizes(allowed_sizes: Iterable[int] | None, where: str) -> tuple[int, ...] | None:
    """``allowed_sizes`` as a sorted tuple of distinct sizes, each an integer >= 1."""
    if allowed_sizes is None:
        return None
    if not_a_collection(allowed_sizes):
        raise ValueError(
            f"{where}: allowed_sizes must be a collection of integer sizes >= 1 of the axis, "
            f"e.g. (1, 2, 4); got {type(allowed_sizes).__name__}: {allowed_sizes!r}"
        )
    sizes = list(allowed_sizes)
    bad = [s for s in sizes if isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 1]
    if bad or not sizes:
        raise ValueError(
            f"{where}: allowed_sizes must hold integer sizes >= 1 of the axis, e.g. (1, 2, 4); "
            f"got {tuple(sizes)}"
        )
    return tuple(sorted({int(s) for s in sizes}))


def clean_slices(ids: np.ndarray, k: int, lost: Iterable[int]) -> list[int]:
    """Positions along grid axis ``k`` whose slice holds none of the ``lost`` ids."""
    lost_arr = np.fromiter(set(lost), dtype=np.int64)
    hit = np.isin(ids, lost_arr)
    other = tuple(a for a in range(ids.ndim) if a != k)
    touched = hit.any(axis=other) if other else hit
    return [int(i) for i in np.flatnonzero(~touched)]


def shrink_grid(
    devices: np.ndarray,
    axis_names: Sequence[Any],
    lost_devices: Iterable[Any],
    axis: Any,
    *,
    allowed_sizes: Iterable[int] | None = None,
) -> np.ndarray:
    """The largest sub-grid that avoids ``lost_devices``, dropping whole slices along ``axis``.

    Args:
      devices: the device grid (``mesh.devices``): devices, objects with ``.id``, or ids.
      axis_names: one name per grid dimension.
      lost_devices: devices or ids to avoid; ids not in the grid are ignored.
      axis: the axis along which slices may be dropped.
      allowed_sizes: the sizes ``axis`` may take (e.g. ``(1, 2, 4)`` when the global
        batch must divide evenly); ``None`` allows any size. The largest allowed size
        not above the number of clean slices wins; the first clean slices are kept.

    Returns:
      A grid of the same kind, with the clean slices in their original order.

    Raises:
      ValueError: ``axis`` is not in ``axis_names``, or no slice (or no allowed number
        of slices) is free of lost devices.

    Example:
      >>> shrink_grid(np.arange(8).reshape(2, 4), ("data", "fsdp"), [5], "data").tolist()
      [[0, 1, 2, 3]]
    """
    k = axis_position(axis_names, axis, "shrink_mesh")
    lost = set(_ids(lost_devices, "shrink_mesh: lost_devices"))
    ids = grid_ids(devices)
    keep = clean_slices(ids, k, lost)
    n = len(keep)
    sizes = check_allowed_sizes(allowed_sizes, "shrink_mesh")
    if sizes is not None:
        fitting = [s for s in sizes if s <= n]
        if not fitting:
            raise ValueError(
                f"shrink_mesh: {n} slice(s) along axis {axis!r} are free of lost devices, "
                f"but allowed_sizes={list(sizes)} has no size <= {n}; "
                f"{describe_grid(devices, axis_names)}, lost devices {sorted(lost)}. "
                "Allow smaller sizes, or restore from a checkpoint on fewer devices"
            )
        n = fitting[-1]
    if n == 0:
        in_grid = sorted(lost & set(ids.ravel().tolist()))
        raise ValueError(
            f"shrink_mesh: every one of the {ids.shape[k]} slice(s) along axis {axis!r} "
            f"holds a lost device, so no mesh with axis names {tuple(axis_names)} avoids "
            f"them: {describe_grid(devices, axis_names)}, lost devices {in_grid}. "
            "Shrink along another axis, or restore from a checkpoint"
        )
    return np.take(devices, keep[:n], axis=k)


def grow_grid(
    devices: np.ndarray,
    axis_names: Sequence[Any],
    new_devices: Sequence[Any],
    axis: Any,
) -> np.ndarray:
    """Appends whole slices of ``new_devices`` along ``axis``: the inverse of a shrink.

    Args:
      devices: the current device grid.
      axis_names: one name per grid dimension.
      new_devices: devices (or ids) to add, in order; they fill new slices, each in
        row-major order of the other axes. Their number must be a multiple of the
        slice size (the product of the other axes' sizes).
      axis: the axis that grows.

    Returns:
      The grid with ``len(new_devices) // slice_size`` more positions along ``axis``.

    Raises:
      ValueError: ``axis`` unknown, no devices given, a device already in the grid or
        given twice, or a number of devices that does not fill whole slices.

    Example:
      >>> grow_grid(np.arange(4).reshape(1, 4), ("data", "fsdp"), [4, 5, 6, 7], "data").tolist()
      [[0, 1, 2, 3], [4, 5, 6, 7]]
    """
    k = axis_position(axis_names, axis, "grow_mesh")
    new = list(_listed(new_devices, "grow_mesh"))
    new_ids = [device_id(d, "grow_mesh") for d in new]
    slice_shape = devices.shape[:k] + devices.shape[k + 1 :]
    per_slice = math.prod(slice_shape)
    where = describe_grid(devices, axis_names)
    if not new:
        raise ValueError(f"grow_mesh: no devices given to add to the {where}")
    dup = repeated_ids(new_ids)
    if dup:
        raise ValueError(f"grow_mesh: devices {dup} are given more than once; list each once")
    present = sorted(set(new_ids) & set(grid_ids(devices).ravel().tolist()))
    if present:
        raise ValueError(
            f"grow_mesh: devices {present} are already in the {where}; pass only devices to add"
        )
    if len(new) % per_slice:
        short = per_slice - len(new) % per_slice
        raise ValueError(
            f"grow_mesh: got {len(new)} device(s), but a slice along axis {axis!r} needs "
            f"{per_slice} (the other axes have sizes {slice_shape}); add {short} more device(s) "
            "to complete a slice (e.g. healthy devices that shrink_mesh dropped), or pass the "
            "target mesh instead"
        )
    if devices.dtype.kind in "iu":
        flat = np.asarray(new_ids, dtype=devices.dtype)
    else:
        flat = _as_objects(new)
    block = np.moveaxis(flat.reshape((len(new) // per_slice, *slice_shape)), 0, k)
    return np.concatenate([devices, block], axis=k)


def _as_objects(items: Sequence[Any]) -> np.ndarray:
    # Filling element by element stops numpy from looking inside device-like objects.
    out = np.empty(len(items), dtype=object)
    for i, d in enumerate(items):
        out[i] = d
    return out


def _new_mesh(devices: np.ndarray, like: Mesh) -> Mesh:
    axis_types = getattr(like, "axis_types", None)
    if axis_types is None:  # pragma: no cover - older meshes without axis types
        return Mesh(devices, like.axis_names)
    return Mesh(devices, like.axis_names, axis_types=axis_types)


def shrink_mesh(
    mesh: Mesh,
    lost_devices: Iterable[Any],
    axis: str,
    *,
    allowed_sizes: Iterable[int] | None = None,
) -> Mesh:
    """The largest mesh with the same axis names that avoids ``lost_devices``.

    Whole slices along ``axis`` (usually the data-parallel axis) that hold a lost device
    are dropped; every other axis keeps its size, so ``carry_shardings`` can move the
    same ``PartitionSpec``s onto the result. Lost devices outside ``mesh`` are ignored:
    when none of them is in it, the mesh comes back unchanged unless ``allowed_sizes``
    excludes its size along ``axis`` (then it shrinks to the largest allowed size).

    Args:
      mesh: the current mesh.
      lost_devices: the devices (or device ids) that are gone.
      axis: the mesh axis whose slices may be dropped.
      allowed_sizes: sizes ``axis`` may take, e.g. ``(1, 2, 4)``; default: any.

    Returns:
      A ``Mesh`` on surviving devices (same axis names and axis types).

    Raises:
      ValueError: ``axis`` is not a mesh axis, or every slice along it (or every
        allowed number of slices) holds a lost device (the message shows the mesh and
        the lost devices), or the mesh lists a device twice.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh
      >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
      >>> small = reshard.shrink_mesh(mesh, [jax.devices()[5]], "data")
      >>> dict(small.shape), [d.id for d in small.devices.flat]
      ({'data': 1, 'fsdp': 4}, [0, 1, 2, 3])
    """
    check_distinct_devices(mesh, "shrink_mesh")
    devices = shrink_grid(
        mesh.devices, mesh.axis_names, lost_devices, axis, allowed_sizes=allowed_sizes
    )
    if devices.shape == mesh.devices.shape:
        return mesh
    return _new_mesh(devices, mesh)


def grow_mesh(mesh: Mesh, devices_or_mesh: Sequence[Any] | Mesh, axis: str) -> Mesh:
    """The inverse of ``shrink_mesh``: a larger mesh along ``axis``.

    Args:
      mesh: the current (shrunk) mesh.
      devices_or_mesh: either the devices (or device ids) that came back, which are
        appended as whole new slices along ``axis`` (their number must be a multiple of
        the slice size), or a target ``Mesh`` -- typically the mesh before the loss -- that is checked
        and returned: same axis names, same sizes on the other axes, not smaller along
        ``axis``, and holding every device of ``mesh``.
      axis: the mesh axis that grows.

    Returns:
      The larger ``Mesh`` (same axis names and axis types).

    Raises:
      ValueError: an unknown axis, devices that do not fill whole slices or are already
        in ``mesh``, a target mesh that does not extend ``mesh`` along ``axis``, or a
        mesh that lists a device twice.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh
      >>> small = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "fsdp"))
      >>> big = reshard.grow_mesh(small, jax.devices()[4:8], "data")
      >>> dict(big.shape)
      {'data': 2, 'fsdp': 4}
    """
    check_distinct_devices(mesh, "grow_mesh")
    if isinstance(devices_or_mesh, Mesh):
        check_distinct_devices(devices_or_mesh, "grow_mesh (target)")
        check_grow_target(mesh, devices_or_mesh, axis)
        return devices_or_mesh
    new = _as_devices(devices_or_mesh, mesh)
    return _new_mesh(grow_grid(mesh.devices, mesh.axis_names, new, axis), mesh)


def _as_devices(items: Iterable[Any], mesh: Mesh) -> list[Any]:
    """``items`` with every integer id replaced by the JAX device of that id.

    A ``Mesh`` holds devices, so ids (accepted everywhere else devices are named) are
    looked up among the devices of the mesh's platform.
    """
    platform = mesh.devices.flat[0].platform
    by_id: dict[int, Any] = {}
    out = []
    for d in _listed(items, "grow_mesh"):
        if isinstance(d, bool):
            raise ValueError(f"grow_mesh: {d!r} is neither a device nor a device id")
        if isinstance(d, int | np.integer):
            by_id = by_id or {x.id: x for x in jax.devices(platform)}
            if int(d) not in by_id:
                raise ValueError(
                    f"grow_mesh: no {platform} device has id {int(d)} (ids "
                    f"{device_ranges(sorted(by_id))} exist); pass devices, or ids of devices "
                    "JAX has"
                )
            d = by_id[int(d)]
        out.append(d)
    return out


def check_grow_target(mesh: Mesh, target: Mesh, axis: str) -> None:
    """Raises ``ValueError`` unless ``target`` extends ``mesh`` along ``axis`` only."""
    k = axis_position(mesh.axis_names, axis, "grow_mesh")
    here = describe_grid(mesh.devices, mesh.axis_names)
    there = describe_grid(target.devices, target.axis_names)
    if tuple(target.axis_names) != tuple(mesh.axis_names):
        raise ValueError(
            f"grow_mesh: the target mesh has axis names {tuple(target.axis_names)}, the "
            f"current one {tuple(mesh.axis_names)}; build the target with the same axis names"
        )
    if tuple(target.axis_types) != tuple(mesh.axis_types):
        raise ValueError(
            f"grow_mesh: the target mesh has axis types {tuple(target.axis_types)}, the "
            f"current one {tuple(mesh.axis_types)}; build the target with the same axis types"
        )
    a, b = mesh.devices.shape, target.devices.shape
    if a[:k] + a[k + 1 :] != b[:k] + b[k + 1 :] or b[k] < a[k]:
        raise ValueError(
            f"grow_mesh: the target {there} must match the current {here} on every axis "
            f"but {axis!r} and be at least as large along {axis!r}"
        )
    missing = sorted(
        set(grid_ids(mesh.devices).ravel().tolist()) - set(target.device_ids.ravel().tolist())
    )
    if missing:
        raise ValueError(
            f"grow_mesh: the target {there} lacks devices {missing} of the current {here}; "
            "a grown mesh keeps every current device"
        )


def carry_shardings(tree: Any, mesh: Mesh) -> Any:
    """The same shardings on another mesh: each ``NamedSharding`` keeps its spec.

    Args:
      tree: a pytree whose leaves are ``Sharding``s, or arrays / ``ShapeDtypeStruct``s
        with a ``.sharding`` (their sharding is carried), e.g. a whole training state.
      mesh: the new mesh (from ``shrink_mesh`` or ``grow_mesh``); it must have every
        mesh axis the specs name.

    Returns:
      A pytree of the same structure holding ``NamedSharding(mesh, spec, memory_kind)``
      per leaf. A ``SingleDeviceSharding`` on a device of ``mesh`` is kept as it is.

    Raises:
      ValueError: a leaf without a sharding, a sharding other than ``NamedSharding``
        (or ``SingleDeviceSharding`` on a device of ``mesh``), or a spec naming an
        axis ``mesh`` lacks. The message names the leaf path.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> old = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
      >>> new = reshard.shrink_mesh(old, [4, 5], "data")
      >>> reshard.carry_shardings({"w": NamedSharding(old, P("fsdp"))}, new)["w"].spec == P("fsdp")
      True
    """
    ids = set(mesh.device_ids.ravel().tolist())

    def carry(path: Any, leaf: Any) -> Sharding:
        where = jax.tree_util.keystr(path) or "<root>"
        s = (
            leaf
            if isinstance(leaf, Sharding)
            else _compat.sharding_of(leaf, f"leaf {where}")
            if isinstance(leaf, jax.Array)
            else getattr(leaf, "sharding", None)
        )
        if isinstance(s, NamedSharding):
            for entry in _compat.spec_entries(s.spec):
                for name in _entry_names(entry):
                    if name not in mesh.axis_names:
                        raise ValueError(
                            f"carry_shardings: leaf {where} has spec {s.spec} naming axis "
                            f"{name!r}, but the new mesh has axes {tuple(mesh.axis_names)}; "
                            "build the new mesh with the same axis names (shrink_mesh does)"
                        )
            return NamedSharding(mesh, s.spec, memory_kind=s.memory_kind)
        if isinstance(s, SingleDeviceSharding) and device_id(next(iter(s.device_set))) in ids:
            return s
        got = type(leaf).__name__ if s is None else f"{type(s).__name__} {s}"
        raise ValueError(
            f"carry_shardings: leaf {where} has {got}; only NamedShardings (and "
            "SingleDeviceShardings on devices of the new mesh) can be carried over. Put "
            "the leaf on a NamedSharding of the old mesh first"
        )

    return jax.tree_util.tree_map_with_path(carry, tree, is_leaf=lambda x: isinstance(x, Sharding))


def _entry_names(entry: Any) -> tuple[Any, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return tuple(entry) if isinstance(entry, tuple | list) else (entry,)
