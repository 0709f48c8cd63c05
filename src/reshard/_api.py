"""The public entry points ``reshard`` and ``plan``: normalise once, then plan.

This layer flattens the pytree, broadcasts the sharding prefix, validates every leaf
(errors name the leaf path), routes non-``jax.Array`` leaves to ``jax.device_put``,
and looks plans up in a bounded cache. Inner layers trust what it hands them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding, SingleDeviceSharding

from . import _collective_common, _compat, _programs, _sharing
from ._errors import DataLossError
from ._execute import _whole_copy, device_peak_extra, execute_plan, traced_leaf
from ._geometry import box_from_index
from ._mesh_surgery import (
    _listed,
    check_distinct_devices,
    device_id,
    device_ranges,
    not_a_collection,
)
from ._plan import ARRAY, HOST, KEY, LeafInfo, Plan, plan_processes, processes_of
from ._planner import LeafSpec, ShardSpec, plan_leaves

EXECUTORS = ("auto", "host", "device", "collective")
PLAN_CACHE_SIZE = 128

# Two bounded LRU caches: plans that cross processes, and plans within one process.
# Every process makes the same calls that cross processes (the multi-controller
# contract), so the first evolves alike on every process; calls within one process may
# differ per process, as often as it likes (docs/multiprocess.md). In one shared LRU
# those would evict a collective plan on one process only, which then checks its
# rebuilt plan with the others (``agree``) while they run the cached one: a hang.
_cache: OrderedDict[_Key, Plan] = OrderedDict()
_local_cache: OrderedDict[_Key, Plan] = OrderedDict()
# A shortcut to those caches' entries for calls whose every leaf is a live jax.Array
# and whose every destination is a Sharding given per leaf or once for the tree:
# keyed by what such a call is (the tree's structure, each array's shape, dtype and
# sharding, each destination), without the leaf paths and checks the caches' own keys
# are built from (~4 of ~5 ms of a cached lookup of 512 arrays). It only leads to an
# entry of theirs (by its key: a plan the caches drop is not kept alive here, nor its
# compiled programs), which a hit refreshes there as a lookup of its own would: what
# the caches hold, and in what order, is the same with it as without it.
_quick: OrderedDict[_Key, _Key] = OrderedDict()
_cache_lock = threading.Lock()


class _Key:
    """A cache key that hashes once: a key holds an entry per leaf, and each lookup,
    refresh and store would hash them all again."""

    __slots__ = ("hash", "value")

    def __init__(self, value: Hashable) -> None:
        self.value = value
        self.hash = hash(value)

    def __hash__(self) -> int:
        return self.hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Key) and self.hash == other.hash and self.value == other.value


def clear_plan_cache() -> None:
    """Forgets every cached plan, every compiled program (which equal plans share,
    cached or not), and what was memoised per sharding."""
    with _cache_lock:
        _cache.clear()
        _local_cache.clear()
        _quick.clear()
    _programs.clear()
    for memo in (_shard_specs, _destination_ok, _whole_copy):  # they hold shardings
        memo.cache_clear()


def plan_cache_size() -> int:
    return len(_cache) + len(_local_cache)


def reshard(
    x: Any,
    sharding: Any,
    *,
    donate: bool = False,
    may_alias: bool | None = None,
    cache_resharding_plans: bool = False,
    executor: str = "auto",
    avoid_devices: Iterable[Any] | None = (),
) -> Any:
    """Returns a copy of ``x`` committed to ``sharding``, moving as few bytes as possible.

    Drop-in for ``pathwaysutils.experimental.reshard.reshard`` on plain JAX.

    Args:
      x: an array, a scalar, or a pytree of them. ``jax.Array`` leaves (PRNG-key
        arrays included) are moved by a plan; any other leaf is placed with
        ``jax.device_put``.
      sharding: a ``jax.sharding.Sharding`` or a pytree of them that is a tree prefix
        of ``x`` (one sharding then covers a whole subtree); a ``jax.Device`` stands
        for its ``SingleDeviceSharding``, as in ``jax.device_put``.
      donate: consume the sources once the whole pytree has been moved (they then
        read as deleted); an array keeping 1 MiB or more in device memory hands those
        shards over without a copy. A failure frees nothing (but see the README on
        a hand-over over several device sets that runs out of memory). An array
        sharing buffers with a live array outside ``x`` that reshard made zero-copy (a
        ``may_alias=True`` output, a part of ``split_by_mesh_axis``, or what it came
        from) is left valid instead, and its output is a copy.
      may_alias: ``None`` copies shards that stay on their device (handing them over
        only when donating), so the result shares no buffer with ``x``, even where
        nothing changes (``jax.device_put`` would return ``x`` itself there), as
        Pathways returns a copy. ``True`` hands such shards over always (donating
        ``x`` to a jitted step later frees them under the output); ``False`` copies
        them always, when donating too. See ``Plan.execute``.
      cache_resharding_plans: keep the plan in a bounded LRU cache keyed by avals,
        shardings and options, so repeated calls do not plan again (nor, across
        processes, build their schedule and check it with the others again: ~10%
        of a 288 MiB relayout there). Compiled programs are shared by equal plans
        either way (the last 256, each freed when dropped), so calls do not compile
        again even without it; so are the copy tables of each array geometry.
      executor: ``"auto"`` (default), ``"host"`` (CPU only), ``"device"`` or
        ``"collective"``; see ``reshard.plan``.
      avoid_devices: devices (or ids) whose source shards must not be read, e.g. lost
        devices; each must be one of ``jax.devices()``. Raises ``DataLossError`` when
        some data has no other copy.

    Returns:
      A pytree with the structure of ``x``.

    Raises:
      ValueError: a sharding that is not a ``Sharding``, a sharding tree that is not a
        prefix of ``x``, a shape the destination cannot divide, a spec longer than the
        array rank, a deleted or donated input, a ``ShapeDtypeStruct`` without a
        sharding, an ``avoid_devices`` id JAX does not have, mixed platforms.
      TypeError: ``avoid_devices`` that is not an iterable of devices or ids.
      DataLossError: with ``avoid_devices``, data that no allowed device holds.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> devs = np.array(jax.devices()[:4])
      >>> x = jax.device_put(np.arange(16.0), NamedSharding(Mesh(devs, "a"), P("a")))
      >>> y = reshard.reshard(x, NamedSharding(Mesh(devs[::-1], "b"), P("b")))
      >>> bool(np.array_equal(y, x))  # compared on the host: x and y use other devices
      True
    """
    # Counted (see count_call) only once it is known to be a collective call, never
    # counted and taken back: a call within one process, made in another thread while
    # a collective reshard reads the count, would show this process out of step.
    # Donations by other threads from here on are seen by execute_plan (its inputs are
    # checked while planning).
    seen = _sharing.readers.deletions
    try:
        p, checked = _plan(
            x,
            sharding,
            executor=executor,
            avoid_devices=avoid_devices,
            cache=cache_resharding_plans,
        )
    except BaseException as e:
        refuse_unplanned(x, sharding, e)
        raise
    run = functools.partial(
        execute_plan, p, x, donate=donate, may_alias=may_alias, checked=checked, deletions=seen
    )
    if p.crosses_processes:
        with _collective_common.counted_call():  # counted before anything else can fail
            return run()
    return run()


def refuse_unplanned(x: Any, sharding: Any, error: BaseException) -> None:
    """For a public call that raised ``error`` before it had a plan to run: where it
    may have been a collective call, counts it, and tells the other processes, so that
    any of them in the same call's check raises too (``_collective_common.refused``)."""
    if _may_cross_processes(x, sharding):
        _collective_common.count_call()  # a collective call, refused
        _collective_common.refused(error)


def _may_cross_processes(x: Any, sharding: Any) -> bool:
    """For a call that could not be planned: whether the devices its arguments name
    (its arrays' and its destination shardings') may belong to more than one process.
    So a call within one process is not counted (``Plan.crosses_processes``) even when
    its arguments are refused; where in doubt, it is."""
    if jax.process_count() == 1:
        return False
    try:
        found: set[int] = set()
        for v in jax.tree_util.tree_leaves(x):
            if isinstance(v, jax.Array | jax.ShapeDtypeStruct):
                devices: Any = getattr(v.sharding, "device_set", None)
                found |= {d.process_index for d in devices or ()}
        shardings = jax.tree_util.tree_leaves(
            sharding, is_leaf=lambda s: isinstance(s, Sharding | jax.Device)
        )
        destinations: set[int] = set()
        for s in shardings:
            if isinstance(s, Mesh):  # (reshard.recover's destination may be one)
                devices = list(s.devices.flat)
            else:
                devices = [s] if isinstance(s, jax.Device) else getattr(s, "device_set", ())
            destinations |= {d.process_index for d in devices}
        # No destination device to see (a PartitionSpec for a sharding, say): in doubt.
        return not destinations or len(found | destinations) > 1
    except Exception:  # arguments too broken to tell
        return True


def plan(
    x: Any,
    sharding: Any,
    *,
    executor: str = "auto",
    avoid_devices: Iterable[Any] | None = (),
    cache: bool = True,
) -> Plan:
    """Plans moving ``x`` to ``sharding`` without touching any data.

    Args:
      x: a pytree of ``jax.Array``s and/or ``jax.ShapeDtypeStruct``s that carry a
        ``.sharding`` (other leaves are allowed and will go through
        ``jax.device_put``).
      sharding: a ``Sharding`` (or ``jax.Device``) or a pytree of them that is a tree
        prefix of ``x``.
      executor: ``"auto"`` picks ``"collective"`` when JAX runs several processes
        and the plan's devices belong to more than one of them
        (``Plan.crosses_processes``), else ``"host"`` when every device is a CPU, else
        ``"device"``.
      avoid_devices: devices (or device ids) never to read from.
      cache: look the plan up in / store it into the bounded plan cache. A pytree
        whose node metadata has no plain ``==`` (a numpy array, say) is planned
        afresh on every call instead, as its tree cannot be compared with a cached one.

    Returns:
      A ``Plan``: ``print(plan)`` summarises it, ``plan.stats`` has the numbers,
      ``plan.transfer_matrix()`` the bytes per device pair, ``plan.execute(x)`` runs it.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> src = NamedSharding(Mesh(np.array(jax.devices()[:4]), "a"), P("a"))
      >>> dst = NamedSharding(Mesh(np.array(jax.devices()[4:8]), "b"), P("b"))
      >>> p = reshard.plan(jax.ShapeDtypeStruct((1024,), np.float32, sharding=src), dst)
      >>> p.stats.bytes_moved == p.stats.bytes_lower_bound == 4096
      True
    """
    return _plan(x, sharding, executor=executor, avoid_devices=avoid_devices, cache=cache)[0]


def _plan(
    x: Any, sharding: Any, *, executor: str, avoid_devices: Iterable[Any] | None, cache: bool
) -> tuple[Plan, bool]:
    """``plan``, and whether every leaf of ``x`` is a live ``jax.Array`` of the plan's
    shape, dtype and sharding (so ``execute_plan`` need not check them again)."""
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    avoid = _avoid_ids(avoid_devices)
    quick = _quick_key(x, sharding, executor, avoid)
    if quick is not None and cache:
        try:
            with _cache_lock:
                found = _quick.get(quick)
                if found is not None:
                    for store in (_cache, _local_cache):
                        hit = store.get(found)  # (usually the very key object stored there)
                        if hit is not None:
                            store.move_to_end(found)
                            _quick.move_to_end(quick)
                            return hit, True
                    del _quick[quick]  # that plan has left the cache
        except (ValueError, TypeError):
            cache = False  # (as below)
    paths, values, treedef = _flatten(x)
    dst = _broadcast_shardings(sharding, x, len(values))
    leaves = tuple(_leaf_info(p, v, s) for p, v, s in zip(paths, values, dst, strict=True))
    if cache:
        try:
            key = _Key((treedef, leaves, executor, avoid))
            with _cache_lock:
                for cached in (_cache, _local_cache):
                    got = cached.get(key)
                    if got is not None:
                        cached.move_to_end(key)
                        _remember_quick(quick, key)
                        return got, quick is not None
        except (ValueError, TypeError):
            # Pytree node metadata without plain equality (a numpy array, say) cannot
            # be compared with a cached tree's: plan this call without the cache.
            cache = False
    result = _build_plan(treedef, leaves, executor, avoid)
    if cache:
        try:
            with _cache_lock:
                store = _cache if result.crosses_processes else _local_cache
                store[key] = result
                while len(store) > PLAN_CACHE_SIZE:
                    store.popitem(last=False)
                _remember_quick(quick, key)
        except (ValueError, TypeError):
            pass  # as above: the plan is still good, only not cached
    return result, quick is not None


def _quick_key(x: Any, sharding: Any, executor: str, avoid: frozenset[int]) -> _Key | None:
    """The shortcut key of a call (see ``_quick``), or None where the call does not
    qualify: a leaf that is not a live ``jax.Array`` (tracers, ShapeDtypeStructs, host
    values, deleted arrays: the full path checks and names them), a destination that is
    not a ``Sharding`` (a device, None, a spec), a sharding tree that is a prefix of
    ``x`` but not ``x``'s own structure, node metadata that cannot be compared."""
    array_type = _compat.array_type()
    try:
        values, treedef = jax.tree_util.tree_flatten(x)
        if isinstance(sharding, Sharding):
            dst: Sequence[Any] = [sharding] * len(values)
        else:
            dst, s_def = jax.tree_util.tree_flatten(sharding)
            if s_def != treedef:  # type: ignore[operator]
                return None
        entries = []
        v: Any
        for v, s in zip(values, dst, strict=True):
            if type(v) is not array_type or not isinstance(s, Sharding) or v.is_deleted():
                return None
            if not v.committed and jax.process_count() > 1:
                return None  # placed like a host value there (``_leaf_info``)
            entries.append((v.shape, v.dtype, v.sharding, s))
        return _Key((treedef, tuple(entries), executor, avoid))
    except (ValueError, TypeError):
        return None


def _remember_quick(quick: _Key | None, key: _Key) -> None:
    """Leads ``quick`` to the plan cache's entry ``key`` (under its lock)."""
    if quick is None:
        return
    _quick[quick] = key
    _quick.move_to_end(quick)
    # Bounded like the caches; entries whose plan has left them go when next hit, or
    # here, oldest first.
    while len(_quick) > 2 * PLAN_CACHE_SIZE:
        _quick.popitem(last=False)


# ----------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------


def path_str(path: Sequence[Any]) -> str:
    """``params['w'][0]`` style text for a pytree key path (empty for the root)."""
    return jax.tree_util.keystr(tuple(path))


def _flatten(x: Any) -> tuple[list[str], list[Any], Any]:
    with_path, treedef = jax.tree_util.tree_flatten_with_path(x)
    return [path_str(p) for p, _ in with_path], [v for _, v in with_path], treedef


def _children(node: Any) -> tuple[list[Any], list[Any], Any]:
    """One level of a pytree node: its children's keys and values, and its treedef."""
    with_path, treedef = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda n: n is not node)
    if with_path and not with_path[0][0]:  # a leaf: its only "child" is itself
        return [], [], treedef
    return [p[0] for p, _ in with_path], [v for _, v in with_path], treedef


def _prefix_mismatch(prefix: Any, full: Any) -> str:
    """Where the sharding tree ``prefix`` first stops being a prefix of ``x`` (``full``)
    and how the two differ there, naming keys and types but no values."""
    is_sharding = lambda s: isinstance(s, Sharding | jax.Device) or s is None  # noqa: E731

    def name(k: Any) -> str:
        return repr(k.key) if isinstance(k, jax.tree_util.DictKey) else jax.tree_util.keystr((k,))

    def describe(node: Any) -> str:
        keys, _, treedef = _children(node)
        kind = "jax.Array" if isinstance(node, jax.Array) else type(node).__name__
        if node is None:
            return "None"
        if treedef.num_nodes == 1 and treedef.num_leaves == 1:
            return f"a leaf ({kind})"
        if isinstance(node, list | tuple) and all(
            isinstance(k, jax.tree_util.SequenceKey) for k in keys
        ):
            return f"a {kind} of {len(keys)}"
        names = [name(k) for k in keys]
        more = f", ... ({len(names)} in all)" if len(names) > 8 else ""
        return f"a {kind} with keys [{', '.join(names[:8])}{more}]"

    path: list[Any] = []
    while not is_sharding(prefix):
        p_keys, p_kids, p_def = _children(prefix)
        f_keys, f_kids, f_def = _children(full)
        if p_def != f_def or p_keys != f_keys:
            where = f"x{path_str(path)}" if path else "the root"
            text = (
                f"at {where} the sharding tree has {describe(prefix)}, but x has {describe(full)}"
            )
            if type(prefix) is type(full):
                p_names, f_names = [name(k) for k in p_keys], [name(k) for k in f_keys]
                only_p = [k for k in p_names if k not in f_names]
                only_f = [k for k in f_names if k not in p_names]
                if (only_p or only_f) and not isinstance(prefix, list | tuple):
                    sides = [
                        f"only {side} has [{', '.join(keys[:8])}]"
                        for side, keys in (("the sharding tree", only_p), ("x", only_f))
                        if keys
                    ]
                    text += f" ({', '.join(sides)})"
                elif p_names == f_names:
                    # Same children: the node's own static data differs (a dataclass's
                    # static field, say); one level of each treedef shows it, no values.
                    text += f" whose node data differs: {p_def} against {f_def}"
            return text
        # The first child that is not a prefix (there is one, or flattening would
        # have worked).
        for k, p_kid, f_kid in zip(p_keys, p_kids, f_kids, strict=True):
            try:
                jax.tree_util.tree_structure(p_kid, is_leaf=is_sharding).flatten_up_to(f_kid)  # type: ignore[attr-defined]
            except (ValueError, TypeError):
                path.append(k)
                prefix, full = p_kid, f_kid
                break
        else:  # pragma: no cover - flatten_up_to failed, so a child differs
            break
    return f"the structures differ below x{path_str(path)}"


def _broadcast_shardings(sharding: Any, x: Any, n: int) -> list[Any]:
    """One destination sharding per leaf of ``x``, from a tree prefix of ``x``."""
    s_with_path, s_def = jax.tree_util.tree_flatten_with_path(
        sharding, is_leaf=lambda s: isinstance(s, Sharding | jax.Device) or s is None
    )
    # A device stands for its SingleDeviceSharding, as in jax.device_put.
    s_with_path = [
        (p, SingleDeviceSharding(s) if isinstance(s, jax.Device) else s) for p, s in s_with_path
    ]

    def refuse(p: Any, s: Any, hint: str = "") -> ValueError:
        where = f"at {path_str(p)}" if p else "at the root"
        return ValueError(
            f"sharding {where} must be a jax.sharding.Sharding, got {type(s).__name__}: {s!r}.{hint}"
        )

    for p, s in s_with_path:
        if isinstance(s, PartitionSpec):
            raise refuse(p, s, " Wrap a PartitionSpec in NamedSharding(mesh, spec).")
        if not isinstance(s, Sharding) and s is not None:
            raise refuse(p, s)
    try:
        subtrees = s_def.flatten_up_to(x)  # type: ignore[attr-defined]
    except (ValueError, TypeError):
        # (JAX's own message prints x's subtrees, the arrays' values included.)
        raise ValueError(
            f"the sharding pytree must be a tree prefix of x: {_prefix_mismatch(sharding, x)}"
        ) from None
    out: list[Any] = []
    for (p, s), sub in zip(s_with_path, subtrees, strict=True):
        n_leaves = len(jax.tree_util.tree_leaves(sub))
        if s is None and n_leaves:
            # None stands only over a part of x without leaves (x's own None, say, as
            # jax.tree.map gives it), as in Pathways and jax.device_put.
            raise refuse(p, s, f" None stands only where x has no leaves; here it has {n_leaves}.")
        out.extend([s] * n_leaves)
    assert len(out) == n, (len(out), n)
    return out


@functools.lru_cache(maxsize=256)
def _is_key(dtype: Any) -> bool:
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _leaf_info(path: str, v: Any, dst: Sharding) -> LeafInfo:
    where = path or "<root>"
    if isinstance(v, jax.Array):
        if isinstance(v, jax.core.Tracer):
            raise traced_leaf(where, v)
        if v.is_deleted():
            raise ValueError(
                f"leaf {where} is a deleted jax.Array (was it donated or deleted earlier?); "
                "pass live arrays"
            )
        shape, dtype, src = tuple(v.shape), v.dtype, _compat.sharding_of(v, f"leaf {where}")
        if not v.committed and jax.process_count() > 1:
            # An uncommitted array (``jnp.arange(8)``, a step counter, a key from
            # ``jax.random.key(0)``) lives on each process's own default device: across
            # processes jax.device_put takes it as that process's value, as it takes a
            # host value, and so does reshard.
            _check_destination(where, shape, dst)
            if not _is_key(dtype):
                return LeafInfo(path, HOST, shape, dtype, None, dst)
            # Put from its key data (``put_host_values``), on the data's sharding.
            _check_key_destination(where, dst)
            dd = _key_data_sharding(dst, len(key_data_shape(shape, dtype)) - len(shape))
            if dd is None and len(processes_of(dst)) > 1:
                raise ValueError(
                    f"leaf {where}: an uncommitted key array can be put on devices of "
                    "several processes on a NamedSharding or SingleDeviceSharding only "
                    f"(got {type(dst).__name__}; jax.device_put refuses it across "
                    "processes too)"
                )
            # (Without ``dd``: put by jax.device_put, on devices of one process.)
            return LeafInfo(path, HOST, shape, dtype, None, dst, None, dd)
        if isinstance(src, NamedSharding) and _compat.unreduced_axes(src):
            _check_concrete(where, "source", src)
    elif isinstance(v, jax.ShapeDtypeStruct):
        if v.sharding is None:
            raise ValueError(
                f"leaf {where} is a jax.ShapeDtypeStruct without a sharding, so where its "
                "data lives is unknown; give it one (ShapeDtypeStruct(..., sharding=...))"
            )
        shape, dtype, src = tuple(v.shape), v.dtype, v.sharding
        if isinstance(src, Sharding):
            _check_concrete(where, "source", src)
        if isinstance(src, NamedSharding) and (
            PartitionSpec.UNCONSTRAINED in _compat.spec_entries(src.spec)
        ):
            # Where such a struct's data lives is left to a compiler; a plan needs it.
            raise ValueError(
                f"leaf {where}: source spec {src.spec} leaves a dimension UNCONSTRAINED; "
                "a plan needs the concrete layout the data has"
            )
    else:
        try:
            jax.typeof(v)  # what jax.device_put will refuse, refused before any move
        except (TypeError, ValueError, OverflowError) as e:
            # The same exception type as jax.device_put's, with the leaf named.
            raise type(e)(f"leaf {where}: {e}") from None
        shape = tuple(np.shape(v))
        _check_destination(where, shape, dst)
        return LeafInfo(path, HOST, shape, getattr(v, "dtype", None), None, dst)
    if not _destination_ok(shape, dst):
        _check_destination(where, shape, dst)
    if not isinstance(src, Sharding):
        raise ValueError(f"leaf {where} has no jax.sharding.Sharding (got {src!r})")
    if _is_key(dtype):
        _check_key_destination(where, dst)
        data_shape = key_data_shape(shape, dtype)
        extra = len(data_shape) - len(shape)
        ds, dd = _key_data_sharding(src, extra), _key_data_sharding(dst, extra)
        if ds is None or dd is None:
            # Key arrays with exotic shardings: fall back to jax.device_put, which moves
            # them within one process only (across processes jax 0.10 raised errors,
            # different ones on some layouts). Decided alike on every process; where
            # that one process is another, this one's result holds no shard.
            if len(processes_of(src, dst)) > 1:
                raise ValueError(
                    f"leaf {where}: a key array on a {type(src).__name__} -> "
                    f"{type(dst).__name__} moves only between devices of one process "
                    "(through jax.device_put), and these are devices of processes "
                    f"{sorted(processes_of(src, dst))}; give it a NamedSharding or "
                    "SingleDeviceSharding, on which reshard moves key arrays anywhere"
                )
            return LeafInfo(path, HOST, shape, dtype, src, dst)
        return LeafInfo(path, KEY, shape, dtype, src, dst, ds, dd)
    return LeafInfo(path, ARRAY, shape, dtype, src, dst)


def _check_key_destination(where: str, dst: Sharding) -> None:
    if _compat.reduced_axes(dst):
        # jax 0.10 cannot read such a key array's sharding (nor put one there).
        spec = getattr(dst, "spec", dst)
        raise ValueError(
            f"leaf {where}: a key array cannot take the destination spec {spec}: "
            "JAX holds no key arrays on a spec with reduced axes (jax.device_put "
            "refuses it too); give a spec without them"
        )


@functools.lru_cache(maxsize=1024)
def key_data_shape(shape: tuple[int, ...], dtype: Any) -> tuple[int, ...]:
    """Shape of ``jax.random.key_data`` of a key array (memoised: it traces)."""
    return tuple(jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype)).shape)


def _key_data_sharding(s: Sharding, extra: int) -> Sharding | None:
    if isinstance(s, SingleDeviceSharding) or (isinstance(s, NamedSharding) and s.num_devices == 1):
        # On one device JAX takes the data's sharding as the key array's, unchanged:
        # the destination's own spec (shorter than the data's rank) keeps its spelling.
        return s
    if isinstance(s, NamedSharding):
        spec = _compat.spec_entries(s.spec) + (None,) * extra
        # ``update`` keeps the rest: memory kind, and a custom device order
        # (``_logical_device_ids``), without which the data's shards would be read
        # from, and put on, the wrong devices.
        return s.update(spec=_compat.with_entries(s.spec, spec))
    return None


def _check_destination(where: str, shape: tuple[int, ...], dst: Sharding) -> None:
    _check_concrete(where, "destination", dst)
    spec = dst.spec if isinstance(dst, NamedSharding) else None
    entries = () if spec is None else _compat.spec_entries(spec)
    if PartitionSpec.UNCONSTRAINED in entries:
        raise ValueError(
            f"leaf {where}: destination spec {spec} leaves a dimension "
            "UNCONSTRAINED; a reshard needs a concrete layout (as jax.device_put does): "
            "name mesh axes or None for every dimension"
        )
    if len(entries) > len(shape):
        raise ValueError(
            f"leaf {where}: destination spec {spec} has {len(entries)} entries but the "
            f"array has rank {len(shape)} (shape {shape}); use at most {len(shape)} entries"
        )
    try:
        dst.shard_shape(shape)
    except Exception as e:
        raise ValueError(
            f"leaf {where}: shape {shape} cannot be divided by the destination sharding "
            f"{dst}: {e}. Every sharded dimension must be divisible by its shard count"
        ) from None


@functools.lru_cache(maxsize=4096)
def _destination_ok(shape: tuple[int, ...], dst: Sharding) -> bool:
    """Whether ``_check_destination`` passes (memoised: it runs for every array of
    every call); where not, the caller runs it again to raise with the leaf named."""
    try:
        _check_destination("", shape, dst)
    except ValueError:
        return False
    return True


def _check_concrete(where: str, what: str, s: Sharding) -> None:
    if isinstance(s, NamedSharding) and not isinstance(s.mesh, Mesh):
        raise ValueError(
            f"leaf {where}: the {what} sharding's mesh ({type(s.mesh).__name__}) has no "
            "devices; give a NamedSharding over a concrete jax.sharding.Mesh"
        )
    if not s.device_set:
        raise ValueError(f"leaf {where}: the {what} sharding {s} has no devices")
    if axes := _compat.unreduced_axes(s):
        spec = getattr(s, "spec", s)
        if what == "source":
            raise ValueError(
                f"leaf {where}: the source spec {spec} is unreduced over {sorted(axes)}: "
                "devices along those axes hold addends of a sum, not copies of one "
                "value, and moving bytes cannot add them up (nor can jax.device_put). "
                "Reduce the array first, inside your jitted step."
            )
        raise ValueError(
            f"leaf {where}: the destination spec {spec} is unreduced over {sorted(axes)}: "
            "its devices would hold addends of a sum, while a reshard moves copies of "
            "values; give a spec without unreduced axes."
        )


def _check_distinct_devices(where: str, dst: Any) -> None:
    """Once per plan built (not per call): a mesh listing a device twice."""
    if isinstance(dst, NamedSharding) and dst.mesh.devices.size != len(dst.device_set):
        check_distinct_devices(cast(Mesh, dst.mesh), f"leaf {where}", "the destination mesh")


def _avoid_ids(avoid_devices: Iterable[Any] | None, what: str = "avoid_devices") -> frozenset[int]:
    """Device ids from ``avoid_devices`` (devices or ids), each one a device JAX has;
    errors name the argument as ``what``."""
    if avoid_devices is None:
        return frozenset()
    if not_a_collection(avoid_devices):
        raise TypeError(
            f"{what} must be an iterable of devices or device ids, got "
            f"{type(avoid_devices).__name__}: {avoid_devices!r} (for one device, pass [device])"
        )
    avoid_devices = _listed(avoid_devices)  # (a numpy array of any shape flattened)
    ids, bare = [], []
    for d in avoid_devices:
        try:
            if isinstance(d, bool):  # an int to Python, never meant as an id
                raise ValueError
            ids.append(device_id(d))
        except ValueError:
            raise TypeError(
                f"{what} holds {d!r}, which is neither a device nor a device id"
            ) from None
        if not isinstance(d, jax.Device):
            bare.append(ids[-1])
    # A jax.Device is one JAX has, whatever its platform; a bare id must name one of
    # the default backend's devices or of the CPU's (arrays on CPU beside an accelerator).
    unknown = set(bare) - _all_device_ids()
    if unknown:
        raise ValueError(
            f"{what} names device id(s) {sorted(unknown)} that JAX does not have "
            f"(its ids: {device_ranges(sorted(_all_device_ids()))})"
        )
    return frozenset(ids)


@functools.cache
def _all_device_ids() -> frozenset[int]:
    ids = {d.id for d in jax.devices()}
    with contextlib.suppress(RuntimeError):
        ids.update(d.id for d in jax.devices("cpu"))
    return frozenset(ids)


# ----------------------------------------------------------------------------------
# Building
# ----------------------------------------------------------------------------------


def _memory_kind(s: Sharding) -> str:
    mk = s.memory_kind
    if mk is None:
        dev: Any = next(iter(s.device_set))
        try:
            mk = dev.default_memory().kind
        except Exception:  # pragma: no cover - backends without memories
            mk = "device"
    return mk


def shard_specs(sharding: Sharding, shape: tuple[int, ...]) -> tuple[ShardSpec, ...]:
    """The planner's view of a sharding: one ``ShardSpec`` per device, in order.

    Memoised per sharding and shape (``devices_indices_map`` and the boxes cost ~30 us
    per array, every call without the plan cache); the device order is part of the key
    (``_compat.ordered_devices``)."""
    return _shard_specs(sharding, shape, _compat.USE_PRIVATE)


@functools.lru_cache(maxsize=4096)
def _shard_specs(
    sharding: Sharding, shape: tuple[int, ...], use_private: bool
) -> tuple[ShardSpec, ...]:
    del use_private  # part of the cache key only
    index = sharding.devices_indices_map(shape)
    mk = _memory_kind(sharding)
    return tuple(
        ShardSpec(d.id, mk, d.process_index, box_from_index(index[d], shape))
        for d in _compat.ordered_devices(sharding)
    )


def _check_destination_avoids(where: str, dst: Sharding, avoid: frozenset[int]) -> None:
    avoided = sorted(i for d in dst.device_set if (i := device_id(d)) in avoid)
    if avoided:
        raise ValueError(
            f"leaf {where}: the destination sharding uses avoided devices {avoided}; "
            "build the destination on surviving devices only"
        )


def _check_host_leaf_avoids(leaf: LeafInfo, avoid: frozenset[int]) -> None:
    """A leaf that ``jax.device_put`` moves (a host value; a key array on a sharding
    other than a NamedSharding) can be steered away from no device: it may neither
    land on nor be read from an avoided one."""
    where = leaf.path or "<root>"
    _check_destination_avoids(where, leaf.dst_sharding, avoid)
    src = leaf.src_sharding
    src_ids = [device_id(d) for d in src.device_set] if src else []
    src_avoided = sorted(i for i in src_ids if i in avoid)
    if src_avoided:
        raise ValueError(
            f"leaf {where}: its source uses avoided devices {src_avoided}, and this leaf "
            f"(a {leaf.dtype} array from a {type(src).__name__} to a "
            f"{type(leaf.dst_sharding).__name__}) moves through jax.device_put, which "
            "cannot be told which devices to read, even where replicas survive; give "
            "it NamedShardings on both sides"
        )


def _build_plan(
    treedef: Any, leaves: tuple[LeafInfo, ...], executor: str, avoid: frozenset[int]
) -> Plan:
    specs = []
    platforms: set[str] = set()
    checked: dict[tuple[Sharding, Sharding, Sharding], set[str]] = {}
    for leaf in leaves:
        if leaf.kind == HOST:
            if avoid:
                _check_host_leaf_avoids(leaf, avoid)
            continue
        src: Sharding | None = leaf.src_sharding
        dst: Sharding | None = leaf.dst_sharding
        shape, itemsize = leaf.shape, np.dtype(leaf.dtype).itemsize if leaf.kind == ARRAY else 4
        if leaf.kind == KEY:
            src, dst = leaf.data_src_sharding, leaf.data_dst_sharding
            shape = key_data_shape(leaf.shape, leaf.dtype)
        assert src is not None and dst is not None
        pair = (src, dst, leaf.dst_sharding)
        leaf_platforms = checked.get(pair)
        if leaf_platforms is None:
            # Once per pair of shardings (every layer of a model has the same): these
            # checks cost as much as planning the leaf.
            _check_distinct_devices(leaf.path or "<root>", leaf.dst_sharding)
            devices: set[Any] = set(src.device_set | dst.device_set)
            leaf_platforms = {d.platform for d in devices}
            if len(leaf_platforms) > 1:
                raise ValueError(
                    f"leaf {leaf.path or '<root>'}: source and destination devices mix "
                    f"platforms {sorted(leaf_platforms)}; reshard moves within one platform "
                    "(use jax.device_put to cross platforms)"
                )
            if avoid:
                _check_destination_avoids(leaf.path or "<root>", dst, avoid)
            checked[pair] = leaf_platforms
        platforms |= leaf_platforms
        specs.append(
            LeafSpec(
                leaf.path or "<root>",
                tuple(shape),
                itemsize,
                shard_specs(src, tuple(shape)),
                shard_specs(dst, tuple(shape)),
            )
        )
    if len(platforms) > 1:
        raise ValueError(
            f"arrays of one reshard must live on one platform, got {sorted(platforms)}"
        )
    try:
        leaf_plans, stats = plan_leaves(specs, avoid_devices=avoid)
    except DataLossError as e:
        # Key arrays are planned as their key data, whose extra dimensions are never
        # split: their boxes are reported in the key array's own dimensions.
        ranks = {leaf.path or "<root>": len(leaf.shape) for leaf in leaves if leaf.kind == KEY}
        if not ranks:
            raise
        raise DataLossError(
            [(path, box[: ranks.get(path, len(box))]) for path, box in e.missing]
        ) from None
    if executor == "auto":
        # (A plan within one process runs there alone, as jax.device_put does.)
        if jax.process_count() > 1 and len(plan_processes(leaves)) > 1:
            executor = "collective"
        elif platforms <= {"cpu"}:
            executor = "host"
        else:
            executor = "device"
    if executor == "host" and not platforms <= {"cpu"}:
        raise ValueError(
            f"the host executor runs on CPU devices only, got platforms {sorted(platforms)}"
        )
    plan = Plan(treedef, leaves, leaf_plans, stats, executor, avoid)
    if executor == "device":
        peak = device_peak_extra(plan)
        plan = dataclasses.replace(plan, stats=dataclasses.replace(stats, peak_extra_bytes=peak))
    return plan
