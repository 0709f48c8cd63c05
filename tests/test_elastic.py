"""Elastic device sets: mesh surgery, recovery from surviving shards, the elastic loop.

Ground truths are computed here, independently of the library:
* mesh surgery: a slice is kept iff none of its ids is lost (plain loops over numpy);
* recovery: per leaf, a boolean mask of the elements some surviving device holds,
  from JAX's own ``devices_indices_map``. Shards on lost devices are filled with
  *garbage* (inverted bits), so a result equal to the true array proves that lost
  devices were never read.
"""

from __future__ import annotations

import doctest
import logging
import math
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import surviving_mask
from hypothesis import event, given
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _collective_executor, _elastic, _mesh_surgery
from reshard._mesh_surgery import grow_grid, shrink_grid

DEVICES = jax.devices()
ROOT = Path(__file__).resolve().parents[1]


def mesh_of(shape, names, ids=None):
    ids = range(math.prod(shape)) if ids is None else ids
    return Mesh(np.array([DEVICES[i] for i in ids]).reshape(shape), names)


@dataclass(frozen=True)
class FakeDevice:
    """A device-like object: all the surgery needs is an ``.id``."""

    id: int


# ----------------------------------------------------------------------------------
# Mesh surgery on synthetic grids
# ----------------------------------------------------------------------------------


def expected_clean(ids: np.ndarray, k: int, lost: set[int]) -> list[int]:
    """Positions along axis k whose slice holds no lost id (a plain loop)."""
    out = []
    for i in range(ids.shape[k]):
        if not any(int(v) in lost for v in np.take(ids, i, axis=k).ravel()):
            out.append(i)
    return out


@st.composite
def grids(draw, max_dims=3, max_side=6):
    shape = tuple(draw(st.lists(st.integers(1, max_side), min_size=1, max_size=max_dims)))
    n = math.prod(shape)
    offset = draw(st.integers(0, 1000))
    perm = draw(st.permutations(range(n)))
    ids = (np.array(perm, dtype=np.int64) + offset).reshape(shape)
    names = tuple(f"ax{i}" for i in range(len(shape)))
    k = draw(st.integers(0, len(shape) - 1))
    lost = draw(st.sets(st.sampled_from(ids.ravel().tolist()), max_size=n))
    # Ids that are not in the grid must be ignored.
    lost |= draw(st.sets(st.integers(offset + n, offset + n + 50), max_size=3))
    return ids, names, k, lost


@given(grids(), st.one_of(st.none(), st.sets(st.integers(1, 8), min_size=1, max_size=4)))
def test_shrink_grid_keeps_exactly_the_clean_slices(case, allowed):
    ids, names, k, lost = case
    clean = expected_clean(ids, k, lost)
    n = len(clean)
    if allowed is not None:
        n = max((s for s in allowed if s <= n), default=0)
    if n == 0:
        with pytest.raises(ValueError, match=r"shrink_mesh: .*(every one of|allowed_sizes)"):
            shrink_grid(ids, names, lost, names[k], allowed_sizes=allowed)
        return
    original = ids.copy()
    out = shrink_grid(ids, names, lost, names[k], allowed_sizes=allowed)
    np.testing.assert_array_equal(out, np.take(ids, clean[:n], axis=k))
    assert out.shape[:k] + out.shape[k + 1 :] == ids.shape[:k] + ids.shape[k + 1 :]
    assert not set(out.ravel().tolist()) & lost
    np.testing.assert_array_equal(ids, original)  # the input grid is not modified


@given(grids())
def test_grow_grid_inverts_shrink_grid(case):
    ids, names, k, lost = case
    clean = expected_clean(ids, k, lost)
    if not clean:
        return
    small = shrink_grid(ids, names, lost, names[k])
    dropped = [i for i in range(ids.shape[k]) if i not in clean]
    if not dropped:
        assert small.shape == ids.shape
        return
    # The dropped slices, each in row-major order of the other axes.
    back = np.concatenate([np.take(ids, i, axis=k).ravel() for i in dropped]).tolist()
    big = grow_grid(small, names, back, names[k])
    expected = np.concatenate([np.take(ids, clean, axis=k), np.take(ids, dropped, axis=k)], axis=k)
    np.testing.assert_array_equal(big, expected)
    # And the other way round: shrinking away what was added gives the small grid back.
    np.testing.assert_array_equal(shrink_grid(big, names, back, names[k]), small)


def test_surgery_on_thousands_of_synthetic_devices_is_fast():
    rng = np.random.default_rng(0)
    ids = rng.permutation(16384).reshape(64, 16, 16)
    names = ("data", "fsdp", "tp")
    lost = set(rng.choice(16384, size=40, replace=False).tolist())
    t0 = time.perf_counter()
    small = shrink_grid(ids, names, lost, "data")
    back = grow_grid(small, names, list(range(20000, 20000 + 256 * 3)), "data")  # three new slices
    seconds = time.perf_counter() - t0
    clean = expected_clean(ids, 0, lost)
    np.testing.assert_array_equal(small, ids[clean])
    assert back.shape == (len(clean) + 3, 16, 16)
    assert back[-1].ravel().tolist() == list(range(20000 + 512, 20000 + 768))
    assert seconds < 2.0, seconds


def test_surgery_on_device_like_objects():
    objs = np.empty(12, dtype=object)
    for i in range(12):
        objs[i] = FakeDevice(100 + i)
    grid = objs.reshape(3, 4)
    small = shrink_grid(grid, ("data", "tp"), [FakeDevice(105), 110], "data")
    assert [d.id for d in small.ravel()] == [100, 101, 102, 103]
    grown = grow_grid(small, ("data", "tp"), [FakeDevice(200 + i) for i in range(4)], "data")
    assert grown.dtype == object and grown.shape == (2, 4)
    assert [d.id for d in grown[1]] == [200, 201, 202, 203]
    # Shrinking along the inner axis keeps whole columns.
    cols = shrink_grid(grid, ("data", "tp"), [FakeDevice(105)], "tp")
    assert [[d.id for d in row] for row in cols] == [
        [100, 102, 103],
        [104, 106, 107],
        [108, 110, 111],
    ]


def test_grid_errors_name_the_argument_and_the_fix():
    ids = np.arange(8).reshape(2, 4)
    names = ("data", "fsdp")
    with pytest.raises(
        ValueError, match=r"axis 'dp' is not an axis of the mesh \(axis names \('data', 'fsdp'\)\)"
    ):
        shrink_grid(ids, names, [1], "dp")
    with pytest.raises(
        ValueError,
        match=r"every one of the 2 slice\(s\) along axis 'data' holds a lost device.*"
        r"device ids \[\[0, 1, 2, 3\], \[4, 5, 6, 7\]\], lost devices \[1, 6\].*another axis",
    ):
        shrink_grid(ids, names, [1, 6, 99], "data")
    with pytest.raises(ValueError, match=r"allowed_sizes=\[2\] has no size <= 1"):
        shrink_grid(ids, names, [5], "data", allowed_sizes=[2])
    # Sizes that are not whole, or not >= 1, are mistakes (1.5 was taken as 1).
    for bad in ([1.5], [0, 2], [], [True], ["ab"]):
        with pytest.raises(ValueError, match=r"allowed_sizes must hold integer sizes >= 1"):
            shrink_grid(ids, names, [5], "data", allowed_sizes=bad)
    # One device where a list is expected, and booleans, which Python counts as ints.
    with pytest.raises(TypeError, match=r"got int: 5 \(for one device, pass \[device\]\)"):
        shrink_grid(ids, names, 5, "data")
    with pytest.raises(ValueError, match=r"integer device id, got bool: True"):
        shrink_grid(ids, names, [True], "data")
    small = ids[:1]
    with pytest.raises(
        ValueError, match=r"got 2 device\(s\), but a slice along axis 'data' needs 4.*add 2 more"
    ):
        grow_grid(small, names, [4, 5], "data")
    with pytest.raises(ValueError, match=r"devices \[3\] are already in the mesh"):
        grow_grid(small, names, [3, 4, 5, 6], "data")
    with pytest.raises(ValueError, match=r"devices \[4\] are given more than once"):
        grow_grid(small, names, [4, 4, 5, 6], "data")
    with pytest.raises(ValueError, match=r"no devices given"):
        grow_grid(small, names, [], "data")
    with pytest.raises(ValueError, match=r"integer device id, got str: 'x'"):
        shrink_grid(ids, names, ["x"], "data")


def test_large_grids_are_cut_in_error_messages():
    ids = np.arange(4096).reshape(2, 2048)
    with pytest.raises(ValueError, match=r"\.\.\. \(4096 devices\)") as e:
        shrink_grid(ids, ("data", "fsdp"), [0, 4095], "data")
    assert len(str(e.value)) < 1000


# ----------------------------------------------------------------------------------
# Meshes and shardings
# ----------------------------------------------------------------------------------


def test_shrink_mesh_and_grow_mesh_on_jax_meshes():
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [DEVICES[4], DEVICES[5]], "data")
    assert dict(small.shape) == {"data": 1, "fsdp": 4}
    assert small.device_ids.tolist() == [[0, 1, 2, 3]]
    assert small.axis_types == full.axis_types
    # Lost devices outside the mesh change nothing.
    assert reshard.shrink_mesh(small, [6, 7], "data") is small
    assert reshard.grow_mesh(small, full, "data") is full
    regrown = reshard.grow_mesh(small, DEVICES[4:8], "data")
    assert regrown == full
    # Device ids, as shrink_mesh and ElasticManager take them, grow into devices.
    by_ids = reshard.grow_mesh(small, [4, np.int64(5), 6, DEVICES[7]], "data")
    assert by_ids == full
    assert all(isinstance(d, jax.Device) for d in by_ids.devices.flat)
    with pytest.raises(ValueError, match=r"no cpu device has id 99 \(ids 0-7 exist\)"):
        reshard.grow_mesh(small, [4, 5, 6, 99], "data")
    with pytest.raises(ValueError, match=r"True is neither a device nor a device id"):
        reshard.grow_mesh(small, [4, 5, 6, True], "data")
    # Shrinking the inner axis.
    assert reshard.shrink_mesh(full, [2], "fsdp").device_ids.tolist() == [[0, 1, 3], [4, 5, 7]]


def test_grow_mesh_checks_the_target():
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [4], "data")
    with pytest.raises(ValueError, match=r"target mesh has axis names \('a', 'b'\)"):
        reshard.grow_mesh(small, mesh_of((2, 4), ("a", "b")), "data")
    with pytest.raises(
        ValueError, match=r"must match the current mesh .* on every axis but 'data'"
    ):
        reshard.grow_mesh(small, mesh_of((4, 2), ("data", "fsdp")), "data")
    with pytest.raises(ValueError, match=r"lacks devices \[0, 1, 2, 3\] of the current mesh"):
        reshard.grow_mesh(small, mesh_of((1, 4), ("data", "fsdp"), [4, 5, 6, 7]), "data")


def test_carry_shardings_keeps_specs_and_memory_kinds():
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [7], "data")
    arr = jax.device_put(np.zeros((8, 4)), NamedSharding(full, P(("data", "fsdp"))))
    tree = {
        "w": NamedSharding(full, P(None, "fsdp"), memory_kind="pinned_host"),
        "a": arr,
        "s": jax.ShapeDtypeStruct((4,), jnp.float32, sharding=NamedSharding(full, P("fsdp"))),
        "one": SingleDeviceSharding(DEVICES[2]),
    }
    out = reshard.carry_shardings(tree, small)
    assert out["w"] == NamedSharding(small, P(None, "fsdp"), memory_kind="pinned_host")
    assert out["a"] == NamedSharding(small, P(("data", "fsdp")))
    assert out["s"] == NamedSharding(small, P("fsdp"))
    assert out["one"] is tree["one"]


def test_carry_shardings_errors_name_the_leaf():
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [7], "data")
    with pytest.raises(
        ValueError, match=r"leaf \['b'\] has SingleDeviceSharding.*NamedSharding of the old mesh"
    ):
        reshard.carry_shardings({"b": SingleDeviceSharding(DEVICES[7])}, small)
    with pytest.raises(ValueError, match=r"leaf \['n'\] has ndarray"):
        reshard.carry_shardings({"n": np.zeros(3)}, small)
    other = mesh_of((4,), ("x",))
    with pytest.raises(
        ValueError,
        match=r"leaf \['w'\] has spec .* naming axis 'fsdp', but the new mesh has axes \('x',\)",
    ):
        reshard.carry_shardings({"w": NamedSharding(full, P("fsdp"))}, other)


# ----------------------------------------------------------------------------------
# Recovery on random trees with random lost devices
# ----------------------------------------------------------------------------------

MESH_SHAPES = [(8,), (2, 4), (4, 2), (2, 2, 2), (1, 8)]
DTYPES = [np.float32, np.int8, np.int16, np.float16, np.uint32]


@st.composite
def specs(draw, mesh_shape, rank):
    names = [f"m{i}" for i in range(len(mesh_shape))]
    order = draw(st.permutations(names))
    entries: list[list[str]] = [[] for _ in range(rank)]
    for name in order:
        dim = draw(st.integers(-1, rank - 1))  # -1: replicated along this mesh axis
        if dim >= 0:
            entries[dim].append(name)
    return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])


@st.composite
def recovery_cases(draw):
    shape = draw(st.sampled_from(MESH_SHAPES))
    perm = draw(st.permutations(range(8)))
    src_mesh = mesh_of(shape, tuple(f"m{i}" for i in range(len(shape))), perm)
    lost = draw(st.sets(st.integers(0, 7), max_size=6))
    survivors = draw(st.permutations(sorted(set(range(8)) - lost)))
    n_dst = draw(st.sampled_from([n for n in (1, 2, 4) if n <= len(survivors)]))
    dst_shape = draw(st.sampled_from([(n_dst,)] + ([(2, 2)] if n_dst == 4 else [])))
    dst_mesh = mesh_of(dst_shape, tuple(f"m{i}" for i in range(len(dst_shape))), survivors[:n_dst])
    leaves = []
    for _ in range(draw(st.integers(1, 3))):
        rank = draw(st.integers(1, 3))
        dims = tuple(draw(st.sampled_from([8, 16])) for _ in range(rank))
        dtype = draw(st.sampled_from(DTYPES))
        leaves.append((dims, dtype, draw(specs(shape, rank)), draw(specs(dst_shape, rank))))
    return src_mesh, dst_mesh, lost, leaves, draw(st.booleans())


def make_leaf(value: np.ndarray, sharding: NamedSharding, lost: set[int]) -> jax.Array:
    """A sharded array whose shards on lost devices hold inverted bits (garbage)."""
    bufs = []
    for d, index in sharding.devices_indices_map(value.shape).items():
        block = np.ascontiguousarray(value[index])
        if d.id in lost:
            raw = block.view(np.uint8)
            block = (~raw).view(block.dtype).reshape(block.shape)
        bufs.append(jax.device_put(block, d))
    return jax.make_array_from_single_device_arrays(value.shape, sharding, bufs)


def shard_bytes(x: jax.Array) -> dict[int, bytes]:
    return {s.device.id: np.asarray(s.data).tobytes() for s in x.addressable_shards}


@given(recovery_cases())
def test_recover_random_trees_exact_or_names_what_is_lost(case):
    src_mesh, dst_mesh, lost, leaves, donate = case
    rng = np.random.default_rng(len(leaves))
    values, x, dst, masks = {}, {}, {}, {}
    for i, (dims, dtype, sspec, dspec) in enumerate(leaves):
        raw = rng.integers(0, 256, size=math.prod(dims) * np.dtype(dtype).itemsize, dtype=np.uint8)
        values[f"l{i}"] = raw.view(dtype).reshape(dims)
        ssh = NamedSharding(src_mesh, sspec)
        x[f"l{i}"] = make_leaf(values[f"l{i}"], ssh, lost)
        dst[f"l{i}"] = NamedSharding(dst_mesh, dspec)
        masks[f"['l{i}']"] = surviving_mask(dims, ssh, lost)
    before = {k: shard_bytes(v) for k, v in x.items()}
    lost_paths = {p for p, m in masks.items() if not m.all()}
    event("data lost" if lost_paths else "recoverable")

    if not lost_paths:
        y = reshard.recover(x, dst, lost, donate=donate)
        for k, v in values.items():
            assert y[k].sharding == dst[k]
            assert np.asarray(y[k]).tobytes() == v.tobytes(), k
        if donate:  # consumed whole: never left with some buffers freed
            assert all(v.is_deleted() for v in x.values())
        else:
            assert {k: shard_bytes(v) for k, v in x.items()} == before
        return

    with pytest.raises(reshard.DataLossError, match=r"data lost: \d+ box\(es\)") as e:
        reshard.recover(x, dst, lost, donate=donate)
    got: dict[str, list] = {}
    for path, box in e.value.missing:
        got.setdefault(path, []).append(box)
    assert set(got) == lost_paths
    for path, boxes in got.items():
        covered = np.zeros(masks[path].shape, dtype=int)
        for box in boxes:
            covered[tuple(slice(a, b) for a, b in box)] += 1
        # The boxes are disjoint and cover exactly the elements no survivor holds.
        assert covered.max() == 1
        np.testing.assert_array_equal(covered.astype(bool), ~masks[path])
    # Nothing moved and nothing was freed, even with donate=True.
    assert not any(v.is_deleted() for v in x.values())
    assert {k: shard_bytes(v) for k, v in x.items()} == before


def test_donated_recovery_runs_nothing_on_lost_devices(handover_all, monkeypatch):
    # Survivors keep their shards (the same layout, minus lost devices' replicas). The
    # donated input is consumed without a program over its devices, since a lost device
    # cannot run one: its kept shards are copied, and it is freed whole.
    from reshard import _compat

    ran = []
    real = _compat.prepare_donating_identity
    monkeypatch.setattr(
        _compat,
        "prepare_donating_identity",
        lambda xs: ran.append(xs[0].sharding.device_set) or real(xs),
    )
    full = mesh_of((2, 4), ("data", "fsdp"))
    survivors = mesh_of((1, 4), ("data", "fsdp"), [0, 1, 2, 3])
    value = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    lost = {4, 5}
    x = make_leaf(value, NamedSharding(full, P("fsdp")), lost)
    dst = NamedSharding(survivors, P("fsdp"))
    y = reshard.recover(x, dst, lost, donate=True)
    assert x.is_deleted() and y.sharding == dst
    np.testing.assert_array_equal(np.asarray(y), value)
    assert not any(d.id in lost for devices in ran for d in devices)
    # Without lost devices the same move hands the kept shards over.
    x = make_leaf(value, NamedSharding(full, P("fsdp")), set())
    x = jax.jit(lambda v: v.copy())(x)  # XLA's own buffers, which it can donate
    kept = {
        s.device: s.data.unsafe_buffer_pointer() for s in x.addressable_shards if s.device.id < 4
    }
    y = reshard.reshard(x, dst, donate=True)
    assert x.is_deleted()
    assert {s.device: s.data.unsafe_buffer_pointer() for s in y.addressable_shards} == kept


def test_recover_onto_a_mesh_reads_only_survivors():
    full = mesh_of((2, 4), ("data", "fsdp"))
    value = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    # Lost devices 0 and 1 hold garbage: the result must come from replica 1.
    x = {"w": make_leaf(value, NamedSharding(full, P("fsdp")), {0, 1})}
    small = reshard.shrink_mesh(full, [0, 1], "data")
    p = reshard.plan(x, reshard.carry_shardings(x, small), avoid_devices=[0, 1])
    srcs, _, matrix = p.transfer_matrix()
    assert all(matrix[srcs.index(i)].sum() == 0 for i in (0, 1) if i in srcs)
    y = reshard.recover(x, small, lost_devices=[DEVICES[0], DEVICES[1]])
    np.testing.assert_array_equal(np.asarray(y["w"]), value)
    assert y["w"].sharding == NamedSharding(small, P("fsdp"))


@pytest.mark.parametrize("executor", ["auto", "host", "device", "collective", "recover"])
def test_same_layout_on_spare_devices_reads_only_survivors(executor):
    # Each shard only changes device here, which the host and device executors copy
    # device to device in one batched call: that copy must not read the lost one.
    src = NamedSharding(mesh_of((2, 2), ("r", "s")), P("s"))  # replicas on 0/2 and 1/3
    dst = NamedSharding(mesh_of((2, 2), ("r", "s"), [4, 5, 6, 7]), P("s"))
    value = np.arange(8.0, dtype=np.float32)
    x = make_leaf(value, src, {0})
    if executor == "recover":
        y = reshard.recover(x, dst, [0])
    else:
        y = reshard.reshard(x, dst, executor=executor, avoid_devices=[0])
    np.testing.assert_array_equal(np.asarray(y), value)
    assert y.sharding == dst


@pytest.mark.parametrize("executor", ["host", "device", "collective-host", "collective-device"])
def test_a_lost_device_runs_no_program_and_no_buffer_of_it_is_read(executor, monkeypatch):
    """Its shard's buffer is gone (deleted, as memory on a dead device): every executor
    still recovers, and the collective one leaves the device out of its union mesh."""
    if executor.startswith("collective"):
        monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", executor.endswith("host"))
    mesh = mesh_of((2, 2), ("data", "fsdp"))
    src = NamedSharding(mesh, P("fsdp"))  # replicated over "data": devices 1 and 3
    value = np.arange(64, dtype=np.float32).reshape(16, 4)
    x = make_leaf(value, src, set())
    for shard in x.addressable_shards:
        if shard.device.id == 3:
            shard.data.delete()
    dst = NamedSharding(reshard.shrink_mesh(mesh, [3], "data"), P("fsdp"))
    p = reshard.plan(x, dst, executor=executor.split("-")[0], avoid_devices=[3])
    y = p.execute(x)
    np.testing.assert_array_equal(np.asarray(y), value)
    assert y.sharding == dst
    programs = [
        v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
    ]
    assert all(3 not in {d.id for d in prog.devices} for prog in programs)
    assert bool(programs) == executor.startswith("collective")


def test_recover_data_loss_message_and_key_arrays():
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [4, 5], "data")
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), NamedSharding(full, P("fsdp")))
    y = reshard.recover({"k": keys}, small, [4, 5])
    assert y["k"].sharding == NamedSharding(small, P("fsdp"))
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(y["k"])), np.asarray(jax.random.key_data(keys))
    )
    zero = jax.device_put(np.arange(16.0), NamedSharding(full, P(("data", "fsdp"))))
    with pytest.raises(
        reshard.DataLossError, match=r"1 box\(es\) .*\['opt'\]\[8:12\]\. Restore"
    ) as e:
        reshard.recover({"opt": zero}, small, [4, 5], donate=True)
    assert e.value.missing == [("['opt']", ((8, 12),))]
    assert not zero.is_deleted()


def test_zero_size_arrays_lose_nothing():
    # A zero-size array has no elements: a lost device holds nothing of it to lose.
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [5], "data")

    def state():
        return {
            "w": jax.device_put(
                np.arange(64.0).reshape(8, 8), NamedSharding(full, P(None, "fsdp"))
            ),
            "empty": jax.device_put(
                np.zeros((0, 8), np.float32), NamedSharding(full, P(None, ("data", "fsdp")))
            ),
        }

    for donate in (False, True):
        out = reshard.recover(state(), small, [5], donate=donate)
        assert out["empty"].shape == (0, 8) and out["empty"].dtype == np.float32
        assert out["empty"].sharding == NamedSharding(small, P(None, ("data", "fsdp")))
        assert sorted(s.device.id for s in out["empty"].addressable_shards) == [0, 1, 2, 3]
        np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(64.0).reshape(8, 8))
    one = jax.device_put(np.zeros((0, 3), np.int8), DEVICES[5])
    y = reshard.reshard(one, DEVICES[0], avoid_devices=[5])
    assert y.shape == (0, 3) and y.dtype == np.int8 and y.devices() == {DEVICES[0]}
    # A non-empty array whose only copy was there is still lost, with an empty beside it.
    with pytest.raises(reshard.DataLossError, match=r"\['x'\]\[0:2\]"):
        reshard.reshard(
            {"x": jax.device_put(np.ones(2), DEVICES[5]), "e": one}, DEVICES[0], avoid_devices=[5]
        )


def test_recover_onto_a_mesh_reports_a_lost_single_device_leaf_as_data_loss():
    # carry_shardings refuses a SingleDeviceSharding off the new mesh (ValueError), but
    # when that device is lost the leaf is gone: recover must say DataLossError, as it
    # does with an explicit sharding tree, and leave the inputs intact.
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [5], "data")
    state = {
        "w": jax.device_put(np.arange(8.0), NamedSharding(full, P("fsdp"))),
        "count": jax.device_put(np.int32(7), DEVICES[5]),
    }
    for dst in (small, {"w": NamedSharding(small, P("fsdp")), "count": NamedSharding(small, P())}):
        with pytest.raises(reshard.DataLossError, match=r"\['count'\]\[\]") as e:
            reshard.recover(state, dst, [5], donate=True)
        assert [path for path, _ in e.value.missing] == ["['count']"]
    assert int(state["count"]) == 7 and not state["w"].is_deleted()
    # On a surviving device off the mesh it is still carry_shardings' ValueError.
    state["count"] = jax.device_put(np.int32(7), DEVICES[6])
    with pytest.raises(ValueError, match=r"leaf \['count'\] has SingleDeviceSharding"):
        reshard.recover(state, small, [5])


def test_recover_onto_a_mesh_replicates_an_uncommitted_step_counter_on_it():
    # Committed to its default device (device 0), the counter and the state on the new
    # mesh made the next jitted step fail ("incompatible devices"); it ran before.
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [4, 5], "data")
    state = {
        "w": jax.device_put(np.arange(8.0), NamedSharding(full, P("fsdp"))),
        "step": jnp.int32(3),
    }
    step = jax.jit(lambda s: s["step"] + jnp.sum(s["w"]).astype(jnp.int32))
    assert int(step(state)) == 31
    out = reshard.recover(state, small, [4, 5])
    assert out["step"].sharding == NamedSharding(small, P()) and out["step"].committed
    assert out["step"].dtype == np.int32 and int(out["step"]) == 3
    assert int(step(out)) == 31
    # A committed one on a device of the new mesh stays where it is.
    state["step"] = jax.device_put(jnp.int32(3), DEVICES[1])
    assert reshard.recover(state, small, [4, 5])["step"].sharding == SingleDeviceSharding(
        DEVICES[1]
    )


def test_a_block_of_mesh_devices_names_lost_devices_everywhere():
    # mesh.devices[1:, :2], a 2-D array: recover raised TypeError for it, while
    # shrink_mesh, mark_lost and DeviceLossError raised ValueError.
    full = mesh_of((2, 4), ("data", "fsdp"))
    block = full.devices[1:, :2]
    assert block.shape == (1, 2)
    small = reshard.shrink_mesh(full, block, "data")
    assert dict(small.shape) == {"data": 1, "fsdp": 4}
    x = jax.device_put(np.arange(16.0), NamedSharding(full, P("fsdp")))
    y = reshard.recover(x, small, block)
    assert np.array_equal(np.asarray(y), np.arange(16.0)) and y.sharding.mesh == small
    assert reshard.reshard(x, NamedSharding(small, P("fsdp")), avoid_devices=block).shape == (16,)
    manager = reshard.ElasticManager(full, "data")
    manager.mark_lost(block)
    assert sorted(manager.lost_devices) == [4, 5]
    assert sorted(reshard.DeviceLossError(block).devices) == [4, 5]


def test_recover_refuses_a_destination_on_lost_devices():
    full = mesh_of((2, 4), ("data", "fsdp"))
    x = jax.device_put(np.zeros(8), NamedSharding(full, P("fsdp")))
    with pytest.raises(ValueError, match=r"destination sharding uses avoided devices \[4, 5\]"):
        reshard.recover(x, full, [4, 5])


def test_recover_names_lost_devices_in_its_errors():
    full = mesh_of((2, 4), ("data", "fsdp"))
    small = reshard.shrink_mesh(full, [4], "data")
    x = jax.device_put(np.zeros(8), NamedSharding(full, P("fsdp")))
    for bad in (4, "4", DEVICES[4]):
        with pytest.raises(
            TypeError, match=r"recover: lost_devices must be an iterable .*pass \[device\]"
        ):
            reshard.recover(x, small, bad)
    with pytest.raises(ValueError, match=r"recover: lost_devices names device id\(s\) \[42\]"):
        reshard.recover(x, small, [42])
    assert not x.is_deleted()


# ----------------------------------------------------------------------------------
# The elastic loop
# ----------------------------------------------------------------------------------


def simple_state(mesh):
    return {
        "w": jax.device_put(
            np.arange(32.0, dtype=np.float32).reshape(8, 4), NamedSharding(mesh, P("fsdp"))
        ),
        "step": jax.device_put(np.int32(0), NamedSharding(mesh, P())),
    }


def add_one(state, mesh):
    new = jax.tree.map(lambda a: a + 1, state)
    return new, dict(mesh.shape)


def test_manager_mark_lost_then_returned(caplog):
    full = mesh_of((2, 4), ("data", "fsdp"))
    em = reshard.ElasticManager(full, "data")
    state = simple_state(full)
    state, shape = em.run_step(add_one, state)
    assert shape == {"data": 2, "fsdp": 4} and not em.events
    with caplog.at_level(logging.INFO, logger="reshard.elastic"):
        em.mark_lost([DEVICES[4], 5])
        assert em.pending and em.lost_devices == {4, 5}
        state, shape = em.run_step(add_one, state)
    assert shape == {"data": 1, "fsdp": 4}
    assert sorted(d.id for d in em.active_devices) == [0, 1, 2, 3]
    assert sorted(d.id for d in em.inactive_devices) == [4, 5, 6, 7]
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(32.0).reshape(8, 4) + 2)
    assert sorted(d.id for d in state["w"].devices()) == [0, 1, 2, 3]
    ev = em.events[-1]
    assert (ev.kind, ev.lost, ev.new_shape) == ("shrink", (4, 5), {"data": 1, "fsdp": 4})
    assert ev.state_bytes == 32 * 4 + 4 and ev.bytes_moved == 0 and ev.seconds > 0
    assert any(
        "devices [4, 5] lost" in r.message and "recovered 132 B" in r.message
        for r in caplog.records
    )
    # Kept bytes count every replica (the step counter is on all 4 devices), so they
    # are said to be the shards' bytes, not the state's.
    assert ev.bytes_kept == 32 * 4 + 4 * 4
    assert (
        "(its shards on the new mesh, each replica counted: 0 B copied between devices, 144 B already in place)"
        in str(ev)
    )

    em.mark_returned([4, 5])
    before = np.asarray(state["w"]).copy()
    grown = em.apply(state)
    assert dict(em.mesh.shape) == {"data": 2, "fsdp": 4} and em.mesh == full
    np.testing.assert_array_equal(np.asarray(grown["w"]), before)
    assert grown["w"].sharding == NamedSharding(full, P("fsdp"))
    ev = em.events[-1]
    # Devices 4-7 receive a full replica of w (128 B) and the step counter (4 B each).
    assert (ev.kind, ev.returned) == ("grow", (4, 5))
    assert ev.bytes_moved == 128 + 4 * 4 and em.inactive_devices == ()


def test_manager_events_report_changes_that_needed_no_move():
    """A loss inside a slice already dropped moves nothing; the next event still says it."""
    full = mesh_of((2, 4), ("data", "fsdp"))
    em = reshard.ElasticManager(full, "data")
    state = simple_state(full)
    em.mark_lost([5])
    state, _ = em.run_step(add_one, state)
    em.mark_lost([6])  # its slice is already dropped: no move, no event
    state, _ = em.run_step(add_one, state)
    em.mark_returned([5])  # the slice still holds 6: no move, no event
    state, _ = em.run_step(add_one, state)
    assert [(e.kind, e.lost, e.returned) for e in em.events] == [("shrink", (5,), ())]
    em.mark_returned([6])
    state, _ = em.run_step(add_one, state)
    assert [(e.kind, e.lost, e.returned) for e in em.events] == [
        ("shrink", (5,), ()),
        ("grow", (6,), (5, 6)),
    ]
    assert "devices [6] lost, devices [5, 6] returned" in str(em.events[-1])
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(32.0).reshape(8, 4) + 4)
    assert state["w"].sharding == NamedSharding(full, P("fsdp"))


def test_leaves_that_are_not_arrays_come_back_as_they_are():
    """A state with a Python int and a numpy array: only the arrays move to the mesh."""
    full = mesh_of((2, 4), ("data", "fsdp"))
    host = np.arange(6.0)
    state = {"w": simple_state(full)["w"], "epoch": 3, "rng": host, "none": None}
    small = reshard.shrink_mesh(full, [6], "data")
    out = reshard.recover(state, small, [6])
    assert out["epoch"] == 3 and out["rng"] is host and out["none"] is None
    assert out["w"].sharding == NamedSharding(small, P("fsdp"))
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(32.0).reshape(8, 4))
    # Errors still name the array's own leaf path.
    opt = jax.device_put(np.arange(16.0), NamedSharding(full, P(("data", "fsdp"))))
    with pytest.raises(reshard.DataLossError, match=r"\['opt'\]\[12:14\]"):
        reshard.recover({"step": 1, "opt": opt}, small, [6])

    em = reshard.ElasticManager(full, "data")
    em.mark_lost([6])
    (new, aux) = em.run_step(lambda st, mesh: (dict(st, epoch=st["epoch"] + 1), None), state)
    assert new["epoch"] == 4 and new["rng"] is host and em.events[-1].kind == "shrink"
    assert new["w"].sharding == NamedSharding(em.mesh, P("fsdp"))


def test_manager_recovers_from_an_error_raised_in_the_step():
    full = mesh_of((4, 2), ("data", "fsdp"))
    em = reshard.ElasticManager(full, "data", donate=True)
    calls = []

    def step(state, mesh):
        calls.append(dict(mesh.shape))
        if len(calls) == 1:
            raise RuntimeError("UNAVAILABLE: TPU_6 heartbeat timed out; devices [7] halted")
        return add_one(state, mesh)

    state, shape = em.run_step(step, simple_state(full))
    assert calls == [{"data": 4, "fsdp": 2}, {"data": 3, "fsdp": 2}]
    assert em.lost_devices == {6, 7} and em.mesh.device_ids.tolist() == [[0, 1], [2, 3], [4, 5]]
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(32.0).reshape(8, 4) + 1)
    assert em.events[-1].cause.startswith("RuntimeError: UNAVAILABLE")


def test_manager_retry_limit_and_unrelated_errors():
    full = mesh_of((8,), ("data",))
    em = reshard.ElasticManager(full, "data", max_retries=2)
    state = {"w": jax.device_put(np.zeros(4), NamedSharding(full, P()))}

    def always_failing(state, mesh):
        raise reshard.DeviceLossError([mesh.devices.flat[0]])

    with pytest.raises(
        RuntimeError, match=r"gave up after 2 retries; the last attempt lost devices \[2\]"
    ):
        em.run_step(always_failing, state)
    # The third loss is recorded too (the next apply avoids it), though not applied.
    assert em.lost_devices == {0, 1, 2} and em.pending
    assert dict(em.mesh.shape) == {"data": 6}

    def buggy(state, mesh):
        raise ValueError("shapes do not match on device 3")

    with pytest.raises(ValueError, match="shapes do not match"):
        em.run_step(buggy, state)

    def loses_an_inactive_device(state, mesh):
        raise reshard.DeviceLossError([0])

    # A loss of devices outside the current mesh is not ours to handle: re-raised.
    with pytest.raises(reshard.DeviceLossError, match=r"devices \[0\] lost"):
        em.run_step(loses_an_inactive_device, state)
    assert em.lost_devices == {0, 1, 2} and not em.pending
    assert dict(em.mesh.shape) == {"data": 5}


def test_manager_records_an_idle_device_an_error_names():
    # Device 7 lost: the slice 4-7 is dropped, 4-6 idle. A step error that names idle
    # device 5 is not the step's to retry (re-raised), but 5 is recorded as lost, so
    # that 7's return does not grow the state back onto it.
    full = mesh_of((8,), ("data",))
    em = reshard.ElasticManager(full, "data", allowed_sizes=(4, 8))
    state = jax.device_put(np.arange(8.0), NamedSharding(full, P()))  # replicated
    em.mark_lost([7])
    state = em.apply(state)
    assert dict(em.mesh.shape) == {"data": 4}

    def names_an_idle_device(state, mesh):
        raise RuntimeError("UNAVAILABLE: TPU_5 heartbeat timed out")

    with pytest.raises(RuntimeError, match="TPU_5 heartbeat"):
        em.run_step(names_an_idle_device, state)
    assert em.lost_devices == {5, 7}
    em.mark_returned([7])
    state = em.apply(state)
    assert dict(em.mesh.shape) == {"data": 4} and em.lost_devices == {5}
    np.testing.assert_array_equal(np.asarray(state), np.arange(8.0))


def test_manager_error_parser_may_name_devices_and_must_name_something_sensible():
    full = mesh_of((4, 2), ("data", "fsdp"))
    calls = []

    def step(state, mesh):
        calls.append(dict(mesh.shape))
        if len(calls) == 1:
            raise RuntimeError("the runtime's own wording")
        return add_one(state, mesh)

    em = reshard.ElasticManager(full, "data", error_parser=lambda e: [DEVICES[7]])
    state, _ = em.run_step(step, simple_state(full))
    assert calls == [{"data": 4, "fsdp": 2}, {"data": 3, "fsdp": 2}] and em.lost_devices == {7}
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(32.0).reshape(8, 4) + 1)
    boom = lambda s, m: (_ for _ in ()).throw(RuntimeError("boom"))  # noqa: E731
    for returned, said in (
        (["7"], "an item str: '7'"),
        # One id or one device, not a collection of them ("'int' object is not iterable")
        (7, "int: 7"),
        (DEVICES[7], f"{type(DEVICES[7]).__name__}: {DEVICES[7]!r}"),
    ):
        bad = reshard.ElasticManager(full, "data", error_parser=lambda e, r=returned: r)
        with pytest.raises(TypeError) as e:
            bad.run_step(boom, simple_state(full))
        assert str(e.value) == (
            "ElasticManager: error_parser must return a collection of device ids or devices "
            f"(empty, or None: not a device loss); it returned {said} for RuntimeError: boom"
        )
        assert isinstance(e.value.__cause__, RuntimeError) and not bad.lost_devices
    # None is a parser's "not a device loss": the step's error, unchanged.
    quiet = reshard.ElasticManager(full, "data", error_parser=lambda e: None)
    with pytest.raises(RuntimeError, match="^boom$"):
        quiet.run_step(boom, simple_state(full))
    assert not quiet.lost_devices


def test_manager_handles_a_device_lost_while_the_state_moves(monkeypatch):
    """The move onto the smaller mesh fails, naming another device: it is avoided too."""
    full = mesh_of((4, 2), ("data", "fsdp"))
    real = _elastic._recover_with_plan
    moves = []

    def move_loses_device_2_once(state, target, avoid, donate):
        moves.append((dict(target.shape), sorted(avoid)))
        if len(moves) == 1:
            raise RuntimeError("UNAVAILABLE: device 2 halted")
        return real(state, target, avoid, donate=donate)

    monkeypatch.setattr(_elastic, "_recover_with_plan", move_loses_device_2_once)
    meshes = []

    def step(state, mesh):
        meshes.append(dict(mesh.shape))
        if len(meshes) == 1:
            raise reshard.DeviceLossError([7])
        return add_one(state, mesh)

    em = reshard.ElasticManager(full, "data", donate=True)
    state = simple_state(full)
    out, _ = em.run_step(step, state)
    # Losing 7 drops the slice (6, 7); the move to that mesh lost 2, so (2, 3) goes too.
    assert moves == [({"data": 3, "fsdp": 2}, [7]), ({"data": 2, "fsdp": 2}, [2, 7])]
    assert meshes == [{"data": 4, "fsdp": 2}, {"data": 2, "fsdp": 2}]
    assert em.lost_devices == {2, 7}
    assert {d.id for d in out["w"].sharding.device_set} == {0, 1, 4, 5}
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(32.0).reshape(8, 4) + 1)
    # A move that keeps losing devices counts against max_retries like the step.
    em = reshard.ElasticManager(full, "data", max_retries=1, donate=True)
    monkeypatch.setattr(
        _elastic,
        "_recover_with_plan",
        lambda *a, **k: (_ for _ in ()).throw(RuntimeError("UNAVAILABLE: device 4 halted")),
    )
    state = simple_state(full)
    with pytest.raises(RuntimeError, match=r"gave up after 1 retries") as e:
        em.run_step(lambda s, m: (_ for _ in ()).throw(reshard.DeviceLossError([7])), state)
    assert str(e.value.__cause__) == "UNAVAILABLE: device 4 halted"
    assert em.lost_devices == {4, 7} and em.pending
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(32.0).reshape(8, 4))


def test_a_recovery_that_fails_says_which_loss_led_to_it():
    """Data loss found after a step failed: the step's error is the ``__cause__``."""
    mesh = mesh_of((2, 4), ("data", "fsdp"))
    em = reshard.ElasticManager(mesh, "data")
    state = jax.device_put(np.arange(16.0), NamedSharding(mesh, P(("data", "fsdp"))))

    def step(state, mesh):
        raise RuntimeError("UNAVAILABLE: device 5 halted")

    with pytest.raises(reshard.DataLossError) as e:
        em.run_step(step, state)
    assert str(e.value.__cause__) == "UNAVAILABLE: device 5 halted"
    assert em.pending and em.lost_devices == {5}
    np.testing.assert_array_equal(np.asarray(state), np.arange(16.0))


def test_errors_pickle_and_copy_with_their_attributes():
    """A health checker in another process, or a pool's worker, hands errors over."""
    import copy
    import pickle

    loss = reshard.DeviceLossError([5, 4], "TPU 4 and 5 went away")
    gone = reshard.DataLossError([("['w']", ((0, 4),))])
    for again in (pickle.loads(pickle.dumps(loss)), copy.copy(loss)):
        assert type(again) is reshard.DeviceLossError and again.devices == {4, 5}
        assert str(again) == "TPU 4 and 5 went away"
    for again in (pickle.loads(pickle.dumps(gone)), copy.copy(gone)):
        assert type(again) is reshard.DataLossError and again.missing == gone.missing
        assert str(again) == str(gone)


def test_manager_says_which_sizes_to_allow_when_the_state_does_not_divide():
    full = mesh_of((4, 2), ("data", "fsdp"))
    em = reshard.ElasticManager(full, "data")
    state = {"opt": jax.device_put(np.arange(16.0), NamedSharding(full, P("data")))}
    em.mark_lost([7])  # data 4 -> 3, which 16 does not divide by
    with pytest.raises(ValueError, match=r"cannot be divided") as e:
        em.apply(state)
    assert "'data' has 3 of its 4 slices now" in str(e.value.__notes__)
    assert "allowed_sizes=(1, 2, 4)" in str(e.value.__notes__)
    assert em.pending and not state["opt"].is_deleted()
    em2 = reshard.ElasticManager(full, "data", allowed_sizes=(1, 2, 4))
    em2.mark_lost([7])
    out = em2.apply(state)
    assert dict(em2.mesh.shape) == {"data": 2, "fsdp": 2}
    np.testing.assert_array_equal(np.asarray(out["opt"]), np.arange(16.0))


def test_manager_data_loss_leaves_everything_as_it_was():
    full = mesh_of((2, 4), ("data", "fsdp"))
    em = reshard.ElasticManager(full, "data", donate=True)
    state = {"opt": jax.device_put(np.arange(16.0), NamedSharding(full, P(("data", "fsdp"))))}
    em.mark_lost([6])
    with pytest.raises(reshard.DataLossError, match=r"\['opt'\]\[12:14\]"):
        em.apply(state)
    assert em.mesh is full and em.pending and not em.events
    np.testing.assert_array_equal(np.asarray(state["opt"]), np.arange(16.0))


def test_manager_grows_back_to_the_full_mesh_whatever_allowed_sizes_lists():
    # allowed_sizes=(1, 2, 4) on data=8 (say, copied from the docs): the manager starts
    # at 8; once every device is back it must return there, not idle half the devices.
    full = mesh_of((8, 1), ("data", "fsdp"))
    em = reshard.ElasticManager(full, "data", allowed_sizes=(1, 2, 4))
    assert em.allowed_sizes == (1, 2, 4, 8)
    state = jax.device_put(np.arange(8.0), NamedSharding(full, P()))
    em.mark_lost([7])
    state = em.apply(state)
    assert dict(em.mesh.shape) == {"data": 4, "fsdp": 1}
    em.mark_returned([7])
    state = em.apply(state)
    assert dict(em.mesh.shape) == {"data": 8, "fsdp": 1}
    assert em.inactive_devices == ()
    np.testing.assert_array_equal(np.asarray(state), np.arange(8.0))


def test_manager_argument_errors():
    full = mesh_of((2, 4), ("data", "fsdp"))
    with pytest.raises(ValueError, match=r"axis 'dp' is not an axis of the mesh"):
        reshard.ElasticManager(full, "dp")
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"max_retries must be an integer >= 0, got {bad}"):
            reshard.ElasticManager(full, "data", max_retries=bad)
    assert reshard.ElasticManager(full, "data", max_retries=np.int64(2)).max_retries == 2
    with pytest.raises(TypeError, match=r"grow_mesh: expected a list of devices .* got int: 6"):
        reshard.grow_mesh(reshard.shrink_mesh(full, [4], "data"), 6, "data")
    with pytest.raises(ValueError, match=r"ElasticManager: allowed_sizes must hold .* got \(0,\)"):
        reshard.ElasticManager(full, "data", allowed_sizes=(0,))
    with pytest.raises(
        TypeError, match=r"got Device: CpuDevice\(id=5\) \(for one device, pass \[device\]\)"
    ):
        reshard.shrink_mesh(full, DEVICES[5], "data")
    em = reshard.ElasticManager(mesh_of((1, 4), ("data", "fsdp")), "data")
    with pytest.raises(ValueError, match=r"devices \[6\] are not in the full mesh.*grow_mesh"):
        em.mark_lost([6])
    for bad in (1, DEVICES[1]):
        with pytest.raises(
            TypeError, match=r"ElasticManager.mark_lost: expected a list of devices"
        ):
            em.mark_lost(bad)
        with pytest.raises(TypeError, match=r"ElasticManager.mark_returned: expected a list"):
            em.mark_returned(bad)
    em.mark_lost([1])
    with pytest.raises(ValueError, match=r"every one of the 1 slice\(s\)"):
        em.apply(simple_state(em.full_mesh))
    # One size, a 0-d array of ids, one id for DeviceLossError: clear errors, not
    # "'int' object is not iterable" or "iteration over a 0-d array".
    with pytest.raises(ValueError, match=r"allowed_sizes must be a collection .* got int: 2"):
        reshard.ElasticManager(full, "data", allowed_sizes=2)
    with pytest.raises(ValueError, match=r"allowed_sizes must be a collection .* got int: 1"):
        reshard.shrink_mesh(full, [4], "data", allowed_sizes=1)
    for zero_d in (np.array(2), jnp.array(2)):
        with pytest.raises(
            ValueError,
            match=r"allowed_sizes must be a collection .*got (ndarray|ArrayImpl): (a|A)rray\(2",
        ):
            reshard.shrink_mesh(full, [4], "data", allowed_sizes=zero_d)
        with pytest.raises(TypeError, match=r"expected a list of devices .*pass \[device\]"):
            reshard.shrink_mesh(full, zero_d, "data")
        with pytest.raises(TypeError, match=r"lost_devices must be an iterable .*rray\(2"):
            reshard.recover(jnp.zeros(8), full, zero_d)
    with pytest.raises(TypeError, match=r"expected a list of devices .*pass \[device\]"):
        reshard.shrink_mesh(full, np.array(4), "data")
    with pytest.raises(TypeError, match=r"grow_mesh: expected a list of devices .*ndarray"):
        reshard.grow_mesh(reshard.shrink_mesh(full, [4], "data"), np.array(4), "data")
    with pytest.raises(TypeError, match=r"DeviceLossError: expected a list of devices .* int: 4"):
        reshard.DeviceLossError(4)
    twice = mesh_of((2, 2), ("data", "fsdp"), [0, 1, 1, 2])
    with pytest.raises(ValueError, match=r"the mesh lists device\(s\) \[1\] more than once"):
        reshard.ElasticManager(twice, "data")
    with pytest.raises(ValueError, match=r"shrink_mesh: the mesh lists device\(s\) \[1\]"):
        reshard.shrink_mesh(twice, [7], "data")
    with pytest.raises(ValueError, match=r"grow_mesh: the mesh lists device\(s\) \[1\]"):
        reshard.grow_mesh(twice, [4, 5], "data")
    with pytest.raises(ValueError, match=r"grow_mesh \(target\): the mesh lists device\(s\) \[1"):
        reshard.grow_mesh(mesh_of((1, 2), ("data", "fsdp"), [0, 1]), twice, "data")
    x = jax.device_put(np.zeros(8), NamedSharding(full, P("fsdp")))
    with pytest.raises(TypeError, match=r"recover: lost_devices must be an iterable .*array\(4\)"):
        reshard.recover(x, reshard.shrink_mesh(full, [4], "data"), np.array(4))
    with pytest.raises(TypeError, match=r"avoid_devices must be an iterable .*array\(4\)"):
        reshard.reshard(x, NamedSharding(full, P()), avoid_devices=np.array(4))
    # A bad element of a device list: the message names the call it came from.
    cases = [
        ("shrink_mesh: lost_devices", lambda bad: reshard.shrink_mesh(full, [bad], "data")),
        (
            "grow_mesh",
            lambda bad: reshard.grow_mesh(reshard.shrink_mesh(full, [4], "data"), [bad], "data"),
        ),
        ("DeviceLossError", lambda bad: reshard.DeviceLossError([bad])),
        ("ElasticManager.mark_lost", lambda bad: em.mark_lost([bad])),
        ("ElasticManager.mark_returned", lambda bad: em.mark_returned([bad])),
    ]
    for where, call in cases:
        for bad in (True, 4.0, None):
            with pytest.raises(ValueError, match=rf"^{where}: (?=.*{bad})(?=.*device id)"):
                call(bad)


@pytest.mark.parametrize(
    ("error", "ids"),
    [
        (reshard.DeviceLossError([1, 2]), {1, 2}),
        (RuntimeError("UNAVAILABLE: TPU_3(process=0,(1,1,0,0)) heartbeat lost"), {3}),
        (RuntimeError("INTERNAL: device 2 failed: Xid 79"), {2}),
        (RuntimeError("DATA_LOSS on devices [4, 5]"), {4, 5}),
        (RuntimeError("UNAVAILABLE: device ids: 4, 5 stopped responding"), {4, 5}),
        # A bare list more often names the devices an operation ran on.
        (RuntimeError("INTERNAL: all-reduce over devices 0, 1, 2, 3 failed: device 2 halted"), {2}),
        (RuntimeError("UNAVAILABLE: device ids (1, 2) halted"), {1, 2}),
        (RuntimeError("CudaDevice(id=6) is unhealthy"), {6}),
        (RuntimeError("INTERNAL: gpu:1 uncorrectable ECC error"), {1}),
        (RuntimeError("RESOURCE_EXHAUSTED: out of memory on device 3, allocation failed"), set()),
        (RuntimeError("INTERNAL: compilation failed"), set()),
        (RuntimeError("device 3 is fine"), set()),
        # Errors that name a device without losing it.
        (RuntimeError("INTERNAL: during compilation for device 0: bad HLO"), set()),
        (RuntimeError("INTERNAL: Failed to allocate 4096 bytes on device 0"), set()),
        (RuntimeError("INTERNAL: Failed allocating 4096 bytes on device 0"), set()),
        (RuntimeError("INTERNAL: error while allocating a buffer: device 0 failed"), set()),
        # XLA's internal checks, and what a device cannot do, lose no device.
        (RuntimeError("INTERNAL: RET_CHECK failure (a.cc:12) device_ordinal=0 != 1"), set()),
        (RuntimeError("INTERNAL: unsupported hardware feature on device 0"), set()),
        (RuntimeError("UNIMPLEMENTED: hardware op on device 1 failed"), set()),
        # A PCI bus address is no device id; the driver's words for a lost GPU are.
        (RuntimeError("INTERNAL: GPU 00000000:3B:00.0: Xid 79, GPU has fallen off"), set()),
        (RuntimeError("INTERNAL: GPU 3: Xid 79, GPU has fallen off the bus"), {3}),
        (RuntimeError("UNAVAILABLE: device 3. Xid 79"), {3}),
        (RuntimeError("INTERNAL: cuda 12 error: driver too old"), set()),
        (RuntimeError("INTERNAL: cuda:3 uncorrectable ECC error"), {3}),
        # A bracketed list of the devices an operation ran on counts no more than a bare one.
        (RuntimeError("ABORTED: all-gather over devices [0, 1, 2, 3]: device 2 halted"), {2}),
        (RuntimeError("UNAVAILABLE: across devices (4, 5): TPU_5 heartbeat timed out"), {5}),
        (RuntimeError("INTERNAL: all-reduce over the devices [0, 1, 2, 3]: device 2 halted"), {2}),
        (ValueError("UNAVAILABLE device 3 lost"), set()),
        # A user's callback that raised, in JAX's words: the user's error, not a loss.
        (RuntimeError("INTERNAL: CpuCallback error calling callback: device 3 failed"), set()),
    ],
)
def test_parse_lost_devices(error, ids):
    assert reshard.parse_lost_devices(error) == ids


def test_docstring_examples_run():
    for module in (_mesh_surgery, _elastic):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ----------------------------------------------------------------------------------
# The example
# ----------------------------------------------------------------------------------


def test_example_runs_and_its_checks_pass():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "elastic_training.py"), "--small"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "check FAILED" not in out
    for line in (
        "shrink: devices [4, 5] lost; mesh {'data': 2, 'fsdp': 4} -> {'data': 1, 'fsdp': 4}",
        "check passed: recovered state is bit-exact",
        "check passed: spread state is bit-exact",
        "check passed: loss still falling on 4 devices",
        "DataLossError: data lost: 1 box(es)",
        "all checks passed",
    ):
        assert line in out, (line, out)


def test_grow_mesh_refuses_a_target_with_other_axis_types():
    # Growing keeps the axis types: a target of other types would change how the
    # arrays carried onto it are typed (Explicit against Auto), without a word.
    explicit = (AxisType.Explicit,) * 2
    small = Mesh(np.array(DEVICES[:4]).reshape(1, 4), ("data", "fsdp"), axis_types=explicit)
    target = Mesh(np.array(DEVICES[:8]).reshape(2, 4), ("data", "fsdp"))
    with pytest.raises(ValueError, match="axis types"):
        reshard.grow_mesh(small, target, "data")
    same = Mesh(np.array(DEVICES[:8]).reshape(2, 4), ("data", "fsdp"), axis_types=explicit)
    assert reshard.grow_mesh(small, same, "data") is same
