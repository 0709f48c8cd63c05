"""Every private-JAX fast path has a public fallback that gives the same result."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import check_result, place
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _compat

DEVS = jax.devices()


@pytest.fixture(params=[True, False], ids=["private", "public"])
def private(request, monkeypatch):
    monkeypatch.setattr(_compat, "USE_PRIVATE", request.param)
    return request.param


def test_device_order_and_buffers(private):
    mesh = Mesh(np.array(DEVS[:4])[::-1].reshape(2, 2), ("x", "y"))
    s = NamedSharding(mesh, P("y"))
    x = place(np.arange(16.0).reshape(4, 4), s)
    devs = _compat.ordered_devices(s)
    assert set(devs) == set(mesh.devices.flat)
    bufs = _compat.device_buffers(x)
    index = s.devices_indices_map((4, 4))
    for dev_id, buf in bufs.items():
        dev = next(d for d in DEVS if d.id == dev_id)
        np.testing.assert_array_equal(np.asarray(buf), np.arange(16.0).reshape(4, 4)[index[dev]])


@pytest.mark.parametrize("memory_kind", ["device", "pinned_host"])
def test_assemble_and_reshard_same_result(private, memory_kind):
    src = NamedSharding(Mesh(np.array(DEVS[:4]), ("a",)), P("a"))
    dst = NamedSharding(
        Mesh(np.array(DEVS[4:8]).reshape(2, 2), ("x", "y")), P("y", "x"), memory_kind=memory_kind
    )
    truth = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = place(truth, src)
    for executor in ("host", "device"):
        check_result(reshard.reshard(x, dst, executor=executor), truth, dst)


def test_aligned_empty_is_aligned():
    for shape, dtype in [((3, 5), np.float32), ((7,), np.int8), ((), np.complex64)]:
        a = _compat.aligned_empty(shape, np.dtype(dtype))
        assert a.shape == shape and a.dtype == dtype
        assert a.ctypes.data % 64 == 0
