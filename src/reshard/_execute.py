"""Running a ``Plan``: check the inputs against it, call an executor, donate last."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence, Set
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Sharding

from . import _buffers, _collective_common, _compat, _exact, _programs, _sharing
from ._geometry import volume
from ._local_executor import DeviceProgram, LeafJob, run_device, run_host
from ._plan import ARRAY, HOST, HOST_ROUTE, KEY, LeafInfo, Plan, processes_of
from ._planner import LeafPlan


def _jobs(plan: Plan) -> list[LeafJob]:
    jobs = plan._cache.get("jobs")
    if jobs is None:
        # Arrays of one geometry share their pieces (``plan_leaves``) and so their job's
        # slices: built once, each array's job then only names its own leaf plan.
        built: dict[tuple[Any, ...], LeafJob] = {}
        jobs = []
        for leaf, lp in zip(plan.planned_leaves, plan.leaf_plans, strict=True):
            dtype = np.dtype("uint32" if leaf.kind == KEY else leaf.dtype)
            spec = lp.spec
            # Identities are safe here: every object named is held by the plan (and
            # hashing the shard tuples themselves costs more than building a job).
            key = (id(lp.kept), id(lp.moved), id(lp.reused), id(spec.src), id(spec.dst), dtype)
            job = built.get(key)
            if job is None:
                job = built[key] = _shared_job(lp, dtype)
            jobs.append(_naming(job, lp))
        plan._cache["jobs"] = jobs
    return jobs


def _shared_job(lp: LeafPlan, dtype: np.dtype) -> LeafJob:
    """``LeafJob.build(lp, dtype)``, its parts shared with equal jobs of other plans.

    A plan built anew for each call (uncached, the default) would build its jobs anew:
    ~2.5 ms per call for the 38 arrays (5 geometries) of a 40 MiB model's relayout on
    8 CPU devices, against ~13 ms for the cached call. A job depends on the geometry,
    the pieces and the copy settings alone, so jobs are kept by those in a bounded
    store (``_programs.shared_job``), and an equal job of another plan reuses their
    parts, naming its own leaf plan."""
    spec = lp.spec
    fastcopy = _buffers._fastcopy
    key = (
        spec.shape,
        spec.itemsize,
        spec.src,
        spec.dst,
        lp.kept,
        lp.moved,
        lp.reused,
        dtype,
        # What ``copy_mode`` and the copy tables are made by:
        _buffers.NATIVE_COPY,
        _buffers.NATIVE_COPY_BYTES,
        _buffers.ROW_ITEM_BYTES,
        None if fastcopy is None else getattr(fastcopy, "TABLE_WIDTH", None),
    )
    return _naming(_programs.shared_job(key, lambda: LeafJob.build(lp, dtype)), lp)


def traced_leaf(where: str, v: Any) -> Exception:
    """The error for a tracer among the leaves: ``reshard`` runs eagerly, on data."""
    return jax.errors.ConcretizationTypeError(
        v,
        f"leaf {where} is a tracer: reshard.reshard, reshard.plan and Plan.execute move "
        "concrete arrays and cannot be traced (jax.jit, vmap, grad, shard_map...). Call "
        "them outside the traced function; inside it, jax.device_put or "
        "jax.lax.with_sharding_constraint place values.",
    )


def _check_leaf(leaf: LeafInfo, v: Any) -> bool:
    """Checks ``v`` against what the plan was built for; whether it is a jax.Array.

    A source sharding may be spelled differently from the plan's (``P('a')`` for
    ``P('a', None)``, say) if it is equivalent: the same devices in the same order,
    the same shards, the same memory kind (what ``jax.jit`` accepts for the same
    program). Leaves that ``jax.device_put`` places (NumPy arrays, scalars) must have
    the plan's shape and dtype too (any dtype where the plan had a Python scalar).
    """
    where = leaf.path or "<root>"
    if isinstance(v, jax.core.Tracer):
        raise traced_leaf(where, v)
    if isinstance(v, jax.ShapeDtypeStruct):
        raise ValueError(
            f"leaf {where} is a jax.ShapeDtypeStruct, which describes an array but holds no "
            "data: resharding moves data, so pass the jax.Array (ShapeDtypeStructs are for "
            "reshard.plan, to plan ahead)"
        )
    if isinstance(v, jax.Array) and v.is_deleted():
        raise ValueError(f"leaf {where} is a deleted jax.Array (was it donated earlier?)")
    if leaf.kind == HOST and leaf.src_sharding is None:
        try:
            jax.typeof(v)  # what jax.device_put would refuse, with the leaf named
        except (TypeError, ValueError, OverflowError) as e:
            raise type(e)(f"leaf {where}: {e}") from None
        dtype = getattr(v, "dtype", None)
        if np.shape(v) == leaf.shape and (leaf.dtype is None or dtype == leaf.dtype):
            return False
        planned = "a Python scalar" if leaf.dtype is None else leaf.dtype
        got = type(v).__name__ if dtype is None else dtype
        raise ValueError(
            f"leaf {where}: the plan was built for {planned}{list(leaf.shape)} placed by "
            f"jax.device_put, got {got}{list(np.shape(v))}"
        )
    if not isinstance(v, jax.Array):
        raise ValueError(f"leaf {where}: expected a jax.Array, got {type(v).__name__}")
    src, now = leaf.src_sharding, _compat.sharding_of(v, f"leaf {where}")
    other_sharding = now != src and not _equivalent(now, src, len(leaf.shape))
    if tuple(v.shape) != leaf.shape or v.dtype != leaf.dtype or other_sharding:
        order = ""
        # (a Mesh's text leaves out its devices)
        if other_sharding and str(src) == str(now):
            order = (
                f"; the two differ in their devices: the plan's are {_device_order(src)}, "
                f"the array's {_device_order(now)}"
            )
        raise ValueError(
            f"leaf {where}: the plan was built for {leaf.dtype}{list(leaf.shape)} on "
            f"{src}, got {v.dtype}{list(v.shape)} on {now}{order}"
        )
    return True


def _device_order(s: Sharding | None) -> str:
    """A sharding's device ids, in its mesh's shape where it has a mesh (a large one
    summarised)."""

    def text(ids: Any) -> str:
        return np.array2string(np.asarray(ids), 10**6, separator=", ", threshold=64)

    mesh = getattr(s, "mesh", None)
    if isinstance(mesh, jax.sharding.Mesh):
        logical = getattr(s, "_logical_device_ids", None)
        order = "" if logical is None else f" (in the order {text(list(logical))})"
        return text(mesh.device_ids) + order
    return text([] if s is None else _device_ids(s))


def _equivalent(a: Sharding, b: Sharding | None, ndim: int) -> bool:
    """``a.is_equivalent_to(b, ndim)``, false where JAX cannot compare them."""
    try:
        return b is not None and bool(a.is_equivalent_to(b, ndim))
    except (ValueError, TypeError, NotImplementedError):
        return False


# What arrays of one geometry share of their ``LeafJob``: all but the leaf plan.
_JOB_SHARED = tuple(f.name for f in dataclasses.fields(LeafJob))[1:]


def _naming(job: LeafJob, lp: LeafPlan) -> LeafJob:
    """``job`` as the job of the leaf plan ``lp``, whose geometry it has: its parts
    shared, its own leaf plan named."""
    return job if job.plan is lp else LeafJob(lp, *(getattr(job, f) for f in _JOB_SHARED))


@_compat.moving_bytes()
def execute_plan(
    plan: Plan,
    x: Any,
    *,
    donate: bool,
    may_alias: bool | None,
    checked: bool = False,
    deletions: int | None = None,
) -> Any:
    """Runs ``plan`` on ``x``. ``checked``: every leaf of ``x`` is known to be a live
    ``jax.Array`` of the plan's shape, dtype and sharding (``reshard`` planned it for
    them just now), so the leaves are not checked again (~2 us each); ``deletions``:
    ``_sharing.readers.deletions`` from before that check."""
    values, treedef = jax.tree_util.tree_flatten(x)
    if treedef != plan.treedef:
        raise ValueError(
            f"x has structure {treedef}, but the plan was built for {plan.treedef}; "
            "build a new plan with reshard.plan(x, sharding)"
        )
    # (Before the inputs are checked: a donation by another thread after it is seen.)
    if deletions is None or not checked:
        deletions = _sharing.readers.deletions
    shared_version = _sharing.version()
    weak = set()  # weakly typed arrays (jax.device_put keeps that; so does finish)
    for i, (leaf, v) in enumerate(zip(plan.leaves, values, strict=True)):
        if (checked or _check_leaf(leaf, v)) and leaf.kind == ARRAY and v.weak_type:
            weak.add(i)
    if jax.process_count() > 1 and plan.executor != "collective" and plan.crosses_processes:
        raise ValueError(
            f"the {plan.executor!r} executor runs in one process, but this plan's devices "
            f"belong to processes {sorted(plan.processes)}; plan again here with "
            "reshard.plan(x, sharding) and executor='collective' or 'auto' (a loaded plan "
            "keeps the executor it was built with)"
        )

    # Across processes, an interrupt is held until every collective of the call is
    # done (the programs, and the check of host values after them): raised there,
    # before any input is donated (``interrupts_held``). Another thread of this
    # process may donate (delete) these inputs only while this one reads none of
    # their buffers (``_sharing.readers``).
    readers = _sharing.readers
    # 64-bit arrays with jax_enable_x64 off: programs take them whole, host values are
    # still typed as the caller's setting says.
    x64 = bool(jax.enable_x64.value)
    wide = plan._cache.get("wide types")
    if wide is None:
        wide = plan._cache["wide types"] = _compat.wide_types(
            leaf.dtype for leaf in plan.planned_leaves
        )
    with (
        _collective_common.interrupts_held(plan.crosses_processes),
        readers.reading(),
        _compat.wide_types_whole(wide),
        _explained_guard(),
    ):
        if readers.deletions != deletions:  # some were donated meanwhile: still here?
            _check_not_deleted(plan, values)
        # Host values put on devices of every process: their digests are posted before
        # the transfers, and compared after them (``post_host_values``).
        host = [i for i, leaf in enumerate(plan.leaves) if leaf.kind == HOST]
        forms: dict[int, HostForm] = {}
        compare_host_values: Callable[[], None] = _nothing_to_compare
        if host:
            with jax.enable_x64(x64):
                forms, compare_host_values = post_host_values(
                    [plan.leaves[i] for i in host], [values[i] for i in host]
                )
        planned = [(i, leaf) for i, leaf in enumerate(plan.leaves) if leaf.kind != HOST]
        sources = [
            jax.random.key_data(values[i]) if leaf.kind == KEY else values[i] for i, leaf in planned
        ]
        # Buffers in a custom layout are copied into the default one first (see
        # ``_compat.in_default_layout``): each array once, however many leaves it is.
        relaid: dict[int, jax.Array] = {}
        for j, src in enumerate(sources):
            fixed = relaid.get(id(src))
            if fixed is None:
                fixed = relaid[id(src)] = _compat.in_default_layout(src)
            sources[j] = fixed
        dst_shardings = [_moved_sharding(leaf) for _, leaf in planned]

        # Inputs that share buffers with a live array outside x (a part of a split without
        # donation, or the array such parts came from) are not consumed: freeing their
        # buffers would free them under that array too (see ``_sharing``). Nor do they
        # hand shards over (unless may_alias=True): the output is a copy, as undonated.
        given_arrays = [v for v in values if isinstance(v, jax.Array)] if donate else []
        spared = _spared(given_arrays)
        alias = aliases(
            plan,
            donate=donate,
            may_alias=may_alias,
            spared={j for j, (i, _) in enumerate(planned) if id(values[i]) in spared},
        )

        if not planned:
            moved: list[jax.Array] = []
            if host:
                # So that a process whose tree holds arrays where this one's holds host
                # values meets it in the same check, and both raise.
                leaves = [plan.leaves[i] for i in host]
                what = ("host values", _host_values_described(leaves))
                _agree_without_program(plan, what, leaves[0].dst_sharding)
        elif not plan.crosses_processes and jax.process_index() not in plan.processes:
            # Another process holds every device of the plan and moves everything there
            # (see Plan.crosses_processes), whatever the executor: here the outputs hold no
            # shard.
            moved = [
                jax.make_array_from_single_device_arrays(v.shape, s, [], dtype=v.dtype)
                for v, s in zip(sources, dst_shardings, strict=True)
            ]
        elif plan.executor in ("host", "device"):
            # Arrays whose shards all just change device go through PjRt's own batched
            # copy (started first: it runs while the executor copies the rest).
            whole = _copied_whole(plan, dst_shardings)
            skip = set(whole)
            rest = [j for j in range(len(planned)) if j not in skip]
            copied = _compat.copy_shards(
                [sources[j] for j in whole], [dst_shardings[j] for j in whole]
            )
            jobs = _jobs(plan) if rest else []  # (built per plan: none needed here)
            tkey = f"targets(private={_compat.USE_PRIVATE})"  # as ``whole``
            targets = plan._cache.get(tkey)
            if targets is None:
                # Per array of ``rest``: (destination shard index, device) for this
                # process's devices, in the sharding's own order.
                targets = plan._cache[tkey] = [
                    [
                        (jobs[j].dst_of[d.id], d)
                        for d in _compat.addressable_devices(dst_shardings[j])
                    ]
                    for j in rest
                ]
            args = (
                [sources[j] for j in rest],
                [dst_shardings[j] for j in rest],
                targets,
            )
            rest_alias = [alias[j] for j in rest]
            if not rest:
                built: list[Any] = []
            elif plan.executor == "host":
                built = run_host([jobs[j] for j in rest], *args, alias=rest_alias)
            else:
                # Arrays of a type that programs on this platform do not carry exactly
                # (``_exact``) are moved through host memory instead, as the host
                # executor moves them; the device executor takes the rest.
                key = f"device_split(private={_compat.USE_PRIVATE})"  # as ``rest``
                split = plan._cache.get(key)
                if split is None:
                    inexact = _exact.inexact_types(
                        sources[rest[0]].sharding.device_set, [jobs[j].dtype for j in rest]
                    )
                    split = plan._cache[key] = (
                        [k for k, j in enumerate(rest) if jobs[j].dtype.name not in inexact],
                        [k for k, j in enumerate(rest) if jobs[j].dtype.name in inexact],
                    )
                    if split[1]:  # for str(plan): decided here, at the first run
                        plan._cache[HOST_ROUTE] = (
                            f"{len(split[1])} array(s) of "
                            f"{', '.join(sorted({jobs[rest[k]].dtype.name for k in split[1]}))} "
                            "through host memory"
                        )
                on_device, via_host = split
                built = [None] * len(rest)
                for ks, runner in ((on_device, "device"), (via_host, "host")):
                    if not ks:
                        continue
                    part_args = (
                        [args[0][k] for k in ks],
                        [args[1][k] for k in ks],
                        [args[2][k] for k in ks],
                    )
                    part_alias = [rest_alias[k] for k in ks]
                    if runner == "host":
                        types = sorted({jobs[rest[k]].dtype.name for k in ks})
                        with _explained_guard(
                            f"on this platform, arrays of {', '.join(types)} are cut and "
                            "assembled through host memory with explicit transfers "
                            "(jax.device_get, then jax.device_put), since its compiled "
                            "programs do not keep every bit of them (docs/accelerators.md)"
                        ):
                            part = run_host(
                                [jobs[rest[k]] for k in ks], *part_args, alias=part_alias
                            )
                    else:
                        key = f"device_program(private={_compat.USE_PRIVATE})"  # as its arrays
                        program = plan._cache.get(key)
                        if program is None:
                            program = plan._cache[key] = DeviceProgram([jobs[rest[k]] for k in ks])
                        part = run_device(program, *part_args, alias=part_alias)
                    for k, arr in zip(ks, part, strict=True):
                        built[k] = arr
            by_index = dict(zip(whole, copied, strict=True)) | dict(zip(rest, built, strict=True))
            moved = [by_index[j] for j in range(len(planned))]
        elif plan.executor == "collective":
            try:
                from ._collective_executor import run_collective
            except ImportError as e:  # pragma: no cover - until the module lands
                raise NotImplementedError(
                    "the collective executor is not available in this build"
                ) from e
            # Arrays that only change memory kind on the devices they are on need nothing
            # from another process: each process copies its own shards by PjRt, batched
            # (``_copied_whole``). With a program for the rest, the copies are dispatched
            # before its status is exchanged (``before``), so that a failure of theirs
            # reaches every process.
            in_place, described = _kind_changes_in_place(plan, dst_shardings)
            local_j = set(in_place)
            rest = [j for j in range(len(planned)) if j not in local_j]
            moved = cast(list[jax.Array], [None] * len(planned))

            def copy_in_place() -> None:
                copied = _compat.copy_shards(
                    [sources[j] for j in in_place], [dst_shardings[j] for j in in_place]
                )
                for j, arr in zip(in_place, copied, strict=True):
                    moved[j] = arr

            if rest:
                got = run_collective(
                    plan,
                    [sources[j] for j in rest],
                    [dst_shardings[j] for j in rest],
                    donate=donate,
                    alias=[alias[j] for j in rest],
                    only=None if not local_j else rest,
                    # (The arrays copied here are part of what the processes compare.)
                    also=described,
                    before=copy_in_place if in_place else None,
                )
                for j, arr in zip(rest, got, strict=True):
                    moved[j] = arr
            else:
                _agree_without_program(
                    plan, ("memory-kind changes in place", described), dst_shardings[0]
                )
                copy_in_place()
        else:  # pragma: no cover - validated in plan()
            raise ValueError(f"unknown executor {plan.executor!r}")

        out = list(values)
        for (i, leaf), arr in zip(planned, moved, strict=True):
            if leaf.kind == KEY:
                # The key array's sharding follows the data's; JAX may spell its spec
                # differently (P(None,) for P()), as jax.device_put itself does.
                arr = jax.random.wrap_key_data(arr, impl=jax.random.key_impl(values[i]))
            else:
                aval = _compat.device_put_aval(leaf.shape, leaf.dtype, leaf.dst_sharding, i in weak)
                arr = _compat.finish(arr, aval, fresh=arr is not values[i])
            out[i] = arr
        # jax.Arrays among the host leaves (key arrays on shardings that are neither
        # named nor single-device) are donated below, after the copies; when donating,
        # no copy may share their buffers.
        given = [i for i in host if isinstance(values[i], jax.Array)] if donate else []
        compare_host_values()
        if host:
            with jax.enable_x64(x64):
                placed = put_host_values(
                    [plan.leaves[i] for i in host],
                    [values[i] for i in host],
                    # (None would return an unchanged one itself: a copy, as every array.)
                    may_alias=bool(may_alias is True and not given),
                    forms=forms,
                )
            for i, arr in zip(host, placed, strict=True):
                out[i] = arr
                # An output that shares the input's buffers (may_alias=True) is recorded as
                # the planned ones are (below), so that donating the input later spares it.
                v = values[i]
                if (
                    may_alias is True
                    and not given
                    and isinstance(v, jax.Array)
                    and arr is not v
                    and _shares_a_buffer(_data(v), _data(arr))
                ):
                    _sharing.note_shared(v, [arr])

        if not donate:
            # (Recorded while reading: a thread donating an input next sees it.)
            _note_handed_over(planned, plan, alias, values, out)

    # Donation is the very last step: every output exists, so nothing can be lost.
    if donate:
        with readers.deleting(), _compat.wide_types_whole(wide), _explained_guard():
            if _sharing.version() != shared_version:
                # Another thread recorded sharing meanwhile (a may_alias=True output
                # of one of these inputs, say): those inputs now stay too.
                spared |= _spared(given_arrays)
            # Each donated array (by identity) with its data (key data for key arrays).
            donated: dict[int, tuple[jax.Array, jax.Array]] = {}
            # Buffer keys, read only where needed: with nothing kept, every donated array
            # is simply deleted (``_donate``), and reading them costs ~10 us per array.
            keys_of: dict[int, dict[Key, jax.Array]] = {}

            def keys(v: jax.Array) -> dict[Key, jax.Array]:
                found = keys_of.get(id(v))
                if found is None:
                    found = keys_of[id(v)] = _compat.buffer_keys(donated[id(v)][1])
                return found

            kept: set[Key] = set()  # buffers an output took over unchanged
            for (i, _leaf), src, lp, a in zip(
                planned, sources, plan.leaf_plans, alias, strict=True
            ):
                if id(values[i]) in spared:
                    continue
                donated.setdefault(id(values[i]), (values[i], src))
                if a and lp.reused:
                    devices = {lp.spec.src[si].device for _, si in lp.reused}
                    # This process's buffers only: the others' kept shards are theirs.
                    kept.update(k for k in keys(values[i]) if k[0] in devices)
            for i in given:
                v = values[i]
                if id(v) in spared:
                    continue
                data = _data(v)
                donated.setdefault(id(v), (v, data))
                # Asked for a copy, jax.device_put may still hand a buffer over (jax 0.10:
                # key arrays replicated onto more devices): what the output holds is kept.
                # Only a buffer of the same shape is the input's own: jax 0.10 may also
                # give a key array's shard a smaller buffer at the address of the input's
                # replica (replicated -> sharded, GSPMDSharding), which stays valid when
                # the input is deleted, and which re-homing would replace by the whole
                # replica.
                if data.size:
                    held = _compat.buffer_keys(_data(out[i]))
                    kept.update(k for k, b in keys(v).items() if k in held and _same(held[k], b))
            # Outputs that may hold a donated buffer: those handed shards over.
            takers = [
                i
                for (i, _), lp, a in zip(planned, plan.leaf_plans, alias, strict=True)
                if a and lp.reused and id(values[i]) not in spared
            ]
            found: list[Donated] = [
                (v, data, keys(v) if kept else {}) for v, data in donated.values()
            ]
            _donate(found, kept, out, takers + given, plan.avoid_devices)
            _note_handed_over(planned, plan, alias, values, out)

    return jax.tree_util.tree_unflatten(treedef, out)


_MOVES_ARE_EXPLICIT = (
    "its moves are explicit transfers, as jax.device_put's are (where jax.device_put "
    "runs a program instead, the guard counts none): shards and pieces copied between "
    "devices or memory kinds, host buffers (the CPU executors', host values) placed on "
    "devices, and on some accelerators (a TPU v5e: bf16, f16, most fp8) arrays of types "
    "their programs do not carry exactly, cut and assembled through host memory "
    "(docs/accelerators.md)"
)


@contextlib.contextmanager
def _explained_guard(why: str = _MOVES_ARE_EXPLICIT) -> Iterator[None]:
    """Adds to an error of ``jax.transfer_guard`` refusing one of this process's
    transfers why the reshard makes it (``why``: the innermost such context's), and
    how to let it."""
    try:
        yield
    except jax.errors.JaxRuntimeError as e:
        if (
            "Disallowed" in str(e)
            and "transfer" in str(e)
            and not getattr(e, "_reshard_guard_explained", False)
        ):
            e._reshard_guard_explained = True  # type: ignore[attr-defined]
            e.add_note(
                f"reshard: a transfer guard refused one of this reshard's transfers: {why}. "
                "The call made no results and the inputs are intact; to let it, call it "
                "under jax.transfer_guard('allow') (or 'log_explicit')"
            )
        raise


def _note_handed_over(
    planned: Sequence[tuple[int, LeafInfo]],
    plan: Plan,
    alias: Sequence[bool],
    values: Sequence[Any],
    out: Sequence[Any],
) -> None:
    """Outputs handed an input's shards share its buffers (consumed or not: the same
    input at two leaves gives two outputs on the same buffers). Recorded once the
    outputs are final (``_donate`` may rebuild them on new handles)."""
    for (i, _), lp, a in zip(planned, plan.leaf_plans, alias, strict=True):
        if a and lp.reused:
            _sharing.note_shared(values[i], [out[i]])


def _spared(given: Sequence[jax.Array]) -> set[int]:
    """ids of the donated arrays ``given`` that must not be consumed: those sharing
    buffers with a live array outside them (``_sharing``), and handles made by hand
    on a spared array's buffers."""
    spared = _sharing.shared_elsewhere(given)
    if spared:
        spared = _sharing.with_handles(
            spared, {id(v): _compat.buffer_keys(_data(v)).keys() for v in given}
        )
    return spared


def _check_not_deleted(plan: Plan, values: Sequence[Any]) -> None:
    for leaf, v in zip(plan.leaves, values, strict=True):
        if isinstance(v, jax.Array) and v.is_deleted():
            raise ValueError(
                f"leaf {leaf.path or '<root>'} was deleted while this call started "
                "(donated by a call in another thread?); pass live arrays"
            )


def _same(a: jax.Array, b: jax.Array) -> bool:
    """Whether two buffers at one address on one device are one buffer."""
    return bool(a.shape == b.shape and a.dtype == b.dtype)


def _shares_a_buffer(a: jax.Array, b: jax.Array) -> bool:
    return not _compat.buffer_keys(a).keys().isdisjoint(_compat.buffer_keys(b).keys())


# Donating, unchanged shards are handed over (not copied) where an array keeps at
# least this many bytes in place (see ``aliases``).
HANDOVER_BYTES = 1 << 20


def aliases(
    plan: Plan, *, donate: bool, may_alias: bool | None, spared: Set[int] = frozenset()
) -> list[bool]:
    """Per planned array: whether its destination shards that equal a source shard on
    the same device are handed over (the output holds that very buffer) or copied.

    Decided from the plan and the options alone, so every process decides alike (the
    collective executor's programs depend on it), and from ``spared``: the planned
    arrays that donating leaves unconsumed (``_sharing``, structural: alike on every
    process too), which are treated as not donated:

    - ``may_alias=False``: copied.
    - Donating: handed over where they hold ``HANDOVER_BYTES`` or more; the input is
      then re-homed (``_donate``), so it reads as deleted while its output keeps the
      buffers, as ``jax.device_put`` does. Re-homing costs ~0.1-0.2 ms per array on
      CPU, more than copying a small array's kept shards, so smaller ones are copied
      and their input freed whole. So are arrays a donating identity cannot or must
      not take over: those in a host memory kind (see ``_identity_may_run``), or with
      a shard on a device to avoid (a lost device must not run a program).
    - ``may_alias=True``: handed over; the input stays valid and shares them.
    - ``None`` (the default): copied, so that every output shares no buffer with its
      input, as from Pathways (its ``reshard`` returns "a copy of x"), even an array
      that does not change at all (where ``jax.device_put`` returns the input itself):
      a trainer step that donates its parameters must not free a sampler's copy of
      them, including the leaves whose layout the sync keeps.
    """
    out = []
    for j, (leaf, lp) in enumerate(zip(plan.planned_leaves, plan.leaf_plans, strict=True)):
        if may_alias is False or not lp.reused:
            out.append(False)
        elif donate and j not in spared:
            kept = sum(volume(lp.spec.dst[di].box) for di, _ in lp.reused) * lp.spec.itemsize
            src = leaf.src_sharding
            out.append(
                kept >= max(HANDOVER_BYTES, 1)
                and (src is None or _identity_may_run(src, plan.avoid_devices))
            )
        else:
            out.append(may_alias is True)
    return out


HostForm = tuple[np.ndarray, bool, Any]


def _nothing_to_compare() -> None:
    """``post_host_values``' comparison where there is nothing to compare."""


def post_host_values(
    leaves: Sequence[LeafInfo], values: Sequence[Any]
) -> tuple[dict[int, HostForm], Callable[[], None]]:
    """The host forms (``_host_form``) of the host leaves' values that
    ``put_host_values`` puts from this process's copy (by index), and the check that
    those put on devices of every process are equal on every process: their digests
    are posted now, before the call's transfers, and compared by the function returned,
    after them (``_collective_executor.values_everywhere``: a process failing after its
    transfers has posted already, and a process that refused the call, bad input there
    or a value it cannot type, a Python int over int32 with x64 off on it alone, posts
    its refusal there, so that no process waits for either).

    The function raises ``ValueError`` on every process, naming the leaves whose values
    differ between processes, or ``RuntimeError`` where a peer refused this call.
    """
    shardings = [leaf.dst_sharding for leaf in leaves]
    elsewhere = set(_held_elsewhere(leaves, values))
    ours = [i for i in _put_from_host(values, shardings) if i not in elsewhere]
    forms = {i: _host_form(values[i]) for i in ours}
    # Those put on devices of every process.
    checked = [i for i in ours if len(processes_of(shardings[i])) == jax.process_count()]
    if not checked:
        return forms, _nothing_to_compare
    return forms, _posted_equal_across_processes(
        [leaves[i] for i in checked], [forms[i] for i in checked]
    )


def put_host_values(
    leaves: Sequence[LeafInfo], values: Sequence[Any], may_alias: bool, forms: dict[int, HostForm]
) -> list[jax.Array]:
    """``jax.device_put`` of the host leaves' values (numpy arrays, Python scalars, key
    arrays on shardings other than named ones, and across processes uncommitted
    arrays) onto their destination shardings.

    Across processes, a key array put by ``jax.device_put`` on devices of another
    process alone comes out here as the planned leaves do: an array with no shard
    here (``jax.device_put`` refuses a sharding of no device of this process). Values
    other than committed arrays are put from this process's copy of them where their
    destination is not on this process's devices alone, with
    the type, weak type and abstract value ``jax.device_put`` gives them (``forms``,
    checked by ``post_host_values``). There ``jax.device_put`` refuses uncommitted
    key arrays, and fails on some processes for an uncommitted array put on devices of
    some processes (jax 0.10: "must have one shard each"). For a value put on devices
    of every process it first checks that every process passes the same value: it
    all-gathers the whole value over every device, laid out as processes x local
    devices. That moves the value to every device once per process, involves devices
    the plan avoids, and fails where processes hold different numbers of devices (jax
    0.10: "cannot reshape array"). Such values are checked by ``post_host_values``
    instead, a 16-byte digest each, posted before the call's transfers and compared
    after them."""
    shardings = [leaf.dst_sharding for leaf in leaves]
    elsewhere = _held_elsewhere(leaves, values)
    ours = sorted(forms)
    if not ours and not elsewhere:
        return list(jax.device_put(list(values), shardings, may_alias=may_alias))
    out: list[Any] = [None] * len(values)
    for i in elsewhere:
        v = values[i]
        out[i] = jax.make_array_from_single_device_arrays(v.shape, shardings[i], [], dtype=v.dtype)
    rest = sorted(set(range(len(values))) - set(ours) - set(elsewhere))
    if rest:
        placed = jax.device_put(
            [values[i] for i in rest], [shardings[i] for i in rest], may_alias=may_alias
        )
        for i, arr in zip(rest, placed, strict=True):
            out[i] = arr
    for i, (host, weak, impl) in forms.items():
        s = leaves[i].data_dst_sharding if impl is not None else shardings[i]
        assert s is not None  # set for every uncommitted key array by the API layer

        def block(idx: Any, host: np.ndarray = host) -> np.ndarray:
            return host[idx]  # type: ignore[no-any-return]

        # (An uncommitted array of a 64-bit type made with jax_enable_x64 on is one
        # still, whole, as in one process.)
        with _compat.wide_types_whole([host.dtype]):
            arr = jax.make_array_from_callback(host.shape, s, block, dtype=host.dtype)
            if impl is not None:
                out[i] = jax.random.wrap_key_data(arr, impl=impl)
            else:
                aval = _compat.device_put_aval(host.shape, host.dtype, s, weak)
                out[i] = _compat.finish(arr, aval, fresh=True)
    return out


def _held_elsewhere(leaves: Sequence[LeafInfo], values: Sequence[Any]) -> list[int]:
    """Which of ``values`` are key arrays put by ``jax.device_put`` (on a sharding
    neither named nor single-device, which the API layer lets move within one process
    only) on devices of another process alone."""
    if jax.process_count() == 1:
        return []
    me = jax.process_index()
    return [
        i
        for i, (leaf, v) in enumerate(zip(leaves, values, strict=True))
        if leaf.data_dst_sharding is None
        and isinstance(v, jax.Array)
        and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key)
        and me not in processes_of(leaf.dst_sharding)
    ]


def _posted_equal_across_processes(
    leaves: Sequence[LeafInfo], forms: Sequence[tuple[np.ndarray, bool, Any]]
) -> Callable[[], None]:
    """Posts a digest of each of these values, each put on devices of every process,
    in two halves (its type: shape, dtype, weak type, key implementation; and its
    bytes); the function returned raises ``ValueError`` on every process if any differs
    between processes."""
    types = [repr((h.shape, str(h.dtype), weak, str(impl))).encode() for h, weak, impl in forms]
    digests = b"".join(
        hashlib.sha256(t).digest()[:8] + hashlib.sha256(t + h.tobytes()).digest()[:8]
        for t, (h, _, _) in zip(types, forms, strict=True)
    )
    from . import _collective_executor as collective

    # (Without the key-value store, over one destination device per process: every
    # process has one, each checked value being put on devices of every process.)
    read = collective.values_everywhere(
        digests, {d for leaf in leaves for d in leaf.dst_sharding.device_set}
    )
    return functools.partial(_compare_digests, read, leaves, forms)


def _compare_digests(
    read: Callable[[], dict[int, bytes]],
    leaves: Sequence[LeafInfo],
    forms: Sequence[tuple[np.ndarray, bool, Any]],
) -> None:
    """``_posted_equal_across_processes``' comparison, of every process's digests."""
    everyone = read()
    counts = {p: len(d) // 16 for p, d in everyone.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(
            "reshard was called with different arguments on different processes: they "
            "put different numbers of host values (numpy arrays, Python scalars, "
            f"uncommitted arrays) on devices of every process ({counts}, by process). "
            "Every process must pass the same pytree, with the same values"
        )
    rows = np.stack([np.frombuffer(d, np.uint8) for _, d in sorted(everyone.items())])
    rows = rows.reshape(len(everyone), len(leaves), -1)
    differ = [k for k in range(len(leaves)) if not (rows[:, k] == rows[0, k]).all()]
    if differ:
        where = ", ".join(leaves[k].path or "<root>" for k in differ)
        # A type that differs: the same value typed by different settings (a float64
        # array, a Python int, with jax_enable_x64 on some processes only), say.
        typed = [k for k in differ if not (rows[:, k, :8] == rows[0, k, :8]).all()]
        why = ""
        if typed:
            here = "; ".join(
                f"{leaves[k].path or '<root>'}: {forms[k][0].dtype}{list(forms[k][0].shape)}"
                f"{', weakly typed' if forms[k][1] else ''}"
                for k in typed
            )
            why = (
                f" (the type it takes differs between processes, here {here}: is "
                "jax_enable_x64 set alike on every process?)"
            )
        raise ValueError(
            f"{'leaf' if len(differ) == 1 else 'leaves'} {where}: the value to be put on "
            f"devices of every process differs between processes{why}; every process must "
            "pass the same value"
        )


def _host_form(v: Any) -> tuple[np.ndarray, bool, Any]:
    """``v`` in host memory as ``jax.device_put`` types it (a float64 array becomes a
    float32 one unless x64 is on; a Python int a weakly typed int32), its weak type,
    and for a key array its implementation (the host form is then its key data). A
    numpy value is converted on the host, not put whole on one device first."""
    if isinstance(v, jax.Array):  # uncommitted, on this process's default device
        if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            return np.asarray(jax.random.key_data(v)), False, jax.random.key_impl(v)
        return np.asarray(v), bool(v.weak_type), None
    if isinstance(v, np.ndarray | np.generic):
        return np.asarray(v, dtype=jax.dtypes.canonicalize_dtype(v.dtype)), False, None
    # A Python scalar: JAX's own type and weak typing, without a transfer (which a
    # transfer guard of this process would refuse before it could tell its peers).
    aval = jax.typeof(v)
    return np.asarray(v, dtype=aval.dtype), bool(aval.weak_type), None


def _put_from_host(values: Sequence[Any], shardings: Sequence[Sharding]) -> list[int]:
    """Which of ``values`` are put from their host form: across processes, anything
    but a committed array, put where this process alone cannot (on a sharding not
    fully addressable here)."""
    if jax.process_count() == 1:
        return []
    return [
        i
        for i, (v, s) in enumerate(zip(values, shardings, strict=True))
        if not (isinstance(v, jax.Array) and v.committed) and not s.is_fully_addressable
    ]


def _copied_whole(plan: Plan, dst_shardings: Sequence[Sharding]) -> list[int]:
    """Indices (among the planned arrays) of those copied shard by shard: every
    destination shard is the source shard at the same position of the other
    sharding's device list, no source device is to be avoided, and either the memory
    kind changes or none of the destination devices holds a source shard. PjRt copies
    those in one batched call (``_compat.copy_shards``; it reads every source shard),
    with less overhead per array than any executor: a tree of 512 arrays of 64 KiB
    moved between two device sets in ~12 ms that way, against ~30 ms through the host
    executor and ~18 ms through ``jax.device_put``."""
    # Device order differs between the private and the public path (see _compat).
    key = f"copied_whole(private={_compat.USE_PRIVATE})"
    whole = plan._cache.get(key)
    if whole is None:
        whole = []
        for j, (leaf, lp, dst) in enumerate(
            zip(plan.planned_leaves, plan.leaf_plans, dst_shardings, strict=True)
        ):
            src = leaf.src_sharding
            if src is None or leaf.kind == KEY:
                continue  # key arrays: their data's sharding is made per call
            if _whole_copy(src, dst, lp.spec.shape, plan.avoid_devices, _compat.USE_PRIVATE):
                whole.append(j)
        plan._cache[key] = whole
    return whole


def _device_ids(s: Sharding) -> list[int]:
    return [d.id for d in _compat.ordered_devices(s)]


def _kind_changes_in_place(
    plan: Plan, dst_shardings: Sequence[Sharding]
) -> tuple[list[int], list[Any]]:
    """Those of ``_copied_whole`` whose every shard stays on its device (the memory
    kind changes): within each process, whatever the plan's devices. And what the
    processes compare of them, since no program moves them: index, type, shape,
    devices and memory kinds on both sides. Worked out once per plan."""
    key = f"kind_changes_in_place(private={_compat.USE_PRIVATE})"
    found = plan._cache.get(key)
    if found is None:
        local: list[int] = []
        described: list[Any] = []
        for j in _copied_whole(plan, dst_shardings):
            leaf, src, dst = plan.planned_leaves[j], _source_sharding(plan, j), dst_shardings[j]
            ids = _device_ids(src)
            if ids == _device_ids(dst):
                local.append(j)
                described.append(
                    (j, leaf.kind, str(leaf.dtype), list(leaf.shape))
                    + (ids, str(src.memory_kind), ids, str(dst.memory_kind))
                )
        found = plan._cache[key] = (local, described)
    return found


def _agree_without_program(plan: Plan, what: tuple[str, Any], sharding: Sharding) -> None:
    """The check across processes (``_collective_executor.agree``) of a call that runs
    no program, so has no program's check: made only of memory-kind changes in place,
    or of host values alone. ``what`` (its kind, and what the processes compare of it)
    describes it. Once per plan, as a program's, for a plan that crosses processes;
    under the collective watchdog."""
    from ._collective_executor import agree_on, collective_timeout_s, fingerprint, watchdog

    agreed = f"{what[0]} agreed"
    if not plan.crosses_processes or plan._cache.get(agreed):
        return
    device: Any = next(iter(sharding.device_set))
    with watchdog(collective_timeout_s()):
        agree_on(fingerprint(what), str(device.platform), plan.avoid_devices)
    plan._cache[agreed] = True


def _host_values_described(leaves: Sequence[LeafInfo]) -> list[Any]:
    """What the processes compare of a call of host values alone (its plan's first
    run): each leaf's path, shape, and destination devices, spec and memory kind. Not
    its type: the digests of the values compare the type JAX gives each (a float64
    array and a float32 one are the same with x64 off, as for ``jax.device_put``), and
    name it where it differs (``post_host_values``, at every call)."""
    return [
        (
            leaf.path,
            list(leaf.shape),
            _device_ids(leaf.dst_sharding),
            repr(getattr(leaf.dst_sharding, "spec", None)),
            str(leaf.dst_sharding.memory_kind),
        )
        for leaf in leaves
    ]


def _source_sharding(plan: Plan, j: int) -> Sharding:
    src = plan.planned_leaves[j].src_sharding
    assert src is not None  # (``_copied_whole`` takes no array without one)
    return src


@functools.lru_cache(maxsize=4096)
def _whole_copy(
    src: Sharding, dst: Sharding, shape: tuple[int, ...], avoid: frozenset[int], use_private: bool
) -> bool:
    """``_copied_whole``'s test for one (non-key) array (memoised: the arrays of a tree
    share their shardings and shapes). ``use_private`` is part of the key only."""
    from ._api import _memory_kind, shard_specs  # (the API layer imports this module)

    del use_private
    src_devs, dst_devs = _compat.ordered_devices(src), _compat.ordered_devices(dst)
    src_ids = {d.id for d in src_devs}
    if (
        len(src_devs) != len(dst_devs)
        or src_ids & avoid  # the copy reads every source shard
        # Within one memory kind, only between devices: a device's copy of its own
        # buffer by a program is far faster on accelerators (``copies_in_place``). A
        # change of memory kind is a transfer wherever the shard goes: PjRt's, as
        # ``jax.device_put``'s, batched for the whole call.
        or (_memory_kind(src) == _memory_kind(dst) and src_ids & {d.id for d in dst_devs})
    ):
        return False
    src_box = {s.device: s.box for s in shard_specs(src, shape)}
    dst_box = {s.device: s.box for s in shard_specs(dst, shape)}
    return all(src_box[a.id] == dst_box[b.id] for a, b in zip(src_devs, dst_devs, strict=True))


def device_peak_extra(plan: Plan) -> dict[int, int]:
    """The device executor's peak extra bytes per device (``PlanStats``), an upper
    bound: besides the destination shards, each piece it moves is cut out on its source
    device (unless it is a whole source shard) and lands on its destination device
    before the shards are built from it; a source shard it reads from a host memory
    kind is staged in device memory first, and a shard for a host memory kind is built
    in device memory first. Arrays that PjRt copies whole (``_copied_whole``) land as
    their destination shards."""
    peak = collections.Counter(plan.stats.peak_extra_bytes)
    whole = set(_copied_whole(plan, [_moved_sharding(leaf) for leaf in plan.planned_leaves]))
    for j, (leaf, lp) in enumerate(zip(plan.planned_leaves, plan.leaf_plans, strict=True)):
        if j in whole:
            continue
        spec, isz = lp.spec, lp.spec.itemsize
        device: Any = next(iter(leaf.dst_sharding.device_set))
        compute_kind = device.default_memory().kind
        reused = {di for di, _ in lp.reused}
        read = {p.src for p in lp.moved} | {p.src for p in lp.kept if p.dst not in reused}
        for si in read:
            if spec.src[si].memory_kind != compute_kind:
                peak[spec.src[si].device] += volume(spec.src[si].box) * isz
        for di, d in enumerate(spec.dst):
            if di not in reused and d.memory_kind != compute_kind:
                peak[d.device] += volume(d.box) * isz
        for p in lp.moved:
            nbytes = volume(p.box) * isz
            peak[spec.dst[p.dst].device] += nbytes
            if p.box != spec.src[p.src].box:
                peak[spec.src[p.src].device] += nbytes
    return dict(peak)


Key = tuple[int, int]  # a buffer, by ``_compat.buffer_keys``: (device id, address)
# A donated array, its data (key data for key arrays) and the data's buffers by key.
Donated = tuple[jax.Array, jax.Array, dict[Key, jax.Array]]


def _donate(
    found: Sequence[Donated],
    kept: set[Key],
    out: list[Any],
    outputs: Sequence[int],
    avoid: frozenset[int] = frozenset(),
) -> None:
    """Consumes the donated arrays ``found``: each reads as deleted after,
    and its buffers are freed except those outputs took over (``kept``), which the
    outputs at ``outputs`` of ``out`` keep (rebuilt on new handles where needed).

    - An array no output took a buffer of is deleted.
    - One that an output took buffers of is re-homed: a donating identity hands its
      buffers to a new array (XLA aliases them, nothing is copied; where JAX declines,
      for a numpy view of a shard say, it copies those), the outputs are rebuilt on
      the new handles, and the array is deleted.
    - Arrays linked by shared buffers (one array's output passed with it, say) cannot
      be donated one by one, since that would free a buffer under another: the
      outputs get copies of the kept buffers they share, and the arrays are deleted.
      So do arrays no identity may run on (see ``_identity_may_run``), and arrays
      with kept buffers XLA does not own (``_buffers.lease_test``: an identity would
      copy those anyway, and its allocation could fail after other device sets'
      inputs were consumed); where the CPU executors' pool holds those (their own
      outputs), the outputs' new handles are over the same memory, not copies.

    Every process reaches the same end (each input deleted), whatever sharing it sees
    in its own buffers. Nothing is deleted before every copy and identity has run, so
    no array is ever left reading as valid with some buffers freed (using it would
    crash the process).
    """
    group = list(range(len(found)))  # union-find over arrays that share a buffer

    def root(a: int) -> int:
        while group[a] != a:
            group[a] = group[group[a]]
            a = group[a]
        return a

    first: dict[Key, int] = {}
    for a, (_, _, bufs) in enumerate(found):
        for k in bufs:
            group[root(a)] = root(first.setdefault(k, a))
    members: dict[int, list[int]] = collections.defaultdict(list)
    for a in range(len(found)):
        members[root(a)].append(a)
    rehome: dict[tuple[Any, ...], list[int]] = collections.defaultdict(list)
    shared: dict[Key, jax.Array] = {}  # kept buffers of linked arrays, to copy
    on_lease: Callable[[Iterable[int]], bool] | None = None
    for linked in members.values():
        if not any(k in kept for a in linked for k in found[a][2]):
            continue
        data = found[linked[0]][1]
        # Buffers XLA does not own (the CPU executors' outputs) an identity would copy,
        # allocating after earlier device sets' inputs were consumed: given new handles
        # up front, over the same memory (``_compat.new_handles``).
        on_lease = on_lease or _buffers.lease_test()
        adopted = on_lease(k[1] for a in linked for k in found[a][2] if k in kept)
        if len(linked) == 1 and not adopted and _identity_may_run(data.sharding, avoid):
            # One identity per device assignment (jit takes no two device orders).
            by = _compat.ordered_devices(data.sharding) if _compat.USE_PRIVATE else (id(data),)
            rehome[by].append(linked[0])
        else:
            shared.update((k, b) for a in linked for k, b in found[a][2].items() if k in kept)

    remap: dict[Key, jax.Array] = {}  # an output's old buffer -> its new one
    unused: list[jax.Array] = []  # new handles of buffers no output took over
    if rehome or shared:
        # The outputs' buffers, read before the identity invalidates the old handles.
        held = {i: _compat.buffer_keys(_data(out[i])) for i in outputs}
        if shared:
            remap.update(zip(shared, _compat.new_handles(list(shared.values())), strict=True))
        # Every identity's program first (one per device assignment), so that a
        # failure to build one comes before any array is donated.
        runs = [
            (group_of, _compat.prepare_donating_identity([found[a][1] for a in group_of]))
            for group_of in rehome.values()
        ]
        for group_of, run in runs:
            for a, n in zip(group_of, run(), strict=True):
                home = _compat.device_buffers(n)
                for k in found[a][2]:
                    if k in kept:
                        remap[k] = home[k[0]]
                    else:
                        unused.append(home[k[0]])
        for i, keys in held.items():
            if any(k in remap for k in keys):
                _with_new_buffers(out, i, [remap.get(k, b) for k, b in keys.items()])
    for x, _, _ in found:
        if not x.is_deleted():  # (re-homed ones read as deleted already)
            x.delete()
    for b in unused:
        b.delete()


def _identity_may_run(s: Sharding, avoid: frozenset[int]) -> bool:
    """Whether a donating identity may run on arrays of sharding ``s``: in device
    memory only, on no device to avoid (a lost device cannot run a program).

    Not in ``unpinned_host``, where XLA runs nothing (jax 0.10 on CPU aborts); nor in
    ``pinned_host``: there jax 0.10 gives the outputs of ``jax.jit`` on a
    ``SingleDeviceSharding`` a device memory space, and a program donating one aborts
    the process (so does a plain donating ``jax.jit``), and accelerators need not run
    programs on host memory at all. Kept host-memory shards are copied instead.
    """
    devices: Any = s.device_set
    return s.memory_kind in (None, "device") and not any(d.id in avoid for d in devices)


def _data(v: jax.Array) -> jax.Array:
    """A key array's key data; any other array itself."""
    return jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v


def _with_new_buffers(out: list[Any], i: int, parts: list[jax.Array]) -> None:
    """Replaces ``out[i]`` with the same array over ``parts`` (its data's, for keys)."""
    if jax.dtypes.issubdtype(out[i].dtype, jax.dtypes.prng_key):
        data = _compat.with_buffers(jax.random.key_data(out[i]), parts)
        out[i] = jax.random.wrap_key_data(data, impl=jax.random.key_impl(out[i]))
    else:
        out[i] = _compat.with_buffers(out[i], parts)


def _moved_sharding(leaf: LeafInfo) -> Sharding:
    """The sharding the executor builds: the key data's for key arrays."""
    s = leaf.data_dst_sharding if leaf.kind == KEY else leaf.dst_sharding
    assert s is not None  # set for every KEY leaf by the API layer
    return s
