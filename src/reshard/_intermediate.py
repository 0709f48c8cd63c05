"""Intermediate shardings: the seed's detour for resharding many shards into fewer.

``find_intermediate_sharding(in, out)`` looks for a sharding on ``in``'s devices in
which the array is cut along each "split candidate" dimension into as many shards as
``out`` wants there, and replicated over the remaining devices (new *replica* axes).
``reshard_with_intermediate_sharding`` reshards to it, keeps the first replica (a
sub-mesh, via ``split_by_mesh_axis``, so nothing is copied) and reshards that to
``out``. The rules follow ``pathwaysutils.experimental.reshard``, whose callers move
here by changing one import; this module's docstrings state them.

Per dimension ``i`` the *shard count* of a ``NamedSharding`` is the product of the
sizes of the mesh axes its spec entry names (1 for ``None``); ``src`` and ``dst`` are
the counts of ``in`` and ``out``.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from . import _compat
from ._mesh_surgery import repeated_ids
from ._split import shard_count, split_by_mesh_axis

__all__ = [
    "INTERMEDIATE_REPLICA_SUFFIX",
    "INTERMEDIATE_SPLIT_SUFFIX",
    "NoIntermediateShardingError",
    "NoIntermediateShardingNeededError",
    "find_intermediate_sharding",
    "reshard_with_intermediate_sharding",
]

INTERMEDIATE_SPLIT_SUFFIX = "_intermediate_split"
INTERMEDIATE_REPLICA_SUFFIX = "_intermediate_replica"


class NoIntermediateShardingError(ValueError):
    """No intermediate sharding exists for this pair of shardings.

    A ``ValueError`` because the shardings passed are what rules it out; callers that
    only want the detour when it exists catch this and reshard directly.
    """


class NoIntermediateShardingNeededError(NoIntermediateShardingError):
    """Some dimension already shares shards between the two shardings.

    Raised when ``gcd(src[i], dst[i]) > 1`` for some dimension ``i``: the detour is
    not worth taking there, and a direct reshard is used.
    """


def _entries(spec: PartitionSpec, rank: int) -> list[Any]:
    """The spec's entries; an empty spec reads as ``rank`` replicated dimensions."""
    entries = _compat.spec_entries(spec)
    return list(entries) if entries else [None] * rank


def _single_axis(entry: Any) -> str | None:
    """The axis name of an entry naming exactly one axis (``'x'`` or ``('x',)``)."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, tuple | list) and len(entry) == 1 and isinstance(entry[0], str):
        return entry[0]
    return None


def find_intermediate_sharding(
    in_sharding: jax.sharding.Sharding, out_sharding: jax.sharding.Sharding
) -> tuple[NamedSharding, list[str]]:
    """Finds a sharding to pass through when resharding ``in_sharding`` to ``out_sharding``.

    Only for two ``NamedSharding``s. With ``src``/``dst`` the per-dimension shard counts
    (an empty spec reads as all-``None`` of the other spec's length), there is no
    intermediate sharding when ``max(src) % max(dst) != 0``, ``prod(src) <= prod(dst)``
    or ``prod(src) % prod(dst) != 0``; none is needed when ``gcd(src[i], dst[i]) > 1``
    for some ``i``. The split candidates are the dimensions with ``src[i] > dst[i]``
    whose spec entry is a single mesh axis ``a``; each such ``a`` (size ``src[i]``)
    becomes ``a + INTERMEDIATE_REPLICA_SUFFIX`` of size ``src[i] // dst[i]`` and
    ``a + INTERMEDIATE_SPLIT_SUFFIX`` of size ``dst[i]``. The new mesh holds the same
    devices in the same order: replica axes first (in mesh-axis order), then the
    original axes with split axes in place. The spec is ``in``'s spec with each
    candidate entry renamed to its split axis; ``in``'s memory kind is kept.

    Args:
      in_sharding: the sharding the array has.
      out_sharding: the sharding it should get.

    Returns:
      ``(intermediate, replica_axes)``: the intermediate ``NamedSharding`` on
      ``in_sharding``'s devices, and the names of its replica axes.

    Raises:
      NoIntermediateShardingNeededError: some dimension shares a shard factor.
      NoIntermediateShardingError: no intermediate sharding exists (the message says
        which rule failed), or a spec has an ``UNCONSTRAINED`` entry.

    Example:
      A (16, 16) array sharded 8 ways by rows goes to 4 devices sharded by columns.
      The intermediate sharding replicates the rows on all 8 devices, and keeping one
      replica (one device) leaves an array whose shards line up with no others:

      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from reshard import find_intermediate_sharding
      >>> devices = np.array(jax.devices()[:8])
      >>> src = NamedSharding(Mesh(devices, ("fsdp",)), P("fsdp", None))
      >>> dst = NamedSharding(Mesh(devices[:4], ("tp",)), P(None, "tp"))
      >>> inter, replica_axes = find_intermediate_sharding(src, dst)
      >>> dict(inter.mesh.shape)
      {'fsdp_intermediate_replica': 8, 'fsdp_intermediate_split': 1}
      >>> tuple(inter.spec), replica_axes
      (('fsdp_intermediate_split', None), ['fsdp_intermediate_replica'])
    """
    if not isinstance(in_sharding, NamedSharding) or not isinstance(out_sharding, NamedSharding):
        raise NoIntermediateShardingError(
            "intermediate shardings exist only between two NamedShardings; got "
            f"in_sharding={in_sharding!r} and out_sharding={out_sharding!r}."
        )
    given = f"in_sharding={in_sharding!r}, out_sharding={out_sharding!r}"
    for name, given_sharding in (("in", in_sharding), ("out", out_sharding)):
        given_spec = given_sharding.spec
        if _compat.reduced_axes(given_sharding) or _compat.unreduced_axes(given_sharding):
            # Such a spec also says how devices along some axes relate (copies to be
            # summed in the backward pass, or addends): the detour's replica split
            # would have to keep that, which the seed's rules do not cover.
            raise NoIntermediateShardingError(
                f"the {name} spec has reduced or unreduced axes; intermediate shardings "
                f"exist only between plain layouts. Got {given}."
            )
        if PartitionSpec.UNCONSTRAINED in _compat.spec_entries(given_spec):
            # Such a spec leaves the layout to the compiler: there are no shard counts
            # to reason about (Pathways refuses it too).
            raise NoIntermediateShardingError(
                f"the {name} spec has an UNCONSTRAINED entry; intermediate shardings "
                f"exist only between concrete layouts. Got {given}."
            )
    in_entries = _entries(in_sharding.spec, len(out_sharding.spec))
    out_entries = _entries(out_sharding.spec, len(in_sharding.spec))
    if len(in_entries) != len(out_entries):
        raise NoIntermediateShardingError(
            f"the specs have different lengths ({len(in_entries)} and {len(out_entries)});"
            f" write both with one entry per array dimension. Got {given}."
        )
    src = [shard_count(in_sharding.mesh, e) for e in in_entries]
    dst = [shard_count(out_sharding.mesh, e) for e in out_entries]
    counts = f"shard counts per dimension: in {src}, out {dst}"
    if max(src, default=1) % max(dst, default=1):
        raise NoIntermediateShardingError(
            f"the largest input shard count does not divide by the largest output one "
            f"({counts}). Got {given}."
        )
    if math.prod(src) <= math.prod(dst):
        raise NoIntermediateShardingError(
            f"the input has no more shards than the output ({counts}); the detour only "
            f"helps when going to fewer shards. Got {given}."
        )
    if math.prod(src) % math.prod(dst):
        raise NoIntermediateShardingError(
            f"the input's shard total is not a multiple of the output's ({counts}). Got {given}."
        )
    if math.prod(math.gcd(s, d) for s, d in zip(src, dst, strict=True)) != 1:
        raise NoIntermediateShardingNeededError(
            f"a dimension is sharded by factors with a common divisor ({counts}), so the "
            f"input's shards already divide the output's there; reshard directly. "
            f"Got {given}."
        )

    # axis -> (dimension, replicas, split size); a mesh axis is in at most one entry.
    candidates: dict[str, tuple[int, int, int]] = {}
    for i, entry in enumerate(in_entries):
        axis = _single_axis(entry)
        if axis is not None and src[i] > dst[i]:
            if src[i] % dst[i]:
                # The axis cannot be factored into replica x split devices.
                raise NoIntermediateShardingError(
                    f"dimension {i} is sharded {src[i]} ways over {axis!r}, which does "
                    f"not factor by the output's {dst[i]} ways ({counts}). Got {given}."
                )
            candidates[axis] = (i, src[i] // dst[i], dst[i])
    if not candidates:
        raise NoIntermediateShardingError(
            f"no dimension can be split: none goes to fewer shards while sharded over a "
            f"single mesh axis ({counts}). Got {given}."
        )

    mesh = in_sharding.mesh
    if not isinstance(mesh, Mesh):
        # (jax.typeof(x).sharding is such a one.) The intermediate mesh reshapes the
        # input's devices, which an abstract mesh does not name.
        raise NoIntermediateShardingError(
            f"in_sharding is on the abstract mesh {mesh!r}; the intermediate sharding is "
            f"built on the input's devices, so pass a NamedSharding over a concrete "
            f"jax.sharding.Mesh (x.sharding, say). Got {given}."
        )
    replica_axes: list[tuple[str, int, Any]] = []
    kept_axes: list[tuple[str, int, Any]] = []
    for axis, size, kind in zip(mesh.axis_names, mesh.devices.shape, mesh.axis_types, strict=True):
        if axis in candidates:
            _, replicas, split = candidates[axis]
            # Both halves inherit the axis type, so explicit/auto mode is unchanged.
            replica_axes.append((axis + INTERMEDIATE_REPLICA_SUFFIX, replicas, kind))
            kept_axes.append((axis + INTERMEDIATE_SPLIT_SUFFIX, split, kind))
        else:
            kept_axes.append((axis, size, kind))
    names, sizes, kinds = zip(*(replica_axes + kept_axes), strict=True)
    if clash := repeated_ids(names):
        raise NoIntermediateShardingError(
            f"the intermediate mesh would name axes {clash} twice: the input mesh already "
            f"has an axis of that name. Got {given}."
        )
    new_mesh = Mesh(mesh.devices.reshape(sizes), names, axis_types=kinds)
    spec = list(_compat.spec_entries(in_sharding.spec))
    for axis, (i, _, _) in candidates.items():
        spec[i] = axis + INTERMEDIATE_SPLIT_SUFFIX
    intermediate = NamedSharding(
        new_mesh, PartitionSpec(*spec), memory_kind=in_sharding.memory_kind
    )
    return intermediate, [name for name, _, _ in replica_axes]


def reshard_with_intermediate_sharding(
    x: Any,
    in_sharding: jax.sharding.Sharding,
    out_sharding: jax.sharding.Sharding,
    *,
    donate: bool = False,
    may_alias: bool | None = None,
    cache_resharding_plans: bool = False,
) -> Any:
    """Reshards ``x`` to ``out_sharding``, through an intermediate sharding if one exists.

    With ``intermediate, replica_axes = find_intermediate_sharding(in_sharding,
    out_sharding)``, ``x`` is resharded to ``intermediate``, the first slice along each
    replica axis is kept (``split_by_mesh_axis``, which copies nothing; the other
    replicas are released), and that slice is resharded to ``out_sharding``. When
    ``find_intermediate_sharding`` raises ``NoIntermediateShardingError`` (or its
    subclass), ``x`` is resharded directly.

    Args:
      x: an array or pytree of arrays, laid out as ``in_sharding``.
      in_sharding: the sharding of ``x`` (only used to find the intermediate).
      out_sharding: the sharding of the result; applied to every leaf.
      donate: whether ``x`` may be consumed. A destination that cannot hold ``x`` is
        refused before anything moves, so a failure loses nothing.
      may_alias: passed to ``reshard.reshard``.
      cache_resharding_plans: passed to ``reshard.reshard`` (each of its reshards).

    Returns:
      ``x`` resharded to ``out_sharding``.

    Example:
      >>> import jax, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> from reshard import reshard_with_intermediate_sharding
      >>> devices = np.array(jax.devices()[:8])
      >>> src = NamedSharding(Mesh(devices, ("fsdp",)), P("fsdp", None))
      >>> dst = NamedSharding(Mesh(devices[:4], ("tp",)), P(None, "tp"))
      >>> x = jax.device_put(np.arange(64.0).reshape(8, 8), src)
      >>> y = reshard_with_intermediate_sharding(x, src, dst)
      >>> y.sharding == dst, bool((np.asarray(y) == np.asarray(x)).all())
      (True, True)
    """
    from ._api import plan, reshard  # late: the core API imports this module's package

    cache = cache_resharding_plans
    try:
        intermediate, replica_axes = find_intermediate_sharding(in_sharding, out_sharding)
    except NoIntermediateShardingError:
        return reshard(
            x, out_sharding, donate=donate, may_alias=may_alias, cache_resharding_plans=cache
        )
    if donate:
        # The first reshard frees x, so a destination the last one would refuse (a
        # shape it cannot divide, say) must be refused before: a failure loses nothing.
        # Every leaf keeps its shape on the way, so planning x -> out_sharding checks it.
        plan(x, out_sharding, cache=cache)
    try:
        y = reshard(
            x, intermediate, donate=donate, may_alias=may_alias, cache_resharding_plans=cache
        )
    except ValueError:
        if not donate:
            # Name what the caller gave, not the intermediate sharding built from it.
            plan(x, out_sharding, cache=cache)
        raise
    for axis in replica_axes:
        # Keep the first replica; dropping the list releases the others' buffers. (The
        # count is given: a tree with no arrays has no mesh to read it from.)
        y = split_by_mesh_axis(y, axis, intermediate.mesh.shape[axis])[0]
    # Not donated: reshard frees sources only after the whole result is written, so
    # donating would not lower the peak, and y's buffers go when this frame returns.
    return reshard(y, out_sharding, may_alias=may_alias, cache_resharding_plans=cache)
