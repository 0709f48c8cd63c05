"""The collective executor: a plan run by one compiled SPMD program on every process.

Multi-controller JAX (one process per host) cannot ``jax.device_put`` an array to a
different device set; what it can do is run one program on many devices at once, every
process calling it with the same arguments. This executor turns a plan into such a
program, over the **union mesh**: a 1-D mesh (axis ``"r"``) of every device that holds
a source shard or will hold a destination shard, ordered by device id so every process
builds the same one. Pieces that change device travel in **rounds**, one
``lax.ppermute`` each: the pairs of devices that exchange data are edge-coloured (a
bipartite colouring), so in a round every device sends to at most one device and
receives from at most one, and the number of rounds is the largest number of partners
any device has. All pieces between the pair of a round travel packed in one buffer, so
the number of collectives does not grow with the number of arrays or pieces (each
``ppermute`` costs a fixed latency: ~1-5 ms over gloo on loopback).

Two ways of packing, chosen per plan:

* **host-packed** (every device a CPU): the source shards are read through zero-copy
  numpy views; each sender's pieces are copied once into a 64-byte-aligned byte
  buffer that XLA adopts without a copy; the program is nothing but ``ppermute``s of
  those buffers; receivers copy each piece once into fresh destination shards.
  Copies between devices of one process never touch the network. Buffers are capped
  at ``CHUNK_BYTES`` because gloo moves one huge buffer slower than a few medium ones.
* **device-packed** (accelerators; also runs on CPU): each array enters as a *block
  array* on the union mesh (device ``k``'s block is its source shard, a zero
  placeholder where it holds none), built with
  ``jax.make_array_from_single_device_arrays`` without copying. Inside ``shard_map``
  each device cuts its pieces with ``dynamic_slice`` at offsets it looks up in small
  tables indexed by ``lax.axis_index``, concatenates them per element type,
  ``ppermute``s, and writes what it receives into its output block with
  ``dynamic_update_slice``. Output blocks of the destination devices become the
  result.

The program and its schedule are cached in the plan, so a cached plan neither re-plans
nor recompiles. Plans are deterministic (``_planner``), hence so are the schedule and
the order of collectives, which is what lets every process run it in lock step.
Nothing here deletes a source buffer: donation happens in ``_execute`` after every
output exists, so a failure leaves the inputs intact.
"""

from __future__ import annotations

import functools
import math
import os
import threading
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from . import _compat
from ._buffers import host_empty
from ._geometry import Box, box_shape
from ._local_executor import in_compute_memory
from ._planner import LeafPlan

AXIS = "r"
# Over gloo one huge buffer is slower than a few medium ones (jax 0.10, loopback: 72
# MiB per device pair in one ppermute took ~1.8x as long as in four), so host-packed
# buffers are cut at this size. On the 288 MiB benchmark (2 processes x 4 CPU devices,
# A/B in one launch) ~3 MiB buffers took 1.27-1.47x the ppermute floor, ~6 MiB ones
# 1.52-1.88x; a guess, not verified: Linux's default socket send buffer tops out at 4 MiB.
CHUNK_BYTES = 3 * 2**20
# Host-packed transfers run as a pipeline of programs of at most this many bytes per
# device each, so packing, the network and unpacking overlap. A few chunks per program
# (not one) measured faster on the same benchmark: fewer dispatches, the same overlap.
STAGE_BYTES = 12 * 2**20
# ... but a plan is cut into at least this many programs where it has the chunks for
# it: in a single program packing, the network and unpacking would not overlap.
MIN_STAGES = 4
_ALIGN = 64  # byte offset alignment of pieces in a packed buffer
# Host-side copies (packing, unpacking, same-process pieces) run on a few threads.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None
_unpacker: ThreadPoolExecutor | None = None
_THREADED_COPY_BYTES = 1 << 20
# None: pack on the host when every device is a CPU. Tests set True/False to force one.
PACK_ON_HOST: bool | None = None


@dataclass(frozen=True)
class _Slot:
    """One piece-shaped place in a round: every position moves at most one piece in it.

    Attributes:
      leaf: which array the pieces belong to.
      shape: the shape of the pieces.
      send_start: per mesh position, where its piece starts in its source block.
      recv_start: per mesh position, where its received piece goes in its output block.
      recv_mask: per mesh position, whether it receives a piece in this slot; ``None``
        when every position whose output block is kept receives one (the others hold
        garbage, so nothing needs protecting).
    """

    leaf: int
    shape: tuple[int, ...]
    send_start: np.ndarray
    recv_start: np.ndarray
    recv_mask: np.ndarray | None


@dataclass(frozen=True)
class _Round:
    """Pieces that move at the same time, each sender to one receiver.

    Attributes:
      perm: ``(source position, destination position)`` pairs on the union mesh; empty
        for the round of copies that stay on their device.
      groups: per element type, the slots whose pieces travel packed in one buffer
        (one ``ppermute`` per group).
    """

    perm: tuple[tuple[int, int], ...]
    groups: tuple[tuple[np.dtype, tuple[_Slot, ...]], ...]


@dataclass(frozen=True)
class _LeafBlocks:
    """Block shapes of one array inside the program."""

    src_block: tuple[int, ...]
    dst_block: tuple[int, ...]
    scalar: bool  # rank-0 array, carried as shape (1,) inside the program


# One copy in union-mesh coordinates: (leaf, source position, destination position,
# piece shape, start in the source block, start in the destination block).
_Copy = tuple[int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def color_edges(edges: Sequence[tuple[int, int]]) -> list[int]:
    """Colours the edges of a bipartite multigraph so no two edges at a node share one.

    Senders and receivers are the two sides, so each colour is a valid ``ppermute``
    round. Uses the classic alternating-path recolouring (König's theorem): the number
    of colours equals the largest degree, the fewest rounds possible.

    Args:
      edges: ``(sender, receiver)`` pairs; repeated pairs are separate edges.

    Returns:
      The colour (round index) of each edge, in input order.
    """
    at_send: dict[tuple[int, int], int] = {}  # (sender, colour) -> edge index
    at_recv: dict[tuple[int, int], int] = {}  # (receiver, colour) -> edge index
    colour = [-1] * len(edges)

    def free(table: dict[tuple[int, int], int], node: int) -> int:
        c = 0
        while (node, c) in table:
            c += 1
        return c

    for e, (u, v) in enumerate(edges):
        a, b = free(at_send, u), free(at_recv, v)
        if (v, a) in at_recv:
            # `a` is taken at v. Walk the path from v along colours a, b, a, ... and swap
            # a <-> b on it; in a bipartite graph it never reaches u, so afterwards `a`
            # is free at both ends of e.
            path: list[int] = []
            node, on_recv_side, c = v, True, a
            while True:
                nxt = (at_recv if on_recv_side else at_send).get((node, c))
                if nxt is None:
                    break
                path.append(nxt)
                su, sv = edges[nxt]
                node, on_recv_side = (su, False) if on_recv_side else (sv, True)
                c = b if c == a else a
            for p in path:
                su, sv = edges[p]
                del at_send[(su, colour[p])]
                del at_recv[(sv, colour[p])]
            for p in path:
                su, sv = edges[p]
                colour[p] = b if colour[p] == a else a
                at_send[(su, colour[p])] = p
                at_recv[(sv, colour[p])] = p
        colour[e] = a
        at_send[(u, a)] = e
        at_recv[(v, a)] = e
    return colour


def _offset(inner: Box, outer: Box) -> tuple[int, ...]:
    return tuple(i0 - o0 for (i0, _), (o0, _) in zip(inner, outer, strict=True))


def _uniform_shape(lp: LeafPlan, side: str) -> tuple[int, ...]:
    shards = lp.spec.src if side == "source" else lp.spec.dst
    shapes = {box_shape(s.box) for s in shards}
    if len(shapes) != 1:
        raise ValueError(
            f"leaf {lp.spec.name}: the collective executor needs equally shaped {side} "
            f"shards, got shapes {sorted(shapes)}; use executor='host' or 'device' in one "
            "process, or a sharding with even shards"
        )
    return shapes.pop()


def _leaf_copies(
    li: int, lp: LeafPlan, position: dict[int, int], alias: bool
) -> tuple[_LeafBlocks, list[_Copy], set[int]]:
    """One array's copies, its block shapes, and the positions whose output is kept."""
    spec = lp.spec
    src_block, dst_block = _uniform_shape(lp, "source"), _uniform_shape(lp, "destination")
    copies: list[_Copy] = []
    for p in lp.kept + lp.moved:
        s, d = spec.src[p.src], spec.dst[p.dst]
        copies.append(
            (
                li,
                position[s.device],
                position[d.device],
                box_shape(p.box),
                _offset(p.box, s.box),
                _offset(p.box, d.box),
            )
        )
    if not alias:  # may_alias=False: unchanged shards are copied too
        for di, si in lp.reused:
            s, d = spec.src[si], spec.dst[di]
            zero = (0,) * len(spec.shape)
            copies.append(
                (li, position[s.device], position[d.device], box_shape(d.box), zero, zero)
            )
    reused_pos = {position[spec.dst[di].device] for di, _ in lp.reused} if alias else set()
    keep = {position[d.device] for d in spec.dst} - reused_pos
    scalar = len(spec.shape) == 0
    if scalar:
        src_block = dst_block = (1,)
        copies = [(li, s, d, (1,), (0,), (0,)) for li, s, d, _, _, _ in copies]
    return _LeafBlocks(src_block, dst_block, scalar), copies, keep


def _all_copies(
    leaf_plans: Sequence[LeafPlan], position: dict[int, int], alias: bool
) -> tuple[list[_LeafBlocks], list[set[int]], list[_Copy]]:
    """Block shapes, kept output positions and copies of every array of the plan."""
    blocks: list[_LeafBlocks] = []
    keep: list[set[int]] = []
    copies: list[_Copy] = []
    for li, lp in enumerate(leaf_plans):
        b, cs, k = _leaf_copies(li, lp, position, alias)
        blocks.append(b)
        keep.append(k)
        copies.extend(cs)
    return blocks, keep, copies


def _rounds_of(pairs: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], ...]]:
    """Groups device pairs into permutations (rounds), fewest possible."""
    pairs = sorted(pairs)
    colour = color_edges(pairs)
    return [
        tuple(pr for pr, col in zip(pairs, colour, strict=True) if col == c)
        for c in sorted(set(colour))
    ]


# ----------------------------------------------------------------------------------
# Host-packed path
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Chunk:
    """One byte buffer moved by one ``ppermute`` in the host-packed path.

    Attributes:
      perm: ``(source position, destination position)`` pairs that exchange it.
      nbytes: bytes per device (the most any of its senders packs).
      sends: per sending position, ``(copy, byte offset)`` of each piece it packs.
    """

    perm: tuple[tuple[int, int], ...]
    nbytes: int
    sends: dict[int, tuple[tuple[_Copy, int], ...]]


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _split_rows(c: _Copy, itemsize: int, limit: int) -> list[_Copy]:
    """Splits a copy along its first dimension into parts of at most ``limit`` bytes."""
    li, s, d, shape, s0, d0 = c
    nbytes = math.prod(shape) * itemsize
    if nbytes <= limit or not shape or shape[0] == 1:
        return [c]
    step = max(1, limit // (nbytes // shape[0]))
    return [
        (
            li,
            s,
            d,
            (min(step, shape[0] - r), *shape[1:]),
            (s0[0] + r, *s0[1:]),
            (d0[0] + r, *d0[1:]),
        )
        for r in range(0, shape[0], step)
    ]


def _host_chunks(
    remote: dict[tuple[int, int], list[_Copy]], itemsizes: Sequence[int], limit: int
) -> list[_Chunk]:
    """Packs the cross-process copies of each round into byte buffers of about equal size.

    Each pair of a round fills its own sequence of buffers of at most about ``limit``
    bytes (split evenly, pieces cut along their first dimension where needed); buffer
    ``b`` of the round is one ``ppermute`` among the pairs that have a ``b``-th
    buffer, as large as the largest of them.
    """
    chunks: list[_Chunk] = []
    for members in _rounds_of(list(remote)):
        packed: dict[tuple[int, int], list[tuple[list[tuple[_Copy, int]], int]]] = {}
        for pr in members:
            total = sum(math.prod(c[3]) * itemsizes[c[0]] for c in remote[pr])
            target = _round_up(-(-total // max(1, -(-total // limit))), _ALIGN)
            bufs: list[tuple[list[tuple[_Copy, int]], int]] = [([], 0)]
            for cp in remote[pr]:
                for part in _split_rows(cp, itemsizes[cp[0]], target):
                    n = math.prod(part[3]) * itemsizes[part[0]]
                    items, used = bufs[-1]
                    off = _round_up(used, _ALIGN)
                    if used and off + n > target:
                        bufs.append(([], 0))
                        items, off = bufs[-1][0], 0
                    items.append((part, off))
                    bufs[-1] = (items, off + n)
            packed[pr] = bufs
        for b in range(max(len(v) for v in packed.values())):
            have = [pr for pr in members if b < len(packed[pr])]
            chunks.append(
                _Chunk(
                    tuple(have),
                    max(1, max(packed[pr][b][1] for pr in have)),
                    {pr[0]: tuple(packed[pr][b][0]) for pr in have},
                )
            )
    return chunks


def _stages(chunks: Sequence[_Chunk], limit: int) -> list[list[int]]:
    """Groups consecutive chunks into stages of at most ``limit`` bytes per device.

    Each stage is its own compiled program, so while one stage is on the wire the
    sender already packs the next and the receiver unpacks the previous one. Stages
    are made smaller where needed to have at least ``MIN_STAGES`` of them.
    """
    limit = min(limit, max(1, sum(ch.nbytes for ch in chunks) // MIN_STAGES))
    stages: list[list[int]] = []
    used = 0
    for ci, ch in enumerate(chunks):
        if not stages or used + ch.nbytes > limit:
            stages.append([])
            used = 0
        stages[-1].append(ci)
        used += ch.nbytes
    return stages


def _slices(start: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))


def _run_host_packed(
    program: CollectiveProgram, sources: Sequence[jax.Array], shardings: Sequence[Any]
) -> list[jax.Array]:
    """Host-packed execution: numpy packs, ``ppermute``s move, numpy unpacks."""
    position, devices = program.position, program.devices
    bufs = [_compat.device_buffers(s) for s in sources]
    views: dict[tuple[int, int], np.ndarray] = {}
    me = jax.process_index()

    # Zero-copy views of this process's source shards, made up front: the copy
    # threads below only read them.
    for li, b in enumerate(bufs):
        for dev_id, a in b.items():
            if dev_id in position:
                v = np.asarray(a).reshape(program.leaves[li].src_block)
                views[(li, position[dev_id])] = v

    def source_view(li: int, pos: int) -> np.ndarray:
        return views[(li, pos)]

    # Destination shards this process builds (not handed over), written once each.
    outs: dict[tuple[int, int], np.ndarray] = {}
    for li, sharding in enumerate(shardings):
        for d in _compat.ordered_devices(sharding):
            pos = position[d.id]
            if d.process_index == me and pos not in program.reused[li]:
                # From the pool of warm blocks: fresh memory costs a page fault per
                # 4 KiB, about as much as the copy into it.
                outs[(li, pos)] = host_empty(program.leaves[li].dst_block, program.dtypes[li])

    def fill(buf: np.ndarray, items: Sequence[tuple[_Copy, int]]) -> None:
        for (li, s, _, shape, s0, _), off in items:
            src = source_view(li, s)
            n = math.prod(shape) * src.itemsize
            buf[off : off + n].view(src.dtype).reshape(shape)[...] = src[_slices(s0, shape)]

    def pack(ci: int) -> jax.Array:
        ch = program.chunks[ci]
        data = []
        tasks: list[tuple[int, Callable[[], None]]] = []
        for d in program.local_devices:
            items = ch.sends.get(position[d.id], ())
            # Send buffers are kept between runs: fresh memory costs a page fault per
            # 4 KiB on first touch, about as much as the copy itself.
            buf = program.send_buffers.get((ci, d.id)) if items else None
            if buf is None:
                buf = _compat.aligned_empty((ch.nbytes,), np.dtype(np.uint8))
                if items:
                    program.send_buffers[(ci, d.id)] = buf
            tasks.append((ch.nbytes, functools.partial(fill, buf, items)))
            data.append(buf)
        _run_all(tasks)
        return _compat.assemble(
            (len(devices) * ch.nbytes,),
            np.dtype(np.uint8),
            program.block_sharding,
            data,
            program.local_devices,
        )

    def take(raw: np.ndarray, out: np.ndarray, items: Sequence[tuple[int, _Copy]]) -> None:
        for off, (_, _, _, shape, _, d0) in items:
            n = math.prod(shape) * out.itemsize
            out[_slices(d0, shape)] = raw[off : off + n].view(out.dtype).reshape(shape)

    def unpack(ci: int, received: jax.Array) -> None:
        raw_of = _compat.device_buffers(received)
        raws: dict[int, np.ndarray] = {}
        per_shard: dict[tuple[int, int], list[tuple[int, _Copy]]] = defaultdict(list)
        for li, pos, off, cp in program.unpack[ci]:
            if pos not in raws:  # zero-copy view; waits for the transfer
                raws[pos] = np.asarray(raw_of[devices[pos].id])
            per_shard[(li, pos)].append((off, cp))
        # One task per destination shard: no two tasks write the same memory.
        _run_all(
            [
                (
                    outs[(li, pos)].nbytes,
                    functools.partial(take, raws[pos], outs[(li, pos)], items),
                )
                for (li, pos), items in per_shard.items()
            ]
        )

    if program.local_devices and program.stages:
        # Runs of one program share its send buffers: one at a time.
        with program.lock:
            # A pipeline: this thread packs stage s + 1 while stage s is on the wire
            # (XLA usually runs it asynchronously), and a helper thread unpacks each
            # stage as soon as it arrives.
            every: list[Any] = []
            unpacked = []
            for s, stage in enumerate(program.stages):
                every.append(program.compiled(s)(*[pack(ci) for ci in stage]))
                for ci, r in zip(stage, every[-1], strict=True):
                    unpacked.append(_unpack_pool().submit(unpack, ci, r))
            for f in unpacked:
                f.result()
            # Send buffers are reused by the next run: every transfer must be over (a
            # process that only sends does not otherwise wait for them).
            jax.block_until_ready(every)

    def copy_local(out: np.ndarray, copies: Sequence[_Copy]) -> None:
        for li, s, _, shape, s0, d0 in copies:
            out[_slices(d0, shape)] = source_view(li, s)[_slices(s0, shape)]

    # Copies within this process need no network.
    _run_all(
        [
            (out.nbytes, functools.partial(copy_local, out, program.local_copies[li][pos]))
            for (li, pos), out in outs.items()
            if pos in program.local_copies[li]
        ]
    )

    arrays = []
    for li, sharding in enumerate(shardings):
        shard_shape = box_shape(program.leaf_plans[li].spec.dst[0].box)
        parts: list[Any] = []
        devs = []
        for d in _compat.ordered_devices(sharding):
            if d.process_index != me:
                continue
            pos = position[d.id]
            src_pos = program.reused[li].get(pos)
            if src_pos is not None:
                parts.append(bufs[li][devices[src_pos].id])
            else:
                parts.append(outs[(li, pos)].reshape(shard_shape))
            devs.append(d)
        arrays.append(_finish(program.leaf_plans[li], program.dtypes[li], sharding, parts, devs))
    return arrays


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="reshard-collective-copy")
    return _pool


def _unpack_pool() -> ThreadPoolExecutor:
    global _unpacker
    if _unpacker is None:
        _unpacker = ThreadPoolExecutor(1, thread_name_prefix="reshard-collective-unpack")
    return _unpacker


def _run_all(tasks: Sequence[tuple[int, Callable[[], None]]]) -> None:
    """Runs ``(bytes, copy task)``s: large ones on a few threads (numpy releases the GIL
    while copying, and first-touch page faults of fresh memory then happen in parallel
    too), small ones right here (a thread hand-off costs more than they do)."""
    big = [t for n, t in tasks if n >= _THREADED_COPY_BYTES]
    pending = [_copy_pool().submit(t) for t in big] if len(big) > 1 and COPY_THREADS > 1 else []
    if not pending:
        for t in big:
            t()
    for n, t in tasks:
        if n < _THREADED_COPY_BYTES:
            t()
    for f in pending:
        f.result()


def _finish(
    lp: LeafPlan, dtype: np.dtype, sharding: Any, parts: list[Any], devs: list[Any]
) -> jax.Array:
    """Puts this process's destination shards (numpy or on-device) together."""
    shape = tuple(lp.spec.shape)
    if parts and not any(isinstance(p, jax.Array) for p in parts):
        return _compat.assemble(shape, dtype, sharding, parts, devs)  # zero-copy on CPU
    parts = _compat.place_host_buffers(parts, devs, sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(shape, sharding, parts, dtype=dtype)


# ----------------------------------------------------------------------------------
# Device-packed path
# ----------------------------------------------------------------------------------


def _slots(copies: Sequence[_Copy], keep: Sequence[set[int]], n: int) -> list[_Slot]:
    """Lays out the copies of one round as slots.

    Within a round each position sends to at most one other, so the copies of one
    sender all go to one receiver. Copies of the same array and shape from different
    senders share a slot; a sender's k-th copy of that kind goes to the k-th slot of
    that kind. For the regular patterns of real shardings every sender fills the same
    slots, so nothing is padded.
    """
    per_sender: dict[tuple[int, tuple[int, ...], int], list[_Copy]] = defaultdict(list)
    for c in copies:
        per_sender[(c[0], c[3], c[1])].append(c)
    depth: dict[tuple[int, tuple[int, ...]], int] = defaultdict(int)
    for (li, shape, _), cs in per_sender.items():
        depth[(li, shape)] = max(depth[(li, shape)], len(cs))
    slots = []
    for li, shape in sorted(depth):
        rank = len(shape)
        senders = [cs for (lj, sh, _), cs in sorted(per_sender.items()) if (lj, sh) == (li, shape)]
        for k in range(depth[(li, shape)]):
            send = np.zeros((n, rank), np.int32)
            recv = np.zeros((n, rank), np.int32)
            mask = np.zeros((n,), bool)
            for cs in senders:
                if k < len(cs):
                    _, s, d, _, s0, d0 = cs[k]
                    send[s], recv[d], mask[d] = s0, d0, True
            needs_mask = any(not mask[p] for p in keep[li])
            slots.append(_Slot(li, shape, send, recv, mask if needs_mask else None))
    return slots


def _device_rounds(
    copies: Sequence[_Copy], keep: Sequence[set[int]], dtypes: Sequence[np.dtype], n: int
) -> list[_Round]:
    """The device-packed schedule: per round and element type, one packed ``ppermute``.

    Copies that stay on their device need no collective and form one local round.
    """
    remote: dict[tuple[int, int], list[_Copy]] = defaultdict(list)
    local: list[_Copy] = []
    for c in copies:
        if c[1] == c[2]:
            local.append(c)
        else:
            remote[(c[1], c[2])].append(c)

    def grouped(cs: Sequence[_Copy]) -> tuple[tuple[np.dtype, tuple[_Slot, ...]], ...]:
        by_type: dict[str, list[_Slot]] = defaultdict(list)
        for slot in _slots(cs, keep, n):
            by_type[str(_wire_dtype(dtypes[slot.leaf]))].append(slot)
        return tuple(
            (_wire_dtype(dtypes[ss[0].leaf]), tuple(ss)) for _, ss in sorted(by_type.items())
        )

    rounds = [
        _Round(members, grouped([x for pr in members for x in remote[pr]]))
        for members in _rounds_of(list(remote))
    ]
    if local:
        rounds.append(_Round((), grouped(local)))
    return rounds


def _wire_dtype(dtype: np.dtype) -> np.dtype:
    """What pieces of ``dtype`` travel as: floats as unsigned integers of their width.

    Bits are bits to a copy; gloo moves ``bfloat16`` far slower than integers (seen on
    jax 0.10, CPU), and floats of one width then share a buffer.
    """
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize in (2, 4, 8):
        return np.dtype({2: np.uint16, 4: np.uint32, 8: np.uint64}[dtype.itemsize])
    return dtype


def _cut(x: jax.Array, slot: _Slot, block: tuple[int, ...], me: jax.Array) -> jax.Array:
    """This position's piece of ``slot``, out of its source block ``x``."""
    if slot.shape == block:
        return x  # the whole block: no slicing
    start = jnp.asarray(slot.send_start)[me]
    return lax.dynamic_slice(x, tuple(start[k] for k in range(len(slot.shape))), slot.shape)


def _put(
    out: jax.Array | None, piece: jax.Array, slot: _Slot, block: tuple[int, ...], me: jax.Array
) -> jax.Array:
    """Writes this position's received ``piece`` of ``slot`` into its output block."""
    if out is None and slot.shape == block and slot.recv_mask is None:
        return piece  # fills the whole block wherever it matters: no zero-fill, no copy
    if out is None:
        out = jnp.zeros(block, piece.dtype)
    rstart = jnp.asarray(slot.recv_start)[me]
    starts = tuple(rstart[k] for k in range(len(slot.shape)))
    if slot.recv_mask is not None:
        # A position that receives nothing in this slot must not overwrite its output:
        # it writes back what is already there (costs the piece, not the block).
        current = lax.dynamic_slice(out, starts, slot.shape)
        piece = jnp.where(jnp.asarray(slot.recv_mask)[me], piece, current)
    return lax.dynamic_update_slice(out, piece, starts)


def _body(
    blocks: Sequence[_LeafBlocks], rounds: Sequence[_Round], inputs: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
    """What every device runs: all rounds, then its output blocks."""
    me = lax.axis_index(AXIS)
    outs: list[jax.Array | None] = [None] * len(blocks)
    for rd in rounds:
        for wire, slots in rd.groups:
            pieces = [_cut(inputs[s.leaf], s, blocks[s.leaf].src_block, me) for s in slots]
            if rd.perm:
                pieces = [lax.bitcast_convert_type(p, wire) for p in pieces]
            if rd.perm and len(pieces) == 1:
                pieces = [lax.ppermute(pieces[0], AXIS, list(rd.perm))]
            elif rd.perm:
                # One buffer per round and element type: one collective, not one per piece.
                flat = jnp.concatenate([p.reshape(-1) for p in pieces])
                flat = lax.ppermute(flat, AXIS, list(rd.perm))
                bounds = np.cumsum([math.prod(s.shape) for s in slots])[:-1].tolist()
                pieces = [
                    part.reshape(s.shape)
                    for part, s in zip(jnp.split(flat, bounds), slots, strict=True)
                ]
            if rd.perm:
                pieces = [
                    lax.bitcast_convert_type(p, inputs[s.leaf].dtype)
                    for p, s in zip(pieces, slots, strict=True)
                ]
            for s, piece in zip(slots, pieces, strict=True):
                outs[s.leaf] = _put(outs[s.leaf], piece, s, blocks[s.leaf].dst_block, me)
    return tuple(
        o if o is not None else jnp.zeros(b.dst_block, x.dtype)  # every shard reused
        for o, b, x in zip(outs, blocks, inputs, strict=True)
    )


# ----------------------------------------------------------------------------------
# The program
# ----------------------------------------------------------------------------------


class CollectiveProgram:
    """A plan compiled into one SPMD program over the union mesh. Cached per plan.

    Args:
      leaf_plans: the planner's leaf plans (key arrays already as their key data).
      dtypes: the element type of each planned array (``uint32`` for key data).
      alias: whether destination shards identical to a source shard at the same
        location are handed over (``may_alias``) instead of copied.
      pack_on_host: host-packed (True) or device-packed (False); ``None`` picks
        host-packed when every device is a CPU.
    """

    def __init__(
        self,
        leaf_plans: Sequence[LeafPlan],
        dtypes: Sequence[Any],
        *,
        alias: bool,
        pack_on_host: bool | None = None,
    ) -> None:
        ids = sorted(
            {s.device for lp in leaf_plans for s in lp.spec.src}
            | {s.device for lp in leaf_plans for s in lp.spec.dst}
        )
        by_id = {d.id: d for d in jax.devices()}
        unknown = [i for i in ids if i not in by_id]
        if unknown:
            raise ValueError(
                f"the plan uses device ids {unknown}, which are not among jax.devices(); "
                "plan and execute with the same JAX runtime"
            )
        self.devices = [by_id[i] for i in ids]
        self.position = {d: k for k, d in enumerate(ids)}
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.block_sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
        me = jax.process_index()
        self.local_devices = [d for d in self.devices if d.process_index == me]
        self.leaf_plans = list(leaf_plans)
        self.dtypes = [np.dtype(d) for d in dtypes]
        self.alias = alias
        self.leaves, keep, copies = _all_copies(self.leaf_plans, self.position, alias)
        # Destination position -> source position whose buffer is handed over as it is.
        self.reused: list[dict[int, int]] = [
            {
                self.position[lp.spec.dst[di].device]: self.position[lp.spec.src[si].device]
                for di, si in lp.reused
            }
            if alias
            else {}
            for lp in self.leaf_plans
        ]
        if pack_on_host is None:
            pack_on_host = all(d.platform == "cpu" for d in self.devices)
        self.host_packed = pack_on_host
        n = len(ids)
        self.schedule: list[_Round] = []
        self.in_shapes: list[tuple[int, ...]] = []
        self.chunks: list[_Chunk] = []
        self.local_copies: list[dict[int, list[_Copy]]] = [{} for _ in leaf_plans]
        self.unpack: list[list[tuple[int, int, int, _Copy]]] = []
        self.stages: list[list[int]] = []
        if pack_on_host:
            process = [d.process_index for d in self.devices]
            remote: dict[tuple[int, int], list[_Copy]] = defaultdict(list)
            for c in copies:
                if process[c[1]] != process[c[2]]:
                    remote[(c[1], c[2])].append(c)
                else:  # same device or same process: numpy copies, no network
                    self.local_copies[c[0]].setdefault(c[2], []).append(c)
            self.chunks = _host_chunks(remote, [dt.itemsize for dt in self.dtypes], CHUNK_BYTES)
            # Per chunk, what each receiving position of this process takes out of it.
            self.unpack = [
                [
                    (cp[0], cp[2], off, cp)
                    for items in ch.sends.values()
                    for cp, off in items
                    if process[cp[2]] == me
                ]
                for ch in self.chunks
            ]
            self.stages = _stages(self.chunks, STAGE_BYTES)
            self.in_shapes = [(n * ch.nbytes,) for ch in self.chunks]
            self.in_dtypes = [np.dtype(np.uint8)] * len(self.chunks)
        else:
            # Sub-byte integers (int4) travel widened to 8 bits: XLA packs them two per
            # byte inside programs but not in buffers made from host data, and an
            # executable refuses arguments whose layout differs from its own.
            self.in_dtypes = [_carrier(dt) for dt in self.dtypes]
            self.schedule = _device_rounds(copies, keep, self.in_dtypes, n)
            self.in_shapes = [(n * lf.src_block[0], *lf.src_block[1:]) for lf in self.leaves]
        self._compiled: dict[int, Any] = {}
        self.send_buffers: dict[tuple[int, int], np.ndarray] = {}  # (chunk, device id)
        self.lock = threading.Lock()
        self._placeholder_fns: dict[tuple[int, tuple[int, ...]], Any] = {}

    @property
    def collectives(self) -> int:
        """Number of ``ppermute``s in the program."""
        if self.host_packed:
            return len(self.chunks)
        return sum(len(rd.groups) for rd in self.schedule if rd.perm)

    def compiled(self, stage: int = 0) -> Any:
        """The compiled program (of one stage, host-packed), built once, then reused."""
        fn = self._compiled.get(stage)
        if fn is not None:
            return fn
        if self.host_packed:
            chunks = [self.chunks[ci] for ci in self.stages[stage]]
            shapes = [self.in_shapes[ci] for ci in self.stages[stage]]
            dtypes = [self.in_dtypes[ci] for ci in self.stages[stage]]

            def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
                # Nothing but the network: packing and unpacking happen on the host.
                return tuple(
                    lax.ppermute(x, AXIS, list(ch.perm))
                    for x, ch in zip(inputs, chunks, strict=True)
                )

            out_count = len(chunks)
        else:
            blocks, rounds = self.leaves, self.schedule
            shapes, dtypes = self.in_shapes, self.in_dtypes

            def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
                return _body(blocks, rounds, inputs)

            out_count = len(blocks)
        program = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=tuple(PartitionSpec(AXIS) for _ in shapes),
                out_specs=tuple(PartitionSpec(AXIS) for _ in range(out_count)),
                check_vma=False,
            )
        )
        avals = [
            jax.ShapeDtypeStruct(s, d, sharding=self.block_sharding)
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        fn = self._compiled[stage] = program.lower(*avals).compile()
        return fn

    def placeholders(self, device: Any, leaves: Sequence[int]) -> list[jax.Array]:
        """Zero source blocks for ``leaves`` on ``device`` (one dispatch per device)."""
        cache_key = (device.id, tuple(leaves))
        fn = self._placeholder_fns.get(cache_key)
        if fn is None:
            shapes = [(self.leaves[i].src_block, self.in_dtypes[i]) for i in leaves]
            fn = jax.jit(
                lambda: tuple(jnp.zeros(s, d) for s, d in shapes),
                out_shardings=tuple(SingleDeviceSharding(device) for _ in shapes),
            )
            self._placeholder_fns[cache_key] = fn
        return list(fn())


def _carrier(dtype: np.dtype) -> np.dtype:
    """The element type a device-packed program holds ``dtype`` in (int4 -> int8)."""
    if jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8:
        return np.dtype(np.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else np.uint8)
    return dtype


def _block_inputs(program: CollectiveProgram, sources: Sequence[jax.Array]) -> list[jax.Array]:
    """Per array, the block array on the union mesh, from this process's source shards."""
    per_leaf: list[dict[int, jax.Array]] = []
    missing: dict[int, list[int]] = defaultdict(list)  # device id -> leaves lacking a block
    for li, src in enumerate(sources):
        bufs = _compat.device_buffers(src)
        blocks: dict[int, jax.Array] = {}
        for d in program.local_devices:
            b = bufs.get(d.id)
            if b is None:
                missing[d.id].append(li)
                continue
            b = in_compute_memory(b, d)
            if program.leaves[li].scalar:
                b = b.reshape((1,))
            if b.dtype != program.in_dtypes[li]:
                b = b.astype(program.in_dtypes[li])
            blocks[d.id] = b
        per_leaf.append(blocks)
    for d in program.local_devices:
        if missing[d.id]:
            for li, ph in zip(missing[d.id], program.placeholders(d, missing[d.id]), strict=True):
                per_leaf[li][d.id] = ph
    return [
        jax.make_array_from_single_device_arrays(
            program.in_shapes[li],
            program.block_sharding,
            [blocks[d.id] for d in program.local_devices],
            dtype=program.in_dtypes[li],
        )
        for li, blocks in enumerate(per_leaf)
    ]


def run_collective(
    plan: Any,
    sources: Sequence[jax.Array],
    shardings: Sequence[jax.sharding.Sharding],
    *,
    donate: bool,
    may_alias: bool | None,
) -> list[jax.Array]:
    """Executes ``plan`` with one compiled collective program; every process calls it.

    Multi-controller contract: every process calls this with the same plan (built from
    the same avals and shardings), passing its own addressable shards of the same
    arrays, in the same order of calls -- as for any JAX computation across processes.

    Args:
      plan: a ``Plan`` (its leaf plans are run; the program is cached in it).
      sources: the source arrays (PRNG-key arrays already converted to key data).
      shardings: per array, the destination sharding (of the key data for key arrays).
      donate: unused here: donation is the caller's last step, after every output exists.
      may_alias: ``False`` copies destination shards that equal a source shard at the
        same location; otherwise those buffers are handed over unchanged.

    Returns:
      One array per source, committed to its destination sharding.
    """
    del donate  # never delete here: a failure must leave every input intact
    alias = may_alias is not False
    key = f"collective_program(alias={alias}, pack_on_host={PACK_ON_HOST})"
    program: CollectiveProgram | None = plan._cache.get(key)
    if program is None:
        program = CollectiveProgram(
            plan.leaf_plans, [s.dtype for s in sources], alias=alias, pack_on_host=PACK_ON_HOST
        )
        plan._cache[key] = program
    if program.host_packed:
        return _run_host_packed(program, sources, shardings)
    if program.local_devices:
        outputs = program.compiled()(*_block_inputs(program, sources))
    else:
        # This process holds no device of the union: nothing to send, nothing to keep.
        outputs = [None] * len(sources)
    return [
        _assemble(program, li, src, out, sharding)
        for li, (src, out, sharding) in enumerate(zip(sources, outputs, shardings, strict=True))
    ]


def _assemble(
    program: CollectiveProgram,
    li: int,
    src: jax.Array,
    out: jax.Array | None,
    sharding: jax.sharding.Sharding,
) -> jax.Array:
    """The destination array of leaf ``li`` from its output blocks (and reused shards)."""
    reused = program.reused[li]
    src_bufs = _compat.device_buffers(src) if reused else {}
    out_bufs = _compat.device_buffers(out) if out is not None else {}
    parts: list[jax.Array] = []
    devs = []
    me = jax.process_index()
    mk = sharding.memory_kind
    for d in _compat.ordered_devices(sharding):
        if d.process_index != me:
            continue
        pos = program.position[d.id]
        if pos in reused:
            parts.append(src_bufs[program.devices[reused[pos]].id])
        else:
            block = out_bufs[d.id]
            if program.leaves[li].scalar:
                block = block.reshape(())
            if block.dtype != program.dtypes[li]:
                block = block.astype(program.dtypes[li])
            if mk is not None and block.sharding.memory_kind != mk:
                block = jax.device_put(block, SingleDeviceSharding(d, memory_kind=mk))
            parts.append(block)
        devs.append(d)
    return _finish(program.leaf_plans[li], program.dtypes[li], sharding, parts, devs)
