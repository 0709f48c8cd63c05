"""Device-packed collective transfers: the program itself cuts, moves and places pieces.

Used when the union mesh holds accelerators (it also runs on CPU, where host packing
is faster). Each array enters the program as a *block array* on the union mesh:
device ``k``'s block is its source shard, or a zero placeholder where it holds none,
put together with ``jax.make_array_from_single_device_arrays`` without copying. Inside
``shard_map`` each device cuts its pieces with ``dynamic_slice`` at offsets it looks
up in small tables indexed by ``lax.axis_index``, concatenates them per element type,
``ppermute``s them (one collective per round and element type, however many arrays
and pieces), and writes what it receives into its output block with
``dynamic_update_slice``. The output blocks of the destination devices become the
result.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from . import _collective_common as common
from . import _compat
from ._collective_common import AXIS, Copy, LeafBlocks
from ._local_executor import bits_dtype, from_bits, in_compute_memory_all, in_memory_kinds, to_bits

if TYPE_CHECKING:
    from ._collective_executor import CollectiveProgram


# Per device, the most bytes of placeholders one program takes: the arrays run in
# groups (one program each) whose source blocks, where a device of the union holds no
# source shard of an array, add up to at most this (an array over it alone). Without
# groups, a device of a disjoint trainer -> sampler sync would hold zeros as large as
# a trainer device's whole share of the tree while the program runs.
GROUP_BYTES = 1 << 30


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
      groups: per element type the program holds (``bits_dtype``), the slots whose
        pieces travel packed in one buffer (one ``ppermute`` per group).
    """

    perm: tuple[tuple[int, int], ...]
    groups: tuple[tuple[_Slot, ...], ...]


def _slots(copies: Sequence[Copy], keep: Sequence[set[int]], n: int) -> list[_Slot]:
    """Lays out the copies of one round as slots.

    Within a round each position sends to at most one other, so the copies of one
    sender all go to one receiver. Copies of the same array and shape from different
    senders share a slot; a sender's k-th copy of that kind goes to the k-th slot of
    that kind. For the regular patterns of real shardings every sender fills the same
    slots, so nothing is padded.
    """
    per_sender: dict[tuple[int, tuple[int, ...], int], list[Copy]] = defaultdict(list)
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


def device_rounds(
    copies: Sequence[Copy], keep: Sequence[set[int]], dtypes: Sequence[np.dtype], n: int
) -> list[_Round]:
    """The device-packed schedule: per round and element type, one packed ``ppermute``.

    Copies that stay on their device need no collective and form one local round.
    """
    remote: dict[tuple[int, int], list[Copy]] = defaultdict(list)
    local: list[Copy] = []
    for c in copies:
        if c[1] == c[2]:
            local.append(c)
        else:
            remote[(c[1], c[2])].append(c)

    def grouped(cs: Sequence[Copy]) -> tuple[tuple[_Slot, ...], ...]:
        # Grouped by the type the program holds them in (``bits_dtype``): floats of one
        # width share a buffer with the unsigned integers of that width. Gloo also moves
        # ``bfloat16`` far slower than integers (seen on jax 0.10, CPU).
        by_type: dict[str, list[_Slot]] = defaultdict(list)
        for slot in _slots(cs, keep, n):
            by_type[str(bits_dtype(dtypes[slot.leaf]))].append(slot)
        return tuple(tuple(ss) for _, ss in sorted(by_type.items()))

    rounds = [
        _Round(members, grouped([x for pr in members for x in remote[pr]]))
        for members in common.rounds_of(list(remote))
    ]
    if local:
        rounds.append(_Round((), grouped(local)))
    return rounds


class _Lookup:
    """This position's entries of the slots' tables, inside one trace of ``body``.

    A column whose entries are equal at every position is a constant (``dynamic_slice``
    at a constant start is a plain slice); the others are looked up by ``axis_index``,
    each distinct column once per program, however many slots share it.
    """

    def __init__(self, me: jax.Array) -> None:
        self.me = me
        self.memo: dict[tuple[str, bytes], jax.Array] = {}

    def column(self, col: np.ndarray) -> np.int32 | bool | jax.Array:
        if (col == col[0]).all():
            # A start as a 32-bit integer, the type of the looked-up ones: a Python int
            # is a 64-bit one with jax_enable_x64 on, and dynamic_slice refuses starts
            # of mixed types.
            return col[0].item() if col.dtype == bool else np.int32(col[0])
        key = (col.dtype.str, col.tobytes())
        if key not in self.memo:
            self.memo[key] = lax.dynamic_index_in_dim(np.asarray(col), self.me, keepdims=False)
        return self.memo[key]

    def row(self, table: np.ndarray) -> tuple[np.int32 | bool | jax.Array, ...]:
        return tuple(self.column(table[:, k]) for k in range(table.shape[1]))


def _cut(x: jax.Array, slot: _Slot, block: tuple[int, ...], at: _Lookup) -> jax.Array:
    """This position's piece of ``slot``, out of its source block ``x``."""
    if slot.shape == block:
        return x  # the whole block: no slicing
    return lax.dynamic_slice(x, at.row(slot.send_start), slot.shape)


def _put(
    out: jax.Array | None, piece: jax.Array, slot: _Slot, block: tuple[int, ...], at: _Lookup
) -> jax.Array:
    """Writes this position's received ``piece`` of ``slot`` into its output block."""
    if out is None and slot.shape == block and slot.recv_mask is None:
        return piece  # fills the whole block wherever it matters: no zero-fill, no copy
    if out is None:
        out = lax.full(block, 0, piece.dtype)
    starts = at.row(slot.recv_start)
    if slot.recv_mask is not None:
        # A position that receives nothing in this slot must not overwrite its output:
        # it writes back what is already there (costs the piece, not the block).
        receives = at.column(slot.recv_mask)
        if receives is False:
            return out
        if receives is not True:
            piece = lax.select(receives, piece, lax.dynamic_slice(out, starts, slot.shape))
    return lax.dynamic_update_slice(out, piece, starts)


def body(
    blocks: Sequence[LeafBlocks], rounds: Sequence[_Round], inputs: Sequence[jax.Array]
) -> tuple[jax.Array, ...]:
    """What every device runs: all rounds, then its output blocks."""
    at = _Lookup(lax.axis_index(AXIS))
    dtypes = [x.dtype for x in inputs]
    inputs = [to_bits(x) for x in inputs]  # cut, moved and placed as bits
    outs: list[jax.Array | None] = [None] * len(blocks)
    for rd in rounds:
        # Every piece of a group has the group's type already: the inputs are bits.
        for slots in rd.groups:
            pieces = [_cut(inputs[s.leaf], s, blocks[s.leaf].src_block, at) for s in slots]
            if rd.perm and len(pieces) == 1:
                pieces = [lax.ppermute(pieces[0], AXIS, list(rd.perm))]
            elif rd.perm:
                # One buffer per round and element type: one collective, not one per piece.
                flat = lax.concatenate([lax.reshape(p, (p.size,)) for p in pieces], 0)
                flat = lax.ppermute(flat, AXIS, list(rd.perm))
                ends = np.cumsum([math.prod(s.shape) for s in slots]).tolist()
                pieces = [
                    lax.reshape(lax.slice_in_dim(flat, end - math.prod(s.shape), end), s.shape)
                    for end, s in zip(ends, slots, strict=True)
                ]
            for s, piece in zip(slots, pieces, strict=True):
                outs[s.leaf] = _put(outs[s.leaf], piece, s, blocks[s.leaf].dst_block, at)
    return tuple(
        from_bits(o if o is not None else lax.full(b.dst_block, 0, x.dtype), dt)
        for o, b, x, dt in zip(outs, blocks, inputs, dtypes, strict=True)
    )


def carrier(dtype: np.dtype) -> np.dtype:
    """The element type a device-packed program holds ``dtype`` in: sub-byte types
    widened to a byte, with every value kept (int4 -> int8; float4_e2m1fn ->
    float8_e4m3fn, which holds each of its 16 codes exactly, both zeros included)."""
    if jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8:
        return np.dtype(np.int8 if jnp.issubdtype(dtype, jnp.signedinteger) else np.uint8)
    if jnp.issubdtype(dtype, jnp.floating) and jnp.finfo(dtype).bits < 8:
        return np.dtype(jnp.float8_e4m3fn)
    return dtype


# The most pieces (copies, ``all_copies``) one program moves: its size, and the time
# and memory compiling it takes, grow with them (on 8 CPU devices, ~3 ms of compiling
# and ~70 KiB held per piece: a relayout of 400 small arrays of 16 pieces each took
# 22 s and held 460 MiB as one program).
COPIES_PER_PROGRAM = 512


def block_inputs(
    program: CollectiveProgram, sources: Sequence[jax.Array], leaves: Sequence[int]
) -> list[jax.Array]:
    """Per array of ``leaves``, the block array on the union mesh, from this process's
    source shards (zero placeholders where a device holds none)."""
    per_leaf: dict[int, dict[int, jax.Array]] = {}
    missing: dict[int, list[int]] = defaultdict(list)  # device id -> leaves lacking a block
    held = {li: _compat.device_buffers(sources[li]) for li in leaves}
    # Shards in a host memory kind go to device memory (programs read that) in one
    # batched copy for the group, not one call per shard.
    staged = in_compute_memory_all(
        [(held[li][d.id], d) for li in leaves for d in program.local_devices if d.id in held[li]]
    )
    for li in leaves:
        bufs = held[li]
        blocks: dict[int, jax.Array] = {}
        for d in program.local_devices:
            b = bufs.get(d.id)
            if b is None:
                missing[d.id].append(li)
                continue
            b = staged.get(id(b), b)
            if program.leaves[li].scalar:
                b = b.reshape((1,))
            else:
                b = _compat.empty_as(b, program.leaves[li].src_block)
            if b.dtype != program.in_dtypes[li]:
                b = b.astype(program.in_dtypes[li])
            blocks[d.id] = b
        per_leaf[li] = blocks
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
        for li, blocks in per_leaf.items()
    ]


def kept_blocks(
    program: CollectiveProgram, li: int, out: jax.Array, sharding: jax.sharding.Sharding
) -> dict[int, jax.Array]:
    """The output blocks of leaf ``li`` that ``assemble_parts`` uses: those of this process's
    destination devices that are not handed a source shard. Every other device of the
    union mesh also gets an output block from the SPMD program (garbage, as large as a
    destination shard); dropping them as each group's program is dispatched frees them
    when it finishes, instead of holding every group's until the last one has run (on a
    disjoint trainer -> sampler sync, as much again as a trainer device's share)."""
    reused = program.reused[li]
    bufs = _compat.device_buffers(out)
    return {
        d.id: bufs[d.id]
        for d in _compat.addressable_devices(sharding)
        if program.position[d.id] not in reused
    }


def assemble_parts(
    program: CollectiveProgram,
    li: int,
    src: jax.Array,
    out_bufs: dict[int, jax.Array],
    sharding: jax.sharding.Sharding,
) -> list[jax.Array]:
    """The destination shards of leaf ``li`` (in ``addressable_devices(sharding)``
    order) from its output blocks (``kept_blocks``) and reused shards; output blocks
    are still in device memory (``assemble`` moves them to a host memory kind)."""
    reused = program.reused[li]
    src_bufs = _compat.device_buffers(src) if reused else {}
    parts: list[jax.Array] = []
    block_shape = program.leaves[li].dst_block
    for d in _compat.addressable_devices(sharding):
        pos = program.position[d.id]
        if pos in reused:
            kept = src_bufs[program.devices[reused[pos]].id]
            parts.append(_compat.empty_as(kept, block_shape, sharding.memory_kind))
        else:
            block = out_bufs[d.id]
            if program.leaves[li].scalar:
                block = block.reshape(())
            else:
                block = _compat.empty_as(block, block_shape)
            if block.dtype != program.dtypes[li]:
                block = block.astype(program.dtypes[li])
            parts.append(block)
    return parts


def assemble(
    program: CollectiveProgram,
    sources: Sequence[jax.Array],
    outputs: Sequence[dict[int, jax.Array]],
    shardings: Sequence[jax.sharding.Sharding],
) -> list[jax.Array]:
    """Every leaf's destination array (``assemble_parts``). Shards bound for a host
    memory kind move there in one batched copy for the whole call, not one call per
    shard (a dispatch each: thousands for hundreds of arrays on 8 accelerators)."""
    parts = [
        assemble_parts(program, li, src, out, sharding)
        for li, (src, out, sharding) in enumerate(zip(sources, outputs, shardings, strict=True))
    ]
    devs = [list(_compat.addressable_devices(s)) for s in shardings]
    placed = iter(
        in_memory_kinds(
            [
                (part, d, s.memory_kind)
                for s, ps, ds in zip(shardings, parts, devs, strict=True)
                for part, d in zip(ps, ds, strict=True)
            ]
        )
    )
    return [
        common.finish(program.leaf_plans[li], program.dtypes[li], s, [next(placed) for _ in ps], ds)
        for li, (s, ps, ds) in enumerate(zip(shardings, parts, devs, strict=True))
    ]


def run_device_packed(
    program: CollectiveProgram,
    sources: Sequence[jax.Array],
    shardings: Sequence[jax.sharding.Sharding],
    *,
    wait: bool = False,
    before: Callable[[], None] | None = None,
) -> list[jax.Array]:
    """Runs a device-packed program per group of arrays and builds this process's
    destination arrays; with ``wait``, returns only once the programs (their
    collectives) have finished here, even where this process keeps none of their
    outputs. ``before`` (the caller's own copies) is called once, first, and across
    processes inside the first group's exchange of failures.

    A group's placeholders live only while its program runs, and the next group's
    are made once it has finished where both would add up to more than
    ``GROUP_BYTES``, which bounds the extra device memory a reshard takes at the price
    of a wait between such groups.

    Across processes, a failure while building this process's inputs (out of memory
    for the placeholders, or staging host-memory shards) must not leave the peers
    waiting in a program's collectives: before calling it, every process of the
    union mesh learns whether any other failed (``exchange_status``), and if one did,
    none calls it and every one raises, all still in step. That costs one small
    all-reduce per group, and waiting for the inputs to be ready (an error in making
    them surfaces only then), so such a reshard returns once its inputs exist.
    """
    outputs: list[dict[int, jax.Array]] = [{} for _ in sources]
    # A process that holds no device of the union has nothing to send or keep.
    groups = program.groups if program.local_devices else []
    exchanged = program.crosses_processes and bool(groups)
    running: list[jax.Array] = []  # an output of each program not waited for
    alive = 0  # the placeholder bytes per device of those programs
    if before is not None and not exchanged:
        before()
    for gi, group in enumerate(groups):
        if not exchanged:
            inputs = block_inputs(program, sources, group)
        else:
            failure: Exception | None = None
            try:
                if gi == 0 and before is not None:
                    before()
                inputs = jax.block_until_ready(block_inputs(program, sources, group))
            except Exception as e:
                failure = e
                common.post_failure(e)
            status = program.exchange_status(failure is not None)
            if failure is not None:
                common.shared_failure(failure, status, "while preparing their inputs")
                failure.add_note(
                    "reshard: this process failed while preparing its part of a "
                    "collective reshard. It told the other processes before the data "
                    "it was preparing moved, and every one of them raises too; the "
                    "inputs are intact."
                )
                raise failure
            common.check_status(status, "while preparing their inputs")
        moved = program.compiled(gi)(*inputs)
        del inputs  # the placeholders go once the program is done with them
        # The placeholders are freed only once the program is done: before the next
        # group makes more, wait for that where they would add up to more than the
        # bound (``GROUP_BYTES``); groups cut for their pieces alone run back to back.
        # (One output says when a program is done; its smallest is held until then.)
        running.append(min(moved, key=lambda a: a.nbytes))
        alive += program.placeholder_bytes[gi]
        last = gi + 1 == len(groups)
        if (wait and last) or (
            not last and alive + program.placeholder_bytes[gi + 1] > program.group_bytes
        ):
            jax.block_until_ready(running)
            running, alive = [], 0
        for li, out in zip(group, moved, strict=True):
            outputs[li] = kept_blocks(program, li, out, shardings[li])
        del moved, out  # the other output blocks (garbage) go now
    del running
    return assemble(program, sources, outputs, shardings)
