"""The local executor: runs a plan inside one process.

Two ways of moving bytes, chosen per run:

* **host** (CPU devices): every destination shard is a fresh 64-byte-aligned numpy
  buffer filled straight from zero-copy numpy views of the source shards, then handed
  to XLA without a copy. Each moved byte is copied once; nothing is gathered.
* **device** (accelerators; also runs on CPU for testing): per source device,
  compiled programs cut out the pieces that leave it; one batched ``device_put``
  moves them device to device; per destination device, compiled programs write the
  received pieces and the locally kept ones into the new shards. Each program takes
  at most ``PIECES_PER_PROGRAM`` pieces, so that compiling stays cheap however large
  the tree, and the pieces of repeated layers fill programs of their own, compiled
  once: dispatches scale with devices and pieces / ``PIECES_PER_PROGRAM``.

Neither path deletes anything: donation is the caller's last step, after every output
exists, so a failure part-way loses no input.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import weakref
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np

from . import _buffers, _compat, _exact, _programs
from ._buffers import (
    NATIVE,
    carve,
    copy_into,
    copy_pieces,
    copy_rows,
    host_empty,
    native_copy,
    piece_table,
)
from ._geometry import box_shape, relative_slices
from ._planner import LeafPlan

# (source shard index, slices into the source shard, slices into the destination
# shard, the raw row item to copy by, ``NATIVE`` or ``None``: see ``copy_mode``)
Copy = tuple[int, tuple[slice, ...], tuple[slice, ...], "np.dtype | str | None"]


def _c_contiguous(piece: tuple[int, ...], full: tuple[int, ...]) -> bool:
    """Whether a box of shape ``piece`` cut out of a C-contiguous array of shape
    ``full`` is C-contiguous (numpy's rule: every dimension longer than 1 has the
    stride of a contiguous array of ``piece``)."""
    if 0 in piece:
        return True
    inner_piece = inner_full = 1
    for p, f in zip(reversed(piece), reversed(full), strict=True):
        if p > 1 and inner_piece != inner_full:
            return False
        inner_piece *= p
        inner_full *= f
    return True


def copy_mode(
    piece: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...], itemsize: int
) -> np.dtype | str | None:
    """How ``copy_into`` would copy a piece of shape ``piece`` from a C-contiguous
    source shard of shape ``src`` into one of shape ``dst``, decided once per plan from
    the shapes: by the C extension (``NATIVE``: a slice of a C-contiguous array has a
    contiguous last axis), by raw rows of this item type, or (``None``) by plain
    assignment."""
    if piece and _buffers.NATIVE_COPY and math.prod(piece) * itemsize >= _buffers.NATIVE_COPY_BYTES:
        return NATIVE
    if len(piece) < 2 or piece[-1] <= 1 or piece[-1] * itemsize > _buffers.ROW_ITEM_BYTES:
        return None
    if _c_contiguous(piece, src) and _c_contiguous(piece, dst):
        return None
    return np.dtype((np.void, piece[-1] * itemsize))


@dataclass(frozen=True)
class LeafJob:
    """What the executor needs for one array, precomputed once per plan."""

    plan: LeafPlan
    dtype: np.dtype
    copies: tuple[tuple[Copy, ...], ...]  # per destination shard
    reused: dict[int, int]  # destination shard index -> source shard index
    dst_of: dict[int, int]  # destination device id -> destination shard index
    shapes: tuple[tuple[int, ...], ...]  # per destination shard
    nbytes: tuple[int, ...]  # per destination shard
    # destination shard index -> the source shard index it is a whole copy of (the
    # same box: one piece, nothing cut or assembled)
    whole: dict[int, int]
    # per destination shard: its copies as rows for ``_fastcopy.copy_pieces`` (one C
    # call for all of them), or ``None`` where they are made one by one (``_fill``)
    tables: tuple[np.ndarray | None, ...]
    # per destination shard: the source shard indices its copies read
    reads: tuple[tuple[int, ...], ...]

    @staticmethod
    def build(lp: LeafPlan, dtype: np.dtype) -> LeafJob:
        spec = lp.spec
        dt = np.dtype(dtype)
        per_dst: list[list[Copy]] = [[] for _ in spec.dst]
        for p in lp.kept + lp.moved:
            sbox, dbox = spec.src[p.src].box, spec.dst[p.dst].box
            mode = copy_mode(box_shape(p.box), box_shape(sbox), box_shape(dbox), dt.itemsize)
            per_dst[p.dst].append(
                (p.src, relative_slices(p.box, sbox), relative_slices(p.box, dbox), mode)
            )
        for di, si in lp.reused:
            box = spec.dst[di].box
            full = relative_slices(box, box)
            per_dst[di].append((si, full, full, None))
        dst_of = {s.device: i for i, s in enumerate(spec.dst)}
        shapes = tuple(box_shape(s.box) for s in spec.dst)
        nbytes = tuple(math.prod(sh) * dt.itemsize for sh in shapes)
        copies = tuple(tuple(c) for c in per_dst)
        whole = {
            di: c[0][0]
            for di, c in enumerate(copies)
            if len(c) == 1 and spec.src[c[0][0]].box == spec.dst[di].box
        }
        src_shapes = [box_shape(s.box) for s in spec.src]
        tables = tuple(
            piece_table([c[:3] for c in cs], src_shapes, sh, dt.itemsize)
            if _buffers.NATIVE_COPY
            else None
            for cs, sh in zip(copies, shapes, strict=True)
        )
        reads = tuple(tuple(sorted({c[0] for c in cs})) for cs in copies)
        return LeafJob(
            lp, dt, copies, dict(lp.reused), dst_of, shapes, nbytes, whole, tables, reads
        )


def _fill(
    out: np.ndarray,
    copies: Sequence[Copy],
    bufs: dict[int, Any],
    src_specs: Sequence[Any],
    views: dict[int, np.ndarray],
) -> np.ndarray:
    """Writes each copy into ``out`` from a zero-copy view of its source shard, as
    ``copy_into`` would, with its choice of loop made once per plan (``copy_mode``):
    its checks cost several times a small piece's copy."""
    for si, ssl, dsl, row in copies:
        v = views.get(si)
        if v is None:
            v = views[si] = _compat.host_view(bufs[src_specs[si].device])
        if row is None:
            out[dsl] = v[ssl]
        elif isinstance(row, str):  # NATIVE
            d, s = out[dsl], v[ssl]
            if not native_copy(d, s):  # pragma: no cover - a source with a strided last axis
                d[...] = s
        else:
            try:
                copy_rows(out[dsl], v[ssl], row)
            except ValueError:  # pragma: no cover - a source with a strided last axis
                copy_into(out, v[ssl], dsl)
    return out


def _fill_all(
    job: LeafJob,
    outs: Sequence[tuple[np.ndarray, int]],
    bufs: dict[int, Any],
    views: dict[int, np.ndarray],
    part: int = 0,
    parts: int = 1,
) -> None:
    """Fills ``(destination shard, its index)``s of one array by one call of the C
    extension (``job.tables``; ``views`` holds every source they read), or, where a
    source view is not a plain C-contiguous buffer, copy by copy (``_fill``). With
    ``parts``, its part ``part`` of every copy (``banded_tasks``)."""
    srcs = [views.get(si) for si in range(len(job.plan.spec.src))]
    # (Only shards that have a table are passed here.)
    work = [(out, cast(np.ndarray, job.tables[di])) for out, di in outs]
    # A refusal comes before any byte is written, and alike for every part.
    if not copy_pieces(srcs, work, part, parts) and part == 0:
        for out, di in outs:
            _fill(out, job.copies[di], bufs, job.plan.spec.src, views)


# Shards below this size are carved out of a shared allocation per array (or per run
# of tiny arrays, ``_buffers.carve``): an allocation per shard costs ~1 us, which
# would weigh on trees of many small leaves. Larger shards get their own memory, so
# freeing an output leaf frees its big buffers.
SMALL_SHARD_BYTES = 1 << 20
# Copies of large shards run on a few threads: numpy releases the GIL while copying.
COPY_THREADS = max(1, min(4, os.cpu_count() or 1))
_pool: ThreadPoolExecutor | None = None


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(COPY_THREADS, thread_name_prefix="reshard-copy")
    return _pool


# Copies of at least this many bytes run on the copy threads.
THREADED_COPY_BYTES = 1 << 20


def banded_tasks(
    nbytes: int, copy: Callable[[int, int], Any]
) -> list[tuple[int, Callable[[], Any]]]:
    """``run_copies`` tasks for one ``copy(part, parts)`` of ``nbytes`` that
    ``_buffers.copy_pieces`` splits by bands: as many parts as copy threads, each of
    ``THREADED_COPY_BYTES`` or more. One call writing every destination of a source
    reads the source once (in bands); the parts share it between the threads."""
    parts = max(1, min(COPY_THREADS, nbytes // THREADED_COPY_BYTES))
    return [(nbytes // parts, functools.partial(copy, p, parts)) for p in range(parts)]


def run_copies(tasks: Sequence[tuple[int, Callable[[], Any]]]) -> None:
    """Runs ``(bytes, copy task)``s: large ones on the copy threads (numpy releases the
    GIL while copying, and first-touch page faults of fresh memory then happen in
    parallel too), small ones right here (a thread hand-off costs more than they do).
    Tasks must not write the same memory."""
    big = [t for n, t in tasks if n >= THREADED_COPY_BYTES]
    threaded = len(big) > 1 and COPY_THREADS > 1
    pending = [_copy_pool().submit(t) for t in big] if threaded else []
    try:
        if not pending:
            for t in big:
                t()
        for n, t in tasks:
            if n < THREADED_COPY_BYTES:
                t()
    finally:
        # Even when a task here raised: nothing may still be writing once this returns.
        for f in pending:
            f.exception()
    for f in pending:
        f.result()


# Whether ``run_host`` copies destination shards that are whole source shards device
# to device through PjRt instead of through host memory; ``None``: off CPU only. On
# CPU a host view is the buffer itself, and the host copy is as fast; elsewhere the
# host executor's path runs only for types that programs do not carry exactly
# (``_exact``), and PjRt's copies keep every bit without a trip through the host.
PJRT_WHOLE_SHARDS: bool | None = None


def run_host(
    jobs: Sequence[LeafJob],
    sources: Sequence[jax.Array],
    shardings: Sequence[jax.sharding.Sharding],
    targets: Sequence[Sequence[tuple[int, Any]]],
    *,
    alias: Sequence[bool],
) -> list[jax.Array]:
    """Executes through host views: one copy per moved or kept byte on CPU. Off CPU,
    where it moves the types that programs do not carry exactly, shards are read
    with explicit transfers, and shards that are whole source shards are copied by
    PjRt (``PJRT_WHOLE_SHARDS``).

    Args:
      jobs: one per array, from ``LeafJob.build``.
      sources: the source arrays (key arrays already converted to their key data).
      shardings: destination sharding per array (of the key data for key arrays).
      targets: per array, ``(destination shard index, device)`` for each device of
        this process, in the order of the sharding's addressable devices.
      alias: per array, whether its unchanged shards are handed over without a copy.
    """
    on_cpu = bool(sources) and _compat.platform_of(sources[0]) == "cpu"  # (one plan, one)
    pjrt = not on_cpu if PJRT_WHOLE_SHARDS is None else PJRT_WHOLE_SHARDS
    # A host view of a shard: on CPU the buffer itself (``_compat.host_view``).
    host_view = _compat.cpu_view if on_cpu else _compat.host_view

    def by_pjrt(job: LeafJob, di: int) -> bool:
        return bool(pjrt and di in job.whole and job.nbytes[di])

    small = itertools.chain.from_iterable(
        carve(
            [
                [
                    job.nbytes[di]
                    for di, _ in tg
                    if job.nbytes[di] < SMALL_SHARD_BYTES
                    and not (a and di in job.reused)
                    and not by_pjrt(job, di)
                ]
                for job, tg, a in zip(jobs, targets, alias, strict=True)
            ]
        )
    )
    big: list[tuple[int, Callable[[], Any]]] = []  # (bytes, copy) per large shard
    batch: list[tuple[np.ndarray, int]] = []  # one array's small shards to fill at once
    banded: list[tuple[np.ndarray, int]] = []  # and its large ones
    leaves: list[tuple[list[Any], list[Any]]] = []
    # (array, position among its shards, source shard, destination) to copy by PjRt
    whole: list[tuple[int, int, jax.Array, jax.sharding.Sharding]] = []
    for job, src, sharding, tg, a in zip(jobs, sources, shardings, targets, alias, strict=True):
        spec = job.plan.spec
        bufs = _compat.device_buffers(src)
        views: dict[int, np.ndarray] = {}
        dst_bufs: list[Any] = []
        dst_devs: list[Any] = []
        for di, dev in tg:
            si = job.reused.get(di)
            if si is not None and a:
                # (A jit output's empty shard may have the whole array's shape.)
                kept = bufs[spec.src[si].device]
                dst_bufs.append(_compat.empty_as(kept, job.shapes[di], sharding.memory_kind))
            elif by_pjrt(job, di):
                part = bufs[spec.src[job.whole[di]].device]
                to = jax.sharding.SingleDeviceSharding(dev, memory_kind=sharding.memory_kind)
                whole.append((len(leaves), len(dst_bufs), part, to))
                dst_bufs.append(None)  # (filled below)
            else:
                n = job.nbytes[di]
                shape = job.shapes[di]
                table = job.tables[di]
                if table is not None:
                    for si in job.reads[di]:
                        if si not in views:
                            views[si] = host_view(bufs[spec.src[si].device])
                if n < SMALL_SHARD_BYTES:
                    out = next(small).view(job.dtype).reshape(shape)
                    if table is not None:
                        batch.append((out, di))
                    else:
                        _fill(out, job.copies[di], bufs, spec.src, views)
                else:
                    out = host_empty(shape, job.dtype)
                    if table is not None:
                        banded.append((out, di))
                    else:
                        fill = functools.partial(_fill, out, job.copies[di], bufs, spec.src, views)
                        big.append((n, fill))
                dst_bufs.append(out)
            dst_devs.append(dev)
        if batch:
            _fill_all(job, batch, bufs, views)
            batch = []
        if banded:
            # The array's large shards in one copy, split by bands between the threads.
            nb = sum(out.nbytes for out, _ in banded)
            big += banded_tasks(nb, functools.partial(_fill_all, job, banded, bufs, views))
            banded = []
        leaves.append((dst_bufs, dst_devs))
    if whole:
        # Copies in place by ``copies_in_place``, the others by one batched PjRt copy.
        stay = [i for i, w in enumerate(whole) if w[2].sharding == w[3]]
        go = [i for i, w in enumerate(whole) if w[2].sharding != w[3]]
        done = dict(zip(stay, copies_in_place([whole[i][2] for i in stay]), strict=True))
        moved = _compat.copy_shards([whole[i][2] for i in go], [whole[i][3] for i in go])
        done.update(zip(go, moved, strict=True))
        for i, (li, k, _, _) in enumerate(whole):
            leaves[li][0][k] = done[i]
    run_copies(big)  # no two tasks write the same memory (shards, or parts of them)
    outs = []
    for job, sharding, (dst_bufs, dst_devs) in zip(jobs, shardings, leaves, strict=True):
        kinds = {isinstance(b, jax.Array) for b in dst_bufs}
        if len(kinds) > 1:
            dst_bufs = _compat.place_host_buffers(dst_bufs, dst_devs, sharding.memory_kind)
        outs.append(_compat.assemble(job.plan.spec.shape, job.dtype, sharding, dst_bufs, dst_devs))
    return outs


def _copies(*xs: jax.Array) -> tuple[jax.Array, ...]:
    """Inside a compiled program: a copy of each input (as bits: see ``_exact``)."""
    return tuple(from_bits(jnp.copy(to_bits(x)), x.dtype) for x in xs)


def copies_in_place(arrays: Sequence[jax.Array]) -> list[jax.Array]:
    """Copies of single-device ``arrays`` in new buffers on their own devices and
    memory kinds.

    Those in their device's default memory, of a type that a copy program carries
    exactly (``_exact``), are copied by one compiled program per device; the others
    (in a host memory kind, where accelerators need not run programs, or of such a
    type) by PjRt, in one batched call. PjRt's copy of a buffer to its own device is
    far slower on an accelerator: 38 ms for 256 MiB of bf16 on a TPU v5e, against
    1.7 ms this way (``benchmarks/gpu_check.py``'s timing, jax 0.10.2).
    """
    out = list(arrays)
    by_device: dict[Any, list[int]] = defaultdict(list)
    rest: list[int] = []
    for i, a in enumerate(arrays):
        device: Any = next(iter(a.sharding.device_set))
        if (
            a.size
            and a.sharding.memory_kind in (None, device.default_memory().kind)
            and _exact.programs_keep_bits(device, a.dtype, only_copies=True)
        ):
            by_device[device].append(i)
        else:
            rest.append(i)
    for device, idx in by_device.items():
        xs = [arrays[i] for i in idx]
        key = ("copies", device.id, tuple((x.shape, str(x.dtype)) for x in xs))
        # (A partial per program: jit's own cache, keyed by the function, would keep
        # every signature's executable past the shared cache's bound.)
        fn = _programs.shared(key, lambda: _programs.OneExecutable(functools.partial(_copies)))
        for i, c in zip(idx, fn(*xs), strict=True):
            out[i] = c
    for i, c in zip(rest, _compat.fresh_copies([arrays[i] for i in rest]), strict=True):
        out[i] = c
    return out


def in_compute_memory_all(shards: Sequence[tuple[jax.Array, Any]]) -> dict[int, jax.Array]:
    """Each ``(shard, device)``'s shard in ``device``'s default memory (compiled
    programs read device memory, so shards in host memory kinds are staged there
    first), in one batched copy (``in_memory_kinds``): by ``id`` of each shard that
    had to move, its staged copy."""
    # (A shard whose sharding names no memory kind is in the default one.)
    named = [(a, d) for a, d in shards if a.sharding.memory_kind is not None]
    placed = in_memory_kinds([(a, d, d.default_memory().kind) for a, d in named])
    return {id(a): p for (a, _), p in zip(named, placed, strict=True) if p is not a}


def in_memory_kinds(shards: Sequence[tuple[jax.Array, Any, str | None]]) -> list[jax.Array]:
    """Each ``(shard, device, memory kind)``'s shard in that memory kind of its device
    (``None``: where it is), those not there already moved in one batched copy
    (``_compat.copy_shards``: a dispatch per call, not per shard)."""
    out = [a for a, _, _ in shards]
    move = [
        i for i, (a, _, mk) in enumerate(shards) if mk is not None and a.sharding.memory_kind != mk
    ]
    placed = _compat.copy_shards(
        [out[i] for i in move],
        [jax.sharding.SingleDeviceSharding(shards[i][1], memory_kind=shards[i][2]) for i in move],
    )
    for i, p in zip(move, placed, strict=True):
        out[i] = p
    return out


def bits_dtype(dtype: Any) -> np.dtype:
    """The element type compiled copies carry ``dtype`` in: a floating type as the
    unsigned integer of its width, anything else as itself.

    Copies move bits, but a compiled program moving floats may change NaNs: on jax
    0.10's CPU backend a ``concatenate`` of ``bfloat16`` (or ``float8_e5m2``) turns
    every NaN into the canonical one (``0x7fc0``), payload and sign lost, as assembling
    a shard from pieces does. Integers are moved bit for bit.
    """
    dtype = np.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating):
        width = jnp.finfo(dtype).bits
        unsigned = {4: jnp.uint4, 8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}
        if width in unsigned:
            return np.dtype(unsigned[width])
    return dtype


def to_bits(x: jax.Array) -> jax.Array:
    """Inside a compiled program: ``x`` as its ``bits_dtype`` (a bitcast, free)."""
    bits = bits_dtype(x.dtype)
    return x if bits == x.dtype else jax.lax.bitcast_convert_type(x, bits)


def from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    """Inside a compiled program: the inverse of ``to_bits``."""
    return x if x.dtype == dtype else jax.lax.bitcast_convert_type(x, dtype)


# ----------------------------------------------------------------------------------
# Device path
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Send:
    leaf: int
    src: int  # source shard index
    slices: tuple[tuple[int, int], ...] | None  # None: the whole shard
    dst_device: int


# Every cut and build program some plan holds, by what it does (``compiled``).
_live_programs: weakref.WeakValueDictionary[tuple[str, _Static, int], Any] = (
    weakref.WeakValueDictionary()
)


class DeviceProgram:
    """The compiled-program form of a plan, built once and cached with the plan (the
    compiled programs themselves are shared by equal plans: ``compiled``)."""

    def __init__(self, jobs: Sequence[LeafJob]) -> None:
        self.jobs = list(jobs)
        # Pieces that change location, grouped by source device; ``send_order`` gives
        # each one its id.
        self.sends: dict[int, list[_Send]] = defaultdict(list)
        self.send_order: list[_Send] = []
        # Per destination device: the (leaf, destination shard) pairs it builds.
        self.builds: dict[int, list[tuple[int, int]]] = defaultdict(list)
        # Destination shards that are one moved piece, whole: the piece that arrives
        # is the shard, with no build program copying it again. It is a new buffer:
        # cut out, moved to another device, staged out of a host memory kind, or (a
        # source shard in device memory) moved to a host memory kind at the end. By
        # (leaf, destination shard), the piece's send id.
        self.adopted: dict[tuple[int, int], int] = {}
        # Per (leaf, destination shard): ("recv", send id, slices into the shard) or
        # ("local", source shard, slices into the source + slices into the shard).
        self.piece_inputs: dict[tuple[int, int], list[tuple[str, int, tuple[slice, ...]]]] = {}
        for li, job in enumerate(self.jobs):
            spec = job.plan.spec
            inputs: dict[int, list[tuple[str, int, tuple[slice, ...]]]] = defaultdict(list)
            for p in job.plan.kept:
                sbox, dbox = spec.src[p.src].box, spec.dst[p.dst].box
                sl = relative_slices(p.box, sbox) + relative_slices(p.box, dbox)
                inputs[p.dst].append(("local", p.src, sl))
            whole: set[int] = set()  # destination shards with a piece that is all of one
            for p in job.plan.moved:
                sbox, dbox = spec.src[p.src].box, spec.dst[p.dst].box
                if p.box == dbox:
                    whole.add(p.dst)
                cut = (
                    None
                    if p.box == sbox
                    else tuple((s.start, s.stop) for s in relative_slices(p.box, sbox))
                )
                send = _Send(li, p.src, cut, spec.dst[p.dst].device)
                inputs[p.dst].append(("recv", len(self.send_order), relative_slices(p.box, dbox)))
                self.sends[spec.src[p.src].device].append(send)
                self.send_order.append(send)
            for di, d in enumerate(spec.dst):
                if di in job.reused:
                    continue
                if di in whole and len(inputs[di]) == 1:
                    self.adopted[(li, di)] = inputs[di][0][1]
                else:
                    self.piece_inputs[(li, di)] = inputs[di]
                    self.builds[d.device].append((li, di))
        # Per device, its cut and build programs (keyed by what each does):
        # the pieces in chunks of at most ``PIECES_PER_PROGRAM`` (``_chunked``), so
        # that a program's size, and the time and memory compiling it takes, do not
        # grow with the tree, and the chunks of repeated layers are one program. Equal
        # plans (one rebuilt with cache=False, say) reuse the programs compiled for the
        # first, instead of compiling their own. The shapes and element types of their
        # inputs belong to the key too, so that each entry compiles exactly one program.
        self.cuts: dict[int, list[tuple[_Static, list[int]]]] = {
            dev: _chunked(
                [
                    ((s.slices, self._src_shape(s.leaf, s.src), str(self.jobs[s.leaf].dtype)), 1, i)
                    for i, s in enumerate(sends)
                    if s.slices is not None
                ]
            )
            for dev, sends in self.sends.items()
        }
        self.outputs: dict[int, list[tuple[_Static, list[tuple[int, int]]]]] = {
            dev: _chunked([self._output(li, di) for li, di in targets])
            for dev, targets in self.builds.items()
        }
        # The (leaf, source device) shards the programs read, staged once per call.
        reads = {(s.leaf, self.jobs[s.leaf].plan.spec.src[s.src].device) for s in self.send_order}
        for (li, _di), pieces in self.piece_inputs.items():
            spec = self.jobs[li].plan.spec
            reads.update((li, spec.src[ref].device) for kind, ref, _sl in pieces if kind == "local")
        self.reads = sorted(reads)
        # The jitted programs, by (what, chunk, device): one entry of the shared cache,
        # weighed as as many programs (``_programs.Programs``), found by every equal
        # plan (one rebuilt for each call, say), so that such a plan finds all of its
        # programs even where they outnumber what the cache holds.
        everything = tuple(
            (name, dev, tuple(desc for desc, _ in by_dev[dev]))
            for name, by_dev in (("cut", self.cuts), ("build", self.outputs))
            for dev in sorted(by_dev)
        )
        self._key = ("device programs", _Static(everything))
        self._fns: _programs.Programs = _programs.shared(self._key, _programs.Programs)

    def compiled(self, what: Callable[..., Any], desc: _Static, device_id: int) -> Any:
        """The jitted cut or build program of one chunk (its key holds the input
        avals too: one executable each), held with this plan's others, so that a plan
        kept in the plan cache never compiles again, whatever the shared cache
        dropped."""
        key = (what.__name__, desc, device_id)
        fn = self._fns.get(key)
        if fn is None:
            # The same program of another plan (repeated layers of another tree) is
            # shared while anything holds it.
            fn = _live_programs.get(key)
            if fn is None:
                fn = _live_programs.setdefault(
                    key, _programs.OneExecutable(functools.partial(what, desc))
                )
            self._fns[key] = fn
            _programs.grown(self._key, self._fns)
        return fn

    def _output(self, li: int, di: int) -> tuple[tuple[Any, ...], int, tuple[int, int]]:
        """What building one destination shard does (for ``_chunked``): its shape and
        type, and per piece, in ``piece_inputs``' order, where it goes (and for a kept
        piece, where it is cut from, out of a source shard of what shape)."""
        job = self.jobs[li]
        pieces = tuple(
            (
                kind,
                tuple((a.start, a.stop) for a in sl),
                None if kind == "recv" else self._src_shape(li, ref),
            )
            for kind, ref, sl in self.piece_inputs[(li, di)]
        )
        return (box_shape(job.plan.spec.dst[di].box), job.dtype, pieces), len(pieces), (li, di)

    def _src_shape(self, li: int, si: int) -> tuple[int, ...]:
        return box_shape(self.jobs[li].plan.spec.src[si].box)


class _Static:
    """A program's description, a cache key: nested tuples of ints, with the hash
    computed once (it is looked up on every call)."""

    __slots__ = ("desc", "_hash")

    def __init__(self, desc: tuple[Any, ...]) -> None:
        self.desc = desc
        self._hash = hash(desc)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Static) and self._hash == other._hash and self.desc == other.desc
        )


def _cut(cuts: _Static, *shards: jax.Array) -> tuple[jax.Array, ...]:
    """The pieces that leave one device, cut out of its source shards: as bits inside,
    in their own type at the program's edges (on a TPU v5e, a program whose output is
    ``bfloat16`` bitcast to ``uint16`` changes its NaNs and subnormals; types that
    programs change anyway do not come here: see ``_exact``)."""
    return tuple(
        from_bits(to_bits(x)[tuple(slice(a, b) for a, b in cut)], x.dtype)
        for x, (cut, _shape, _dtype) in zip(shards, cuts.desc, strict=True)
    )


def _build(outputs: _Static, *pieces: jax.Array) -> list[jax.Array]:
    """Destination shards of one device from the pieces it received and kept, in the
    order of their shards' ``piece_inputs`` (a kept piece is the source shard it is cut
    from)."""
    outs = []
    it = iter(pieces)
    for shape, dtype, inputs in outputs.desc:
        # Assembled as bits: see ``bits_dtype``.
        out = jnp.zeros(shape, bits_dtype(dtype))
        n = len(shape)
        for kind, bounds, _src_shape in inputs:
            sl = tuple(slice(a, b) for a, b in bounds)
            if kind == "recv":
                out = out.at[sl].set(to_bits(next(it)))
            else:
                out = out.at[sl[n:]].set(to_bits(next(it))[sl[:n]])
        outs.append(from_bits(out, dtype))
    return outs


# The most pieces one cut or build program takes. A program's size, and the time and
# memory compiling it takes, grow with its pieces (one program per device over a whole
# tree of 200 arrays of 4 pieces held ~220 MiB and compiled for ~9 s on CPU), while
# each program is one more dispatch per call.
PIECES_PER_PROGRAM = 64


def _chunked(items: Sequence[tuple[Hashable, int, Any]]) -> list[tuple[_Static, list[Any]]]:
    """``items`` (what each does, its pieces, its payload) in programs of at most
    ``PIECES_PER_PROGRAM`` pieces (an item of more is a program of its own), as (the
    program's key: what its items do, the items' payloads).

    Items that do the same thing (the same layer's arrays in a model of many layers)
    fill programs of their own, which are then one compiled program; what remains of
    them is packed with the rest in order.
    """
    groups: dict[Hashable, list[tuple[Hashable, int, Any]]] = {}
    for item in items:
        groups.setdefault(item[0], []).append(item)
    chunks: list[list[tuple[Hashable, int, Any]]] = []
    rest: list[tuple[Hashable, int, Any]] = []
    for group in groups.values():
        per = max(1, PIECES_PER_PROGRAM // max(1, group[0][1]))
        full = len(group) - len(group) % per if len(group) >= per else 0
        chunks.extend(group[k : k + per] for k in range(0, full, per))
        rest.extend(group[full:])
    packed = _programs.consecutive_groups([i[1] for i in rest], PIECES_PER_PROGRAM)
    chunks.extend([rest[k] for k in ks] for ks in packed)
    keys: dict[tuple[Hashable, ...], _Static] = {}  # (equal keys as one object: cheap lookups)
    out = []
    for c in chunks:
        desc = tuple(i[0] for i in c)
        out.append((keys.setdefault(desc, _Static(desc)), [i[2] for i in c]))
    return out


def run_device(
    program: DeviceProgram,
    sources: Sequence[jax.Array],
    shardings: Sequence[jax.sharding.Sharding],
    placements: Sequence[Sequence[tuple[int, Any]]],
    *,
    alias: Sequence[bool],
) -> list[jax.Array]:
    """Executes with compiled slicing/assembly on the devices themselves.

    ``placements`` is per array what ``run_host`` calls ``targets``, and ``alias`` what
    it calls ``alias``.
    """
    jobs = program.jobs
    bufs = [_compat.device_buffers(s) for s in sources]
    alldevs: dict[int, Any] = {}
    for tg in placements:
        alldevs.update((d.id, d) for _, d in tg)
    for s in sources:
        for d in _compat.addressable_devices(s.sharding):
            alldevs[d.id] = d

    # Source shards in a host memory kind are staged in device memory once per call,
    # however many pieces are read from them, all in one batched transfer (a call per
    # shard cost ~60 us each on CPU: 64 arrays of 8 shards from pinned_host, 77 ms
    # against 45).
    shards = [bufs[li][dev] for li, dev in program.reads]
    staged_by_id = in_compute_memory_all([(a, next(iter(a.devices()))) for a in shards])
    staged = {key: staged_by_id.get(id(a), a) for key, a in zip(program.reads, shards, strict=True)}

    def compute_ready(li: int, device_id: int) -> jax.Array:
        return staged[(li, device_id)]

    # 1. Cut the pieces that leave each source device (programs of ``_chunked``).
    payload: dict[int, jax.Array] = {}
    ids = {id(s): i for i, s in enumerate(program.send_order)}
    for dev, sends in program.sends.items():
        for send in sends:
            if send.slices is None:
                src_dev = jobs[send.leaf].plan.spec.src[send.src].device
                payload[ids[id(send)]] = compute_ready(send.leaf, src_dev)
        for desc, chunk in program.cuts[dev]:
            chunk_sends = [sends[k] for k in chunk]
            cut = program.compiled(_cut, desc, dev)(
                *(
                    compute_ready(s.leaf, jobs[s.leaf].plan.spec.src[s.src].device)
                    for s in chunk_sends
                )
            )
            payload.update(zip((ids[id(s)] for s in chunk_sends), cut, strict=True))
            del cut
    # 2. One batched device-to-device transfer for every piece that changes device
    # (one that only changes memory kind is already where it is built).
    recv = dict(payload)
    order = [
        i
        for i in sorted(payload)
        if alldevs[program.send_order[i].dst_device] not in payload[i].devices()
    ]
    moved = _compat.copy_shards(
        [payload[i] for i in order],
        [
            jax.sharding.SingleDeviceSharding(alldevs[program.send_order[i].dst_device])
            for i in order
        ],
    )
    recv.update(zip(order, moved, strict=True))
    # The cut pieces go once their transfers are done (JAX holds them until then), not
    # when this returns: they and the destination shards need not coexist.
    del payload
    # 3. Assemble each destination device's shards (programs of ``_chunked``).
    built: dict[tuple[int, int], jax.Array] = {}
    for dev, chunks in program.outputs.items():
        for desc, targets in chunks:
            inputs = [
                recv[ref]
                if kind == "recv"
                else compute_ready(li, jobs[li].plan.spec.src[ref].device)
                for li, di in targets
                for kind, ref, _sl in program.piece_inputs[(li, di)]
            ]
            outs = program.compiled(_build, desc, dev)(*inputs)
            built.update(zip(targets, outs, strict=True))
            del inputs
    for (li, di), ref in program.adopted.items():
        built[(li, di)] = recv[ref]
    # The received pieces and staged sources go once the shards are built, before
    # any is moved to a host memory kind below.
    del recv, moved
    staged.clear()
    # 4. Per array: move to the destination memory kind and put the shards together.
    # Kept shards that are not handed over are copied where they are
    # (``copies_in_place``).
    all_parts: list[list[Any]] = []
    copy_at: list[tuple[int, int]] = []
    for li, (job, sharding, tg) in enumerate(zip(jobs, shardings, placements, strict=True)):
        spec = job.plan.spec
        parts: list[Any] = []
        for di, _ in tg:
            si = job.reused.get(di)
            if si is None:
                parts.append(built[(li, di)])
                continue
            # (A jit output's empty shard may have the whole array's shape.)
            kept = bufs[li][spec.src[si].device]
            parts.append(_compat.empty_as(kept, job.shapes[di], sharding.memory_kind))
            if not alias[li]:
                copy_at.append((li, len(parts) - 1))
        all_parts.append(parts)
    if copy_at:
        to_copy = [all_parts[li][k] for li, k in copy_at]
        copies = copies_in_place(to_copy)
        for (li, k), c in zip(copy_at, copies, strict=True):
            all_parts[li][k] = c
    # Shards not yet in their destination memory kind, or not on their device (a
    # build program without inputs, for an empty shard, runs on the default device),
    # are moved in one batched transfer for the whole call.
    fix: list[tuple[int, int]] = []
    for li, (sharding, tg, parts) in enumerate(zip(shardings, placements, all_parts, strict=True)):
        mk = sharding.memory_kind
        fix.extend(
            (li, i)
            for i, (p, (_, d)) in enumerate(zip(parts, tg, strict=True))
            if (p.sharding.memory_kind != mk and mk is not None) or d not in p.devices()
        )
    placed = _compat.copy_shards(
        [all_parts[li][i] for li, i in fix],
        [
            jax.sharding.SingleDeviceSharding(
                placements[li][i][1], memory_kind=shardings[li].memory_kind
            )
            for li, i in fix
        ],
    )
    for (li, i), p in zip(fix, placed, strict=True):
        all_parts[li][i] = p
    return [
        _compat.assemble(job.plan.spec.shape, job.dtype, sharding, parts, [d for _, d in tg])
        for job, sharding, tg, parts in zip(jobs, shardings, placements, all_parts, strict=True)
    ]
