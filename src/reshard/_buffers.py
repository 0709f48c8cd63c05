"""Host memory for destination shards (and the collective executor's send buffers)
on CPU, recycled between reshards.

Why: writing into freshly mapped memory costs a page fault per 4 KiB, which makes
filling a new buffer two to three times slower than copying into warm memory. XLA's
own CPU buffers are recycled by its allocator, so without recycling ours a reshard
would lose to ``jax.device_put`` on page faults alone. Repeated reshards of the same
tree (weight sync every RL step) ask for the same sizes again and again.

How: a destination buffer is a view of a *block* handed out through a small *lease*
object. XLA adopts the view without copying and keeps it alive as long as the JAX
buffer lives; when the last view of a lease dies, a finalizer returns the block to the
pool, warm, for the next reshard. The pool is bounded (``RESHARD_HOST_POOL_BYTES``,
default 1 GiB; 0 disables it) and evicts the oldest blocks first. Blocks are never
handed out twice while any view of them is alive.
"""

from __future__ import annotations

import bisect
import functools
import math
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence

import numpy as np

ALIGN = 64  # XLA's CPU client adopts 64-byte aligned host buffers without a copy


def align_up(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN``: where the next buffer carved out of
    a shared block may start."""
    return -(-n // ALIGN) * ALIGN


# Strided copies whose rows (runs along the last axis) are this short or shorter are
# made one row at a time, each row one raw item (``copy_into``). Local executor, a
# 32 MiB array from row shards to column shards, A/B in one process: rows of 4 B took
# 0.22-0.25x the time, 16 B 0.62-0.71x, 64 B 0.73-0.88x; 128 B 0.99-1.01x; 512 B
# 1.02-1.11x, and the 288 MiB LLM tree (512 B and 2 KiB rows) 1.2x, where numpy's
# own loop over the elements is faster.
ROW_ITEM_BYTES = 64

try:  # optional C extension (``_fastcopy.c``); without it, numpy makes every copy
    from . import _fastcopy
except ImportError:  # pragma: no cover - not built (no C compiler at install)
    _fastcopy = None  # type: ignore[assignment]

# Copies of this many bytes or more, with contiguous last axes, are made by
# ``_fastcopy`` (each contiguous run one memcpy, without the GIL) where it is built and
# ``RESHARD_NATIVE_COPY`` is not 0; those of ``STREAM_COPY_BYTES`` or more (a copy, or
# all the boxes of one ``copy_pieces`` call together) are written with non-temporal
# stores (x86-64), which skip the cache: their destination (a send buffer, an output
# shard) is not read again soon, and they are larger than the L2.
NATIVE_COPY_BYTES = 64 << 10
STREAM_COPY_BYTES = 1 << 20
NATIVE_COPY = _fastcopy is not None and os.environ.get("RESHARD_NATIVE_COPY", "1") != "0"
NATIVE = "native"  # the local executor's mark for a copy it makes by ``native_copy``


def native_copy(dst: np.ndarray, src: np.ndarray) -> bool:
    """``dst[...] = src`` through ``_fastcopy`` where that applies (see
    ``NATIVE_COPY_BYTES``); ``False``, having copied nothing, where it does not."""
    n = dst.nbytes
    if (
        not NATIVE_COPY
        or n < NATIVE_COPY_BYTES
        or not dst.ndim
        or dst.shape != src.shape
        or dst.dtype != src.dtype
        or dst.strides[-1] != dst.itemsize
        or src.strides[-1] != src.itemsize
    ):
        return False
    try:
        _fastcopy.copy(dst.view(np.uint8), src.view(np.uint8), n >= STREAM_COPY_BYTES)
    except ValueError:  # overlapping bytes, or a layout numpy cannot view as bytes
        return False
    return True


# ``copy_pieces`` copies its boxes in bands of about this many bytes, a band of each
# box in turn, so that the pieces of one source block bound for different destinations
# read its rows while they are in cache (``_fastcopy.c``, ``copy_banded``). A 4-way
# column cut of 64 MiB (one thread, 2 KiB and 8 KiB rows) ran fastest with bands of
# 16-64 KiB: 1.3x and 1.09x faster than box by box, against 1.1-1.25x with 4 KiB or
# 1 MiB bands.
BAND_BYTES = 32 << 10


def copy_pieces(
    srcs: Sequence[np.ndarray | None],
    work: Sequence[tuple[np.ndarray, np.ndarray]],
    part: int = 0,
    parts: int = 1,
) -> bool:
    """Copies the boxes of ``work``'s ``(destination, table)``s out of ``srcs`` by one
    call of ``_fastcopy.copy_pieces`` (tables from ``piece_table``/``rows_table``;
    written past the cache where the boxes hold ``STREAM_COPY_BYTES`` together), in
    bands of ``BAND_BYTES``; with ``parts``, only part ``part`` of every box's bands,
    so that ``parts`` calls on as many threads copy everything once. ``False``, having
    written nothing, where the C code refuses a buffer (one not C-contiguous), which
    it does for every part alike."""
    try:
        _fastcopy.copy_pieces(srcs, work, STREAM_COPY_BYTES, BAND_BYTES, part, parts)
    except (BufferError, ValueError):  # checked before any byte is written
        return False
    return True


@functools.lru_cache(maxsize=4096)
def c_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """The byte strides of a C-contiguous array of ``shape`` (cached: tables ask for
    those of a model's few shapes once per piece)."""
    strides = [itemsize] * len(shape)
    for k in range(len(shape) - 2, -1, -1):
        strides[k] = strides[k + 1] * shape[k + 1]
    return tuple(strides)


def piece_row(
    si: int,
    ssl: Sequence[slice],
    src_strides: Sequence[int],
    dsl: Sequence[slice],
    dst_strides: Sequence[int],
    itemsize: int,
    soff: int = 0,
    doff: int = 0,
) -> list[int] | None:
    """One row of a ``_fastcopy.copy_pieces`` table: the box ``ssl`` of source ``si``
    into the box ``dsl`` of a destination (C strides in bytes, ``c_strides``; the
    boxes start ``soff`` and ``doff`` bytes further on), its axes merged where both
    layouts run on (a column block of whole rows becomes one run). ``None`` for an
    empty box. A row may have more outer axes than the C loop walks: ``rows_table``
    turns those down."""
    shape = [sl.stop - sl.start for sl in ssl]
    if 0 in shape:
        return None
    for a, b, sst, dstr in zip(ssl, dsl, src_strides, dst_strides, strict=True):
        soff += a.start * sst
        doff += b.start * dstr
    run = shape[-1] * itemsize if shape else itemsize
    row = [si, doff, soff, run, 0]  # then [count, dst step, src step] per outer axis
    for k in range(len(shape) - 2, -1, -1):
        n = shape[k]
        if n == 1:
            continue
        ds, ss = dst_strides[k], src_strides[k]
        if len(row) == 5:
            if ds == run and ss == run:
                run *= n
                row[3] = run
                continue
        elif ds == row[-3] * row[-2] and ss == row[-3] * row[-1]:
            row[-3] *= n
            continue
        row += (n, ds, ss)
    row[4] = (len(row) - 5) // 3
    return row


def rows_table(rows: Sequence[list[int]]) -> np.ndarray | None:
    """``rows`` (from ``piece_row``) as a ``copy_pieces`` table; ``None`` where one
    has more outer axes than the C loop walks, or the extension is not built."""
    if _fastcopy is None:
        return None
    width = _fastcopy.TABLE_WIDTH
    if any(len(r) > width for r in rows):
        return None
    return np.array([r + [0] * (width - len(r)) for r in rows], np.int64).reshape(len(rows), width)


def piece_table(
    pieces: Sequence[tuple[int, tuple[slice, ...], tuple[slice, ...]]],
    src_shapes: Sequence[tuple[int, ...]],
    dst_shape: tuple[int, ...],
    itemsize: int,
) -> np.ndarray | None:
    """The table ``_fastcopy.copy_pieces`` copies ``pieces`` into one destination
    shard by: per ``(source index, slices in the source, slices in the destination)``,
    both shards C-contiguous. Empty boxes have no row. ``None`` where the extension
    is not built or a box needs more outer axes than it walks (``MAX_OUTER``): then
    the pieces are copied one by one."""
    if _fastcopy is None:
        return None
    dst_strides = c_strides(dst_shape, itemsize)
    rows = []
    for si, ssl, dsl in pieces:
        row = piece_row(si, ssl, c_strides(src_shapes[si], itemsize), dsl, dst_strides, itemsize)
        if row is not None:
            rows.append(row)
    return rows_table(rows)


def copy_into(dst: np.ndarray, src: np.ndarray, at: tuple[slice, ...] = ()) -> None:
    """``dst[at] = src``, for ``dst[at]`` and ``src`` of one shape and element type, bit
    for bit.

    Large copies go through the C extension where it is built (``native_copy``).
    Otherwise, where both are strided (a piece cut out of a block, or written into
    one) with short contiguous rows along their last axis, each row is copied as one
    raw item: numpy then runs one loop over the rows, where it would otherwise restart
    its inner loop for every row of a few elements (``ROW_ITEM_BYTES``).
    """
    if at:
        dst = dst[at]  # slices: a view
    if native_copy(dst, src):
        return
    row = row_item(dst, src)
    if row is not None:
        copy_rows(dst, src, row)
    else:
        dst[...] = src


def copy_rows(dst: np.ndarray, src: np.ndarray, row: np.dtype) -> None:
    """``dst[...] = src``, each row along the last axis copied as one raw ``row`` item
    (``row_item``); raises ``ValueError`` where a last axis is not contiguous."""
    dst.view(row)[..., 0] = src.view(row)[..., 0]


def row_item(dst: np.ndarray, src: np.ndarray) -> np.dtype | None:
    """The raw item ``copy_into`` copies ``src`` into ``dst`` by, one per row, or
    ``None`` where it assigns them plainly."""
    if (
        dst.ndim >= 2
        and dst.shape[-1] > 1
        and dst.shape[-1] * dst.itemsize <= ROW_ITEM_BYTES
        and dst.dtype == src.dtype
        and dst.shape == src.shape
        and dst.strides[-1] == src.strides[-1] == dst.itemsize
        and not (dst.flags.c_contiguous and src.flags.c_contiguous)
    ):
        return np.dtype((np.void, dst.shape[-1] * dst.itemsize))
    return None


def limit_from_env() -> int:
    """The pool's bound from ``RESHARD_HOST_POOL_BYTES`` (unset or empty: 1 GiB).

    Read when the pool is first used, not at import, so that a bad value does not
    break ``import reshard`` (or ``reshard --help``).

    Raises:
      ValueError: the variable is set to something other than an integer >= 0.
    """
    raw = os.environ.get("RESHARD_HOST_POOL_BYTES", "").strip() or str(1 << 30)
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(
            f"RESHARD_HOST_POOL_BYTES must be an integer number of bytes, 0 or more (0 "
            f"turns the pool off), got {raw!r}"
        )
    return value


class _Lease:
    """Owner object of a leased block: numpy views of it keep it (not the pool) alive.
    (Slots and a hand-made array interface: a lease costs ~1 us, not ~4.)"""

    __slots__ = ("__array_interface__", "__weakref__", "block")

    def __init__(self, block: np.ndarray, address: int, nbytes: int) -> None:
        self.block = block
        self.__array_interface__ = {
            "data": (address, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }


# A request with no free block of its size takes the smallest free block up to this
# fraction larger (1/8: at most 12.5% unused), so that shapes that vary from call to
# call (rollouts of random length) reuse warm memory instead of filling the pool with
# sizes that never come back. A reshard of fixed shapes finds its exact sizes.
NEAR_FIT = 8


class HostPool:
    """A bounded pool of warm, aligned host blocks, keyed by size."""

    def __init__(self, limit_bytes: int | None = None) -> None:
        self._limit = limit_bytes  # None: from the environment, on first use
        self._free: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self._sizes: list[int] = []  # the keys of _free, sorted
        self._cached = 0
        self._lock = threading.Lock()
        # Per lease out: (its key, its block, the block's address), given back when the
        # lease goes.
        self._out: dict[weakref.ref[_Lease], tuple[int, np.ndarray, int]] = {}
        # Blocks given back, not yet filed: a lease can go during a garbage collection
        # that starts inside the locked section (any allocation may start one), where
        # taking the lock again would wait for ever. Filed by whoever holds the lock.
        self._pending: list[tuple[int, np.ndarray]] = []
        self.hits = 0
        self.misses = 0

    @property
    def limit(self) -> int:
        if self._limit is None:
            self._limit = limit_from_env()
        return self._limit

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            self._file_pending()
            return self._cached

    def _fit(self, nbytes: int) -> int | None:
        """The key of the free blocks that serve ``nbytes``: its own size, else the
        smallest up to ``1 / NEAR_FIT`` larger."""
        if nbytes in self._free:
            return nbytes
        i = bisect.bisect_left(self._sizes, nbytes)
        if i < len(self._sizes) and self._sizes[i] <= nbytes + nbytes // NEAR_FIT:
            return self._sizes[i]
        return None

    def _drop_key(self, key: int) -> None:
        del self._free[key]
        del self._sizes[bisect.bisect_left(self._sizes, key)]

    def take(self, nbytes: int) -> np.ndarray:
        """A writable, 64-byte aligned uint8 array of ``nbytes`` (warm when possible).

        Raises:
          ValueError: ``RESHARD_HOST_POOL_BYTES`` is not an integer (read on first use).
        """
        # Read here (once): a bad setting fails the call that uses the pool, not the
        # finalizer that gives a block back later.
        _ = self.limit
        key = max(nbytes, 1)
        block = None
        with self._lock:
            self._file_pending()
            found = self._fit(key)
            if found is not None:
                blocks = self._free[found]
                block = blocks.pop()
                self._cached -= block.nbytes
                if not blocks:
                    self._drop_key(found)
                key = found
                self.hits += 1
            else:
                self.misses += 1
        if block is None:
            block = np.empty(key + ALIGN, np.uint8)
        start = block.__array_interface__["data"][0]
        lease = _Lease(block, start + (-start) % ALIGN, nbytes)
        out = np.asarray(lease)
        # Tracked even with the pool off (nothing is then filed back): ``lease_test``
        # reads which host memory is out.
        self._out[weakref.ref(lease, self._returned)] = (key, block, start)
        return out

    def leased(self) -> list[tuple[int, int]]:
        """The address ranges ``[start, end)`` of the blocks out on lease, sorted."""
        while True:
            try:  # a lease may go (a finalizer, in a collection) while this copies
                entries = list(self._out.values())
                break
            except RuntimeError:  # pragma: no cover - a race of a few instructions
                continue
        # (The address read at take: b.ctypes.data costs ~2 us a block.)
        return sorted((start, start + b.nbytes) for _, b, start in entries)

    def views_of(self, spans: Sequence[tuple[int, int]]) -> list[np.ndarray | None]:
        """Per ``(address, nbytes)`` of ``spans``: a uint8 view of those bytes that keeps
        the lease holding them out (so that memory stays out of the pool while the view
        lives), or ``None`` where no lease holds them, or where the spans given do not
        cover all of theirs: a block carved for several small shards (``carve``) would
        be kept whole by a view of one of them, the bytes of shards not among ``spans``
        included."""
        while True:
            try:  # (as in ``leased``)
                entries = [ref() for ref in list(self._out)]
                break
            except RuntimeError:  # pragma: no cover - a race of a few instructions
                continue
        leases = sorted(
            (np.asarray(lease) for lease in entries if lease is not None),
            key=lambda whole: whole.ctypes.data,
        )
        starts = [whole.ctypes.data for whole in leases]
        found: list[int | None] = []
        covered: dict[int, int] = {}
        seen: set[tuple[int, int]] = set()
        for address, nbytes in spans:
            i = bisect.bisect_right(starts, address) - 1
            if i < 0 or nbytes <= 0 or address + nbytes > starts[i] + leases[i].nbytes:
                found.append(None)
                continue
            found.append(i)
            if (address, nbytes) not in seen:
                seen.add((address, nbytes))
                covered[i] = covered.get(i, 0) + align_up(nbytes)
        return [
            None
            if i is None or covered[i] < leases[i].nbytes
            else leases[i][address - starts[i] : address - starts[i] + nbytes]
            for i, (address, nbytes) in zip(found, spans, strict=True)
        ]

    def _returned(self, ref: weakref.ref[_Lease]) -> None:
        """Called as a lease goes (its last view with it), in whatever thread, maybe
        in a garbage collection inside this pool's own locked section: never waits."""
        entry = self._out.pop(ref, None)
        if entry is None:
            return
        self._pending.append(entry[:2])
        if self._lock.acquire(blocking=False):  # else the holder files it
            try:
                self._file_pending()
            finally:
                self._lock.release()

    def _file_pending(self) -> None:
        """Files the blocks given back (the lock held)."""
        while self._pending:
            key, block = self._pending.pop()
            if block.nbytes > self.limit:
                continue
            if key not in self._free:
                self._free[key] = []
                bisect.insort(self._sizes, key)
            self._free[key].append(block)
            self._free.move_to_end(key)
            self._cached += block.nbytes
            while self._cached > self.limit and self._free:
                old_key, blocks = next(iter(self._free.items()))
                self._cached -= blocks.pop(0).nbytes
                if not blocks:
                    self._drop_key(old_key)

    def clear(self) -> None:
        with self._lock:
            self._pending.clear()
            self._free.clear()
            self._sizes.clear()
            self._cached = 0


POOL = HostPool()


def lease_test() -> Callable[[Iterable[int]], bool]:
    """A test of JAX buffer addresses against the blocks out on lease now (one sorted
    snapshot, so that a caller testing many arrays sorts the leases once): whether any
    of them lies in such a block, i.e. is a buffer the CPU executors filled on the
    host, which XLA adopted without owning it. A donating program cannot take such a
    buffer over and copies it instead (it allocates, so it can run out of memory),
    where it hands an owned one over as it is; a caller donating on several device
    sets copies these first, before any input is consumed."""
    spans = POOL.leased()
    starts = [start for start, _ in spans]

    def test(addresses: Iterable[int]) -> bool:
        for a in addresses:
            i = bisect.bisect_right(starts, a) - 1
            if i >= 0 and a < spans[i][1]:
                return True
        return False

    return test


def release_host_buffers() -> int:
    """Frees the warm host memory kept for reuse by the CPU executor.

    Returns:
      The number of bytes released.
    """
    freed = POOL.cached_bytes
    POOL.clear()
    return freed


# Arrays whose small buffers come to less than this share pooled blocks of up to
# this size (consecutive ones); the others get a block each. (A tree of 500 arrays of
# 64 KiB, host executor, took 1.08-1.11x the time of one block for all with blocks
# of 64 KiB, in a review's runs on this machine: a lease apiece.)
SHARED_BLOCK_BYTES = 256 << 10


def carve(groups: Sequence[Sequence[int]]) -> list[list[np.ndarray]]:
    """Per group (the small destination shards of one array), one uint8 buffer per
    size, each 64-byte aligned, carved out of pooled blocks: one block per group, or
    one for several consecutive groups that together hold under
    ``SHARED_BLOCK_BYTES`` (norms, biases). A lease apiece would cost more than
    filling such small buffers. Any buffer kept alive keeps its whole block, so an
    array kept from a reshard holds its own shards and at most that much else, never
    the rest of the call's small shards."""
    out: list[list[np.ndarray]] = [[] for _ in groups]
    pending: list[int] = []  # consecutive small groups not yet given a block
    used = 0

    def flush(members: list[int]) -> None:
        block = POOL.take(sum(align_up(n) for g in members for n in groups[g]))
        offset = 0
        for g in members:
            for n in groups[g]:
                out[g].append(block[offset : offset + n])
                offset += align_up(n)

    for g, sizes in enumerate(groups):
        total = sum(align_up(n) for n in sizes)
        if not sizes:
            continue
        if total >= SHARED_BLOCK_BYTES:
            flush([g])
            continue
        if pending and used + total > SHARED_BLOCK_BYTES:
            flush(pending)
            pending, used = [], 0
        pending.append(g)
        used += total
    if pending:
        flush(pending)
    return out


def host_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialised, aligned array for one destination shard, from the pool."""
    nbytes = math.prod(shape) * dtype.itemsize
    return POOL.take(nbytes).view(dtype).reshape(shape)
