"""The planner: which bytes move from which location to which, decided before any move.

Vocabulary (see also ``_geometry``):

* **location** -- ``(device id, memory kind)``. Bytes already at the right location
  need no transfer.
* **piece** -- one copy of a box from a source shard to a destination shard. A piece
  whose two shards sit at the same location is *kept* (no transfer); any other piece is
  *moved*.
* **leaf plan** -- the kept and moved pieces of one array.

The planner is pure: it sees shapes, element sizes and shard boxes with their
locations, never array values or real devices, so it runs for thousands of synthetic
devices. It is deterministic (every process of a multi-controller run builds the same
plan) and moves exactly the lower bound: for each destination shard, the bytes not
already at its location.

Among replicas of a source box it picks the holder that keeps the busiest sender least
loaded (greedy, largest requests first), preferring holders in the destination's own
process; it never reads from devices the caller asks it to avoid.
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from ._errors import DataLossError
from ._geometry import Box, intersect, merge_boxes, subtract, volume

Location = tuple[int, str]


@dataclass(frozen=True)
class ShardSpec:
    """Where one shard lives: device id, memory kind, owning process, and its box."""

    device: int
    memory_kind: str
    process: int
    box: Box

    @property
    def location(self) -> Location:
        return (self.device, self.memory_kind)


@dataclass(frozen=True)
class LeafSpec:
    """What the planner needs to know about one array: no values, no devices.

    ``itemsize`` is the number of bytes per element of ``shape``. Shards are listed in
    a fixed order (the executor refers to them by index).
    """

    name: str
    shape: tuple[int, ...]
    itemsize: int
    src: tuple[ShardSpec, ...]
    dst: tuple[ShardSpec, ...]


class Piece(NamedTuple):
    """One copy of ``box`` from source shard ``src`` to destination shard ``dst``.

    ``src``/``dst`` index the ``LeafSpec.src``/``LeafSpec.dst`` shard tuples. A named
    tuple, not a dataclass: plans for thousands of devices hold millions of these.
    """

    box: Box
    src: int
    dst: int


@dataclass(frozen=True)
class LeafPlan:
    """The pieces of one array. ``reused`` lists destination shards that are exactly a
    source shard at the same location: its buffer can be handed over with no copy."""

    spec: LeafSpec
    kept: tuple[Piece, ...]
    moved: tuple[Piece, ...]
    reused: tuple[tuple[int, int], ...]  # (dst shard index, src shard index)

    @property
    def bytes_moved(self) -> int:
        return sum(volume(p.box) for p in self.moved) * self.spec.itemsize


@dataclass(frozen=True)
class PlanStats:
    """Numbers that describe a plan. All byte counts are exact, but for the device
    executor ``peak_extra_bytes`` is an upper bound (see below).

    Attributes:
      array_bytes: logical bytes of all arrays (each element once).
      bytes_total: bytes of all destination shards (replicas counted each time).
      bytes_moved: bytes copied between different locations.
      bytes_kept: destination bytes already at their location (no transfer).
      bytes_lower_bound: independently computed minimum of ``bytes_moved``.
      transfers: number of moved pieces (after merging adjacent ones).
      send_bytes / recv_bytes: per device id, bytes sent / received.
      peak_extra_bytes: per device id, bytes of new destination buffers the executor
        allocates there while the sources are still alive, reused shards excluded:
        those are handed over when donating an array that keeps
        ``HANDOVER_BYTES`` or more in device memory, or with ``may_alias=True``;
        otherwise ``execute`` copies them on their device.
        For the device executor it also counts the pieces cut out on each sender and
        staged on each receiver before the destination shards are built from them,
        and the copies in device memory of shards read from or built for a host
        memory kind (``_execute.device_peak_extra``), as if all lived at once. The collective executor's staging is not
        counted: host-packed, bounded buffers in host memory per stage;
        device-packed, per group of arrays a placeholder source block on each union
        device holding none (at most ``_collective_device.GROUP_BYTES``) and the
        program's own buffers.
    """

    array_bytes: int
    bytes_total: int
    bytes_moved: int
    bytes_kept: int
    bytes_lower_bound: int
    transfers: int
    send_bytes: dict[int, int] = field(repr=False)
    recv_bytes: dict[int, int] = field(repr=False)
    peak_extra_bytes: dict[int, int] = field(repr=False)

    @property
    def max_send_bytes(self) -> int:
        """The most bytes any one device sends (0 where nothing moves)."""
        return max(self.send_bytes.values(), default=0)

    @property
    def mean_send_bytes(self) -> float:
        """The bytes a device sends, on average over the devices that send any."""
        senders = [b for b in self.send_bytes.values() if b]
        return sum(senders) / len(senders) if senders else 0.0

    @property
    def max_peak_extra_bytes(self) -> int:
        """The largest planned peak of extra bytes on any one device."""
        return max(self.peak_extra_bytes.values(), default=0)

    def as_dict(self) -> dict[str, object]:
        """The statistics as a JSON-ready dict (per-device maps keyed by the id as text)."""
        return {
            "array_bytes": self.array_bytes,
            "bytes_total": self.bytes_total,
            "bytes_moved": self.bytes_moved,
            "bytes_kept": self.bytes_kept,
            "bytes_lower_bound": self.bytes_lower_bound,
            "transfers": self.transfers,
            "max_send_bytes": self.max_send_bytes,
            "mean_send_bytes": self.mean_send_bytes,
            "max_peak_extra_bytes": self.max_peak_extra_bytes,
            "send_bytes": {str(k): v for k, v in sorted(self.send_bytes.items())},
            "recv_bytes": {str(k): v for k, v in sorted(self.recv_bytes.items())},
            "peak_extra_bytes": {str(k): v for k, v in sorted(self.peak_extra_bytes.items())},
        }


class _BoxIndex:
    """Finds the distinct source boxes that overlap a query box.

    Per dimension it keeps the sorted distinct intervals; a query takes, per dimension,
    the intervals that overlap it and looks up their products. For grid shardings (all
    of JAX's) the candidates are exactly the overlapping boxes, so a query costs the
    size of its answer, not the number of shards.
    """

    def __init__(self, boxes: Sequence[Box]) -> None:
        self.boxes = list(boxes)
        self.position = {b: i for i, b in enumerate(self.boxes)}
        rank = len(self.boxes[0]) if self.boxes else 0
        self.intervals = [sorted({b[d] for b in self.boxes}) for d in range(rank)]
        self.stops = [[iv[1] for iv in ivs] for ivs in self.intervals]
        # Intervals are sorted by start; sorting by stop too holds for grids. When it
        # doesn't (irregular tilings), fall back to scanning.
        self.grid = all(s == sorted(s) for s in self.stops)

    def overlapping(self, query: Box) -> list[int]:
        per_dim: list[list[tuple[int, int]]] = []
        for d, (q0, q1) in enumerate(query):
            ivs = self.intervals[d]
            if self.grid:
                lo = bisect.bisect_right(self.stops[d], q0)
                cand = []
                for iv in ivs[lo:]:
                    if iv[0] >= q1:
                        break
                    cand.append(iv)
            else:
                cand = [iv for iv in ivs if iv[0] < q1 and q0 < iv[1]]
            per_dim.append(cand)
        out: list[int] = []
        combos: list[tuple[tuple[int, int], ...]] = [()]
        for cand in per_dim:
            combos = [c + (iv,) for c in combos for iv in cand]
        for c in combos:
            i = self.position.get(c)
            if i is not None:
                out.append(i)
        return out


def _check_tiling(spec: LeafSpec, side: str, shards: Sequence[ShardSpec]) -> list[Box]:
    distinct = sorted({s.box for s in shards})
    total = math.prod(spec.shape)
    covered = sum(volume(b) for b in distinct)
    if covered != total:
        raise ValueError(
            f"{spec.name}: the {side} shards do not tile the array of shape {spec.shape} "
            f"exactly ({covered} elements in distinct shards, {total} in the array); "
            "shardings with overlapping or missing shards are not supported"
        )
    return distinct


def lower_bound_bytes(spec: LeafSpec) -> int:
    """Bytes that any plan must move: per destination shard, what is not at its location.

    Computed directly from the shard lists, independently of the planner's pieces.
    """
    at = {s.location: s.box for s in spec.src}
    missing = 0
    for d in spec.dst:
        have = at.get(d.location)
        overlap = intersect(d.box, have) if have is not None else None
        missing += volume(d.box) - (volume(overlap) if overlap is not None else 0)
    return missing * spec.itemsize


def plan_leaves(
    leaves: Sequence[LeafSpec],
    *,
    avoid_devices: Iterable[int] = (),
) -> tuple[tuple[LeafPlan, ...], PlanStats]:
    """Plans a group of arrays together (replica choice balances load across all).

    Args:
      leaves: the arrays to plan.
      avoid_devices: device ids whose source shards must not be read (lost devices).

    Returns:
      The per-leaf plans and the group's statistics.

    Raises:
      DataLossError: some box of some leaf has no copy outside ``avoid_devices``
        (raised before anything could move).
      ValueError: a sharding's shards do not tile its array.
    """
    avoid = frozenset(avoid_devices)
    # Requests: (-bytes, leaf index, dst shard index, region box, candidates' id), the
    # candidates (the src shards holding the region) being ``candidates[id]``: one id
    # per source box of a representative, so that a box with many replicas costs its
    # replicas once, not once per request (1M requests over 1,024 replicas each once
    # took 8 GB and minutes of tuple hashing).
    requests: list[tuple[int, int, int, Box, int]] = []
    candidates: list[tuple[int, ...]] = []
    kept: list[list[Piece]] = [[] for _ in leaves]
    reused: list[list[tuple[int, int]]] = [[] for _ in leaves]
    missing: list[tuple[str, Box]] = []

    # Arrays with the same geometry (every layer of a model, say) get one plan: the
    # representative's pieces are shared, so planning cost grows with the number of
    # distinct geometries, not of leaves. Not when the first has too few requests with
    # a choice of replicas to use them all: then each copy takes part in the balancing
    # on its own (sharing would send every copy from the replicas the first one chose),
    # reusing the representative's regions.
    first: dict[tuple[object, ...], int] = {}
    # (Looked up by the shard tuples' identities first: hashing them costs ~1 us per
    # shard, and a tree's leaves share a few such objects, ``shard_specs`` being
    # memoised. Equal tuples that are other objects still meet in ``first``.)
    by_id: dict[tuple[object, ...], int] = {}
    rep_of = []
    for li, ls in enumerate(leaves):
        quick = (ls.shape, ls.itemsize, id(ls.src), id(ls.dst))
        rep = by_id.get(quick)
        if rep is None:
            rep = by_id[quick] = first.setdefault((ls.shape, ls.itemsize, ls.src, ls.dst), li)
        rep_of.append(rep)
    lost_of: dict[int, list[Box]] = {}
    # Per representative, its requests (a slice of ``requests``) if any has a choice.
    choices: dict[int, tuple[int, int]] = {}
    own = [False] * len(leaves)  # a copy balanced on its own (pieces not shared)

    for li, spec in enumerate(leaves):
        if rep_of[li] != li:
            missing.extend((spec.name, b) for b in lost_of[rep_of[li]])
            span = choices.get(rep_of[li])
            if span is not None:
                own[li] = True
                requests.extend((n, li, di, b, c) for n, _, di, b, c in requests[slice(*span)])
            continue
        first_request = len(requests)
        distinct = _check_tiling(spec, "source", spec.src)
        _check_tiling(spec, "destination", spec.dst)
        holders: dict[Box, list[int]] = defaultdict(list)
        for si, s in enumerate(spec.src):
            if s.device not in avoid:
                holders[s.box].append(si)
        # (A box without elements, of a zero-size array, say, holds nothing to lose.)
        lost_of[li] = merge_boxes([b for b in distinct if b not in holders and volume(b)])
        if lost_of[li]:
            missing.extend((spec.name, b) for b in lost_of[li])
            continue
        index = _BoxIndex(distinct)
        cid_of: dict[Box, int] = {}
        for b, holding in holders.items():
            cid_of[b] = len(candidates)
            candidates.append(tuple(holding))
        at = {s.location: si for si, s in enumerate(spec.src) if s.device not in avoid}
        region_cache: dict[Box, list[tuple[Box, int]]] = {}
        for di, d in enumerate(spec.dst):
            local = at.get(d.location)
            regions = [d.box]
            if local is not None:
                sbox = spec.src[local].box
                if sbox == d.box:
                    reused[li].append((di, local))
                    continue
                overlap = intersect(d.box, sbox)
                if overlap is not None:
                    kept[li].append(Piece(overlap, local, di))
                    regions = subtract(d.box, overlap)
            for region in regions:
                parts = region_cache.get(region)
                if parts is None:
                    parts = []
                    for bi in index.overlapping(region):
                        b = index.boxes[bi]
                        ov = intersect(region, b)
                        if ov is not None:
                            parts.append((ov, cid_of[b]))
                    region_cache[region] = parts
                for ov, cid in parts:
                    requests.append((-volume(ov) * spec.itemsize, li, di, ov, cid))
        # Copies balance on their own only where the representative has fewer requests
        # with a choice than replicas to choose from, so that sharing its choice would
        # leave replicas idle: balancing every copy costs a greedy step per request
        # (100 replicated leaves on 4096 -> 3072 devices: 89 s to plan instead of 4).
        with_choice = [r[4] for r in requests[first_request:] if len(candidates[r[4]]) > 1]
        replicas = {c for cid in set(with_choice) for c in candidates[cid]}
        if with_choice and len(with_choice) < len(replicas):
            choices[li] = (first_request, len(requests))

    if missing:
        raise DataLossError(missing)

    # Greedy balanced choice among replicas: biggest requests first, each to the
    # candidate (same process as the destination if possible) with the least load.
    # Requests are generated in a deterministic order and the sort is stable.
    requests.sort(key=_neg_bytes)
    load: dict[int, int] = defaultdict(int)
    pools: dict[tuple[int, int, int], list[tuple[int, int, int]]] = {}
    procs: dict[tuple[int, int], dict[int, list[int]]] = {}
    chosen: dict[tuple[int, int, int], list[Box]] = defaultdict(list)
    for neg, li, di, box, cid in requests:
        spec = leaves[li]
        rep = rep_of[li]  # copies share candidate pools: same shards, same order
        dproc = spec.dst[di].process
        cands = candidates[cid]
        by_proc = procs.get((rep, cid))
        if by_proc is None:
            by_proc = procs[(rep, cid)] = defaultdict(list)
            for c in cands:
                by_proc[spec.src[c].process].append(c)
        pkey = (rep, cid, dproc if dproc in by_proc else -1)
        heap = pools.get(pkey)
        if heap is None:
            pool = by_proc.get(dproc, cands)
            heap = [(load[spec.src[c].device], spec.src[c].device, c) for c in pool]
            heapq.heapify(heap)
            pools[pkey] = heap
        # Loads only grow, so a stale heap entry is refreshed and pushed back until
        # the top is current: that top is the least-loaded candidate (ties: lowest id).
        while True:
            old, dev, best = heap[0]
            if old == load[dev]:
                break
            heapq.heapreplace(heap, (load[dev], dev, best))
        load[dev] -= neg
        heapq.heapreplace(heap, (load[dev], dev, best))
        chosen[(li, best, di)].append(box)

    moved: list[list[Piece]] = [[] for _ in leaves]
    for (li, si, di), boxes in sorted(chosen.items()):
        if len(boxes) == 1:
            moved[li].append(Piece(boxes[0], si, di))
        else:
            moved[li].extend(Piece(box, si, di) for box in merge_boxes(boxes))

    reps = {
        li: LeafPlan(spec, tuple(kept[li]), tuple(moved[li]), tuple(reused[li]))
        for li, spec in enumerate(leaves)
        if rep_of[li] == li
    }
    plans = tuple(
        reps[li]
        if rep_of[li] == li
        # (a constructor call: dataclasses.replace costs several times as much)
        else LeafPlan(
            spec,
            reps[rep_of[li]].kept,
            tuple(moved[li]) if own[li] else reps[rep_of[li]].moved,
            reps[rep_of[li]].reused,
        )
        for li, spec in enumerate(leaves)
    )
    # Copies balanced on their own have their own numbers.
    return plans, _stats(plans, [li if own[li] else r for li, r in enumerate(rep_of)])


def _neg_bytes(request: tuple[int, int, int, Box, int]) -> int:
    return request[0]


def _stats(plans: Sequence[LeafPlan], rep_of: Sequence[int]) -> PlanStats:
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    totals = [0] * 6  # array, total, moved, kept, lower bound, transfers
    # Leaves sharing a representative's pieces share its numbers too: each distinct
    # one is counted once, times its number of leaves (in order of first appearance,
    # which orders the devices of the dicts).
    for rep, count in Counter(rep_of).items():
        nums, s, r, p = _leaf_stats(plans[rep])
        for i, v in enumerate(nums):
            totals[i] += v * count
        for acc, part in ((send, s), (recv, r), (peak, p)):
            for dev, v in part.items():
                acc[dev] += v * count
    array_bytes, bytes_total, bytes_moved, bytes_kept, lower, transfers = totals
    return PlanStats(
        array_bytes=array_bytes,
        bytes_total=bytes_total,
        bytes_moved=bytes_moved,
        bytes_kept=bytes_kept,
        bytes_lower_bound=lower,
        transfers=transfers,
        send_bytes=dict(send),
        recv_bytes=dict(recv),
        peak_extra_bytes=dict(peak),
    )


def _leaf_stats(lp: LeafPlan) -> tuple[list[int], dict[int, int], dict[int, int], dict[int, int]]:
    spec = lp.spec
    isz = spec.itemsize
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    peak: dict[int, int] = defaultdict(int)
    total = kept = moved = 0
    reused_dst = {di for di, _ in lp.reused}
    for di, d in enumerate(spec.dst):
        nbytes = volume(d.box) * isz
        total += nbytes
        if di in reused_dst:
            kept += nbytes
        else:
            peak[d.device] += nbytes
    for p in lp.kept:
        kept += volume(p.box) * isz
    for p in lp.moved:
        nbytes = volume(p.box) * isz
        moved += nbytes
        send[spec.src[p.src].device] += nbytes
        recv[spec.dst[p.dst].device] += nbytes
    nums = [math.prod(spec.shape) * isz, total, moved, kept, lower_bound_bytes(spec), len(lp.moved)]
    return nums, send, recv, peak
