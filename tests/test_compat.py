"""Every private-JAX fast path has a public fallback that gives the same result."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import check_result, identity, place, pointers
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
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


def test_shards_read_from_several_threads_at_once(private):
    # jaxlib 0.10.2 makes an array's list of shards when first asked, and threads asking
    # at once left arrays with 2 of their 6 shards, or 12 (the collective executor's
    # copy threads met it: ``KeyError`` for a device of the source, 1 demo in ~10).
    # Garbage collections that switch threads, made frequent, widen that window: without
    # the lock in ``device_buffers`` nearly every round here went wrong.
    import gc
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    s = NamedSharding(Mesh(np.array(DEVS[:6]), ("a",)), P("a"))
    truth = np.arange(6 * 8, dtype=np.float32).reshape(6, 8)
    base = place(truth, s)
    index = s.devices_indices_map(truth.shape)
    threads = 4

    def switch(phase: str, info: dict) -> None:
        if phase == "start":
            time.sleep(0)  # (lets another thread run, mid-collection)

    old = gc.get_threshold()
    gc.set_threshold(5, 1, 1)
    gc.callbacks.append(switch)
    try:
        with ThreadPoolExecutor(threads) as pool:
            for _ in range(40):
                x = jax.make_array_from_single_device_arrays(
                    truth.shape, s, [sh.data for sh in base.addressable_shards]
                )
                barrier = threading.Barrier(threads)

                def read(x=x, barrier=barrier) -> dict:
                    _ = [[i] for i in range(50)]  # (garbage, for collections)
                    barrier.wait()
                    return _compat.device_buffers(x)

                for got in [f.result() for f in [pool.submit(read) for _ in range(threads)]]:
                    assert sorted(got) == sorted(d.id for d in DEVS[:6])
                    for dev_id, buf in got.items():
                        assert buf.devices() == {DEVS[dev_id]}
                        np.testing.assert_array_equal(np.asarray(buf), truth[index[DEVS[dev_id]]])
                assert len(x.addressable_shards) == 6  # the array itself left whole
    finally:
        gc.callbacks.remove(switch)
        gc.set_threshold(*old)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int4"])
def test_host_views_are_the_buffers_themselves_read_only(private, dtype):
    # Types numpy does not know (kind "V") take JAX's conversion directly on the
    # private path, np.asarray on the public one: the same zero-copy, read-only view.
    dt = np.dtype(getattr(jax.numpy, dtype))
    truth = (np.arange(64) % 7).astype(dt).reshape(8, 8)
    x = place(truth, NamedSharding(Mesh(np.array(DEVS[:4]), ("a",)), P("a")))
    for dev_id, buf in _compat.device_buffers(x).items():
        view = _compat.host_view(buf)
        assert view.dtype == dt and view.shape == (2, 8) and not view.flags.writeable
        index = x.sharding.devices_indices_map(x.shape)[DEVS[dev_id]]
        assert view.tobytes() == truth[index].tobytes()
        if dtype != "int4":  # (JAX's conversion copies an int4 shard, either way)
            assert view.ctypes.data == buf.unsafe_buffer_pointer()  # no copy
    buf.delete()
    with pytest.raises(RuntimeError, match="deleted"):
        _compat.host_view(buf)


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


@pytest.mark.parametrize("executor", ["host", "device"])
def test_arrays_with_no_elements_land_on_their_devices(private, executor):
    # Nothing to move: the device executor builds each empty shard with a program of
    # no inputs, which JAX runs on the default device; the public path then put the
    # array together from shards that were all on device 0.
    src = NamedSharding(Mesh(np.array(DEVS[:2]), ("a",)), P())
    dst = NamedSharding(Mesh(np.array(DEVS[2:4]), ("a",)), P("a"))
    truth = np.zeros((2, 0), np.float32)
    check_result(reshard.reshard(place(truth, src), dst, executor=executor), truth, dst)


def test_aligned_empty_is_aligned():
    for shape, dtype in [((3, 5), np.float32), ((7,), np.int8), ((), np.complex64)]:
        a = _compat.aligned_empty(shape, np.dtype(dtype))
        assert a.shape == shape and a.dtype == dtype
        assert a.ctypes.data % 64 == 0


def _ns(ids, spec, shape=None, names=("a",), memory_kind=None):
    """A NamedSharding over devices ``ids`` (a 1-D mesh unless ``shape``)."""
    mesh = Mesh(np.array([DEVS[i] for i in ids]).reshape(shape or (len(ids),)), names)
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


FSDP = _ns([0, 1, 2, 3], P("a"))
# (source sharding, destination sharding, copied shard by shard?)
WHOLE_CASES = {
    "same layout, other devices": (FSDP, _ns([4, 5, 6, 7], P("a")), True),
    "other device order": (FSDP, _ns([7, 5, 6, 4], P("a")), True),
    "2-D mesh, other mesh shape, same boxes by position": (
        _ns([0, 1, 2, 3], P(("x", "y")), (2, 2), ("x", "y")),
        _ns([4, 5, 6, 7], P("a")),
        True,
    ),
    "replicated": (_ns([0, 1], P()), _ns([6, 7], P()), True),
    "pinned host to pinned host": (
        _ns([0, 1, 2, 3], P("a"), memory_kind="pinned_host"),
        _ns([4, 5, 6, 7], P("a"), memory_kind="pinned_host"),
        True,
    ),
    "memory kind changes": (FSDP, _ns([4, 5, 6, 7], P("a"), memory_kind="pinned_host"), True),
    # A change of memory kind is a transfer even on the same device: PjRt's too.
    "memory kind changes in place": (
        FSDP,
        _ns([0, 1, 2, 3], P("a"), memory_kind="pinned_host"),
        True,
    ),
    "memory kind changes, overlapping devices": (
        _ns([0, 1, 2, 3], P("a"), memory_kind="unpinned_host"),
        _ns([2, 3, 4, 5], P("a")),
        True,
    ),
    "boxes move between positions": (
        FSDP,
        _ns([4, 5, 6, 7], P(("y", "x")), (2, 2), ("x", "y")),
        False,
    ),
    "overlapping devices": (FSDP, _ns([2, 3, 4, 5], P("a")), False),
    "relayout": (FSDP, _ns([4, 5, 6, 7], P(None, "a")), False),
}


@pytest.mark.parametrize("executor", ["host", "device"])
@pytest.mark.parametrize("case", list(WHOLE_CASES))
def test_arrays_that_only_change_devices_are_copied_shard_by_shard(private, executor, case):
    """Such arrays skip the executor (PjRt copies their shards in one batched call,
    or ``jax.device_put`` on the public path); every other array goes through it. The
    result is the same, bit for bit, in a tree that mixes both, donated or not."""
    src, dst, whole = WHOLE_CASES[case]
    relaid = _ns([4, 5], P(None, "a"))
    a = np.random.default_rng(0).integers(0, 2**16, (8, 12)).astype(np.uint16)
    b = np.arange(48, dtype=np.float32).reshape(8, 6)
    for donate in (False, True):
        tree = {
            "a": place(a, src),
            "b": place(b, _ns([0, 1], P("a"))),
        }
        p = reshard.plan(tree, {"a": dst, "b": relaid}, executor=executor, cache=False)
        out = p.execute(tree, donate=donate)
        check_result(out["a"], a, dst)
        check_result(out["b"], b, relaid)
        # Without JAX's device assignment (public path) the device order is by id, so
        # a mesh in another order is not recognised: it goes through the executor.
        seen = whole and (private or case != "other device order")
        assert p._cache[f"copied_whole(private={private})"] == ([0] if seen else [])
        assert tree["a"].is_deleted() == donate and tree["b"].is_deleted() == donate


def test_finish_shares_buffers_and_sets_the_aval_where_jax_allows(private):
    s = NamedSharding(Mesh(np.array(DEVS[:4]), ("a",)), P("a"), memory_kind="pinned_host")
    x = place(np.arange(8.0, dtype=np.float32), s)
    aval = _compat.device_put_aval((8,), np.dtype(np.float32), s, True)
    for fresh in (False, True):  # (fresh=True may change x itself)
        y = _compat.finish(x, aval, fresh=fresh)
        check_result(y, np.arange(8.0, dtype=np.float32), s)
        assert set(_compat.buffer_keys(y)) == set(_compat.buffer_keys(x))
        # Public JAX cannot mark an array weakly typed: the fallback keeps it strong.
        assert y.weak_type == private
        if private:
            assert y.aval == jax.device_put(jax.numpy.full((8,), 2.0), s).aval
            assert (y is x) == fresh


@pytest.mark.parametrize("executor", ["host", "device"])
def test_donating_an_array_that_partly_stays_is_the_same_either_way(
    handover_all, private, executor
):
    # The re-homed output (donating identity, then with_buffers) on both paths.
    src = _ns(range(8), P("a"))
    dst = _ns([0, 1, 2, 3, 7, 6, 5, 4], P("a"))
    truth = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    x = place(truth, src)
    kept = {d: p for d, p in pointers(x).items() if d.id < 4}
    y = reshard.reshard(x, dst, donate=True, executor=executor)
    assert x.is_deleted()
    check_result(y, truth, dst)
    assert {d: p for d, p in pointers(y).items() if d.id < 4} == kept
    assert y.committed
    if private:  # (the public path cannot set device_put's aval)
        assert y.aval == jax.device_put(place(truth, src), dst).aval


@pytest.mark.parametrize(
    "missing", ["USE_PRIVATE", "_update_dp_aval", "_ArrayImpl", "_ShapedArray"]
)
@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_outputs_are_committed_whichever_internal_is_missing(monkeypatch, missing, executor):
    # An uncommitted input's batched copy is uncommitted, and only the private path
    # committed it: without it a later jax.jit moved the output to the default device.
    if missing == "USE_PRIVATE":
        monkeypatch.setattr(_compat, "USE_PRIVATE", False)
    else:
        monkeypatch.setattr(_compat, missing, None)
    x = jax.numpy.arange(8, dtype=np.int32)
    assert not x.committed
    dst = SingleDeviceSharding(DEVS[2])
    y = reshard.reshard(x, dst, executor=executor)
    check_result(y, np.arange(8, dtype=np.int32), dst)
    assert y.committed and jax.jit(lambda a: a * 2)(y).devices() == {DEVS[2]}
    assert not x.is_deleted()


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_paths_that_trust_jax_device_order_stand_down_without_it(monkeypatch, executor):
    # Were sharding._device_assignment gone (a future JAX), ordered_devices would fall
    # back to id order, while x._arrays and the batched put/copy keep JAX's own: those
    # private paths then put shards on the wrong devices (wrong values), so they stand
    # down for the public ones.
    monkeypatch.setattr(
        _compat, "ordered_devices", lambda s: tuple(sorted(s.device_set, key=lambda d: d.id))
    )
    monkeypatch.setattr(_compat, "_assignment_known", lambda s: False)
    src = NamedSharding(Mesh(np.array(DEVS[:4]), ("a",)), P("a"))
    dst = NamedSharding(Mesh(np.array(DEVS[4:8][::-1]), ("a",)), P("a"))
    truth = np.arange(16, dtype=np.float32).reshape(8, 2)
    x = place(truth, src)
    check_result(reshard.reshard(x, dst, executor=executor), truth, dst)
    check_result(x, truth, src)


def test_with_buffers_keeps_everything_but_the_buffers(private):
    s = _ns(range(4), P("a"))
    x = place(np.arange(8.0, dtype=np.float32), s)
    other = place(np.arange(8.0, 16.0, dtype=np.float32), s)
    y = _compat.with_buffers(x, list(_compat.device_buffers(other).values()))
    check_result(y, np.arange(8.0, 16.0, dtype=np.float32), s)
    assert y.aval == x.aval and y.committed and pointers(y) == pointers(other)


def test_every_private_hook_is_found_on_this_jax():
    # A renamed internal would otherwise pass silently to its fallback (slower, or
    # without weak types and avals): this names it.
    hooks = [
        "_batched_device_put",
        "_ShapedArray",
        "_update_dp_aval",
        "_ArrayImpl",
        "_batched_copy",
        "_ALWAYS_COPY",
        "_backends_are_initialized",
        "_is_default_layout",
    ]
    assert [h for h in hooks if getattr(_compat, h) is None] == []


def test_donating_identity_hands_buffers_over_and_keeps_few_programs(monkeypatch):
    # One program per signature, in the bounded shared cache: shapes that keep changing
    # (a tree donated each step with new sizes) must not keep every one compiled.
    from reshard import _programs

    monkeypatch.setattr(_programs, "PROGRAM_CACHE_SIZE", 2)
    _programs.clear()
    s = NamedSharding(Mesh(np.array(jax.devices()[:4]), ("a",)), P("a"))
    for n in range(1, 5):
        truth = np.arange(8 * n, dtype=np.float32)
        x = place(truth, s)
        before = pointers(x)
        (y,) = _compat.donating_identity([x])
        assert x.is_deleted() and pointers(y) == before
        check_result(y, truth, s)
        assert _programs.size() == min(n, 2)  # its program is in the bounded cache


# Sources in a custom layout (jax 0.10, CPU): copied to other devices by PjRt, such a
# buffer is misread by compiled programs, and an array put together from buffers of
# two layouts is read in the layout of its first. Each destination below once gave
# wrong values through some executor (``shrink`` even to numpy), and every one of
# them later wrong values in a jitted computation.
LAYOUT_DESTINATIONS = {
    "same": (range(4), P("x")),
    "shrink": (range(2), P("x")),
    "partly kept": (range(8), P("x")),
    "other devices": (range(4, 8), P("x")),
}


@jax.jit
def _plus_zero(a):
    return a + 0


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
@pytest.mark.parametrize("where", list(LAYOUT_DESTINATIONS))
@pytest.mark.parametrize("donate", [False, True])
def test_sources_in_a_custom_layout_move_exactly(private, executor, where, donate):
    from jax._src.layout import Format, Layout

    truth = np.arange(8 * 16 * 4, dtype=np.float32).reshape(8, 16, 4)
    truth.view(np.uint32)[0, 0, 0] = 0x7FC01234  # a NaN with a payload
    src = NamedSharding(Mesh(np.array(DEVS[:4]), ("x",)), P("x"))
    transposed = Format(Layout(major_to_minor=(0, 2, 1)), src)
    # (Module-level functions: a new lambda per call would compile anew each time.)
    to_layout = jax.jit(identity, out_shardings=transposed)
    x = to_layout(place(truth, src))
    assert x.format.layout.major_to_minor == (0, 2, 1)
    ids, spec = LAYOUT_DESTINATIONS[where]
    devices = np.array([DEVS[i] for i in ids])
    if len(devices) == 8:
        dst = NamedSharding(Mesh(devices.reshape(2, 4), ("y", "x")), spec)
    else:
        dst = NamedSharding(Mesh(devices, ("x",)), spec)
    for may_alias in (None, True, False):
        x = to_layout(place(truth, src))
        y = reshard.reshard(x, dst, executor=executor, donate=donate, may_alias=may_alias)
        assert x.is_deleted() == donate  # the input itself, not its default-layout copy
        check_result(y, truth, dst)
        computed = np.asarray(_plus_zero(y))
        np.testing.assert_array_equal(computed[1:], truth[1:] + 0)
