"""The host pool recycles destination memory only after JAX has let go of it."""

from __future__ import annotations

import gc

import jax
import numpy as np
from helpers import place
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard._buffers import HostPool, carve

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
    bufs = carve(sizes)
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
