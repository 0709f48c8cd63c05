"""End-to-end resharding against a numpy ground truth, named and random cases."""

from __future__ import annotations

import doctest
import gc
import math

import jax
import numpy as np
import pytest
from helpers import (
    DTYPES,
    MEMORY_KINDS,
    as_bits,
    check_result,
    lower_bound_by_masks,
    meshes,
    place,
    pointers,
    random_values,
    shard_counts,
    specs,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import reshard

DEVS = jax.devices()


def mesh1(ids: list[int], name: str = "a") -> Mesh:
    return Mesh(np.array([DEVS[i] for i in ids]), (name,))


def itemsize_of(dtype: str) -> int:
    return 4 if dtype == "key" else np.dtype(jax.numpy.dtype(dtype)).itemsize


@st.composite
def cases(draw):
    """A random (source sharding, destination sharding, shape, dtype) case."""
    src_mesh = draw(meshes())
    overlap = draw(st.sampled_from(["any", "same", "disjoint"]))
    if overlap == "same":
        dst_mesh = draw(meshes(devices=list(src_mesh.devices.flat)))
    elif overlap == "disjoint" and src_mesh.devices.size < 8:
        rest = [d for d in DEVS if d not in set(src_mesh.devices.flat)]
        dst_mesh = draw(meshes(devices=rest))
    else:
        dst_mesh = draw(meshes())
    ndim = draw(st.integers(0, 3))
    dtype = draw(st.sampled_from(DTYPES))
    mk_src = "device" if dtype == "key" else draw(st.sampled_from(MEMORY_KINDS))
    mk_dst = "device" if dtype == "key" else draw(st.sampled_from(MEMORY_KINDS))
    src = NamedSharding(src_mesh, draw(specs(src_mesh, ndim)), memory_kind=mk_src)
    dst = NamedSharding(dst_mesh, draw(specs(dst_mesh, ndim)), memory_kind=mk_dst)
    shape = tuple(
        math.lcm(a, b) * draw(st.integers(1, 3))
        for a, b in zip(shard_counts(src, ndim), shard_counts(dst, ndim), strict=True)
    )
    return src, dst, shape, dtype


def run_case(src, dst, shape, dtype, *, executor, donate=False, cache=False, seed=0):
    truth = random_values(np.random.default_rng(seed), shape, dtype)
    x = place(truth, src)
    p = reshard.plan(x, dst, executor=executor, cache=cache)
    expected_bound = lower_bound_by_masks(shape, itemsize_of(dtype), src, dst)
    if dtype == "key":
        expected_bound *= 2  # two uint32 words of key data per threefry key
    assert p.stats.bytes_lower_bound == expected_bound
    assert p.stats.bytes_moved == expected_bound
    y = reshard.reshard(x, dst, executor=executor, donate=donate, cache_resharding_plans=cache)
    check_result(y, truth, dst)
    if donate:
        reused = any(lp.reused for lp in p.leaf_plans)
        if not reused:
            assert x.is_deleted()
    else:
        assert not x.is_deleted()
        np.testing.assert_array_equal(as_bits(x), as_bits(truth))
    return p, y


@settings(max_examples=100)
@given(case=cases(), donate=st.booleans(), cache=st.booleans(), seed=st.integers(0, 2**16))
def test_random_host_executor(case, donate, cache, seed):
    src, dst, shape, dtype = case
    run_case(src, dst, shape, dtype, executor="host", donate=donate, cache=cache, seed=seed)


@settings(max_examples=40)
@given(case=cases(), donate=st.booleans(), seed=st.integers(0, 2**16))
def test_random_device_executor(case, donate, seed):
    src, dst, shape, dtype = case
    run_case(src, dst, shape, dtype, executor="device", donate=donate, cache=True, seed=seed)


@settings(max_examples=25)
@given(case=cases(), donate=st.booleans(), seed=st.integers(0, 2**16))
@pytest.mark.parametrize(
    "pack_on_host,kept_on_device",
    [(True, None), (True, True), (False, None)],
    ids=["host-packed", "host-packed-kept-on-device", "device-packed"],
)
def test_random_collective_executor(pack_on_host, kept_on_device, case, donate, seed):
    # The multi-controller executor in one process: both packings, random bits; and
    # host-packed with kept shards copied by PjRt, as off CPU (KEPT_ON_DEVICE).
    from reshard import _collective_executor

    saved = _collective_executor.PACK_ON_HOST, _collective_executor.KEPT_ON_DEVICE
    _collective_executor.PACK_ON_HOST = pack_on_host
    _collective_executor.KEPT_ON_DEVICE = kept_on_device
    try:
        src, dst, shape, dtype = case
        run_case(
            src, dst, shape, dtype, executor="collective", donate=donate, cache=True, seed=seed
        )
    finally:
        _collective_executor.PACK_ON_HOST, _collective_executor.KEPT_ON_DEVICE = saved


@settings(max_examples=30)
@given(
    case=cases(),
    dtype=st.sampled_from(["float64", "int64", "uint64", "complex128"]),
    executor=st.sampled_from(["host", "device", "collective-host", "collective-device"]),
    seed=st.integers(0, 2**16),
)
def test_random_64_bit_types_with_x64_on(case, dtype, executor, seed):
    # With jax_enable_x64 on, a Python int is a 64-bit integer inside a program: the
    # device-packed program once mixed such constant starts with 32-bit looked-up ones
    # in one dynamic_slice, which JAX refuses (an int64 array, fsdp -> tp).
    from reshard import _collective_executor

    src, dst, shape, _ = case
    saved = _collective_executor.PACK_ON_HOST
    _collective_executor.PACK_ON_HOST = executor == "collective-host"
    try:
        with jax.enable_x64(True):
            run_case(src, dst, shape, dtype, executor=executor.split("-")[0], seed=seed)
            # Host values: a Python int is a weakly typed int64, a float64 stays one.
            rep = NamedSharding(dst.mesh, P(), memory_kind=dst.memory_kind)
            y = reshard.reshard({"i": 3, "f": np.arange(3.0) / 3}, {"i": rep, "f": rep})
            assert (y["i"].dtype, y["i"].weak_type) == (np.int64, True)
            assert y["f"].dtype == np.float64
    finally:
        _collective_executor.PACK_ON_HOST = saved


@settings(max_examples=30)
@given(
    case=cases(),
    dtype=st.sampled_from(["float64", "int64", "uint64", "complex128"]),
    executor=st.sampled_from(["auto", "host", "device", "collective"]),
    donate=st.booleans(),
    may_alias=st.sampled_from([None, True, False]),
    seed=st.integers(0, 2**16),
)
def test_random_64_bit_arrays_move_whole_with_x64_off(
    case, dtype, executor, donate, may_alias, seed
):
    # Made under jax.enable_x64, moved with it off: a program traced with it off reads
    # such an argument as its 32-bit type (each element kept its low 32 bits, through
    # every executor and jax.device_put's own relayout). Host values in the same call
    # are still typed as x64 off says.
    src, dst, shape, _ = case
    assert not jax.config.jax_enable_x64
    with jax.enable_x64(True):
        truth = random_values(np.random.default_rng(seed), shape, dtype)
        x = place(truth, src)
    rep = NamedSharding(dst.mesh, P(), memory_kind=dst.memory_kind)
    tree = {"x": x, "py": 1.5, "np": np.arange(3.0)}
    y = reshard.reshard(
        tree,
        {"x": dst, "py": rep, "np": rep},
        executor=executor,
        donate=donate,
        may_alias=may_alias,
    )
    check_result(y["x"], truth, dst)
    assert (y["py"].dtype, y["py"].weak_type, y["np"].dtype) == (np.float32, True, np.float32)
    if donate:
        assert x.is_deleted()
    else:
        check_result(x, truth, src)
    # The seed helpers assemble (and donate) such arrays whole too.
    axis = dst.mesh.axis_names[0]
    parts = reshard.split_by_mesh_axis(y["x"], axis, donate=donate)
    check_result(reshard.concatenate_by_mesh_axis(parts, axis), truth, dst)
    assert not jax.config.jax_enable_x64  # (restored)


@pytest.mark.parametrize("pack_on_host", [True, False], ids=["host-packed", "device-packed"])
def test_64_bit_integers_relaid_across_devices_with_x64_on(monkeypatch, pack_on_host):
    from reshard import _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    with jax.enable_x64(True):
        truth = random_values(np.random.default_rng(0), (16, 24), "int64")
        src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
        dst = NamedSharding(mesh1([4, 5, 6, 7]), P(None, "a"))
        check_result(reshard.reshard(place(truth, src), dst, executor="collective"), truth, dst)
        # The check of which types programs carry exactly runs its own such program:
        # failing to run, it sent every float through host memory.
        from reshard import _exact

        assert _exact._check(DEVS[0], np.dtype(np.float32))


def _with_logical_ids(draw, s):
    ids = tuple(draw(st.permutations(range(s.mesh.size))))
    return NamedSharding(s.mesh, s.spec, memory_kind=s.memory_kind, _logical_device_ids=ids)


@settings(max_examples=40)
@given(
    case=cases(),
    which=st.sampled_from(["src", "dst", "both"]),
    executor=st.sampled_from(["host", "device", "collective"]),
    keys=st.booleans(),
    donate=st.booleans(),
    data=st.data(),
)
def test_custom_device_orders_are_kept(case, which, executor, keys, donate, data):
    # A NamedSharding with _logical_device_ids lays its shards out in that order, not
    # the mesh's: key arrays once lost it on the way to their data, so their shards
    # were read from and put on the wrong devices (half the cases are key arrays).
    src, dst, shape, dtype = case
    if keys:
        dtype = "key"
        src, dst = NamedSharding(src.mesh, src.spec), NamedSharding(dst.mesh, dst.spec)
    if which in ("src", "both"):
        src = _with_logical_ids(data.draw, src)
    if which in ("dst", "both"):
        dst = _with_logical_ids(data.draw, dst)
    run_case(
        src,
        dst,
        shape,
        dtype,
        executor=executor,
        donate=donate,
        seed=data.draw(st.integers(0, 2**16)),
    )


def test_key_arrays_keep_a_custom_device_order():
    order = NamedSharding(mesh1([0, 1, 2, 3]), P("a"), _logical_device_ids=(2, 0, 3, 1))
    plain = NamedSharding(mesh1([4, 5, 6, 7], "b"), P("b"))
    keys = jax.random.split(jax.random.key(3), 8)
    for executor in ("host", "device", "collective"):
        y = reshard.reshard(place(keys, plain), order, executor=executor)
        check_result(y, keys, order)
        assert y.sharding._logical_device_ids == (2, 0, 3, 1)
        x = place(keys, order)
        check_result(reshard.reshard(x, plain, executor=executor, donate=True), keys, plain)
        assert x.is_deleted()


@pytest.mark.parametrize("executor", ["host", "device"])
@pytest.mark.parametrize(
    "name,src_ids,src_spec,dst_ids,dst_spec",
    [
        ("disjoint fsdp->tp", [0, 1, 2, 3], P("a"), [4, 5, 6, 7], P(None, "a")),
        ("same devices, new layout", list(range(8)), P("a"), list(range(8)), P(None, "a")),
        ("shrink 8->6", list(range(8)), P("a"), list(range(6)), P("a")),
        ("grow 6->8", list(range(6)), P("a"), list(range(8)), P("a")),
        ("reversed order", [0, 1, 2, 3], P("a"), [3, 2, 1, 0], P("a")),
        ("replicated -> sharded", [0, 1, 2, 3], P(), [2, 3, 4, 5], P("a")),
        ("sharded -> replicated", [0, 1, 2, 3], P("a"), [4, 5], P()),
        ("identity", [0, 1, 2, 3], P("a"), [0, 1, 2, 3], P("a")),
    ],
)
def test_named_cases(executor, name, src_ids, src_spec, dst_ids, dst_spec):
    src = NamedSharding(mesh1(src_ids), src_spec)
    dst = NamedSharding(mesh1(dst_ids), dst_spec)
    shape = (48, 24)
    run_case(src, dst, shape, "float32", executor=executor)


# NaNs of every kind (quiet and signalling, payloads, both signs), infinities, zeros
# of both signs and the smallest subnormal, as raw bits per element type.
SPECIAL_BITS = {
    "bfloat16": [0x7FF0, 0x7F81, 0xFFC1, 0xFF80, 0x7F80, 0x8000, 0x0000, 0x0001],
    "float16": [0x7E01, 0x7C01, 0xFE05, 0xFC00, 0x7C00, 0x8000, 0x0000, 0x0001],
    "float32": [0x7FC00001, 0x7F800001, 0xFFC00005, 0xFF800000, 0x7F800000, 0x80000000, 0, 1],
    "float8_e5m2": [0x7D, 0x7E, 0xFD, 0xFE, 0x7C, 0x80, 0x00, 0x01],
    "float4_e2m1fn": list(range(16)),  # every code (no NaN or infinity), one per byte
}


@pytest.mark.parametrize("dtype", sorted(SPECIAL_BITS))
@pytest.mark.parametrize(
    "executor,pack_on_host",
    [("host", None), ("device", None), ("collective", True), ("collective", False)],
)
def test_special_values_move_bit_for_bit(monkeypatch, executor, pack_on_host, dtype):
    # Each destination shard is put together from pieces of two source shards, which
    # compiled programs do by concatenating: on CPU that turns every bfloat16 and
    # float8_e5m2 NaN into the canonical one unless the program moves bits.
    from reshard import _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    unsigned = np.dtype(f"u{np.dtype(jax.numpy.dtype(dtype)).itemsize}")
    bits = np.resize(np.array(SPECIAL_BITS[dtype], unsigned), 48 * 8).reshape(48, 8)
    truth = bits.view(jax.numpy.dtype(dtype))
    src = NamedSharding(mesh1([0, 1]), P(None, "a"))
    for dst in (
        NamedSharding(mesh1([2, 3, 4]), P("a")),  # other devices
        NamedSharding(mesh1([0, 1, 2]), P("a")),  # overlapping
    ):
        y = reshard.reshard(place(truth, src), dst, executor=executor)
        check_result(y, truth, dst)


@pytest.mark.parametrize("shape", [(0,), (0, 4), (4, 0), (1, 0), (2, 0, 4)])
@pytest.mark.parametrize(
    "executor,pack_on_host",
    [("host", None), ("device", None), ("collective", True), ("collective", False)],
)
def test_arrays_with_no_elements(monkeypatch, executor, pack_on_host, shape):
    # Nothing to move, but every destination shard must exist with its own shape. XLA
    # gives every device the whole of an empty array ((4, 0) where shards are (2, 0)):
    # jit outputs come that way (device_put's do not), and so did the device-packed
    # program's outputs, which that path once handed on as the shards.
    from reshard import _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    truth = np.zeros(shape, np.int32)
    rank = len(shape)
    src = NamedSharding(mesh1([0, 1]), P(*(["a"] if shape[0] % 2 == 0 else [None, "a"])))
    for dst in (
        NamedSharding(mesh1([6]), P("a")),  # other devices, one of them
        NamedSharding(mesh1([1, 2, 3, 4]), P(*([None] * (rank - 1)), "a")),  # overlapping
    ):
        for x in (place(truth, src), jax.device_put(truth, src)):
            check_result(reshard.reshard(x, dst, executor=executor), truth, dst)
    # The same shards on the same devices, named another way: handed over as they are
    # (so from device_put, whose shards have their own shapes).
    same = NamedSharding(Mesh(np.array(DEVS[:2]).reshape(1, 2), ("x", "a")), src.spec)
    check_result(reshard.reshard(jax.device_put(truth, src), same, executor=executor), truth, same)
    # Kept shards of a jit output, whose empty shards have the whole array's shape,
    # handed over or copied: each comes out with its own shard shape and memory kind.
    for kind in MEMORY_KINDS:
        src = NamedSharding(src.mesh, src.spec, memory_kind=kind)
        for ids in ([0, 1], [0, 2]):  # the same shards, or device 0 keeping its own
            dst = NamedSharding(mesh1(ids), src.spec, memory_kind=kind)
            for may_alias in (True, None):
                y = reshard.reshard(place(truth, src), dst, executor=executor, may_alias=may_alias)
                check_result(y, truth, dst)


def test_device_packed_runs_in_groups_that_bound_placeholders(monkeypatch):
    from reshard import _collective_device, _collective_executor, _programs

    groups = _programs.consecutive_groups
    assert groups([3, 3, 0, 5, 1], 6) == [[0, 1, 2], [3, 4]]
    assert groups([7, 1, 9], 6) == [[0], [1], [2]]  # an array over the bound alone
    assert groups([], 6) == []
    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", False)
    rng = np.random.default_rng(7)
    truth = {f"w{i}": random_values(rng, (48, 32), "bfloat16") for i in range(4)}
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
    block_bytes = 12 * 32 * 2  # each array's source block (placeholder) per device
    for dst, want in (
        # Other devices: placeholders for every array, two per group.
        (NamedSharding(mesh1([4, 5, 6, 7]), P(None, "a")), [[0, 1], [2, 3]]),
        # The same devices: every device holds a source block, no placeholders.
        (NamedSharding(mesh1([0, 1, 2, 3]), P(None, "a")), [[0, 1, 2, 3]]),
    ):
        monkeypatch.setattr(_collective_device, "GROUP_BYTES", 2 * block_bytes)
        x = {k: place(v, src) for k, v in truth.items()}
        p = reshard.plan(x, dict.fromkeys(truth, dst), executor="collective", cache=False)
        y = p.execute(x)
        (program,) = [
            v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
        ]
        assert program.groups == want
        for k, v in truth.items():
            check_result(y[k], v, dst)


def test_device_packed_frees_the_output_blocks_off_the_destination(monkeypatch):
    # The SPMD program gives every device of the union an output block per array, the
    # size of a destination shard: garbage off the destination (the trainer devices of
    # a trainer -> sampler sync). Kept for every group until the end, they came to as
    # much again as the trainer devices' own share; now each group's go once its
    # program is done. Measured when the results are assembled, after the last group.
    from reshard import _collective_device, _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", False)
    monkeypatch.setattr(_collective_device, "GROUP_BYTES", 1 << 16)  # a group per array
    truth = [np.full((256, 256), i, np.float32) for i in range(6)]  # 256 KiB each
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
    dst = NamedSharding(mesh1([4, 5, 6, 7]), P(None, "a"))
    x = [place(v, src) for v in truth]

    def bytes_on(ids):
        found = {}
        for a in jax.live_arrays():
            for sh in a.addressable_shards:
                if sh.device.id in ids:
                    found[(sh.device.id, sh.data.unsafe_buffer_pointer())] = sh.data.nbytes
        return sum(found.values())

    gc.collect()  # (garbage of earlier tests freed later would read as negative)
    before = bytes_on({0, 1, 2, 3})
    seen = []
    real = _collective_device.assemble_parts

    def spy(program, li, *args):
        if li == 0:
            jax.block_until_ready(jax.live_arrays())
            seen.append((len(program.groups), bytes_on({0, 1, 2, 3}) - before))
        return real(program, li, *args)

    monkeypatch.setattr(_collective_device, "assemble_parts", spy)
    y = reshard.reshard(x, [dst] * len(x), executor="collective")
    assert seen == [(6, 0)]
    for v, t in zip(y, truth, strict=True):
        check_result(v, t, dst)


def _count_transfer_calls(monkeypatch):
    """Records ``(what, how many arrays)`` for every ``jax.device_put`` and every
    non-empty ``_compat.copy_shards`` (PjRt's batched copy) from here on."""
    from reshard import _compat

    calls = []
    put, copy = jax.device_put, _compat.copy_shards

    def counted_put(x, *a, **k):
        calls.append(("device_put", len(x) if isinstance(x, list) else 1))
        return put(x, *a, **k)

    def counted_copy(xs, shardings):
        if xs:
            calls.append(("copy_shards", len(xs)))
        return copy(xs, shardings)

    monkeypatch.setattr(jax, "device_put", counted_put)
    monkeypatch.setattr(_compat, "copy_shards", counted_copy)
    return calls


@pytest.mark.parametrize("kinds", [("pinned_host", "device"), ("device", "pinned_host")])
def test_device_packed_moves_host_memory_shards_in_batched_calls(monkeypatch, kinds):
    # Shards in a host memory kind go to device memory before the program and back
    # after it: one jax.device_put per shard was a dispatch each (64 here; thousands
    # for hundreds of arrays on 8 accelerators), now one batched call per side.
    from reshard import _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", False)
    src_kind, dst_kind = kinds
    src = NamedSharding(mesh1(range(8)), P("a"), memory_kind=src_kind)
    dst = NamedSharding(mesh1(range(8)), P(None, "a"), memory_kind=dst_kind)
    truth = [np.full((16, 16), i, np.float32) for i in range(8)]
    x = [place(t, src) for t in truth]
    p = reshard.plan(x, [dst] * len(x), executor="collective", cache=False)
    p.execute(x)  # compiled outside the count
    calls = _count_transfer_calls(monkeypatch)
    y = p.execute(x)
    assert 1 <= len(calls) <= 2 and all(n > 1 for _, n in calls), calls
    for v, t in zip(y, truth, strict=True):
        check_result(v, t, dst)


def _memory_kind_case(src_kind, dst_ids, dst_kind, n=6):
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"), memory_kind=src_kind)
    dst = NamedSharding(mesh1(dst_ids), P("a"), memory_kind=dst_kind)
    truth = [np.arange(64, dtype=np.float32).reshape(8, 8) + i for i in range(n - 1)]
    truth.append(random_values(np.random.default_rng(n), (8, 4), "bfloat16"))
    return [place(t, src) for t in truth], truth, dst


@pytest.mark.parametrize("donate", [False, True], ids=["kept", "donated"])
@pytest.mark.parametrize("executor", ["auto", "host", "device"])
@pytest.mark.parametrize(
    "dst_ids", [[0, 1, 2, 3], [3, 2, 1, 0], [2, 3, 4, 5]], ids=["same", "permuted", "overlapping"]
)
@pytest.mark.parametrize(
    "src_kind,dst_kind", [(a, b) for a in MEMORY_KINDS for b in MEMORY_KINDS if a != b]
)
def test_memory_kind_changes_of_whole_shards_are_one_batched_copy(
    monkeypatch, executor, dst_ids, src_kind, dst_kind, donate
):
    # Each shard stays whole and only changes memory kind (and perhaps device): PjRt
    # copies every such array of the call in one batched call, as jax.device_put does,
    # instead of the executors' per-shard work (which took ~2x jax.device_put's time
    # on 64 small arrays).
    x, truth, dst = _memory_kind_case(src_kind, dst_ids, dst_kind)
    calls = _count_transfer_calls(monkeypatch)
    before = [pointers(v) for v in x]
    y = reshard.reshard(x, [dst] * len(x), executor=executor, donate=donate)
    assert calls == [("copy_shards", len(x))], calls
    for v, t, ptrs in zip(y, truth, before, strict=True):
        check_result(v, t, dst)
        assert not set(pointers(v).values()) & set(ptrs.values())
    assert all(v.is_deleted() for v in x) == donate


@pytest.mark.parametrize(
    "src_kind,dst_kind,dst_ids",
    [
        ("pinned_host", "device", [3, 2, 1, 0]),
        ("device", "pinned_host", [0, 1, 2, 3]),
        ("unpinned_host", "pinned_host", [2, 3, 4, 5]),
        ("device", "device", [4, 5, 6, 7]),
    ],
)
def test_device_executor_batches_its_transfers_and_takes_whole_pieces_as_shards(
    monkeypatch, src_kind, dst_kind, dst_ids
):
    # With PjRt's whole copy out of the way, the device executor's own path: shards of
    # host memory kinds are staged in device memory in one batched call, and moved to
    # the destination's memory kind in one (a call per shard was ~60 us each), and a
    # destination shard that is one whole moved piece is that piece, with no build
    # program copying it again.
    from reshard import _execute
    from reshard._local_executor import DeviceProgram

    monkeypatch.setattr(_execute, "_copied_whole", lambda plan, dst: [])
    x, truth, dst = _memory_kind_case(src_kind, dst_ids, dst_kind, n=16)
    before = [pointers(v) for v in x]
    p = reshard.plan(x, [dst] * len(x), executor="device", cache=False)
    p.execute(x)
    (program,) = [v for v in p._cache.values() if isinstance(v, DeviceProgram)]
    assert not program.builds and len(program.adopted) == 4 * len(x)
    calls = _count_transfer_calls(monkeypatch)
    y = p.execute(x)
    # Staging, between devices, to the memory kind: each a batched call, if any.
    assert 1 <= len(calls) <= 3 and all(n > 1 for _, n in calls), calls
    for v, t, ptrs in zip(y, truth, before, strict=True):
        check_result(v, t, dst)
        assert not set(pointers(v).values()) & set(ptrs.values())


def test_device_executor_takes_cut_pieces_as_shards_and_builds_the_rest():
    # Replicated -> sharded elsewhere: each destination shard is one piece cut out of a
    # replica, taken as it is; sharded -> fewer devices: each is built from two pieces.
    from reshard._local_executor import DeviceProgram

    truth = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    cases = [
        (P(), [0, 1, 2, 3], [4, 5, 6, 7], 4, 0),
        (P("a"), [0, 1, 2, 3], [4, 5], 0, 2),
    ]
    for src_spec, src_ids, dst_ids, adopted, built in cases:
        x = place(truth, NamedSharding(mesh1(src_ids), src_spec))
        dst = NamedSharding(mesh1(dst_ids), P("a"))
        p = reshard.plan(x, dst, executor="device", cache=False)
        y = p.execute(x)
        check_result(y, truth, dst)
        (program,) = [v for v in p._cache.values() if isinstance(v, DeviceProgram)]
        assert len(program.adopted) == adopted
        assert sum(len(t) for t in program.builds.values()) == built
        assert not set(pointers(y).values()) & set(pointers(x).values())


def test_identity_moves_nothing_and_copies_unless_asked_to_alias():
    """Nothing crosses devices; the result is still a copy (as from Pathways), so a
    consumer that donates the result cannot free the input, nor the reverse."""
    s = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
    x = place(np.arange(32.0, dtype=np.float32), s)
    p = reshard.plan(x, s)
    assert p.stats.bytes_moved == 0 and p.stats.bytes_kept == p.stats.bytes_total
    for kw in ({}, {"may_alias": False}):
        y = reshard.reshard(x, s, **kw)
        assert not set(pointers(y).values()) & set(pointers(x).values())
        check_result(y, np.arange(32.0, dtype=np.float32), s)
        jax.jit(lambda v: v + 1, donate_argnums=0)(y)
        np.testing.assert_array_equal(np.asarray(x), np.arange(32.0, dtype=np.float32))
    z = reshard.reshard(x, s, may_alias=True)
    assert pointers(z) == pointers(x)
    check_result(z, np.arange(32.0, dtype=np.float32), s)


def test_replicas_balance_senders():
    # Source fully replicated on 4 devices, destination 4 shards elsewhere: each
    # destination shard should come from a different replica.
    src = NamedSharding(mesh1([0, 1, 2, 3]), P())
    dst = NamedSharding(mesh1([4, 5, 6, 7]), P("a"))
    x = place(np.arange(64, dtype=np.float32), src)
    p = reshard.plan(x, dst)
    assert p.stats.max_send_bytes == p.stats.mean_send_bytes == 64
    assert sorted(p.stats.send_bytes) == [0, 1, 2, 3]


def test_single_device_sharding_and_pytrees():
    tree = {
        "w": place(np.arange(24.0).reshape(4, 6), NamedSharding(mesh1([0, 1]), P("a"))),
        "b": [place(np.ones(4, np.int32), SingleDeviceSharding(DEVS[3])), 2.5],
        "n": np.arange(3),
    }
    dst = {
        "w": SingleDeviceSharding(DEVS[5]),
        "b": NamedSharding(mesh1([6, 7]), P()),
        "n": SingleDeviceSharding(DEVS[1]),
    }
    out = reshard.reshard(tree, dst)
    assert out["w"].sharding == dst["w"]
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(24.0).reshape(4, 6))
    assert out["b"][0].sharding == dst["b"] and out["b"][1].sharding == dst["b"]
    assert float(out["b"][1]) == 2.5
    assert isinstance(out["n"], jax.Array) and out["n"].sharding == dst["n"]
    np.testing.assert_array_equal(np.asarray(out["n"]), np.arange(3))


def test_prng_keys_move_exactly_without_host_round_trip():
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
    dst = NamedSharding(mesh1([4, 5]), P(None, "a"))
    keys = jax.random.split(jax.random.key(7), 32).reshape(8, 4)
    x = place(keys, src)
    y = reshard.reshard(x, dst)
    assert y.dtype == x.dtype and y.sharding == dst
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(y)), np.asarray(jax.random.key_data(keys))
    )
    # The moved keys still generate the same numbers.
    np.testing.assert_array_equal(
        np.asarray(jax.random.uniform(y[3, 2])), np.asarray(jax.random.uniform(keys[3, 2]))
    )


@pytest.mark.parametrize("ids", [[6], [6, 7]], ids=["one-device", "two-devices"])
def test_key_arrays_keep_the_destination_spec_as_written(ids):
    # On one device JAX takes the key data's sharding as the key array's unchanged, so
    # padding the data's spec with None for its extra dimension once gave the keys one
    # spec entry too many there (P('b', None, None) for P('b', None)).
    keys = jax.random.split(jax.random.key(3), 12).reshape(6, 2)
    x = place(keys, NamedSharding(mesh1([0, 1, 2]), P("a")))
    for spec in (P("b", None), P("b"), P(None, "b"), P()):
        dst = NamedSharding(mesh1(ids, "b"), spec)
        y = reshard.reshard(x, dst)
        # As jax.device_put spells it (on several devices JAX pads the spec to the
        # key array's rank: P('b', None) for P('b')), and as written on one device.
        assert y.sharding == jax.device_put(x, dst).sharding, (y.sharding, dst)
        assert y.sharding == dst if len(ids) == 1 else y.sharding.is_equivalent_to(dst, 2)
        np.testing.assert_array_equal(
            np.asarray(jax.random.key_data(y)), np.asarray(jax.random.key_data(keys))
        )


@pytest.mark.parametrize("executor", ["host", "device"])
@pytest.mark.parametrize(
    "src_mk,dst_mk",
    [("device", "pinned_host"), ("pinned_host", "device"), ("unpinned_host", "pinned_host")],
)
def test_memory_kind_with_layout_change(executor, src_mk, dst_mk):
    """jax.device_put fails on some of these ('Memory kind mismatch'); we must not."""
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"), memory_kind=src_mk)
    dst = NamedSharding(
        Mesh(np.array(DEVS[2:6]).reshape(2, 2), ("x", "y")), P("y", "x"), memory_kind=dst_mk
    )
    truth = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    x = place(truth, src)
    check_result(reshard.reshard(x, dst, executor=executor), truth, dst)


@pytest.mark.parametrize("executor", ["auto", "host", "device", "collective"])
@pytest.mark.parametrize(
    ("src_ids", "src_spec", "dst_ids", "dst_spec", "dst_mk"),
    [
        ([0, 1, 2, 3], P("a"), [4, 5, 6, 7], P("a"), "device"),  # only changes device
        ([0, 1, 2, 3], P("a"), [4, 5, 6, 7], P(), "device"),  # replicated elsewhere
        ([0, 1, 2, 3], P("a"), [0, 1, 2, 3], P(), "device"),  # kept shards, gathered
        ([0, 1, 2, 3], P("a"), [3, 2, 1, 0], P("a"), "pinned_host"),  # memory kind
    ],
    ids=["same-layout", "replicate", "in-place", "pinned"],
)
def test_weak_type_is_kept_like_device_put(executor, src_ids, src_spec, dst_ids, dst_spec, dst_mk):
    # jnp.full with a Python scalar is weakly typed: it must not promote a bfloat16
    # it meets after the move, as it does not after jax.device_put.
    x = place(jax.numpy.full((8,), 2.0), NamedSharding(mesh1(src_ids), src_spec))
    assert x.weak_type
    dst = NamedSharding(mesh1(dst_ids), dst_spec, memory_kind=dst_mk)
    y = reshard.reshard(x, dst, executor=executor)
    assert y.weak_type
    if dst_mk == "device":  # (jax.device_put itself fails to relay into pinned_host)
        assert jax.device_put(x, dst).weak_type
    check_result(y, np.full((8,), 2.0, np.float32), dst)
    assert jax.numpy.result_type(y, jax.numpy.bfloat16) == jax.numpy.bfloat16
    # A strongly typed array stays strong.
    z = reshard.reshard(place(np.full((8,), 2.0, np.float32), x.sharding), dst, executor=executor)
    assert not z.weak_type
    assert jax.numpy.result_type(z, jax.numpy.bfloat16) == jax.numpy.float32


@pytest.mark.parametrize("executor", ["auto", "host", "device", "collective"])
def test_output_is_what_device_put_returns(executor):
    # Committed, with device_put's abstract value (its mesh and memory space): jax.jit
    # reads those to place what it makes from the output.
    committed = place(np.arange(8, dtype=np.int32), NamedSharding(mesh1([0, 1, 2, 3]), P("a")))
    uncommitted = jax.numpy.arange(8, dtype=np.int32)  # on device 0, not committed
    dsts = [
        SingleDeviceSharding(DEVS[2]),
        SingleDeviceSharding(DEVS[1], memory_kind="pinned_host"),
        NamedSharding(mesh1([4, 5, 6, 7], "b"), P("b"), memory_kind="pinned_host"),
        NamedSharding(mesh1([6, 7], "b"), P()),
    ]
    for x in (committed, uncommitted):
        for dst in dsts:
            want = jax.device_put(x, dst)
            y = reshard.reshard(x, dst, executor=executor)
            check_result(y, np.arange(8, dtype=np.int32), dst)
            assert y.committed and y.aval == want.aval and jax.typeof(y) == jax.typeof(want)
            doubled = jax.jit(lambda a: a * 2)(y)
            assert doubled.sharding.memory_kind == dst.memory_kind
            assert doubled.sharding.device_set == dst.device_set
    assert not uncommitted.committed and not uncommitted.is_deleted()


def test_plan_from_shape_dtype_structs_matches_arrays():
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
    dst = NamedSharding(mesh1([2, 3, 4, 5]), P(None, "a"))
    sds = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=src)
    p1 = reshard.plan(sds, dst, cache=False)
    x = place(np.arange(64, dtype=np.float32).reshape(8, 8), src)
    p2 = reshard.plan(x, dst, cache=False)
    assert p1.stats == p2.stats
    y = p1.execute(x)
    check_result(y, np.arange(64, dtype=np.float32).reshape(8, 8), dst)


def test_plan_summary_matrix_and_dict():
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"))
    dst = NamedSharding(mesh1([4, 5, 6, 7]), P(None, "a"))
    p = reshard.plan(jax.ShapeDtypeStruct((8, 8), np.float32, sharding=src), dst)
    text = str(p)
    assert "moved:" in text and "optimal" in text and "256 B" in text
    srcs, dsts, m = p.transfer_matrix()
    assert srcs == [0, 1, 2, 3] and dsts == [4, 5, 6, 7]
    assert m.sum() == p.stats.bytes_moved == 256 and (m == 16).all()
    assert list(m.sum(axis=1)) == [p.stats.send_bytes[d] for d in srcs]
    assert list(m.sum(axis=0)) == [p.stats.recv_bytes[d] for d in dsts]
    d = p.to_dict()
    assert d["stats"]["bytes_moved"] == 256
    assert sum(piece["bytes"] for piece in d["leaves"][0]["pieces"]) == 256


def test_docstring_examples_run():
    from reshard import _api

    assert doctest.testmod(_api, raise_on_error=True).attempted > 0


def _live_buffers() -> set[tuple[int, int, int]]:
    """(device id, address, bytes) of every live buffer, each once (arrays that share
    a buffer, such as single-device views of an array's shards, count it once)."""
    return {
        (s.device.id, s.data.unsafe_buffer_pointer(), s.data.nbytes)
        for a in jax.live_arrays()
        for s in a.addressable_shards
    }


def _run_watching_live_buffers(x, dst, may_alias=None):
    """Plans and runs ``x`` -> ``dst`` on the device executor; returns the output, the
    plan and, per device, the most bytes of new live buffers seen after any of its
    programs and transfers."""
    import gc

    from reshard import _compat, _local_executor

    # A first run checks which types this platform's programs carry (``_exact``): its
    # probe arrays, garbage in cycles until collected, would count as new buffers.
    reshard.plan(x, dst, executor="device", cache=False).execute(x, may_alias=True)
    gc.collect()
    base = _live_buffers()
    seen: dict[int, int] = {}

    def watch(fn):
        def call(*args, **kwargs):
            out = jax.block_until_ready(fn(*args, **kwargs))
            extra: dict[int, int] = {}
            for d, _, nbytes in _live_buffers() - base:
                extra[d] = extra.get(d, 0) + nbytes
            for d, v in extra.items():
                seen[d] = max(seen.get(d, 0), v)
            return out

        return call

    compiled, device_put, copy_shards = (
        _local_executor.DeviceProgram.compiled,
        jax.device_put,
        _compat.copy_shards,
    )
    _local_executor.DeviceProgram.compiled = lambda *a: watch(compiled(*a))
    jax.device_put = watch(device_put)
    _compat.copy_shards = watch(copy_shards)  # (the executor's batched transfers)
    try:
        p = reshard.plan(x, dst, executor="device")
        y = p.execute(x, may_alias=may_alias)
    finally:
        _local_executor.DeviceProgram.compiled, jax.device_put = compiled, device_put
        _compat.copy_shards = copy_shards
    return y, p, seen


@pytest.mark.parametrize(
    "dst_ids,src_kind,dst_kind",
    [
        ([0, 1, 2, 3], None, None),
        ([4, 5, 6, 7], None, None),
        ([0, 1, 2, 3], "pinned_host", "device"),
        ([4, 5, 6, 7], "device", "pinned_host"),
        ([2, 3, 4, 5], "unpinned_host", "pinned_host"),
    ],
    ids=["relayout", "disjoint", "from-pinned-host", "to-pinned-host", "host-kinds-overlapping"],
)
def test_device_executor_peak_extra_bounds_what_it_allocates(dst_ids, src_kind, dst_kind):
    # The device executor cuts pieces on their senders and stages them on their
    # receivers before building the destination shards, and stages shards of host
    # memory kinds in device memory: its plan's peak extra bytes count those too (the
    # planner's own count, destination shards alone, falls short). Live buffers are
    # counted after every program and transfer it runs.
    src = NamedSharding(mesh1([0, 1, 2, 3]), P("a"), memory_kind=src_kind)
    dst = NamedSharding(mesh1(dst_ids), P(None, "a"), memory_kind=dst_kind)
    truth = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)
    y, p, seen = _run_watching_live_buffers(place(truth, src), dst)
    check_result(y, truth, dst)
    shard = truth.nbytes // 4
    assert seen and all(v <= p.stats.peak_extra_bytes.get(d, 0) for d, v in seen.items()), (
        seen,
        p.stats.peak_extra_bytes,
    )
    # More than the destination shards alone on some device: cut or staged pieces.
    assert max(seen.values()) > shard


@settings(max_examples=25, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**16))
def test_device_executor_peak_extra_bounds_random_cases(case, seed):
    # Shards that stay are handed over (may_alias=True): the stat leaves them out.
    src, dst, shape, dtype = case
    truth = random_values(np.random.default_rng(seed), shape, dtype)
    y, p, seen = _run_watching_live_buffers(place(truth, src), dst, may_alias=True)
    check_result(y, truth, dst)
    over = {d: v for d, v in seen.items() if v > p.stats.peak_extra_bytes.get(d, 0)}
    assert not over, (src, dst, over, p.stats.peak_extra_bytes)


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_reduced_specs_move_as_replicas_and_unreduced_ones_are_refused(executor):
    # A spec may carry reduced axes (copies of one value) and unreduced ones (addends
    # of a sum); such a spec refuses to be iterated, so every check reads its
    # entries through ``partitions``.
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"), axis_types=explicit)
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    reduced = NamedSharding(mesh, P("a", None, reduced={"b"}))
    plain = NamedSharding(mesh, P(None, "a"))
    x = place(value, reduced)
    out = reshard.plan(x, plain, executor=executor).execute(x)
    check_result(out, value, plain)
    back = reshard.plan(out, reduced, executor=executor).execute(out)
    check_result(back, value, reduced)
    assert jax.typeof(back) == jax.typeof(jax.device_put(out, reduced))  # (its aval)
    unreduced = NamedSharding(mesh, P("a", None, unreduced={"b"}))
    u = jax.device_put(value, unreduced)
    for args, side in [((u, plain), "source"), ((x, unreduced), "destination")]:
        with pytest.raises(ValueError, match=rf"the {side} spec .* is unreduced over \['b'\]"):
            reshard.reshard(*args, donate=True)
    assert not x.is_deleted() and not u.is_deleted()
    # JAX holds no key array on a reduced spec (it cannot read its sharding back):
    # refused before anything moves, so a donated input stays.
    keys = place(jax.random.split(jax.random.key(0), 32).reshape(8, 4), plain)
    with pytest.raises(ValueError, match=r"a key array cannot take the destination spec"):
        reshard.plan(keys, NamedSharding(mesh, P("a", None, reduced={"b"})), executor=executor)
    with pytest.raises(ValueError, match=r"a key array cannot take the destination spec"):
        reshard.reshard(keys, NamedSharding(mesh, P("a", None, reduced={"b"})), donate=True)
    assert not keys.is_deleted()
    # A key array made on such a spec from its data: JAX cannot read its sharding,
    # nor move it; the error names the leaf and the way round.
    data = place(
        np.asarray(jax.random.key_data(keys)),
        NamedSharding(mesh, P("a", None, None, reduced={"b"})),
    )
    made = {"rng": jax.random.wrap_key_data(data)}
    unreadable = r"leaf \['rng'\]: JAX cannot read this key array's sharding"
    with pytest.raises(ValueError, match=unreadable):
        reshard.reshard(made, {"rng": plain}, executor=executor, donate=True)
    with pytest.raises(ValueError, match=unreadable):  # a plan made for another array
        reshard.plan({"rng": keys}, {"rng": plain}, executor=executor).execute(made)
    with pytest.raises(ValueError, match=unreadable):
        reshard.carry_shardings(made, mesh)
    with pytest.raises(ValueError, match=unreadable):
        reshard.recover(made, mesh, [7])
    with pytest.raises(ValueError, match=unreadable):
        reshard.ElasticManager(mesh, axis="a").apply(made)
    with pytest.raises(ValueError, match=r"arrays\['rng'\]: JAX cannot read this key array's"):
        reshard.split_by_mesh_axis(made, "a")
    assert not data.is_deleted()
    # The way round the error gives: the key data it was made from, moved and wrapped.
    moved = jax.random.wrap_key_data(reshard.reshard(data, NamedSharding(mesh, P(None, "b", None))))
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(moved)), np.asarray(data))
    assert moved.sharding.spec == P(None, "b")
    carried = reshard.carry_shardings({"x": reduced}, mesh)["x"]
    assert carried == reduced


def test_device_packed_tables_are_constants_where_equal_and_looked_up_once_each():
    # A device-packed program looks up each position's piece offsets by axis_index.
    # A column equal at every position is a constant instead (a plain slice), and
    # slots sharing a column share one lookup: tracing did one gather per entry of
    # every slot before, ~1.3 s of a 24-array tree's ~3.8 s first call.
    from reshard import _collective_device

    seen = []

    def lookups(me):
        at = _collective_device._Lookup(me)
        cols = [np.array(c, np.int32) for c in ([3, 3, 3, 3], [0, 4, 8, 12], [0, 4, 8, 12])]
        got = [at.column(c) for c in cols]
        row = at.row(np.array([[5, 0], [5, 4], [5, 8], [5, 12]], np.int32))
        seen.append((type(got[0]), got[1] is got[2] is row[1], len(at.memo)))
        return got[1], row

    for me in range(4):
        one, (first, second) = jax.jit(lookups)(np.int32(me))
        assert (int(one), first, int(second)) == (4 * me, 5, 4 * me)
    # Traced once; constants are 32-bit integers, as the looked-up offsets are (a
    # Python int would be a 64-bit one with jax_enable_x64 on: mixed starts, refused).
    assert seen == [(np.int32, True, 1)]


def test_calls_from_several_threads_at_once():
    # A server may push weights from several threads: calls on one input, on new array
    # objects over its buffers (whose shard lists jaxlib makes on first access, not
    # safely across threads: see _compat.device_buffers), with every executor, must
    # each give the exact result and leave the input whole.
    import threading
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(7)
    truth = {f"w{i}": rng.standard_normal((64, 48)).astype(np.float32) for i in range(4)}
    truth["b"] = rng.integers(-(2**31), 2**31 - 1, (48,), dtype=np.int32)
    src_mesh = Mesh(np.array(DEVS[:4]), ("a",))
    x = {k: place(v, NamedSharding(src_mesh, P("a"))) for k, v in truth.items()}
    meshes_ = [
        Mesh(np.array(DEVS[4:]).reshape(2, 2), ("a", "b")),
        Mesh(np.array(DEVS), ("a",)),
        src_mesh,
    ]
    dsts = [
        NamedSharding(meshes_[0], P("a", "b")),
        NamedSharding(meshes_[1], P(None, "a")),
        NamedSharding(meshes_[2], P(None, "a")),
    ]
    threads = 3
    barrier = threading.Barrier(threads)

    def work(k: int) -> int:
        barrier.wait()
        done = 0
        for it in range(6):
            d = dsts[(k + it) % len(dsts)]
            want = {n: d if v.ndim == 2 else NamedSharding(d.mesh, P()) for n, v in truth.items()}
            for executor in ("host", "device", "collective"):
                arg = {
                    n: jax.make_array_from_single_device_arrays(
                        v.shape, v.sharding, [s.data for s in v.addressable_shards]
                    )
                    for n, v in x.items()
                }
                out = reshard.reshard(arg, want, executor=executor)
                for n, y in out.items():
                    check_result(y, truth[n], want[n])
                    done += 1
        return done

    with ThreadPoolExecutor(threads) as pool:
        counts = [f.result() for f in [pool.submit(work, k) for k in range(threads)]]
    assert counts == [6 * 3 * len(truth)] * threads
    for n, v in x.items():
        check_result(v, truth[n], NamedSharding(src_mesh, P("a")))
