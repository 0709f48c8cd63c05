"""Host-packed collective transfers: numpy packs, ``ppermute``s move, numpy unpacks.

Used when every device of the union mesh is a CPU, where a device's memory is this
process's memory, shared by all of the process's devices. The compiled programs are
nothing but ``ppermute``s of byte buffers (*chunks*); copies between devices of one
process never touch the network. What crosses between two processes takes one of two
forms:

* **A whole source shard**, where the receiving process needs all of it (fsdp -> tp:
  each of its devices needs a column block of every row block). The shard itself is
  sent, zero-copy (in row ranges, if large), once, to one device of that process, and
  the process copies every piece out of it into its destination shards: one copy per
  byte in all, and bytes that several of its devices need cross once. Where the shard
  is exactly one destination shard (weight sync between equal layouts), the buffer
  that arrives becomes that shard: no copy at all.
* **Packed pieces**, elsewhere, and for shards too small to be worth a collective of
  their own: each sender copies its pieces once into a chunk, and the receiver copies
  them out of what arrives into its destination shards. A small shard that the
  receiving process needs all of, for several of its devices, is packed whole (one
  contiguous copy instead of one per piece) into the chunk to one of its devices and
  cut up there; it crosses once however many of them need it.

What decides the speed on a small machine, where the network (gloo over loopback:
the kernel copies every byte twice) and the copies share a few cores:

* **Chunks of a few MiB.** Over gloo one huge buffer is slower than several medium
  ones moved at once, so each pair's pieces are cut into chunks of about
  ``CHUNK_BYTES``.
* **A pipeline of stages.** Chunks run as a sequence of programs (*stages*) of a few
  chunks each: while one stage is on the wire the sender packs the next and a helper
  thread unpacks the one that arrived. One stage is in flight at a time: a stage is
  dispatched once the one before has finished on this process's devices (two in
  flight could meet in their collectives in different orders on different processes
  and deadlock; a fuzzer found it with 3 processes x 2 devices).
* **No fresh memory.** Every page touched for the first time costs a fault (about as
  much as copying it). Each stage's buffers, sent and received, are let go as soon as
  it is unpacked, so the next stages reuse the same memory: XLA's allocator recycles
  the received ones, the pool of warm host blocks (``_buffers``) the send buffers and
  destination shards. Holding every stage's buffers to the end of the reshard
  instead made the 288 MiB benchmark ~16% slower (A/B in one launch).

**Failures part-way.** A process that fails before its last stage (out of memory
while packing, say) must not leave its peers waiting in the stages it would skip, nor
let them return what it never sent: it sends filler (memory never written) in every
stage left, and the last stage sums one status per process (``psum``: ~1 ms over
gloo, an ``all_gather`` ~4 ms), so every process raises, all still in step. The
copies within a process (made while the first stage travels), the copies of shards
kept or moved whole within it off CPU, and the caller's own copies (``before``) are
made or dispatched before that last stage, so a failure of theirs is reported too. A
failure after the last stage (unpacking, building outputs) corrupts nothing the
others receive, so only that process raises.

The pool is bounded, so memory held between reshards stays bounded, and a reshard
holds only the stages in flight, not all of its chunks at once. Packing in
cache-sized bands of the sources measured the same as plain order in isolation.

On 2 shared cores the fsdp -> tp relayout is bound by CPU and memory bandwidth: the
receiver's one copy per byte (~50 core-ms per 288 MiB; cutting column blocks out of
memory not in cache runs at ~6 GB/s here, a plain copy at ~14) competes with the
kernel's loopback copies, and the stages' transfers slow down while it runs. Copying
row bands through a cached scratch buffer first was 1.7x faster alone and no faster
in place (docs/performance-record.md). Measured and not better there (each in its own
plan, several launches): sending 256 KiB shards whole instead of packing them;
packing everything on the sender; and senders assembling each destination block so
that the receiver copies nothing, which moved the same copying to the sender (again in
2026-12, with streaming stores and copy tables: 0.95-1.10x the time; what arrives then
becomes the destination and is held, where the receiver's cut lets each stage's
buffers go for the next to reuse). Sending the 512 KiB shards whole too (the sender
then copies nothing) was 2-3% faster there, and slower for trees of nothing but such
shards; it is the default (``WHOLE_BYTES``).
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import jax
import numpy as np

from . import _buffers, _compat
from . import _collective_common as common
from . import _local_executor as local
from ._buffers import (
    POOL,
    align_up,
    c_strides,
    carve,
    copy_into,
    copy_pieces,
    host_empty,
    piece_row,
    piece_table,
    rows_table,
)
from ._collective_common import Copy, LeafBlocks
from ._geometry import box_shape, full_box, subtract_many

if TYPE_CHECKING:
    from ._collective_executor import CollectiveProgram

# Over gloo one huge buffer is slower than a few medium ones (jax 0.10, loopback: 72
# MiB per device pair in one ppermute took ~1.8x as long as in four), so chunks are cut
# at about this size.
CHUNK_BYTES = 3 * 2**20
# Bytes per device in one stage (one compiled program), and the fewest stages a plan
# is cut into where it has the chunks for it: with one stage nothing would overlap.
STAGE_BYTES = 12 * 2**20
MIN_STAGES = 4
# ...but no stage is made smaller than this to get there: a stage costs a fixed
# latency (~1-2 ms over gloo here), which a small reshard would pay several times for
# nothing to overlap. A/B in two launches each: a tree of 38 arrays of ~2 KiB went
# from 5 stages to 1 and from ~17-19 to ~12-14 ms per relayout; with ~0.6 MiB per
# device, 4 stages and 1 took the same time.
MIN_STAGE_BYTES = 2**20
# Source shards of at least WHOLE_BYTES[0] bytes that a receiving process needs all of
# are sent as they are (zero-copy), in row ranges of at most WHOLE_BYTES[1] bytes (one
# huge buffer crosses gloo slowly). Smaller ones are packed into shared chunks, so tiny
# arrays (norms, biases) do not each cost a ppermute. 512 KiB rather than 1 MiB (since
# 2026-12-06): the fsdp -> tp relayout's 512 KiB shards then go whole (the sender packs
# nothing, the receiver cuts them with the rest), and its ten stages become the same
# six as the weight sync's. A/B with each variant's plan built afresh, medians of 15
# in one launch each: the 288 MiB relayout took 0.954, 1.003, 0.959, 0.968, 0.973,
# 0.984 and 1.015x the time of 1 MiB, with 0.95-1.01x the CPU; the 40 MiB one 1.035,
# 0.847 and 0.946x with 0.93-0.94x the CPU (earlier A/Bs had measured 0.93-1.01x for
# the large tree; docs/performance-record.md). The trade-off: more, smaller
# collectives. A tree of nothing but 512 KiB shards (200 arrays) took 1.03-1.07x the
# time (0.96-1.00x the CPU), one of 640 KiB shards 0.95-1.06x.
WHOLE_BYTES = (2**19, 16 * 2**20)
# ...and from this size (if below WHOLE_BYTES[0]) where the shard is exactly one
# destination shard (weight sync between equal layouts): sent whole, it crosses with
# no copy at either end, where packed it costs two. A/B, 512 KiB against 1 MiB, in
# one launch each: the same-layout sync took 0.88-0.99x the time on the 288 MiB tree
# (13 launches) and 0.87-0.96x on the 40 MiB one (7). With WHOLE_BYTES[0] at 512 KiB
# too it adds nothing by default; it stays a setting of its own (the two were tuned
# apart, and may part again).
WHOLE_ARRIVING_BYTES = 2**19
# Bytes per device in one stage of whole shards; the bound also caps the zero-filled
# outputs XLA makes for devices that receive nothing in a ppermute. On the 288 MiB
# benchmark, each variant's plan built afresh in one launch: 16 MiB took 0.84-1.05x
# the time of 32 MiB for the fsdp -> tp relayout (median 0.96x, faster in 12 of 13
# launches; the receiver starts cutting once the first stage has arrived) and
# 0.85-1.04x for the same-layout sync (median 0.95x, 7 of 9); 8 MiB, 0.85-1.00x and
# 0.91-1.07x. (An earlier session had measured them the same within noise.)
WHOLE_STAGE_BYTES = 16 * 2**20
# Smaller shards that a receiving process needs all of, for several of its devices,
# are packed whole and cut up on arrival. A/B against packing their pieces (one
# launch each): the 40 MiB tree's relayout 0.87-1.01x the time over seven launches
# (median 0.97x), the 288 MiB one's 0.98-1.05x over four; same layout unchanged.
BUNDLED = True
# A schedule whose ops (packing, unpacking and copies within a process) copy at least
# this many bytes each on average builds its tables at its first run, so that its first
# call copies by them too: by bands, streamed past the cache. Below it, at its second
# run (``HostSchedule.ran``). (Equal programs share one schedule, uncached calls
# included: ``CollectiveProgram``.)
EAGER_TABLE_OP_BYTES = 1 << 18


def settings() -> tuple[Any, ...]:
    """The settings above, which shape the schedule: part of a program's fingerprint,
    so that processes whose settings differ refuse together instead of waiting in
    collectives that do not match."""
    return (
        CHUNK_BYTES,
        STAGE_BYTES,
        MIN_STAGES,
        MIN_STAGE_BYTES,
        WHOLE_BYTES,
        WHOLE_ARRIVING_BYTES,
        WHOLE_STAGE_BYTES,
        BUNDLED,
    )


_unpacker: ThreadPoolExecutor | None = None


@dataclass(frozen=True)
class Chunk:
    """One byte buffer per device, moved by one ``ppermute``.

    Attributes:
      perm: ``(source position, destination position)`` pairs that exchange it.
      nbytes: bytes per device (the most any of its senders packs).
      sends: per sending position, ``(copy, byte offset)`` of each piece it packs.
      whole: every sender sends rows of one source shard as they are (zero-copy,
        nothing packed); the receiving process cuts its pieces out of what arrives,
        or takes it as a destination shard where it is exactly one.
    """

    perm: tuple[tuple[int, int], ...]
    nbytes: int
    sends: dict[int, tuple[tuple[Copy, int], ...]]
    whole: bool = False


# A copy into a chunk, precomputed: (chunk index within its stage, first byte, end
# byte, leaf, the slices of the source block, the piece's shape).
_PackOp = tuple[int, int, int, int, tuple[slice, ...], tuple[int, ...]]
# A copy out of a chunk that arrived, precomputed: (chunk index within its stage, the
# position it arrived at, first byte, end byte, leaf, the shape those bytes are, the
# slices of them to take (None: all), the slices of the destination block to write
# (None: the bytes become the destination block)).
_TakeOp = tuple[
    int, int, int, int, int, tuple[int, ...], tuple[slice, ...] | None, tuple[slice, ...] | None
]


def _split_rows(c: Copy, itemsize: int, limit: int) -> list[Copy]:
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


def host_chunks(
    remote: dict[tuple[int, int], list[Copy]], itemsizes: Sequence[int], limit: int
) -> list[Chunk]:
    """Packs the cross-process copies of each round into chunks of about equal size.

    Each pair of a round fills its own sequence of buffers of at most about ``limit``
    bytes (split evenly, pieces cut along their first dimension where needed); buffer
    ``b`` of the round is one chunk among the pairs that have a ``b``-th buffer, as
    large as the largest of them.
    """
    chunks: list[Chunk] = []
    for members in common.rounds_of(list(remote)):
        packed: dict[tuple[int, int], list[tuple[list[tuple[Copy, int]], int]]] = {}
        for pr in members:
            total = sum(math.prod(c[3]) * itemsizes[c[0]] for c in remote[pr])
            target = align_up(-(-total // max(1, -(-total // limit))))
            bufs: list[tuple[list[tuple[Copy, int]], int]] = [([], 0)]
            for cp in remote[pr]:
                for part in _split_rows(cp, itemsizes[cp[0]], target):
                    n = math.prod(part[3]) * itemsizes[part[0]]
                    items, used = bufs[-1]
                    off = align_up(used)  # pieces start ALIGN-aligned in a chunk
                    if used and off + n > target:
                        bufs.append(([], 0))
                        items, off = bufs[-1][0], 0
                    items.append((part, off))
                    bufs[-1] = (items, off + n)
            packed[pr] = bufs
        for b in range(max(len(v) for v in packed.values())):
            have = [pr for pr in members if b < len(packed[pr])]
            chunks.append(
                Chunk(
                    tuple(have),
                    max(1, max(packed[pr][b][1] for pr in have)),
                    {pr[0]: tuple(packed[pr][b][0]) for pr in have},
                )
            )
    return chunks


def whole_chunks(moves: Sequence[Copy], itemsizes: Sequence[int]) -> list[Chunk]:
    """Chunks of source rows sent as they are: per array and row range, one per round.

    Args:
      moves: per row range of a source block sent (all of its rows, or a part of a
        large block), a copy of those rows from its device to the device they land on.
    """
    per_part: dict[tuple[int, int], dict[tuple[int, int], Copy]] = defaultdict(dict)
    for c in moves:
        per_part[(c[0], c[4][0])][(c[1], c[2])] = c
    chunks = []
    for (li, _), by_pair in sorted(per_part.items()):
        nbytes = math.prod(next(iter(by_pair.values()))[3]) * itemsizes[li]
        for members in common.rounds_of(list(by_pair)):
            sends: dict[int, tuple[tuple[Copy, int], ...]] = {
                pr[0]: ((by_pair[pr], 0),) for pr in members
            }
            chunks.append(Chunk(members, nbytes, sends, whole=True))
    return chunks


def stages_of(
    chunks: Sequence[Chunk],
    limit: int,
    min_stages: int = 1,
    first: int = 0,
    min_bytes: int = 1,
) -> list[list[int]]:
    """Groups consecutive chunks into stages of at most ``limit`` bytes per device,
    smaller where needed to make at least ``min_stages`` of them, but not smaller
    than ``min_bytes`` for that; chunk indices start at ``first``."""
    limit = min(limit, max(min_bytes, sum(ch.nbytes for ch in chunks) // min_stages))
    stages: list[list[int]] = []
    used = 0
    for ci, ch in enumerate(chunks, start=first):
        if not stages or used + ch.nbytes > limit:
            stages.append([])
            used = 0
        stages[-1].append(ci)
        used += ch.nbytes
    return stages


def _slices(start: Sequence[int], shape: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(a, a + n) for a, n in zip(start, shape, strict=True))


def _pack_ops(items: Sequence[tuple[int, Copy, int]], itemsizes: Sequence[int]) -> list[_PackOp]:
    """One sender's copies into the chunks of a stage, from ``(chunk index within the
    stage, copy, byte offset)`` of every piece."""
    return [
        (k, off, off + math.prod(shape) * itemsizes[li], li, _slices(s0, shape), shape)
        for k, (li, _, _, shape, s0, _), off in items
    ]


def _written(ops: Sequence[_TakeOp], itemsizes: Sequence[int]) -> int:
    """Bytes that take ops write."""
    total = 0
    for _, _, a, b, li, _, take, _ in ops:
        total += (
            (b - a) if take is None else math.prod(t.stop - t.start for t in take) * itemsizes[li]
        )
    return total


def _cuts(
    pieces: Sequence[Copy], r0: int, part: tuple[int, ...]
) -> list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]:
    """``(destination position, slices of the part, slices of its block)`` of each
    piece's rows within a part of a source block: ``part``-shaped, from row ``r0``."""
    out = []
    r1 = r0 + part[0]
    for c in pieces:
        a, b = max(r0, c[4][0]), min(r1, c[4][0] + c[3][0])
        if a < b:
            shape = (b - a, *c[3][1:])
            take = _slices((a - r0, *c[4][1:]), shape)
            put = _slices((c[5][0] + a - c[4][0], *c[5][1:]), shape)
            out.append((c[2], take, put))
    return out


def _covers(pieces: Sequence[Copy], block: tuple[int, ...]) -> bool:
    """Whether the pieces' source boxes together cover the whole source block."""
    boxes = (tuple((a, a + n) for a, n in zip(c[4], c[3], strict=True)) for c in pieces)
    return not subtract_many(full_box(block), boxes)


class HostSchedule:
    """What this process packs, sends, unpacks and copies locally, per stage.

    Args:
      copies: every copy of the plan, in union-mesh coordinates.
      blocks: block shapes per array.
      itemsizes: bytes per element per array.
      process: the process index of each union-mesh position.
      me: this process's index.
    """

    def __init__(
        self,
        copies: Sequence[Copy],
        blocks: Sequence[LeafBlocks],
        itemsizes: Sequence[int],
        process: Sequence[int],
        me: int,
    ) -> None:
        remote: dict[tuple[int, int], list[Copy]] = defaultdict(list)
        # Per array: destination position -> copies within one process (no network).
        self.local_copies: list[dict[int, list[Copy]]] = [{} for _ in blocks]
        # Pieces that cross processes, per (array, source position, destination process).
        crossing: dict[tuple[int, int, int], list[Copy]] = defaultdict(list)
        for c in copies:
            if process[c[1]] == process[c[2]]:
                if process[c[2]] == me:
                    self.local_copies[c[0]].setdefault(c[2], []).append(c)
            else:
                crossing[(c[0], c[1], process[c[2]])].append(c)

        # Arrays of one geometry (a model's layers) repeat the same pieces but for their
        # array's index: the geometry below is worked out once per distinct set of
        # pieces (~half of this schedule's build for an LLM-shaped tree).
        covered: dict[Any, bool] = {}
        cut: dict[Any, list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]] = {}

        def covers(cs: Sequence[Copy], block: tuple[int, ...]) -> bool:
            key = (block, tuple(c[3:5] for c in cs))
            got = covered.get(key)
            if got is None:
                got = covered[key] = _covers(cs, block)
            return got

        def cuts(
            cs: Sequence[Copy], r0: int, part: tuple[int, ...]
        ) -> list[tuple[int, tuple[slice, ...], tuple[slice, ...]]]:
            key = (tuple(c[2:] for c in cs), r0, part)
            got = cut.get(key)
            if got is None:
                got = cut[key] = _cuts(cs, r0, part)
            return got

        # Where a destination process needs all of a source shard, the shard itself is
        # sent, once, to one of its devices, and the process copies every piece out of
        # it: the sender copies nothing, and bytes that several of its devices need
        # cross once. Elsewhere, each sender packs the pieces.
        forward = []
        bundled = []
        for (li, src, _), cs in sorted(crossing.items()):
            block = blocks[li].src_block
            nbytes = math.prod(block) * itemsizes[li]
            # Sent in this many row ranges of at most WHOLE_BYTES[1] bytes each.
            parts = -(-nbytes // max(1, WHOLE_BYTES[1]))
            # The copies that are the whole source block and a whole destination block:
            # sent in one part, what arrives is that destination block.
            whole = [c for c in cs if c[3] == block == blocks[li].dst_block and parts == 1]
            least = min(WHOLE_BYTES[0], WHOLE_ARRIVING_BYTES) if whole else WHOLE_BYTES[0]
            if WHOLE_BYTES[1] > 0 and least <= nbytes and parts <= block[0] and covers(cs, block):
                forward.append((nbytes, li, src, cs, parts, whole))
            elif BUNDLED and block and len(cs) > 1 and covers(cs, block):
                bundled.append((nbytes, li, src, cs))
            else:
                for c in cs:
                    remote[(c[1], c[2])].append(c)
        moves: list[Copy] = []  # source rows sent whole: source position -> landing one
        # Per (array, source position, landing position, first row): what the landing
        # process takes out of those rows, as (writing position, op without its chunk
        # index).
        takes: dict[tuple[int, int, int, int], list[tuple[int, _TakeOp]]] = {}
        # (array, destination position) of this process whose block is what arrives.
        self.arrive_whole: set[tuple[int, int]] = set()
        load: dict[int, int] = defaultdict(int)  # bytes landing on each position
        for nbytes, li, src, cs, parts, whole in sorted(forward, key=lambda f: (-f[0], f[1], f[2])):
            src_block, dst_block = blocks[li].src_block, blocks[li].dst_block
            # Land on a device whose whole block it is (no copy there), else on the
            # least loaded device that needs part of it.
            land = whole[0][2] if whole else min({c[2] for c in cs}, key=lambda d: (load[d], d))
            load[land] += nbytes
            rows = src_block[0] if src_block else 1
            step = -(-rows // parts)
            for r0 in range(0, rows, step):
                r1 = min(rows, r0 + step)
                part = (r1 - r0, *src_block[1:])
                start = (r0,) + (0,) * (len(src_block) - 1)
                moves.append((li, src, land, part, start, start))
                size = math.prod(part) * itemsizes[li]
                ops: list[tuple[int, _TakeOp]] = []
                if whole:
                    ops.append((land, (-1, land, 0, size, li, dst_block, None, None)))
                    if process[land] == me:
                        self.arrive_whole.add((li, land))
                rest = [c for c in cs if not whole or c is not whole[0]]
                for writer, take, put in cuts(rest, r0, part):
                    ops.append((writer, (-1, land, 0, size, li, part, take, put)))
                takes[(li, src, land, r0)] = ops
        # Smaller shards that a process needs all of, wanted by several of its devices:
        # each is packed whole (one contiguous copy), sent once to one of its devices,
        # and cut into its pieces there, instead of packed piece by piece for each device.
        bundles: dict[tuple[int, int, int], list[Copy]] = {}
        for nbytes, li, src, cs in sorted(bundled, key=lambda f: (-f[0], f[1], f[2])):
            land = min({c[2] for c in cs}, key=lambda d: (load[d], d))
            load[land] += nbytes
            block = blocks[li].src_block
            zero = (0,) * len(block)
            remote[(src, land)].append((li, src, land, block, zero, zero))
            bundles[(li, src, land)] = cs

        # Whole shards first: nothing to pack, so they leave at once while the first
        # packed stage is being packed. Packed stages are made small enough to overlap.
        whole_chunked = whole_chunks(moves, itemsizes)
        packed = host_chunks(remote, itemsizes, CHUNK_BYTES)
        self.chunks = whole_chunked + packed
        self.stages = stages_of(whole_chunked, WHOLE_STAGE_BYTES) + stages_of(
            packed, STAGE_BYTES, MIN_STAGES, first=len(whole_chunked), min_bytes=MIN_STAGE_BYTES
        )
        # Per stage: local sending position -> pack ops; local writing position ->
        # (bytes written, take ops).
        self.pack: list[dict[int, list[_PackOp]]] = []
        self.unpack: list[dict[int, tuple[int, list[_TakeOp]]]] = []
        for stage in self.stages:
            sends: dict[int, list[tuple[int, Copy, int]]] = defaultdict(list)
            writes: dict[int, list[_TakeOp]] = defaultdict(list)
            for k, ci in enumerate(stage):
                ch = self.chunks[ci]
                for pos, items in ch.sends.items():
                    for cp, off in items:
                        li, land = cp[0], cp[2]
                        if ch.whole:
                            for writer, op in takes[(li, pos, land, cp[4][0])]:
                                if process[writer] == me:
                                    writes[writer].append((k, *op[1:]))
                            continue
                        if process[pos] == me:
                            sends[pos].append((k, cp, off))
                        if process[land] == me:
                            end = off + math.prod(cp[3]) * itemsizes[li]
                            shards = bundles.get((li, pos, land))
                            if shards is None:
                                put = _slices(cp[5], cp[3])
                                writes[land].append((k, land, off, end, li, cp[3], None, put))
                                continue
                            # Rows of a bundled shard: its pieces are cut out here.
                            for writer, take, put in cuts(shards, cp[4][0], cp[3]):
                                writes[writer].append((k, land, off, end, li, cp[3], take, put))
            self.pack.append({p: _pack_ops(v, itemsizes) for p, v in sends.items()})
            self.unpack.append({p: (_written(v, itemsizes), v) for p, v in writes.items()})
        # The same ops as tables for one C call each (``None``: op by op), built by
        # ``build_tables`` at the schedule's first run where its ops are large (the
        # tables also cut in bands and stream: ``ran``), else at its second.
        self.runs = 0
        self.tables_tried = False
        nops = sum(len(ops) for st in self.pack for ops in st.values())
        nops += sum(len(ops) for st in self.unpack for _, ops in st.values())
        nbytes = sum(op[2] - op[1] for st in self.pack for ops in st.values() for op in ops)
        nbytes += sum(n for st in self.unpack for n, _ in st.values())
        for li, per_pos in enumerate(self.local_copies):
            for cs in per_pos.values():
                nops += len(cs)
                nbytes += sum(math.prod(c[3]) for c in cs) * itemsizes[li]
        self.tables_at = 1 if nbytes >= EAGER_TABLE_OP_BYTES * max(1, nops) else 2
        self._sizes = (list(blocks), list(itemsizes))
        self.pack_tables: list[dict[int, PackTables]] | None = None
        self.unpack_tables: list[StageTakes] | None = None
        self.local_tables: list[LocalTables] | None = None
        # Stands in for the chunk of a device that sends nothing in it: never written,
        # so its pages are never touched. (Sent only by a failing process, in place of
        # its data: whatever the memory held then reaches peers that discard it.)
        self.idle = _compat.aligned_empty(
            (max((ch.nbytes for ch in self.chunks), default=1),), np.dtype(np.uint8)
        )
        # Per whole chunk and sending position: (array, first byte, end byte) of the
        # source block that it sends (its rows: a range of the block's bytes).
        self.whole_rows: dict[int, dict[int, tuple[int, int, int]]] = {}
        for ci, ch in enumerate(self.chunks):
            if ch.whole:
                sent = self.whole_rows[ci] = {}
                for pos, (((li, _, _, shape, start, _), _),) in ch.sends.items():
                    if process[pos] == me:
                        first = start[0] * math.prod(shape[1:]) * itemsizes[li]
                        sent[pos] = (li, first, first + math.prod(shape) * itemsizes[li])
        # Per stage, whether this process sends anything in it (else every chunk it
        # hands the stage is filler: ``_filler_stage``).
        self.sends_in = [
            any(process[pos] == me for ci in stage for pos in self.chunks[ci].sends)
            for stage in self.stages
        ]

    def ran(self) -> None:
        """Counts a run of the schedule; the one ``tables_at`` says builds its tables.
        For small ops, building them costs about what they save in one run (a few us
        per op, ops being per array here, not per geometry), so a schedule run once
        copies op by op (as uncached calls did when each built its own schedule: 512
        arrays of 64 KiB across 2 processes, uncached, took 1.07-1.12x the time with
        the tables built at every call). Large ops copy much faster by the tables
        (``EAGER_TABLE_OP_BYTES``). Calls in several threads may share the schedule:
        the tables are built once the count reaches ``tables_at``, whoever counts."""
        self.runs += 1
        if self.runs >= self.tables_at and not self.tables_tried:
            self.tables_tried = True
            try:
                self.build_tables()
            except Exception:  # pragma: no cover - tables only speed copies up
                # Raising here, before the first stage, would leave the peers waiting.
                self.pack_tables = self.unpack_tables = self.local_tables = None

    def build_tables(self) -> None:
        """The pack, take and local-copy ops as ``copy_pieces`` tables."""
        blocks, itemsizes = self._sizes
        self.pack_tables = [
            {p: _pack_tables(ops, blocks, itemsizes) for p, ops in stage.items()}
            for stage in self.pack
        ]
        self.unpack_tables = [_stage_takes(stage, blocks, itemsizes) for stage in self.unpack]
        self.local_tables = _local_tables(self.local_copies, blocks, itemsizes)


def _unpack_pool() -> ThreadPoolExecutor:
    global _unpacker
    if _unpacker is None:
        _unpacker = ThreadPoolExecutor(1, thread_name_prefix="reshard-collective-unpack")
    return _unpacker


def _fill(bufs: Sequence[np.ndarray], views: dict[int, np.ndarray], ops: Sequence[_PackOp]) -> None:
    """Packs one sender's pieces into its chunks of a stage."""
    for k, a, b, li, sl, shape in ops:
        src = views[li]
        copy_into(bufs[k][a:b].view(src.dtype).reshape(shape), src[sl])


def _fill_by_table(
    bufs: Sequence[np.ndarray],
    views: dict[int, np.ndarray],
    ops: Sequence[_PackOp],
    found: tuple[tuple[int, ...], list[tuple[int, np.ndarray]]],
) -> None:
    """``_fill`` in one C call (``PackTables``); op by op where the C code refuses a
    buffer, which it does before writing anything."""
    leaves, tables = found
    if not copy_pieces([views[li] for li in leaves], [(bufs[k], t) for k, t in tables]):
        _fill(bufs, views, ops)


def _take_banded(
    srcs: Sequence[np.ndarray],
    work: Sequence[tuple[np.ndarray, np.ndarray]],
    raws: dict[int, list[np.ndarray]],
    outs: dict[int, dict[int, np.ndarray]],
    fallback: Sequence[tuple[int, list[_TakeOp]]],
    dtypes: Sequence[np.dtype],
    part: int,
    parts: int,
) -> None:
    """Part ``part`` of the copies out of a stage's chunks, by one C call for the
    ``(block, table)``s of every position (``StageTakes``); where the C code refuses
    a buffer, which it does before writing anything and for every part alike, part 0
    makes the copies of the ``fallback`` ops (per position) one by one (those whose
    chunk became a block whole were adopted already)."""
    if not copy_pieces(srcs, work, part, parts) and part == 0:
        for pos, ops in fallback:
            _take(raws, outs[pos], [op for op in ops if op[7] is not None], dtypes)


def _unpack_tasks(
    stage: dict[int, tuple[int, list[_TakeOp]]],
    found: StageTakes | None,
    raws: dict[int, list[np.ndarray]],
    outs: dict[int, dict[int, np.ndarray]],
    dtypes: Sequence[np.dtype],
) -> list[tuple[int, Callable[[], None]]]:
    """The copies of one stage's take ops (``stage``: per position of this process,
    bytes written and ops) as ``local.run_copies`` tasks; chunks that become blocks
    whole are adopted here. With tables, the copies into every position's blocks are
    one copy split by bands (``local.banded_tasks``): each chunk that arrived is cut
    up for all the devices it feeds while its rows are in cache."""
    tasks: list[tuple[int, Callable[[], None]]] = []
    chunks, per_pos = found if found is not None else ((), {})
    work: list[tuple[np.ndarray, np.ndarray]] = []
    fallback: list[tuple[int, list[_TakeOp]]] = []
    nbytes = 0
    for pos, (n, ops) in stage.items():
        tabled = per_pos.get(pos)
        if tabled is None:
            tasks.append((n, functools.partial(_take, raws, outs[pos], ops, dtypes)))
            continue
        tables, whole = tabled
        _take(raws, outs[pos], whole, dtypes)  # chunks that become blocks: no copy
        work += [(outs[pos][li], t) for li, t in tables.items()]
        fallback.append((pos, ops))
        nbytes += n - sum(op[3] - op[2] for op in whole)  # (bytes copied)
    if work:
        srcs = [raws[land][k] for land, k in chunks]
        copy = functools.partial(_take_banded, srcs, work, raws, outs, fallback, dtypes)
        tasks += local.banded_tasks(nbytes, copy)
    return tasks


# One sender's pack ops of a stage as tables: the arrays they read (source indices of
# the rows), and per chunk index within the stage its table; ``None``: op by op.
PackTables = tuple[tuple[int, ...], list[tuple[int, np.ndarray]]] | None
# One writing position's take ops of a stage: a table per array written (source
# indices into the stage's chunks, ``StageTakes``), and the ops whose chunk becomes a
# block whole; ``None``: op by op.
TakeTables = tuple[dict[int, np.ndarray], list[_TakeOp]] | None
# A stage's take ops of every position of this process: the ``(landing position,
# chunk index)`` of each chunk read (the source indices of the rows), and per
# position its ``TakeTables``.
StageTakes = tuple[tuple[tuple[int, int], ...], dict[int, TakeTables]]


def _pack_tables(
    ops: Sequence[_PackOp], blocks: Sequence[LeafBlocks], itemsizes: Sequence[int]
) -> PackTables:
    """``ops`` as ``PackTables``: each piece of a source block into its bytes of a
    chunk, laid out C-contiguously there."""
    if not _buffers.NATIVE_COPY:
        return None
    leaves = tuple(sorted({op[3] for op in ops}))
    index = {li: i for i, li in enumerate(leaves)}
    rows: dict[int, list[list[int]]] = defaultdict(list)
    for k, a, _, li, sl, shape in ops:
        size = itemsizes[li]
        src = c_strides(blocks[li].src_block, size)
        full = tuple(slice(0, n) for n in shape)
        row = piece_row(index[li], sl, src, full, c_strides(shape, size), size, doff=a)
        if row is not None:
            rows[k].append(row)
    tables = [(k, rows_table(r)) for k, r in rows.items()]
    if any(t is None for _, t in tables):
        return None
    return leaves, cast(list[tuple[int, np.ndarray]], tables)


def _stage_takes(
    stage: dict[int, tuple[int, list[_TakeOp]]],
    blocks: Sequence[LeafBlocks],
    itemsizes: Sequence[int],
) -> StageTakes:
    """One stage's take ops (per position of this process) as ``StageTakes``."""
    chunks: dict[tuple[int, int], int] = {}
    per_pos = {p: _take_tables(ops, blocks, itemsizes, chunks) for p, (_, ops) in stage.items()}
    return tuple(chunks), per_pos


def _take_tables(
    ops: Sequence[_TakeOp],
    blocks: Sequence[LeafBlocks],
    itemsizes: Sequence[int],
    chunks: dict[tuple[int, int], int],
) -> TakeTables:
    """``ops`` as ``TakeTables``: each piece out of the bytes of a chunk (laid out
    C-contiguously there, maybe cut further) into its destination block; ``chunks``
    numbers the stage's chunks as they are first read."""
    if not _buffers.NATIVE_COPY:
        return None
    rows: dict[int, list[list[int]]] = defaultdict(list)
    whole: list[_TakeOp] = []
    for op in ops:
        k, land, a, _, li, shape, take, put = op
        if put is None:
            whole.append(op)
            continue
        size = itemsizes[li]
        si = chunks.setdefault((land, k), len(chunks))
        ssl = take if take is not None else tuple(slice(0, n) for n in shape)
        dst = c_strides(blocks[li].dst_block, size)
        row = piece_row(si, ssl, c_strides(shape, size), put, dst, size, soff=a)
        if row is not None:
            rows[li].append(row)
    tables = {li: rows_table(r) for li, r in rows.items()}
    if any(t is None for t in tables.values()):
        return None
    return cast(dict[int, np.ndarray], tables), whole


def _take(
    raws: dict[int, list[np.ndarray]],
    outs: dict[int, np.ndarray],
    ops: Sequence[_TakeOp],
    dtypes: Sequence[np.dtype],
) -> None:
    """Copies one device's pieces out of the chunks that arrived (at it or at other
    devices of this process) into its blocks; a chunk that is a whole block becomes
    that block."""
    for k, land, a, b, li, shape, take, put in ops:
        piece = raws[land][k][a:b].view(dtypes[li]).reshape(shape)
        if take is not None:
            piece = piece[take]
        if put is None:
            outs[li] = piece
        else:
            copy_into(outs[li], piece, put)


def _copy_local(
    out: np.ndarray, views: Mapping[int, dict[int, np.ndarray]], copies: Sequence[Copy]
) -> None:
    """Copies pieces between devices of this process into one destination block."""
    for li, s, _, shape, s0, d0 in copies:
        copy_into(out, views[s][li][_slices(s0, shape)], _slices(d0, shape))


# Per array: the source positions its copies within this process read, and per
# destination position the table of those copies (``_buffers.piece_table``, source
# indices into the positions), or ``None`` where they are copied one by one.
LocalTables = tuple[tuple[int, ...], dict[int, np.ndarray]] | None


def _local_tables(
    local_copies: Sequence[dict[int, list[Copy]]],
    blocks: Sequence[LeafBlocks],
    itemsizes: Sequence[int],
) -> list[LocalTables]:
    """``LocalTables`` per array, built once per geometry (a model's layers repeat
    theirs but for the array's index)."""
    built: dict[Any, LocalTables] = {}
    out: list[LocalTables] = []
    for li, per_pos in enumerate(local_copies):
        if not per_pos or not _buffers.NATIVE_COPY:
            out.append(None)
            continue
        key = (
            blocks[li],
            itemsizes[li],
            tuple((pos, tuple(c[1:] for c in cs)) for pos, cs in per_pos.items()),
        )
        if key not in built:
            srcs = tuple(sorted({c[1] for cs in per_pos.values() for c in cs}))
            index = {s: i for i, s in enumerate(srcs)}
            src_blocks = [blocks[li].src_block] * len(srcs)
            tables = {}
            for pos, cs in per_pos.items():
                pieces = [(index[c[1]], _slices(c[4], c[3]), _slices(c[5], c[3])) for c in cs]
                t = piece_table(pieces, src_blocks, blocks[li].dst_block, itemsizes[li])
                if t is None:
                    break
                tables[pos] = t
            built[key] = (srcs, tables) if len(tables) == len(per_pos) else None
        out.append(built[key])
    return out


def _copy_by_table(
    srcs: Sequence[np.ndarray],
    work: Sequence[tuple[np.ndarray, np.ndarray]],
    views: Mapping[int, dict[int, np.ndarray]],
    copies: Sequence[Sequence[Copy]],
    part: int,
    parts: int,
) -> None:
    """Part ``part`` of the copies within this process into the ``(block, table)``s of
    one array, by one C call; where the C code refuses a buffer, which it does before
    writing anything and for every part alike, part 0 copies piece by piece
    (``_copy_local``, ``copies`` per block)."""
    if not copy_pieces(srcs, work, part, parts) and part == 0:
        for (out, _), cs in zip(work, copies, strict=True):
            _copy_local(out, views, cs)


def _local_tasks(
    sched: HostSchedule,
    outs: dict[int, dict[int, np.ndarray]],
    views: Mapping[int, dict[int, np.ndarray]],
) -> list[tuple[int, Callable[[], None]]]:
    """The copies within this process as ``local.run_copies`` tasks: per array, one
    copy into all its blocks, split by bands between the copy threads where it is
    large (``local.banded_tasks``)."""
    tasks: list[tuple[int, Callable[[], None]]] = []
    for li, per_pos in enumerate(sched.local_copies):
        found = None if sched.local_tables is None else sched.local_tables[li]
        if found is None:
            tasks += [
                (outs[pos][li].nbytes, functools.partial(_copy_local, outs[pos][li], views, cs))
                for pos, cs in per_pos.items()
            ]
            continue
        positions, tables = found
        srcs = [views[s][li] for s in positions]
        work = [(outs[pos][li], tables[pos]) for pos in per_pos]
        copy = functools.partial(_copy_by_table, srcs, work, views, list(per_pos.values()))
        tasks += local.banded_tasks(sum(out.nbytes for out, _ in work), copy)
    return tasks


def _pack_stage(
    program: CollectiveProgram, s: int, views: Mapping[int, _SourceViews]
) -> list[jax.Array]:
    """This process's chunks of stage ``s``, as arrays on the union mesh."""
    sched: HostSchedule = program.host
    if not sched.sends_in[s]:
        return _filler_stage(program, s)
    ids = sched.stages[s]
    rows: list[list[np.ndarray]] = []
    tasks: list[tuple[int, Callable[[], None]]] = []
    for d in program.local_devices:
        pos = program.position[d.id]
        row = []
        for ci in ids:
            ch = sched.chunks[ci]
            if pos not in ch.sends:
                row.append(sched.idle[: ch.nbytes])
            elif ch.whole:  # rows of the source shard itself, zero-copy
                li, first, end = sched.whole_rows[ci][pos]
                row.append(views[pos].raw(li)[first:end])
            else:
                row.append(POOL.take(ch.nbytes))
        ops = sched.pack[s].get(pos)
        if ops:
            nbytes = sum(op[2] - op[1] for op in ops)
            found = None if sched.pack_tables is None else sched.pack_tables[s][pos]
            if found is None:
                task = functools.partial(_fill, row, views[pos], ops)
            else:
                task = functools.partial(_fill_by_table, row, views[pos], ops, found)
            tasks.append((nbytes, task))
        rows.append(row)
    local.run_copies(tasks)
    return _stage_arrays(program, ids, rows)


def _stage_arrays(
    program: CollectiveProgram, ids: Sequence[int], rows: Sequence[Sequence[np.ndarray]]
) -> list[jax.Array]:
    """Chunks ``ids`` as arrays on the union mesh, from one row of buffers per local
    device."""
    n = len(program.devices)
    return [
        _compat.assemble(
            (n * program.host.chunks[ci].nbytes,),
            np.dtype(np.uint8),
            program.block_sharding,
            [row[k] for row in rows],
            program.local_devices,
        )
        for k, ci in enumerate(ids)
    ]


def _filler_stage(program: CollectiveProgram, s: int) -> list[jax.Array]:
    """Stage ``s`` as a process sends it that has nothing to send in it (a receiving
    process), or that failed (so that its peers are not left waiting): filler (memory
    never written) in place of every chunk. Made once per program and stage, then
    reused: no stage program donates its inputs, and the receiving process of a weight
    sync made ~60 such arrays per call of the 288 MiB tree (~3 ms of its main thread's
    CPU, in one launch with both versions; the time did not change measurably)."""
    made = program.fillers.get(s)
    if made is None:
        sched: HostSchedule = program.host
        ids = sched.stages[s]
        row = [sched.idle[: sched.chunks[ci].nbytes] for ci in ids]
        with _compat.bookkeeping():  # (sent by a process failing under a transfer guard too)
            made = _stage_arrays(program, ids, [row] * len(program.local_devices))
        program.fillers[s] = made
    return list(made)


def _unpack_stage(
    program: CollectiveProgram,
    s: int,
    received: Sequence[jax.Array],
    sent: Sequence[jax.Array],
    outs: dict[int, dict[int, np.ndarray]],
) -> None:
    """Unpacks stage ``s`` as it arrives, then lets go of its buffers."""
    ops = program.host.unpack[s]
    if ops:
        per_array = [_compat.device_buffers(r) for r in received]
        lands = {op[1] for _, pos_ops in ops.values() for op in pos_ops}
        # Zero-copy views of what arrived; each waits for its transfer.
        view = _viewer(program)
        raws = {land: [view(b[program.devices[land].id]) for b in per_array] for land in lands}
        tables = program.host.unpack_tables
        found = None if tables is None else tables[s]
        tasks = _unpack_tasks(ops, found, raws, outs, program.dtypes)
        local.run_copies(tasks)
    # The stage's send buffers return to the pool when XLA lets go of them; a process
    # that only sends learns here that they have left.
    jax.block_until_ready(list(received))
    del sent


def _viewer(program: CollectiveProgram) -> Callable[[jax.Array], np.ndarray]:
    """``_compat.host_view`` for the single-device arrays of ``program``'s devices,
    which are all of one platform: on CPU without asking each array (hundreds of views
    per call of a model)."""
    return _compat.cpu_view if program.devices[0].platform == "cpu" else _compat.host_view


class _SourceBuffers(dict[int, dict[int, jax.Array]]):
    """Per array, its single-device arrays by device id, found when first asked for:
    the first stage starts without waiting for those of every array (~10-20 us each;
    ~1.5 ms of a call of the 288 MiB tree, before its first stage, until 2026-12-06)."""

    def __init__(self, sources: Sequence[jax.Array]):
        super().__init__()
        self._sources = sources

    def __missing__(self, li: int) -> dict[int, jax.Array]:
        got = self[li] = _compat.device_buffers(self._sources[li])
        return got


class _SourceViews(dict[int, np.ndarray]):
    """Per array, a zero-copy view of one device's source block, made when first
    asked for: stage 0 starts without waiting for the views of every array (~7 us
    each, hundreds of them in a model)."""

    def __init__(self, program: CollectiveProgram, bufs: _SourceBuffers, dev_id: int):
        super().__init__()
        self._program, self._bufs, self._dev_id = program, bufs, dev_id
        self._view = _viewer(program)

    def __missing__(self, li: int) -> np.ndarray:
        view = self._view(self._bufs[li][self._dev_id])
        view = view.reshape(self._program.leaves[li].src_block)
        self[li] = view
        return view

    def raw(self, li: int) -> np.ndarray:
        """The source block of array ``li`` as its bytes (a block sent whole is sent
        as bytes; rows of a block are a range of them). Its view is made once, as
        for ``self[li]``, however many row ranges of it are sent."""
        return self[li].reshape(-1).view(np.uint8)


def _destinations(
    program: CollectiveProgram, shardings: Sequence[Any]
) -> dict[int, dict[int, np.ndarray]]:
    """Per position and array, the destination blocks this process builds (not handed
    over), written once each; from the pool of warm blocks, since fresh memory costs a
    page fault per 4 KiB. Blocks under ``local.SMALL_SHARD_BYTES`` are carved out of
    a pooled block per array (``_buffers.carve``), as the local executor does.
    Every position of this process has a dict, so the unpacking threads never add
    one."""
    sched: HostSchedule = program.host
    outs: dict[int, dict[int, np.ndarray]] = {}
    # Per array with small blocks: the dict of each position that needs one.
    small: dict[int, list[dict[int, np.ndarray]]] = defaultdict(list)
    for li, sharding in enumerate(shardings):
        block, dtype = program.leaves[li].dst_block, program.dtypes[li]
        nbytes = math.prod(block) * dtype.itemsize
        for d in _compat.addressable_devices(sharding):
            pos = program.position[d.id]
            if pos in program.reused[li] or pos in program.moved_whole[li]:
                continue
            mine = outs.setdefault(pos, {})
            if (li, pos) in sched.arrive_whole:  # the arriving chunk is the block
                continue
            if nbytes < local.SMALL_SHARD_BYTES:
                small[li].append(mine)
            else:
                mine[li] = host_empty(block, dtype)
    sizes = {
        li: math.prod(program.leaves[li].dst_block) * program.dtypes[li].itemsize for li in small
    }
    carved = carve([[sizes[li]] * len(mines) for li, mines in small.items()])
    for (li, mines), raws in zip(small.items(), carved, strict=True):
        for mine, raw in zip(mines, raws, strict=True):
            mine[li] = raw.view(program.dtypes[li]).reshape(program.leaves[li].dst_block)
    return outs


def run_host_packed(
    program: CollectiveProgram,
    sources: Sequence[jax.Array],
    shardings: Sequence[Any],
    *,
    before: Callable[[], None] | None = None,
) -> list[jax.Array]:
    """Runs a host-packed program: this process's part of every stage, then its
    destination shards. ``before`` (the caller's own copies) is called once, before
    the last stage where that stage reports failures, else at the end."""
    sched: HostSchedule = program.host
    sched.ran()
    position = program.position
    bufs = _SourceBuffers(sources)
    # Zero-copy views of this process's source shards, per position and array.
    views = {position[d.id]: _SourceViews(program, bufs, d.id) for d in program.local_devices}

    pending: list[Future[None]] = []
    outs: dict[int, dict[int, np.ndarray]] | None = None
    # A failure here before the last stage must not leave the peers waiting in the
    # stages this process would skip: it sends filler in them instead and reports the
    # failure in the last one, so that every process raises, all still in step.
    failure: Exception | None = None
    reported = False  # whether the peers were told of it
    status: jax.Array | None = None
    previous: list[jax.Array] = []  # the outputs of the stage last dispatched
    local_done: Future[None] | None = None  # the copies within this process, started
    kept: dict[tuple[int, int], jax.Array] | None = None  # ``_kept_shards``, once settled

    def settle() -> None:
        """What this process finishes before the last stage, so that a failure of it
        is reported to the peers too, not raised by this process alone once the others
        have finished: the copies within it (first, with one stage), every source's
        buffers found (those not sent are needed after, by those copies and kept
        shards), the copies of kept shards, and the caller's own (``before``)."""
        nonlocal outs, kept
        if outs is None:
            outs = _destinations(program, shardings)
            local.run_copies(_local_tasks(sched, outs, views))
        elif local_done is not None:
            local_done.result()
        for li in range(len(sources)):
            bufs[li]  # noqa: B018 - found (and kept) by __missing__
        kept = _kept_shards(program, shardings, bufs)
        if before is not None:
            before()

    if program.local_devices:
        # A pipeline: this thread packs stage s + 1 while stage s is on the wire (XLA
        # runs it asynchronously), and a helper thread unpacks each stage on arrival.
        last = program.status_stage
        for s in range(len(sched.stages)):
            sent: list[jax.Array] | None = None
            if failure is None:
                try:
                    sent = _pack_stage(program, s, views)
                except Exception as e:
                    failure = e
            if sent is None:
                sent = _filler_stage(program, s)
            if s == last:
                if failure is None:
                    try:
                        settle()
                    except Exception as e:
                        failure = e
                reported = failure is not None
                if failure is not None:
                    common.post_failure(failure)
                sent.append(common.status_input(program, reported))
            if previous:
                # One stage in flight at a time: XLA may run a program's parts on this
                # process's devices at different times, and with two stages in flight
                # their collectives met in different orders on different processes and
                # deadlocked (3 processes x 2 devices, many small stages, under load).
                # The next stage is still packed while this one travels.
                jax.block_until_ready(previous)
            # A failure of the call itself is not survivable: whether this process
            # joined the stage's collectives is unknown, so it raises at once.
            received = list(program.compiled(s)(*sent))
            previous = list(received)
            if s == last:
                status = received.pop()
            if failure is None:
                try:
                    if outs is None:
                        # Taken while the first stage travels: a stage starts only once
                        # every process has called it, so nothing slow comes first.
                        outs = _destinations(program, shardings)
                        # Copies within this process need no network: the unpacking
                        # thread does them first, while the first stage travels.
                        tasks = _local_tasks(sched, outs, views)
                        if tasks:
                            local_done = _unpack_pool().submit(local.run_copies, tasks)
                            pending.append(local_done)
                    pending.append(
                        _unpack_pool().submit(_unpack_stage, program, s, received, sent, outs)
                    )
                except Exception as e:
                    failure = e
            del sent, received
    try:
        if failure is None and kept is None:  # no status stage: settled here, at the end
            settle()
    finally:
        for f in pending:  # nothing keeps writing once this returns or raises
            f.exception()
    if failure is not None:
        if reported:
            assert status is not None
            common.shared_failure(failure, status, "while moving data")
            failure.add_note(
                "reshard: this process failed while moving data. It still took part in "
                "every stage, and every other process raises too; the inputs are intact."
            )
        raise failure
    common.check_status(status, "while moving data")
    for f in pending:
        f.result()
    assert outs is not None and kept is not None
    return [_output(program, li, sharding, outs, kept) for li, sharding in enumerate(shardings)]


def _kept_shards(
    program: CollectiveProgram, shardings: Sequence[Any], bufs: _SourceBuffers
) -> dict[tuple[int, int], jax.Array]:
    """Per (array, position) of this process whose destination shard is a source shard
    kept as it is: that buffer, handed over, or where the program copies kept shards on
    their devices (``copy_kept``), its copy there (``local.copies_in_place``: a copy
    program where it carries the type exactly, else PjRt); and whose destination shard
    is a whole source shard of another of its devices (``moved_whole``): its copy by
    PjRt, device to device."""
    kept: dict[tuple[int, int], jax.Array] = {}
    moves: list[tuple[tuple[int, int], jax.Array, Any]] = []
    for li, sharding in enumerate(shardings):
        for d in _compat.addressable_devices(sharding):
            pos = program.position[d.id]
            src_pos = program.reused[li].get(pos)
            if src_pos is not None:
                kept[li, pos] = bufs[li][program.devices[src_pos].id]
            src_pos = program.moved_whole[li].get(pos)
            if src_pos is not None:
                to = jax.sharding.SingleDeviceSharding(d, memory_kind=sharding.memory_kind)
                moves.append(((li, pos), bufs[li][program.devices[src_pos].id], to))
    copy = [k for k in kept if program.copy_kept[k[0]]]
    for k, c in zip(copy, local.copies_in_place([kept[k] for k in copy]), strict=True):
        kept[k] = c
    moved = _compat.copy_shards([m[1] for m in moves], [m[2] for m in moves])
    for (k, _, _), c in zip(moves, moved, strict=True):
        kept[k] = c
    return kept


def _output(
    program: CollectiveProgram,
    li: int,
    sharding: Any,
    outs: dict[int, dict[int, np.ndarray]],
    kept: Mapping[tuple[int, int], jax.Array],
) -> jax.Array:
    """Destination array ``li``, of this process's destination blocks (zero-copy on
    CPU) and of the source shards it keeps as they are (``_kept_shards``)."""
    shard_shape = box_shape(program.leaf_plans[li].spec.dst[0].box)
    parts: list[Any] = []
    devs = list(_compat.addressable_devices(sharding))
    for d in devs:
        pos = program.position[d.id]
        buf = kept.get((li, pos))
        if buf is not None:
            # (A jit output's empty shard may have the whole array's shape.)
            parts.append(_compat.empty_as(buf, shard_shape, sharding.memory_kind))
        else:
            parts.append(outs[pos][li].reshape(shard_shape))
    return common.finish(program.leaf_plans[li], program.dtypes[li], sharding, parts, devs)
