"""The host pool recycles destination memory only after JAX has let go of it."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import place
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _buffers
from reshard._buffers import HostPool, carve, copy_into

DEVS = jax.devices()


def test_blocks_return_only_when_every_view_is_gone():
    pool = HostPool(limit_bytes=1 << 20)
    a = pool.take(4096)
    assert a.ctypes.data % 64 == 0 and a.nbytes == 4096 and a.flags.writeable
    view = a[100:200]
    del a
    gc.collect()
    assert pool.cached_bytes == 0  # a view is still alive
    del view
    gc.collect()
    assert pool.cached_bytes > 0
    b = pool.take(4096)
    assert pool.hits == 1 and pool.cached_bytes == 0
    c = pool.take(4096)  # b is alive: a second block must be new
    assert c.ctypes.data != b.ctypes.data and pool.misses == 2


def test_carve_gives_aligned_disjoint_buffers_of_one_block():
    sizes = [0, 1, 63, 64, 100, 4096]
    (bufs,) = carve([sizes])
    assert [b.nbytes for b in bufs] == sizes and carve([]) == []
    starts = [b.ctypes.data for b in bufs]
    assert all(p % 64 == 0 for p in starts)
    assert all(b.base is bufs[0].base for b in bufs)  # one pooled block
    spans = sorted((p, p + b.nbytes) for p, b in zip(starts, bufs, strict=True))
    assert all(a1 <= b0 for (_, a1), (b0, _) in zip(spans, spans[1:], strict=False))  # disjoint
    for i, b in enumerate(bufs):
        b[:] = i
    assert all((b == i).all() for i, b in enumerate(bufs))


def test_pool_is_bounded():
    pool = HostPool(limit_bytes=10_000)
    blocks = [pool.take(4000) for _ in range(5)]
    del blocks
    gc.collect()
    assert pool.cached_bytes <= 10_000
    disabled = HostPool(limit_bytes=0)
    x = disabled.take(100)
    del x
    gc.collect()
    assert disabled.cached_bytes == 0


@pytest.mark.parametrize("limit", [1 << 20, 0], ids=["pool", "pool-off"])
def test_lease_test_tells_memory_out_on_lease(monkeypatch, limit):
    # What tells a donating hand-over which buffers XLA does not own: blocks out on
    # lease (also with the pool off), and nothing once their last view is gone.
    pool = HostPool(limit_bytes=limit)
    monkeypatch.setattr(_buffers, "POOL", pool)
    a, b = pool.take(4096), pool.take(100)
    spans = pool.leased()
    assert len(spans) == 2 and spans == sorted(spans)
    for p, n in ((a.ctypes.data, a.nbytes), (b.ctypes.data, b.nbytes)):  # each in a block
        assert [s for s in spans if s[0] <= p and p + n <= s[1]]
    inside = [a.ctypes.data, a.ctypes.data + 4095, b.ctypes.data + 99]
    assert all(_buffers.lease_test()([p]) for p in inside)
    outside = [spans[0][0] - 1, spans[1][1], 0]
    assert not _buffers.lease_test()(outside) and not _buffers.lease_test()([])
    assert _buffers.lease_test()([*outside, inside[0]])
    del a
    gc.collect()
    assert not _buffers.lease_test()([inside[0]]) and _buffers.lease_test()([inside[2]])
    del b
    gc.collect()
    assert pool.leased() == []


@pytest.mark.parametrize("value", ["abc", "1GiB", "-1"])
def test_a_bad_pool_size_fails_the_first_use_not_the_import(monkeypatch, value):
    monkeypatch.setenv("RESHARD_HOST_POOL_BYTES", value)
    pool = HostPool()  # as at import: nothing read yet
    with pytest.raises(ValueError, match=f"RESHARD_HOST_POOL_BYTES must be an integer.*{value}"):
        pool.take(100)
    assert pool.leased() == []
    monkeypatch.setenv("RESHARD_HOST_POOL_BYTES", " ")  # blank: unset, 1 GiB
    assert HostPool().limit == 1 << 30
    monkeypatch.setenv("RESHARD_HOST_POOL_BYTES", "4096")
    assert HostPool().limit == 4096


def test_repeated_reshards_reuse_memory_and_stay_exact():
    src = NamedSharding(Mesh(np.array(DEVS[:4]), ("a",)), P("a"))
    dst = NamedSharding(Mesh(np.array(DEVS[4:8]), ("b",)), P(None, "b"))
    truth = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    x = place(truth, src)
    reshard.release_host_buffers()
    y = reshard.reshard(x, dst)
    first = {s.device.id: s.data.unsafe_buffer_pointer() for s in y.addressable_shards}
    del y
    gc.collect()
    z = reshard.reshard(x, dst)
    again = {s.device.id: s.data.unsafe_buffer_pointer() for s in z.addressable_shards}
    assert set(again.values()) == set(first.values())  # warm blocks were reused
    np.testing.assert_array_equal(np.asarray(z), truth)
    w = reshard.reshard(x, dst)  # z is alive: its memory must not be handed out
    assert not set(s.data.unsafe_buffer_pointer() for s in w.addressable_shards) & set(
        again.values()
    )
    np.testing.assert_array_equal(np.asarray(z), truth)
    np.testing.assert_array_equal(np.asarray(w), truth)
    assert reshard.release_host_buffers() >= 0


COPY_DTYPES = [np.bool_, np.int8, jnp.int4, jnp.bfloat16, np.float32, np.complex64]


@settings(max_examples=200, deadline=None)
@given(
    shape=st.lists(st.integers(1, 9), min_size=0, max_size=3),
    data=st.data(),
    dtype=st.sampled_from(COPY_DTYPES),
    src_transposed=st.booleans(),
)
def test_copy_into_copies_every_bit_of_any_box(shape, data, dtype, src_transposed):
    # A box cut out of one block and written into a box of another, as the executors
    # do: both strided, either, or neither, rows short or long, any element type.
    n = len(shape)
    bounds = [data.draw(st.tuples(st.integers(0, d - 1), st.integers(1, d))) for d in shape]
    box = tuple(slice(a, max(a + 1, b)) for a, b in bounds)
    size = tuple(s.stop - s.start for s in box)
    rng = np.random.default_rng(sum(shape) + n)
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    src_block = raw.view(dtype).reshape(shape)  # any bits: NaN payloads, odd bools
    if src_transposed and n >= 2:  # a source whose last axis is not contiguous
        src_block = np.ascontiguousarray(np.swapaxes(src_block, 0, 1)).swapaxes(0, 1)
    dst_block = np.zeros(tuple(d + 2 for d in size), dtype)
    at = tuple(slice(1, 1 + d) for d in size)
    want = dst_block.copy()
    want[at] = src_block[box]
    copy_into(dst_block, src_block[box], at)
    assert dst_block.tobytes() == want.tobytes()


@pytest.mark.parametrize("row_bytes", [0, 64, 1 << 20])
def test_copy_into_is_exact_whichever_loop_copies(monkeypatch, row_bytes):
    # Short rows are copied as raw items; the result is the same bytes either way,
    # including a 0-d block and a fully contiguous copy.
    monkeypatch.setattr(_buffers, "ROW_ITEM_BYTES", row_bytes)
    src = np.arange(64 * 48, dtype=np.float32).reshape(64, 48).astype(jnp.bfloat16)
    for cols in (slice(0, 1), slice(3, 11), slice(16, 48), slice(0, 48)):
        dst = np.zeros((80, 60), jnp.bfloat16)
        copy_into(dst, src[5:45, cols], (slice(2, 42), slice(4, 4 + cols.stop - cols.start)))
        want = np.zeros((80, 60), jnp.bfloat16)
        want[2:42, 4 : 4 + cols.stop - cols.start] = src[5:45, cols]
        assert dst.tobytes() == want.tobytes()
    scalar = np.zeros((), np.float32)
    copy_into(scalar, np.float32(2.5))
    assert scalar == 2.5


@settings(max_examples=300, deadline=None)
@given(data=st.data(), itemsize=st.sampled_from([1, 2, 4, 8]))
def test_host_executor_chooses_copy_into_loop_from_shapes_alone(data, itemsize):
    # The host executor decides once per plan, from the shapes, which loop copies each
    # piece (``copy_mode``); it must be the one copy_into picks from the arrays.
    from reshard._local_executor import copy_mode

    rank = data.draw(st.integers(0, 4))
    full_src = tuple(data.draw(st.integers(1, 6)) for _ in range(rank))
    full_dst = tuple(data.draw(st.integers(1, 6)) for _ in range(rank))
    piece = tuple(
        data.draw(st.integers(0, min(a, b))) for a, b in zip(full_src, full_dst, strict=True)
    )
    dtype = np.dtype(f"u{itemsize}")
    src, dst = np.zeros(full_src, dtype), np.zeros(full_dst, dtype)

    def box(full):
        start = [data.draw(st.integers(0, f - p)) for f, p in zip(full, piece, strict=True)]
        return tuple(slice(a, a + p) for a, p in zip(start, piece, strict=True))

    s, d = src[box(full_src)], dst[box(full_dst)]
    assert copy_mode(piece, full_src, full_dst, itemsize) == _buffers.row_item(d, s)


def test_carve_gives_each_array_its_block_and_tiny_arrays_shared_ones():
    # Before, one block held every small shard of a call: an output array kept alive
    # (a norm kept for logging) kept all of them, call after call.
    from reshard import _buffers

    tiny = [[16 << 10] * 2] * 20  # 32 KiB per array: eight share a 256 KiB block
    medium = [[300 << 10] * 4] * 3  # 1.2 MiB per array: a block each
    bufs = carve([*tiny, [], *medium])
    assert [[b.nbytes for b in g] for g in bufs] == [*tiny, [], *medium]
    for group in bufs[21:]:
        assert len({id(b.base) for b in group}) == 1
        assert group[0].base.nbytes - _buffers.ALIGN <= _buffers.align_up(300 << 10) * 4
    shared = {id(g[0].base) for g in bufs[:20]}
    assert len(shared) == 3  # 20 arrays of 32 KiB in blocks of up to 256 KiB
    assert all(len({id(b.base) for b in g}) == 1 for g in bufs[:20])
    assert not shared & {id(g[0].base) for g in bufs[21:]}


def test_pool_reuses_a_slightly_larger_block_for_varying_sizes():
    pool = HostPool(limit_bytes=1 << 30)
    a = pool.take(1_000_000)
    del a
    gc.collect()
    b = pool.take(960_000)  # within 1/8: the warm block serves it
    assert pool.hits == 1 and b.nbytes == 960_000 and b.ctypes.data % 64 == 0
    del b
    gc.collect()
    c = pool.take(800_000)  # more than 1/8 smaller: a block of its own
    assert pool.hits == 1 and pool.misses == 2
    d = pool.take(1_000_000)  # its exact size is free again
    assert pool.hits == 2
    del c, d
    gc.collect()
    assert pool.cached_bytes >= 1_800_000
    pool.clear()
    assert pool.cached_bytes == 0 and pool.take(1_000_000).nbytes == 1_000_000


@pytest.mark.timeout(60, method="thread")  # a deadlock blocks signals: end the run
def test_a_lease_going_in_a_collection_inside_the_pool_does_not_deadlock():
    # Any allocation under the pool's lock may start a garbage collection, which may
    # free a cycle holding another lease; giving that back took the lock again (a
    # deadlock: found by review, in the previous versions too).
    class Holder:
        pass

    pool = HostPool(limit_bytes=64 << 10)  # small: blocks are evicted too
    threshold = gc.get_threshold()
    gc.set_threshold(1)
    try:
        for i in range(2000):
            v = pool.take(4096 + 64 * (i % 50))
            h = Holder()
            h.me, h.view = h, pool.take(4096)
            del h, v
    finally:
        gc.set_threshold(*threshold)
    gc.collect()
    assert 0 < pool.cached_bytes <= 64 << 10
    assert not pool._pending and not pool._out


def test_donating_many_arrays_reads_the_leases_once(monkeypatch):
    # A reading of the leases sorts every block out; read per array, a donating call
    # of N arrays beside M live leases cost N * M (seconds for 512 x 4000).
    from reshard import _execute

    monkeypatch.setattr(_execute, "HANDOVER_BYTES", 0)
    reads = []
    real = _buffers.POOL.leased
    monkeypatch.setattr(_buffers.POOL, "leased", lambda: reads.append(1) or real())
    devs = jax.devices()
    mesh = Mesh(np.array(devs[:8]).reshape(2, 4), ("a", "b"))
    s = NamedSharding(mesh, P("a", "b"))
    x = [jax.device_put(np.full((8, 8), i, np.float32), s) for i in range(16)]
    reshard.reshard(x, NamedSharding(mesh, P("a", "b")), donate=True)
    assert len(reads) <= 1 and all(a.is_deleted() for a in x)
    reads.clear()
    x = [jax.device_put(np.full((8, 8), i, np.float32), s) for i in range(16)]
    reshard.split_by_mesh_axis(x, "a", donate=True)
    assert len(reads) <= 1 and all(a.is_deleted() for a in x)
