"""``Plan``: everything decided before a byte moves, for one pytree.

A plan is built from avals and shardings only (``reshard.plan``), is immutable, and
can be executed many times on arrays of the same avals and shardings. It carries the
planner's pieces and statistics, a readable summary (``str(plan)``), a transfer matrix
and a JSON-ready dictionary form.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.sharding import Sharding

from ._geometry import volume
from ._planner import LeafPlan, PlanStats

# How a leaf is handled: planned array, planned PRNG-key array (moved as its key data),
# or anything else (numpy, Python scalars), which goes through ``jax.device_put``.
ARRAY, KEY, HOST = "array", "key", "host"
# ``Plan._cache`` entry: which arrays an executor moved without programs, and how (set
# at the first run, where it is decided; ``str(plan)`` reports it).
HOST_ROUTE = "host_route"


@dataclass(frozen=True)
class LeafInfo:
    """One leaf of the input pytree, as seen when planning."""

    path: str
    kind: str  # ARRAY, KEY or HOST
    shape: tuple[int, ...]
    dtype: Any
    src_sharding: Sharding | None
    dst_sharding: Sharding
    # For KEY leaves: the key data's shardings (source and destination).
    data_src_sharding: Sharding | None = None
    data_dst_sharding: Sharding | None = None


def processes_of(*shardings: Sharding) -> set[int]:
    """The JAX processes whose devices ``shardings`` use."""
    devices: set[Any] = {d for s in shardings for d in s.device_set}
    return {d.process_index for d in devices}


def plan_processes(leaves: Sequence[LeafInfo]) -> frozenset[int]:
    """The JAX processes holding a source or destination device of any leaf, read from
    the live devices (a pickled plan's devices are this runtime's once loaded)."""
    # Each distinct sharding object once (a tree's leaves share a few).
    shardings = {id(s): s for leaf in leaves for s in (leaf.src_sharding, leaf.dst_sharding)}
    return frozenset(processes_of(*(s for s in shardings.values() if s is not None)))


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


@dataclass(frozen=True, eq=False)
class Plan:
    """A resharding plan for one pytree. Build with ``reshard.plan``.

    Attributes:
      treedef: structure of the input (and output) pytree.
      leaves: per leaf, its path, kind, aval and shardings.
      leaf_plans: the planner's result for every planned (array or key) leaf, in order.
      stats: byte counts, transfers, per-device load (see ``PlanStats``).
      executor: how the plan runs: ``"host"``, ``"device"`` or ``"collective"``.
      avoid_devices: device ids whose shards the plan never reads.
    """

    treedef: Any
    leaves: tuple[LeafInfo, ...]
    leaf_plans: tuple[LeafPlan, ...]
    stats: PlanStats
    executor: str
    avoid_devices: frozenset[int] = frozenset()
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    # -- running -----------------------------------------------------------------

    def execute(self, x: Any, *, donate: bool = False, may_alias: bool | None = None) -> Any:
        """Runs the plan on ``x`` (same structure, avals and shardings it was built for).

        Args:
          x: the pytree to move.
          donate: consume the source arrays after the whole pytree has been moved
            (never before: a failure leaves every input intact); they then read as
            deleted. An array that keeps ``_execute.HANDOVER_BYTES`` (1 MiB) or more
            in device memory on its devices hands those shards to the output without
            a copy. An array that shares buffers with a live array outside ``x`` that
            this library made zero-copy (``_sharing``: a part of a split, say) stays
            valid instead.
          may_alias: for shards that stay on their device: ``None`` copies them
            unless donating, so the output shares no buffer with the input, even an
            array that does not change (``jax.device_put`` would return the input
            itself), as Pathways returns a copy; ``True`` hands them over always (the
            output then shares buffers with the input: donating the input later to
            a jitted training step, say, frees them under the output; ``reshard``,
            ``split_by_mesh_axis`` and ``concatenate_by_mesh_axis`` leave it
            unconsumed while the output lives); ``False`` copies them always, when
            donating too.

        Returns:
          A pytree like ``x`` with every leaf committed to its destination sharding.
        """
        from ._collective_common import counted_call
        from ._execute import execute_plan

        if self.crosses_processes:
            with counted_call():  # counted before anything can fail (see count_call)
                return execute_plan(self, x, donate=donate, may_alias=may_alias)
        return execute_plan(self, x, donate=donate, may_alias=may_alias)

    # -- describing --------------------------------------------------------------

    @property
    def planned_leaves(self) -> tuple[LeafInfo, ...]:
        """The leaves the plan's executor moves: every one but those put as
        ``jax.device_put`` puts them (Python scalars, numpy arrays, key arrays on
        shardings neither named nor single-device, and across processes uncommitted
        arrays)."""
        return tuple(leaf for leaf in self.leaves if leaf.kind != HOST)

    @property
    def processes(self) -> frozenset[int]:
        """The JAX processes that hold a source or destination device of the plan."""
        found = self._cache.get("processes")
        if found is None:
            found = self._cache["processes"] = plan_processes(self.leaves)
        return found

    @property
    def crosses_processes(self) -> bool:
        """Whether running the plan needs more than one process (collectives: every
        process must call it alike). A plan whose devices all belong to one process
        runs there alone, like ``jax.device_put``; the other processes, holding no
        shard of it, only make its (empty) outputs."""
        return len(self.processes) > 1

    def transfer_matrix(self) -> tuple[list[int], list[int], np.ndarray]:
        """Bytes moved from each source device to each destination device.

        Returns:
          ``(source device ids, destination device ids, matrix)`` where
          ``matrix[i, j]`` is the number of bytes device ``src[i]`` sends to device
          ``dst[j]``. Kept bytes (already in place) are not included.
        """
        src_ids: set[int] = set()
        dst_ids: set[int] = set()
        for lp in self.leaf_plans:
            src_ids.update(s.device for s in lp.spec.src)
            dst_ids.update(s.device for s in lp.spec.dst)
        srcs, dsts = sorted(src_ids), sorted(dst_ids)
        si = {d: i for i, d in enumerate(srcs)}
        di = {d: i for i, d in enumerate(dsts)}
        m = np.zeros((len(srcs), len(dsts)), dtype=np.int64)
        for lp in self.leaf_plans:
            spec = lp.spec
            for p in lp.moved:
                m[si[spec.src[p.src].device], di[spec.dst[p.dst].device]] += (
                    volume(p.box) * spec.itemsize
                )
        return srcs, dsts, m

    def to_dict(self, *, pieces: bool = True) -> dict[str, Any]:
        """A JSON-ready description: statistics, and per leaf its pieces."""
        out: dict[str, Any] = {"executor": self.executor, "stats": self.stats.as_dict()}
        out["avoid_devices"] = sorted(self.avoid_devices)
        leaves = []
        plans = iter(self.leaf_plans)
        for leaf in self.leaves:
            d: dict[str, Any] = {
                "path": leaf.path,
                "kind": leaf.kind,
                "shape": list(leaf.shape),
                "dtype": str(leaf.dtype),
            }
            if leaf.kind != HOST:
                lp = next(plans)
                d["bytes_moved"] = lp.bytes_moved
                d["transfers"] = len(lp.moved)
                if pieces:
                    spec = lp.spec
                    d["pieces"] = [
                        {
                            "box": [list(b) for b in p.box],
                            "src_device": spec.src[p.src].device,
                            "src_memory_kind": spec.src[p.src].memory_kind,
                            "dst_device": spec.dst[p.dst].device,
                            "dst_memory_kind": spec.dst[p.dst].memory_kind,
                            "bytes": volume(p.box) * spec.itemsize,
                        }
                        for p in lp.moved
                    ]
            leaves.append(d)
        out["leaves"] = leaves
        return out

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        """Pickling: everything but the compiled programs, devices by id.

        A plan loads in any process whose JAX has devices of the same platforms and
        ids (the same topology), which it then uses; its programs compile again on
        first use there.
        """
        fields = (
            self.treedef,
            self.leaves,
            self.leaf_plans,
            self.stats,
            self.executor,
            self.avoid_devices,
        )
        out = io.BytesIO()
        _DevicesById(out, protocol=pickle.HIGHEST_PROTOCOL).dump(fields)
        return _load_plan, (out.getvalue(),)

    def __copy__(self) -> Plan:
        return self.__deepcopy__({})

    def __deepcopy__(self, memo: dict[int, Any]) -> Plan:
        """A new plan with the same content and no compiled programs, without pickling:
        a plan is immutable (its statistics' dictionaries are copied), its devices are
        this process's own, and its tree structure may hold what pickle cannot (a
        locally defined pytree class, say)."""
        import copy

        return Plan(
            self.treedef,
            self.leaves,
            self.leaf_plans,
            copy.deepcopy(self.stats, memo),
            self.executor,
            self.avoid_devices,
        )

    def __str__(self) -> str:
        s = self.stats
        n_planned = len(self.leaf_plans)
        n_host = len(self.leaves) - n_planned
        devices = {d.device for lp in self.leaf_plans for d in lp.spec.dst}
        optimal = "optimal" if s.bytes_moved == s.bytes_lower_bound else "ABOVE the lower bound"
        recv_max = max(s.recv_bytes.values(), default=0)
        lines = [
            f"reshard plan ({self.executor} executor): {n_planned} array(s)"
            + (f" + {n_host} host leaf/leaves via jax.device_put" if n_host else ""),
            f"  data:        {human_bytes(s.array_bytes)} logical, "
            f"{human_bytes(s.bytes_total)} at the destination on {len(devices)} device(s)",
            f"  moved:       {human_bytes(s.bytes_moved)} in {s.transfers} transfer(s) "
            f"(lower bound {human_bytes(s.bytes_lower_bound)}: {optimal})",
            f"  kept:        {human_bytes(s.bytes_kept)} already in place",
            f"  send/device: max {human_bytes(s.max_send_bytes)}, mean {human_bytes(s.mean_send_bytes)} "
            f"over {sum(1 for v in s.send_bytes.values() if v)} sender(s)",
            f"  recv/device: max {human_bytes(recv_max)}",
            f"  peak extra:  max {human_bytes(s.max_peak_extra_bytes)} on one device",
        ]
        if self.avoid_devices:
            lines.append(f"  avoiding:    devices {sorted(self.avoid_devices)}")
        route = self._cache.get(HOST_ROUTE)
        if route:
            lines.append(
                f"  host route:  {route}: this platform's programs change some of their "
                "bits (measured at the first run; docs/accelerators.md)"
            )
        return "\n".join(lines)


class _DevicesById(pickle.Pickler):
    """Pickles JAX devices (inside shardings and meshes) as their platform and id."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, jax.Device):
            return ("jax.Device", obj.platform, obj.id)
        return None


class _DevicesFromJax(pickle.Unpickler):
    """Gives back the devices ``_DevicesById`` wrote, from this process's JAX."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self._devices: dict[str, dict[int, Any]] = {}

    def persistent_load(self, pid: Any) -> Any:
        _, platform, device_id = pid
        devices = self._devices.get(platform)
        if devices is None:
            try:
                devices = {d.id: d for d in jax.devices(platform)}
            except RuntimeError:  # no such platform here
                devices = {}
            self._devices[platform] = devices
        if device_id not in devices:
            raise ValueError(
                f"this plan uses {platform} device {device_id}, which this JAX does not "
                f"have ({jax.device_count()} device(s): "
                f"{sorted({d.platform for d in jax.devices()})}); a pickled plan loads "
                "only where the same devices exist: plan again here with reshard.plan"
            )
        return devices[device_id]


def _load_plan(data: bytes) -> Plan:
    return Plan(*_DevicesFromJax(data).load())
