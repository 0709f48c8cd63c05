"""split_by_mesh_axis / concatenate_by_mesh_axis: rules, errors, zero-copy, round trips.

Ground truth is numpy: a part of an array sharded along the split axis is the original
with that axis's block range kept (see ``expected_part``). Every result is checked for
its sharding, each shard's device and index, and each shard's bytes.
"""

from __future__ import annotations

import doctest
import math
import re

import jax
import ml_dtypes
import numpy as np
import pytest
from helpers import failing_identity_after, pointers
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _buffers, _split, concatenate_by_mesh_axis, split_by_mesh_axis

DEVICES = jax.devices()


def make_mesh(shape, names, device_ids=None):
    ids = range(math.prod(shape)) if device_ids is None else device_ids
    return Mesh(np.array([DEVICES[i] for i in ids]).reshape(shape), names)


# A copy under jit gives buffers XLA owns, as arrays out of a training step are; a
# fresh device_put may alias the numpy input, and donating such a buffer copies it.
_owned_copy = jax.jit(lambda a: a.copy())


def put(value, mesh, spec, memory_kind=None):
    return _owned_copy(jax.device_put(value, NamedSharding(mesh, spec, memory_kind=memory_kind)))


def entry_axes(entry):
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, tuple) else (entry,)


def expected_part(value, spec, mesh, axis, lo, hi):
    """numpy: the part [lo:hi) along mesh ``axis`` of ``value`` laid out as ``spec``."""
    for dim, entry in enumerate(spec):
        axes = entry_axes(entry)
        if axis in axes:
            sizes = [mesh.shape[a] for a in axes]
            m = axes.index(axis)
            block = value.shape[dim] // math.prod(sizes)
            v = value.reshape(value.shape[:dim] + tuple(sizes) + (block,) + value.shape[dim + 1 :])
            v = np.take(v, np.arange(lo, hi), axis=dim + m)
            return v.reshape(value.shape[:dim] + (-1,) + value.shape[dim + 1 :])
    return value


def host(a):
    """numpy copy of an array (key arrays as their key data)."""
    if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    return np.asarray(a)


def assert_bits(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def assert_array(a, want, sharding):
    """``a`` equals numpy ``want`` bit for bit, is laid out as ``sharding``, shard by shard."""
    assert a.sharding == sharding
    assert a.sharding.memory_kind == sharding.memory_kind
    assert a.shape == want.shape[: a.ndim]
    index_map = sharding.devices_indices_map(a.shape)
    assert {s.device for s in a.addressable_shards} == set(index_map)
    for shard in a.addressable_shards:
        # Key arrays report an extra trailing slice for the key data; compare the rest.
        assert shard.index[: a.ndim] == index_map[shard.device]
        assert shard.data.devices() == {shard.device}
        assert_bits(host(shard.data), want[shard.index])
    assert_bits(host(a), want)


# --------------------------------------------------------------------------- split rules


def test_none_gives_one_part_per_position():
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = put(value, mesh, P("stage", "fsdp"))
    parts = split_by_mesh_axis(x, "stage")
    assert len(parts) == 2
    for k, part in enumerate(parts):
        sub = Mesh(mesh.devices[k : k + 1], mesh.axis_names)
        assert_array(part, value[4 * k : 4 * k + 4], NamedSharding(sub, P("stage", "fsdp")))


def test_the_pathways_module_call_shape_works():
    # Pathways users import the helpers' modules and call the function inside
    # (``from pathwaysutils.experimental import split_by_mesh_axis`` then
    # ``split_by_mesh_axis.split_by_mesh_axis(...)``); with reshard's import instead,
    # the same lines run.
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    x = put(value, mesh, P("stage", "fsdp"))
    parts = split_by_mesh_axis.split_by_mesh_axis(x, "stage")
    assert reshard.split_by_mesh_axis.split_by_mesh_axis is split_by_mesh_axis
    joined = concatenate_by_mesh_axis.concatenate_by_mesh_axis(parts, "stage")
    assert_array(joined, value, NamedSharding(mesh, P("stage", "fsdp")))


def test_int_gives_equal_parts():
    mesh = make_mesh((8,), ("x",))
    value = np.arange(16, dtype=np.int32)
    x = put(value, mesh, P("x"))
    parts = split_by_mesh_axis([x], "x", 4)
    assert len(parts) == 4
    for k, (part,) in enumerate(parts):
        sub = Mesh(mesh.devices[2 * k : 2 * k + 2], ("x",))
        assert_array(part, value[4 * k : 4 * k + 4], NamedSharding(sub, P("x")))


def test_sequence_gives_unequal_parts():
    mesh = make_mesh((4, 2), ("stage", "tp"))
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    x = put(value, mesh, P("stage", "tp"))
    parts = split_by_mesh_axis({"w": x}, "stage", [1, 3])
    bounds = [(0, 1), (1, 3), (3, 4)]
    assert [p["w"].shape for p in parts] == [(2, 6), (4, 6), (2, 6)]
    for (lo, hi), part in zip(bounds, parts, strict=True):
        sub = Mesh(mesh.devices[lo:hi], mesh.axis_names)
        assert_array(part["w"], value[2 * lo : 2 * hi], NamedSharding(sub, P("stage", "tp")))


def test_replicated_array_keeps_its_shape():
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    value = np.arange(8, dtype=np.float32)
    x = put(value, mesh, P("fsdp"))
    for k, part in enumerate(split_by_mesh_axis(x, "stage")):
        sub = Mesh(mesh.devices[k : k + 1], mesh.axis_names)
        assert_array(part, value, NamedSharding(sub, P("fsdp")))


def test_split_along_inner_axis_of_a_tuple_entry():
    # ("a", "b") numbers blocks a-major, so b = 0 holds blocks 0 and 2: not contiguous.
    mesh = make_mesh((2, 2), ("a", "b"))
    value = np.arange(8, dtype=np.float32)
    x = put(value, mesh, P(("a", "b")))
    first, second = split_by_mesh_axis(x, "b")
    assert_array(
        first,
        np.array([0, 1, 4, 5], np.float32),
        NamedSharding(Mesh(mesh.devices[:, :1], ("a", "b")), P(("a", "b"))),
    )
    assert_array(
        second,
        np.array([2, 3, 6, 7], np.float32),
        NamedSharding(Mesh(mesh.devices[:, 1:], ("a", "b")), P(("a", "b"))),
    )


def test_split_middle_axis_of_3d_mesh_on_permuted_devices():
    mesh = make_mesh((2, 2, 2), ("a", "b", "c"), device_ids=[5, 3, 0, 6, 1, 7, 2, 4])
    value = np.arange(4 * 8 * 2, dtype=np.int16).reshape(4, 8, 2)
    spec = P("b", ("a", "c"), None)
    x = put(value, mesh, spec)
    parts = split_by_mesh_axis(x, "b", [1])
    for k, part in enumerate(parts):
        sub = Mesh(mesh.devices[:, k : k + 1], mesh.axis_names)
        assert_array(part, value[2 * k : 2 * k + 2], NamedSharding(sub, spec))


def test_split_copies_nothing():
    mesh = make_mesh((4, 2), ("stage", "tp"))
    x = put(np.arange(64, dtype=np.float32).reshape(8, 8), mesh, P("stage", "tp"))
    before = pointers(x)
    parts = split_by_mesh_axis(x, "stage")
    for part in parts:
        for device, ptr in pointers(part).items():
            assert ptr == before[device]
    assert not x.is_deleted()  # donate=False: the parts alias the still-valid input
    np.testing.assert_array_equal(np.asarray(x), np.arange(64).reshape(8, 8))


def test_donate_consumes_inputs_and_still_copies_nothing():
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    x = put(value, mesh, P(("stage", "fsdp")))
    r = put(np.ones(3, np.int8), mesh, P())
    before = {**pointers(x)}
    parts = split_by_mesh_axis({"x": x, "r": r, "again": x}, "stage", donate=True)
    assert x.is_deleted() and r.is_deleted()
    for k, part in enumerate(parts):
        sub = NamedSharding(Mesh(mesh.devices[k : k + 1], mesh.axis_names), P(("stage", "fsdp")))
        assert_array(part["x"], value[4 * k : 4 * k + 4], sub)
        assert_array(part["again"], value[4 * k : 4 * k + 4], sub)
        assert_bits(host(part["r"]), np.ones(3, np.int8))
        for device, ptr in pointers(part["x"]).items():
            assert ptr == before[device]


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int8])
@pytest.mark.parametrize("rows", [8, 8 * 65536])  # carved shards; 1 MiB ones
def test_donating_an_earlier_reshards_output_copies_nothing_either(dtype, rows):
    # The CPU executors' outputs are host memory on lease from reshard's pool, which a
    # donating program would copy: split and concatenate take them over as the same
    # memory instead (they copied them whole before), which the pool lends out to no
    # one else while the parts live, and takes back once they go.
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    value = (np.arange(rows * 4) % 127).astype(dtype).reshape(rows, 4)
    x = reshard.reshard(
        put(value, mesh, P(("stage", "fsdp"))), NamedSharding(mesh, P(("stage", "fsdp")))
    )
    before = pointers(x)
    assert _buffers.lease_test()(before.values())
    parts = split_by_mesh_axis(x, "stage", donate=True)
    assert x.is_deleted()
    for part in parts:
        for device, ptr in pointers(part).items():
            assert ptr == before[device]
    joined = concatenate_by_mesh_axis(parts, "stage")
    assert all(p.is_deleted() for p in parts)
    # (Shards under 1 MiB share one block per array, which each part, donated on its
    # own device set, covers only in part: those are copied.)
    if value.nbytes // 8 >= 1 << 20:
        assert pointers(joined) == before
    del x, parts
    for _ in range(3):  # the pool lends out memory meanwhile: not joined's
        junk = reshard.reshard(
            put(value[::-1].copy(), mesh, P(("stage", "fsdp"))),
            NamedSharding(mesh, P(("fsdp", "stage"))),
        )
        del junk
    assert_array(joined, value, NamedSharding(mesh, P(("stage", "fsdp"))))
    del joined
    import gc

    gc.collect()
    assert not _buffers.lease_test()(before.values())


def test_donate_failure_loses_nothing(monkeypatch):
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    x = put(np.arange(8, dtype=np.float32), mesh, P("fsdp"))

    def broken(*args, **kwargs):
        raise RuntimeError("simulated failure while building a part")

    monkeypatch.setattr(jax, "make_array_from_single_device_arrays", broken)
    with pytest.raises(RuntimeError, match="simulated failure"):
        split_by_mesh_axis(x, "stage", donate=True)
    monkeypatch.undo()
    assert not x.is_deleted()
    np.testing.assert_array_equal(np.asarray(x), np.arange(8))


def test_memory_kind_is_kept():
    mesh = make_mesh((2, 2), ("a", "b"))
    value = np.arange(16, dtype=np.float32).reshape(4, 4)
    x = put(value, mesh, P("a", "b"), memory_kind="pinned_host")
    parts = split_by_mesh_axis(x, "a", donate=True)
    for k, part in enumerate(parts):
        sub = NamedSharding(
            Mesh(mesh.devices[k : k + 1], ("a", "b")), P("a", "b"), memory_kind="pinned_host"
        )
        assert_array(part, value[2 * k : 2 * k + 2], sub)
    joined = concatenate_by_mesh_axis(parts, "a")
    assert_array(joined, value, x.sharding)


@pytest.mark.parametrize("made_by", ["jit", "device_put"])
def test_unpinned_host_arrays_are_split_and_joined_without_being_consumed(made_by):
    # XLA runs nothing on unpinned host memory: donating jit-made one-device parts to
    # the jitted identity aborted the process (jax 0.10, CPU). Such inputs stay valid,
    # and the result aliases them.
    mesh = make_mesh((2,), ("a",))
    value = np.arange(16, dtype=np.float32).reshape(4, 4)
    unpinned = NamedSharding(mesh, P(None, "a"), memory_kind="unpinned_host")
    # Not put(): its jitted copy would land in device memory.
    if made_by == "jit":
        x = jax.jit(lambda v: v, out_shardings=unpinned)(value)
    else:
        x = jax.device_put(value, unpinned)
    assert x.sharding.memory_kind == "unpinned_host"
    before = pointers(x)
    for donate in (False, True):
        parts = split_by_mesh_axis(x, "a", donate=donate)
        assert not x.is_deleted()
        for k, part in enumerate(parts):
            sub = NamedSharding(
                Mesh(mesh.devices[k : k + 1], ("a",)), P(None, "a"), memory_kind="unpinned_host"
            )
            assert_array(part, value[:, 2 * k : 2 * k + 2], sub)
        joined = concatenate_by_mesh_axis(parts, "a")
        assert not any(p.is_deleted() for p in parts)
        assert_array(joined, value, x.sharding)
        assert pointers(joined) == before


@pytest.mark.parametrize("spec", [P(), P("b")])
def test_donation_declined_for_one_shard_keeps_every_shard_alive(spec):
    # A numpy view of one shard (np.asarray of a replicated array) makes JAX donate the
    # other buffers only, leaving the input "not deleted" but without them: the result
    # once held deleted shards, and a jit on it crashed the process.
    mesh = make_mesh((2, 2), ("a", "b"))
    value = np.arange(2, dtype=np.float32)
    parts = split_by_mesh_axis(put(value, mesh, spec), "a")
    view = host(parts[0])
    joined = concatenate_by_mesh_axis(parts, "a")
    assert all(p.is_deleted() for p in parts)
    assert_array(joined, value, NamedSharding(mesh, spec))
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a + 1)(joined)), value + 1)
    np.testing.assert_array_equal(view, value)  # the view still reads what it saw
    x = put(value, mesh, spec)
    view = host(x)
    for k, part in enumerate(split_by_mesh_axis(x, "a", donate=True)):
        assert x.is_deleted()
        sub = NamedSharding(Mesh(mesh.devices[k : k + 1], ("a", "b")), spec)
        assert_array(part, value, sub)


@pytest.mark.parametrize("made_by", ["jit", "device_put"])
@pytest.mark.parametrize("sections", [None, [2, 3]])
def test_arrays_with_no_elements(made_by, sections):
    # XLA gives every device the whole of an empty array ((0, 24, 2) where shards are
    # (0, 6, 2)) in jit outputs, the donating identity's included: parts and joins
    # once failed on those, a join after donating the inputs.
    mesh = make_mesh((4, 1), ("a", "d"))
    sharding = NamedSharding(mesh, P(None, "a", None))
    value = np.zeros((0, 24, 2), np.float32)
    if made_by == "jit":
        x = jax.jit(lambda v: v, out_shardings=sharding)(value)
    else:
        x = jax.device_put(value, sharding)
    parts = split_by_mesh_axis(x, "a", sections, donate=True)
    edges = [0, 1, 2, 3, 4] if sections is None else [0, *sections, 4]
    for lo, hi, part in zip(edges[:-1], edges[1:], parts, strict=True):
        sub = NamedSharding(Mesh(mesh.devices[lo:hi], ("a", "d")), P(None, "a", None))
        assert_array(part, value[:, 6 * lo : 6 * hi], sub)
    joined = concatenate_by_mesh_axis(parts, "a")
    assert all(p.is_deleted() for p in parts)
    assert_array(joined, value, sharding)


@pytest.mark.parametrize("mesh_shape", [(2,), (2, 2)])
def test_inputs_that_share_buffers_are_left_undonated(mesh_shape):
    # Parts of one array at two leaves (and an array with what was handed its
    # buffers) share buffers: donating both asked XLA to donate one buffer twice
    # (an error, or a segfault on a 2-D mesh); donating one would leave the other on
    # freed buffers. They stay valid instead, and the results alias them.
    names = ("a", "b")[: len(mesh_shape)]
    mesh = make_mesh(mesh_shape, names)
    value = np.arange(8, dtype=np.float32)
    x = put(value, mesh, P("a"))
    parts = split_by_mesh_axis({"w": x, "tied": x}, "a")
    joined = concatenate_by_mesh_axis(parts, "a")
    for key in ("w", "tied"):
        assert_array(joined[key], value, x.sharding)
        assert not any(p[key].is_deleted() for p in parts)
    y = reshard.reshard(x, NamedSharding(mesh, P("a")), may_alias=True)  # x's buffers
    assert pointers(y) == pointers(x)
    split = split_by_mesh_axis({"x": x, "y": y}, "a", donate=True)
    assert not x.is_deleted() and not y.is_deleted()
    for k, part in enumerate(split):
        sub = NamedSharding(Mesh(mesh.devices[k : k + 1], names), P("a"))
        assert_array(part["x"], value[4 * k : 4 * k + 4], sub)
        assert_array(part["y"], value[4 * k : 4 * k + 4], sub)


def test_prng_key_arrays():
    mesh = make_mesh((4, 2), ("a", "b"))
    keys = put(jax.random.split(jax.random.key(7), 8), mesh, P("a"))
    data = host(keys)
    parts = split_by_mesh_axis(keys, "a", 2)
    for k, part in enumerate(parts):
        assert jax.dtypes.issubdtype(part.dtype, jax.dtypes.prng_key)
        assert_array(
            part,
            data[4 * k : 4 * k + 4],
            NamedSharding(Mesh(mesh.devices[2 * k : 2 * k + 2], ("a", "b")), P("a")),
        )
    joined = concatenate_by_mesh_axis(parts, "a")
    assert_array(joined, data, keys.sharding)


def test_shape_dtype_structs_get_part_layouts():
    mesh = make_mesh((4, 2), ("stage", "tp"))
    spec = P("stage", "tp")
    s = jax.ShapeDtypeStruct((8, 4), ml_dtypes.bfloat16, sharding=NamedSharding(mesh, spec))
    parts = split_by_mesh_axis({"s": s}, "stage", [3])
    assert [p["s"].shape for p in parts] == [(6, 4), (2, 4)]
    assert parts[1]["s"].sharding == NamedSharding(Mesh(mesh.devices[3:], mesh.axis_names), spec)
    assert parts[0]["s"].dtype == ml_dtypes.bfloat16
    joined = concatenate_by_mesh_axis(parts, "stage")
    assert joined["s"].shape == (8, 4) and joined["s"].sharding == s.sharding


def test_tree_without_leaves():
    assert split_by_mesh_axis({}, "x", 3) == [{}, {}, {}]
    assert split_by_mesh_axis([], "x", [1, 2]) == [[], [], []]
    assert concatenate_by_mesh_axis([{}, {}], "x") == {}


# --------------------------------------------------------------------------- split errors


@pytest.fixture
def mesh24():
    return make_mesh((2, 4), ("stage", "fsdp"))


def test_error_leaf_not_an_array(mesh24):
    with pytest.raises(ValueError, match=r"arrays\['b'\] is a ndarray, expected a jax.Array"):
        split_by_mesh_axis({"a": put(np.ones(4), mesh24, P()), "b": np.ones(4)}, "stage")


def test_error_not_a_named_sharding():
    x = jax.device_put(np.ones(4), SingleDeviceSharding(DEVICES[0]))
    with pytest.raises(
        ValueError, match=r"arrays\[0\] has sharding SingleDeviceSharding.*only NamedSharding"
    ):
        split_by_mesh_axis([x], "stage")


def test_error_different_meshes(mesh24):
    other = make_mesh((2, 4), ("stage", "tp"))
    with pytest.raises(
        ValueError, match=r"one mesh; arrays\[0\] is on .*'fsdp'.* but arrays\[1\] is on .*'tp'"
    ):
        split_by_mesh_axis([put(np.ones(4), mesh24, P()), put(np.ones(4), other, P())], "stage")


def test_error_axis_not_in_mesh(mesh24):
    with pytest.raises(
        ValueError,
        match=r"mesh_axis='tp' is not an axis of the mesh; its axes are \{'stage': 2, 'fsdp': 4\}",
    ):
        split_by_mesh_axis(put(np.ones(4), mesh24, P()), "tp")


@pytest.mark.parametrize("count", [3, 0, -2, 8])
def test_error_indivisible_count(mesh24, count):
    x = put(np.ones(8), mesh24, P("fsdp"))
    with pytest.raises(
        ValueError, match=rf"sections={count} does not divide the mesh axis of size 4"
    ):
        split_by_mesh_axis(x, "fsdp", count)


@pytest.mark.parametrize(
    "sections",
    [[2, 2], [3, 1], [0, 2], [4], [1, 5], [-1]],
    ids=["repeated", "decreasing", "zero", "at-end", "past-end", "negative"],
)
def test_error_bad_boundaries(mesh24, sections):
    x = put(np.ones(8), mesh24, P("fsdp"))
    want = f"sections={sections} must be strictly increasing interior boundaries, each in (0, 4)"
    with pytest.raises(ValueError, match=re.escape(want)):
        split_by_mesh_axis(x, "fsdp", sections)


@pytest.mark.parametrize(
    "sections", [np.array(2), np.int8(2), jax.numpy.int32(2)], ids=["0-d", "np", "jax"]
)
def test_any_integer_scalar_is_a_count(mesh24, sections):
    # (and boundaries in a jax array are read as numpy's are)
    y = put(np.arange(8, dtype=np.float32), mesh24, P("fsdp"))
    assert [p.shape for p in split_by_mesh_axis(y, "fsdp", jax.numpy.array([1]))] == [(2,), (6,)]
    value = np.arange(8, dtype=np.float32)
    x = put(value, mesh24, P("fsdp"))
    parts = split_by_mesh_axis(x, "fsdp", sections)
    assert [p.shape for p in parts] == [(4,), (4,)]
    for k, part in enumerate(parts):
        assert_bits(host(part), value[4 * k : 4 * k + 4])
    assert len(split_by_mesh_axis({}, "fsdp", sections)) == 2


@pytest.mark.parametrize(
    "sections", ["12", 1.5, [1.5], True, [True], np.array(True), np.array([[1]]), np.array(2.0)]
)
def test_error_sections_of_wrong_type(mesh24, sections):
    x = put(np.ones(8), mesh24, P("fsdp"))
    with pytest.raises(
        ValueError, match=r"mesh_axis_indices_or_sections=.*(must be None, an int|must hold ints)"
    ):
        split_by_mesh_axis(x, "fsdp", sections)


def test_error_struct_whose_shape_does_not_fit_its_sharding(mesh24):
    # An array's shape always fits its sharding; a struct's is not checked by JAX, and
    # its parts would get shapes that drop rows (5 on 2 devices -> parts of 2 and 2).
    bad = jax.ShapeDtypeStruct((6,), np.float32, sharding=NamedSharding(mesh24, P("fsdp")))
    with pytest.raises(ValueError, match=r"arrays\['w'\]: shape \(6,\) does not fit its sharding"):
        split_by_mesh_axis({"w": bad}, "fsdp")
    halves = [make_mesh((1,), ("a",), [0]), make_mesh((3,), ("a",), [1, 2, 3])]
    parts = [
        jax.ShapeDtypeStruct((n,), np.float32, sharding=NamedSharding(m, P("a")))
        for n, m in zip([2, 7], halves, strict=True)
    ]
    with pytest.raises(ValueError, match=r"array_trees\[1\]: shape \(7,\) does not fit"):
        concatenate_by_mesh_axis(parts, "a")


@pytest.mark.parametrize("kind", ["reduced", "unreduced"])
@pytest.mark.parametrize("axis", ["stage", "tp"])
def test_specs_with_reduced_or_unreduced_axes_split_and_join(kind, axis):
    # Such a spec refuses to be iterated ("Using *pspec is dangerous"): parts keep
    # it whole. Splitting regroups buffers, so even the addends an unreduced array
    # holds come back exactly (JAX gives such shards no index).
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    mesh = Mesh(np.array(DEVICES).reshape(4, 2), ("stage", "tp"), axis_types=explicit)
    value = np.arange(32, dtype=np.float32).reshape(8, 4)
    spec = P("stage", None, **{kind: {"tp"}})
    x = put(value, mesh, spec)
    held = {s.device: np.asarray(s.data) for s in x.addressable_shards}
    parts = split_by_mesh_axis({"x": x}, axis)
    for k, part in enumerate(parts):
        got = part["x"]
        assert got.sharding.spec == spec
        rows = value[2 * k : 2 * k + 2] if axis == "stage" else value
        assert got.shape == rows.shape
        for shard in got.addressable_shards:
            assert_bits(np.asarray(shard.data), held[shard.device])
        if kind == "reduced":
            assert_bits(host(got), rows)
    joined = concatenate_by_mesh_axis(parts, axis)["x"]
    assert joined.sharding == x.sharding
    assert [s.device for s in joined.addressable_shards] == list(held)
    for shard in joined.addressable_shards:
        assert_bits(np.asarray(shard.data), held[shard.device])
    if kind == "reduced":
        assert_bits(host(joined), value)


def test_error_abstract_mesh(mesh24):
    s = jax.ShapeDtypeStruct(
        (8,), np.float32, sharding=NamedSharding(mesh24.abstract_mesh, P("fsdp"))
    )
    with pytest.raises(
        ValueError, match=r"arrays is on the abstract mesh .*need a Mesh of devices"
    ):
        split_by_mesh_axis(s, "fsdp")


def test_error_deleted_input(mesh24):
    x = put(np.ones(8), mesh24, P("fsdp"))
    x.delete()
    with pytest.raises(ValueError, match=r"arrays has been deleted"):
        split_by_mesh_axis(x, "fsdp")


@pytest.mark.parametrize("donate", [False, True])
def test_weak_type_survives_split_and_join(mesh24, donate):
    # jnp.full with a Python scalar is weakly typed; jax.device_put keeps that, and
    # so do the parts and the joined array (bfloat16 times them stays bfloat16).
    x = jax.device_put(jax.numpy.full((8, 4), 2.0), NamedSharding(mesh24, P("stage")))
    strong = put(np.full((8, 4), 2.0, np.float32), mesh24, P("stage"))
    parts = split_by_mesh_axis([x, strong], "stage", donate=donate)
    assert [[a.weak_type for a in part] for part in parts] == [[True, False]] * 2
    joined = concatenate_by_mesh_axis(parts, "stage")
    assert [a.weak_type for a in joined] == [True, False]
    assert jax.numpy.result_type(joined[0], jax.numpy.bfloat16) == jax.numpy.bfloat16
    for a in joined:
        np.testing.assert_array_equal(np.asarray(a), np.full((8, 4), 2.0, np.float32))
    sds = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=x.sharding, weak_type=True)
    assert all(part.weak_type for part in split_by_mesh_axis(sds, "stage"))


def test_error_empty_tree_without_count():
    with pytest.raises(ValueError, match="no leaves.*pass mesh_axis_indices_or_sections"):
        split_by_mesh_axis({}, "x")


@pytest.mark.parametrize(
    ("sections", "parts"), [(3, 3), (np.int64(2), 2), ([1, 5], 3), (np.array([2]), 2)]
)
def test_empty_tree_gives_the_parts_asked_for(sections, parts):
    assert split_by_mesh_axis({"a": {}}, "x", sections) == [{"a": {}}] * parts


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        (0, "positive number of parts"),
        (-2, "positive number of parts"),
        ([0, 2], "each above 0"),
        ([3, 3], "strictly increasing"),
        ([2, 1], "strictly increasing"),
        ([1.5], "must hold ints"),
        ("2", "must be None, an int or a sequence"),
    ],
)
def test_error_empty_tree_bad_sections(sections, message):
    # No axis size to check against, but the form of the sections still is.
    with pytest.raises(ValueError, match=message):
        split_by_mesh_axis({}, "x", sections)


# --------------------------------------------------------------------------- concatenate


def test_concatenate_joins_independent_arrays():
    left = make_mesh((1, 2), ("stage", "tp"), [6, 7])
    right = make_mesh((3, 2), ("stage", "tp"), [0, 1, 2, 3, 4, 5])
    a = np.arange(2 * 4, dtype=np.float32).reshape(2, 4)
    b = 100 + np.arange(6 * 4, dtype=np.float32).reshape(6, 4)
    rep = np.arange(3, dtype=np.int8)
    joined = concatenate_by_mesh_axis(
        [
            {"w": put(a, left, P("stage", "tp")), "r": put(rep, left, P())},
            {"w": put(b, right, P("stage", "tp")), "r": put(rep, right, P())},
        ],
        "stage",
    )
    mesh = make_mesh((4, 2), ("stage", "tp"), [6, 7, 0, 1, 2, 3, 4, 5])
    assert_array(joined["w"], np.concatenate([a, b]), NamedSharding(mesh, P("stage", "tp")))
    assert_array(joined["r"], rep, NamedSharding(mesh, P()))


def test_concatenate_copies_nothing_and_donates():
    mesh = make_mesh((4, 2), ("stage", "tp"))
    x = put(np.arange(32, dtype=np.float32).reshape(8, 4), mesh, P("stage", "tp"))
    before = pointers(x)
    parts = split_by_mesh_axis(x, "stage", 2, donate=True)  # x consumed: parts hold all
    joined = concatenate_by_mesh_axis(parts, "stage")
    assert all(p.is_deleted() for p in parts)
    assert pointers(joined) == before
    assert_array(joined, np.arange(32, dtype=np.float32).reshape(8, 4), x.sharding)


def test_concatenating_the_executors_outputs_copies_them_before_consuming_any(monkeypatch):
    # The host executor's outputs live in host memory XLA adopted, not owns: the
    # donating identity of the second device set copied them after the first set's
    # inputs were consumed, so running out of memory there lost those. They are
    # copied with the rest before anything is consumed: no identity runs for them.
    truth = np.arange(8 * 8192, dtype=np.float32).reshape(8, 8192)
    meshes = [make_mesh((2, 2), ("stage", "tp"), ids) for ids in ([0, 1, 2, 3], [4, 5, 6, 7])]
    parts = [
        reshard.reshard(
            put(half, mesh, P(None, "tp")), NamedSharding(mesh, P("stage", "tp")), executor="host"
        )
        for half, mesh in zip(np.split(truth, 2), meshes, strict=True)
    ]
    assert all(_buffers.lease_test()(pointers(p).values()) for p in parts)
    ran: list[int] = []
    failing_identity_after(monkeypatch, ran)
    joined = concatenate_by_mesh_axis(parts, "stage")
    assert ran == [] and all(p.is_deleted() for p in parts)
    mesh = make_mesh((4, 2), ("stage", "tp"), range(8))
    assert_array(joined, truth, NamedSharding(mesh, P("stage", "tp")))


def _two_parts(spec_left=None, spec_right=None, n_left=4, n_right=4):
    spec_left = P("stage") if spec_left is None else spec_left
    spec_right = P("stage") if spec_right is None else spec_right
    left = make_mesh((2, 2), ("stage", "tp"), [0, 1, 2, 3])
    right = make_mesh((2, 2), ("stage", "tp"), [4, 5, 6, 7])
    return [
        put(np.ones(n_left, np.float32), left, spec_left),
        put(np.ones(n_right, np.float32), right, spec_right),
    ]


def test_concatenate_error_empty():
    with pytest.raises(ValueError, match="array_trees is empty"):
        concatenate_by_mesh_axis([], "stage")


def test_concatenate_error_not_a_sequence():
    with pytest.raises(ValueError, match="array_trees must be a sequence of pytrees, got dict"):
        concatenate_by_mesh_axis({"a": 1}, "stage")


def test_concatenate_takes_any_iterable_in_order():
    a = np.arange(4, dtype=np.float32)
    b = 10 + np.arange(4, dtype=np.float32)
    left = make_mesh((2, 2), ("stage", "tp"), [0, 1, 2, 3])
    right = make_mesh((2, 2), ("stage", "tp"), [4, 5, 6, 7])
    parts = [put(a, left, P("stage")), put(b, right, P("stage"))]
    joined = concatenate_by_mesh_axis((p for p in parts), "stage")
    mesh = make_mesh((4, 2), ("stage", "tp"))
    assert_array(joined, np.concatenate([a, b]), NamedSharding(mesh, P("stage")))


@pytest.mark.parametrize("not_trees", [np.ones(2), "ab", 3], ids=["ndarray", "str", "int"])
def test_concatenate_error_not_a_sequence_of_trees(not_trees):
    with pytest.raises(ValueError, match="array_trees must be a sequence of pytrees, got"):
        concatenate_by_mesh_axis(not_trees, "stage")


def test_logical_device_ids_are_refused_by_split_and_concatenate():
    # Such a sharding does not lay its shards out by the mesh's device array: cutting
    # the mesh would hand out the wrong shards, so both functions refuse it.
    mesh = make_mesh((2, 4), ("stage", "fsdp"))
    sharding = NamedSharding(mesh, P("stage"), _logical_device_ids=tuple(range(7, -1, -1)))
    value = np.arange(16, dtype=np.float32)
    x = _owned_copy(jax.device_put(value, sharding))
    message = r"arrays\[0\] has a NamedSharding with _logical_device_ids set"
    with pytest.raises(ValueError, match=message):
        split_by_mesh_axis([x], "stage", donate=True)
    other = put(value, make_mesh((2, 4), ("stage", "fsdp")), P("stage"))
    with pytest.raises(ValueError, match=r"array_trees\[1\] has a NamedSharding with _logical"):
        concatenate_by_mesh_axis([other, x], "stage")
    assert not x.is_deleted() and not other.is_deleted()
    np.testing.assert_array_equal(np.asarray(x), value)
    # The identity order is the mesh's own: such arrays split and join as any other.
    same = NamedSharding(mesh, P("stage"), _logical_device_ids=tuple(range(8)))
    parts = split_by_mesh_axis(_owned_copy(jax.device_put(value, same)), "stage")
    np.testing.assert_array_equal(np.asarray(parts[1]), value[8:])
    np.testing.assert_array_equal(np.asarray(concatenate_by_mesh_axis(parts, "stage")), value)


def test_concatenate_error_different_structures():
    a, b = _two_parts()
    with pytest.raises(
        ValueError, match=r"array_trees\[1\] has structure .* but array_trees\[0\] has"
    ):
        concatenate_by_mesh_axis([{"w": a}, {"v": b}], "stage")


def test_concatenate_error_different_axis_names():
    a = put(np.ones(4), make_mesh((2, 2), ("stage", "tp"), [0, 1, 2, 3]), P())
    b = put(np.ones(4), make_mesh((2, 2), ("stage", "dp"), [4, 5, 6, 7]), P())
    with pytest.raises(
        ValueError,
        match=r"array_trees\[1\] is on a mesh with axes \('stage', 'dp'\), but array_trees\[0\] on one with axes \('stage', 'tp'\)",
    ):
        concatenate_by_mesh_axis([a, b], "stage")


def test_concatenate_error_different_axis_types():
    explicit = (jax.sharding.AxisType.Explicit,) * 2
    a = put(np.ones(4), make_mesh((2, 2), ("stage", "tp"), [0, 1, 2, 3]), P("stage"))
    m = Mesh(np.array(DEVICES[4:8]).reshape(2, 2), ("stage", "tp"), axis_types=explicit)
    b = put(np.ones(4), m, P("stage"))
    with pytest.raises(ValueError, match=r"array_trees\[1\] is on a mesh with axis types"):
        concatenate_by_mesh_axis([a, b], "stage")


def test_error_struct_with_an_unconstrained_entry(mesh24):
    loose = NamedSharding(mesh24, P(P.UNCONSTRAINED, "stage"))
    s = jax.ShapeDtypeStruct((8, 8), np.float32, sharding=loose)
    with pytest.raises(ValueError, match=r"arrays\['w'\] has spec .* UNCONSTRAINED entry"):
        split_by_mesh_axis({"w": s}, "fsdp")


def test_concatenate_error_different_sizes_off_the_axis():
    a = put(np.ones(4), make_mesh((2, 2), ("stage", "tp"), [0, 1, 2, 3]), P())
    b = put(np.ones(4), make_mesh((1, 4), ("stage", "tp"), [4, 5, 6, 7]), P())
    with pytest.raises(
        ValueError,
        match=r"mesh of sizes \{'stage': 1, 'tp': 4\}, but array_trees\[0\] on \{'stage': 2, 'tp': 2\}; the meshes may differ only along 'stage'",
    ):
        concatenate_by_mesh_axis([a, b], "stage")


def test_concatenate_error_axis_not_in_mesh():
    with pytest.raises(ValueError, match=r"mesh_axis='pp' is not an axis of the mesh"):
        concatenate_by_mesh_axis(_two_parts(), "pp")


def test_concatenate_error_shared_devices():
    mesh = make_mesh((2, 2), ("stage", "tp"))
    x = put(np.ones(4), mesh, P("stage"))
    with pytest.raises(ValueError, match=r"the meshes share devices \[0, 1, 2, 3\]"):
        concatenate_by_mesh_axis([x, x], "stage")
    assert not x.is_deleted()


def test_concatenate_error_not_named_sharding():
    x = jax.device_put(np.ones(4), SingleDeviceSharding(DEVICES[0]))
    with pytest.raises(ValueError, match=r"array_trees\[0\] has sharding SingleDeviceSharding"):
        concatenate_by_mesh_axis([x, x], "stage")


def test_concatenate_error_tree_on_two_meshes():
    a, b = _two_parts()
    with pytest.raises(
        ValueError, match=r"all arrays of one tree must be on one mesh; array_trees\[0\]\[0\]"
    ):
        concatenate_by_mesh_axis([[a, b], [a, b]], "stage")


def test_concatenate_error_different_specs():
    a, b = _two_parts(spec_right=P("tp"))
    with pytest.raises(
        ValueError,
        match=r"array_trees\[1\] has spec .*'tp'.* but array_trees\[0\] has spec .*'stage'",
    ):
        concatenate_by_mesh_axis([a, b], "stage")


def test_concatenate_error_different_dtypes():
    a, b = _two_parts()
    b = b.astype(np.int32)
    with pytest.raises(
        ValueError, match=r"array_trees\[1\] is int32\[4\] but array_trees\[0\] is float32\[4\]"
    ):
        concatenate_by_mesh_axis([a, b], "stage")


def test_concatenate_error_unequal_shard_extents():
    a, b = _two_parts(n_right=8)
    with pytest.raises(
        ValueError,
        match=r"dimension 0 of array_trees\[0\], array_trees\[1\] is sharded along 'stage' with shard extents \[2, 4\]",
    ):
        concatenate_by_mesh_axis([a, b], "stage")


def test_concatenate_error_unequal_replicated_dims():
    a, b = _two_parts(spec_left=P(), spec_right=P(), n_right=6)
    with pytest.raises(
        ValueError,
        match=r"dimension 0 of .* has sizes \[4, 6\]; dimensions not sharded along 'stage' must be equal",
    ):
        concatenate_by_mesh_axis([a, b], "stage")


def test_docstring_examples_run():
    assert doctest.testmod(_split, raise_on_error=True).attempted > 0


def test_public_exports():
    assert reshard.split_by_mesh_axis is split_by_mesh_axis
    assert reshard.concatenate_by_mesh_axis is concatenate_by_mesh_axis


# --------------------------------------------------------------------------- round trips

DTYPES = [np.float32, ml_dtypes.bfloat16, np.int8, np.bool_, np.float16, np.int32, np.uint16]


@st.composite
def layouts(draw):
    """A mesh on a subset of the 8 devices, a spec, a shape and a split request."""
    sizes = draw(
        st.lists(st.sampled_from([1, 2, 3, 4]), min_size=1, max_size=3).filter(
            lambda s: math.prod(s) <= len(DEVICES)
        )
    )
    names = ("a", "b", "c")[: len(sizes)]
    ids = draw(st.permutations(range(len(DEVICES))))[: math.prod(sizes)]
    mesh = make_mesh(tuple(sizes), names, ids)
    rank = draw(st.integers(0, 3))
    where = [draw(st.integers(-1, rank - 1)) for _ in names]  # -1: the axis is unused
    entries = []
    for dim in range(rank):
        axes = draw(st.permutations([n for n, w in zip(names, where, strict=True) if w == dim]))
        if not axes:
            entries.append(None)
        elif len(axes) == 1 and draw(st.booleans()):
            entries.append(axes[0])
        else:
            entries.append(tuple(axes))
    shape = tuple(
        math.prod(mesh.shape[a] for a in entry_axes(e)) * draw(st.integers(1, 3)) for e in entries
    )
    axis = draw(st.sampled_from(names))
    size = mesh.shape[axis]
    sections = draw(
        st.one_of(
            st.none(),
            st.sampled_from([d for d in range(1, size + 1) if size % d == 0]),
            st.lists(st.integers(1, size - 1), unique=True).map(sorted)
            if size > 1
            else st.just([]),
        )
    )
    return mesh, P(*entries), shape, axis, sections


def random_value(rng, shape, dtype):
    if dtype == np.bool_:
        return rng.integers(0, 2, shape).astype(np.bool_)
    itemsize = np.dtype(dtype).itemsize
    raw = rng.integers(0, 256, math.prod(shape) * itemsize, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)  # random bits: NaNs, infs, subnormals too


@settings(max_examples=25)
@given(
    layout=layouts(),
    dtype=st.sampled_from(DTYPES),
    memory_kind=st.sampled_from([None, "pinned_host"]),
    donate=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_round_trip_split_then_concatenate(layout, dtype, memory_kind, donate, seed):
    mesh, spec, shape, axis, sections = layout
    value = random_value(np.random.default_rng(seed), shape, dtype)
    x = put(value, mesh, spec, memory_kind)
    kind = x.sharding.memory_kind
    before = pointers(x)
    parts = split_by_mesh_axis({"x": x}, axis, sections, donate=donate)
    assert x.is_deleted() == donate

    axis_index = mesh.axis_names.index(axis)
    size = mesh.shape[axis]
    if sections is None:
        edges = list(range(size + 1))
    elif isinstance(sections, int):
        edges = list(range(0, size + 1, size // sections))
    else:
        edges = [0, *sections, size]
    assert len(parts) == len(edges) - 1
    for lo, hi, part in zip(edges[:-1], edges[1:], parts, strict=True):
        index = [slice(None)] * len(mesh.axis_names)
        index[axis_index] = slice(lo, hi)
        sub = Mesh(mesh.devices[tuple(index)], mesh.axis_names)
        want = expected_part(value, spec, mesh, axis, lo, hi)
        assert_array(part["x"], want, NamedSharding(sub, spec, memory_kind=kind))
        for device, ptr in pointers(part["x"]).items():
            assert ptr == before[device]  # nothing copied

    joined = concatenate_by_mesh_axis(parts, axis)["x"]
    # Consumed where x was; where x lives, freeing them would free x too.
    assert all(p["x"].is_deleted() == donate for p in parts)
    assert x.is_deleted() == donate
    assert_array(joined, value, x.sharding)
    assert pointers(joined) == before


# --------------------------------------------------------------------------- shared buffers


def _rows_and_columns():
    """A (4, 2) mesh and an 8x8 array on it, sharded along both axes."""
    mesh = make_mesh((4, 2), ("stage", "tp"))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    return mesh, value, put(value, mesh, P("stage", "tp"))


def _intact(x, want):
    """``x`` reads as valid, every shard included, and computes: a half-freed array
    would read as valid and crash the process in the jit below."""
    assert not x.is_deleted()
    assert not any(s.data.is_deleted() for s in x.addressable_shards)
    assert_bits(np.asarray(jax.jit(lambda a: a + 1)(x)), want + 1)


def _consume_part(how, parts):
    """Consumes parts[1] (or parts[1:]) the way ``how`` names; returns the result."""
    if how == "split_donate":
        return split_by_mesh_axis(parts[1], "tp", donate=True)
    if how == "concatenate":
        return concatenate_by_mesh_axis(parts[1:], "stage")
    sub = NamedSharding(Mesh(np.array(DEVICES[:2]), ("t",)), P("t"))
    return reshard.reshard(parts[1], sub, donate=True)


@pytest.mark.parametrize("how", ["split_donate", "concatenate", "reshard_donate"])
def test_consuming_a_part_leaves_the_live_input_whole(how):
    # Before: the part was donated, which freed its buffers under x; x still read as
    # valid, and the next computation on x crashed the process.
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    out = _consume_part(how, parts)
    _intact(x, value)
    assert not parts[1].is_deleted()  # left unconsumed, as a declined donation
    assert_bits(host(parts[1]), value[2:4])
    jax.block_until_ready(out)


def test_a_part_is_consumed_once_its_input_is_gone():
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    del x  # dropped: the parts are all that hold its buffers
    halves = split_by_mesh_axis(parts[1], "tp", donate=True)
    assert parts[1].is_deleted()
    assert_bits(host(halves[0]), value[2:4, :4])
    joined = concatenate_by_mesh_axis(halves, "tp")
    assert all(h.is_deleted() for h in halves)
    assert_bits(host(joined), value[2:4])
    rest = concatenate_by_mesh_axis([parts[0], parts[2], parts[3]], "stage")
    assert parts[0].is_deleted() and parts[3].is_deleted()
    assert_bits(host(rest), value[[0, 1, 4, 5, 6, 7]])


def test_joining_every_part_keeps_the_input_and_copies_nothing():
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    joined = concatenate_by_mesh_axis(parts, "stage")
    _intact(x, value)
    assert not any(p.is_deleted() for p in parts)
    assert pointers(joined) == pointers(x)
    assert_array(joined, value, x.sharding)
    # The join shares x's buffers too: consuming it would free them under x.
    reshard.reshard(joined, NamedSharding(mesh, P()), donate=True)
    _intact(x, value)
    assert not joined.is_deleted()


@pytest.mark.parametrize("how", ["reshard_donate", "split_donate"])
def test_consuming_the_input_leaves_its_live_parts_whole(how):
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    if how == "split_donate":
        split_by_mesh_axis(x, "tp", donate=True)
    else:
        reshard.reshard(x, NamedSharding(mesh, P()), donate=True)
    _intact(x, value)
    for k, part in enumerate(parts):
        _intact(part, value[2 * k : 2 * k + 2])


def test_part_of_a_part_still_shares_with_the_whole():
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    quarters = split_by_mesh_axis(parts[1], "tp")
    del parts  # the middle link is gone; x still holds the quarters' buffers
    split_by_mesh_axis(quarters[0], "stage", donate=True)
    _intact(x, value)
    assert not quarters[0].is_deleted()


def test_may_alias_output_is_not_freed_by_donating_its_input():
    mesh = make_mesh((4, 2), ("stage", "tp"))
    value = np.arange(2**18, dtype=np.float32).reshape(512, 512)
    x = put(value, mesh, P("stage", "tp"))
    y = reshard.reshard(x, x.sharding, may_alias=True)  # hands every shard over
    assert pointers(y) == pointers(x)
    z = reshard.reshard(x, NamedSharding(mesh, P("tp", "stage")), donate=True)
    assert not x.is_deleted()  # left valid: freeing it would free y
    _intact(y, value)
    assert_bits(host(z), value)
    del y
    reshard.reshard(x, NamedSharding(mesh, P("tp", "stage")), donate=True)
    assert x.is_deleted()


def test_concatenate_refuses_an_array_and_a_struct_at_one_leaf():
    mesh = make_mesh((4, 2), ("stage", "tp"))
    value = np.arange(64, dtype=np.float32).reshape(8, 8)
    parts = split_by_mesh_axis(put(value, mesh, P("stage", "tp")), "stage", 2)
    struct = jax.ShapeDtypeStruct(parts[0].shape, parts[0].dtype, sharding=parts[0].sharding)
    for trees in (
        [struct, parts[1]],
        [
            parts[0],
            jax.ShapeDtypeStruct(parts[1].shape, parts[1].dtype, sharding=parts[1].sharding),
        ],
    ):
        with pytest.raises(ValueError, match="all arrays or all ShapeDtypeStructs"):
            concatenate_by_mesh_axis(trees, "stage")
    assert not any(p.is_deleted() for p in parts)


def test_one_mesh_error_names_the_devices_that_differ():
    a = make_mesh((2, 4), ("a", "b"))
    b = make_mesh((2, 4), ("a", "b"), device_ids=[7, 6, 5, 4, 3, 2, 1, 0])
    x, y = put(np.zeros(8, np.float32), a, P()), put(np.zeros(8, np.float32), b, P())
    with pytest.raises(
        ValueError,
        match=r"\[\[0, 1, 2, 3\], \[4, 5, 6, 7\]\] but .*"
        r"\[\[7, 6, 5, 4\], \[3, 2, 1, 0\]\]",
    ):
        split_by_mesh_axis([x, y], "a")


@pytest.mark.parametrize("how", ["reshard", "plan_execute"])
def test_a_part_donated_with_its_live_input_is_left_whole_too(how):
    # x is left unconsumed (its other parts live), so the part in the same call, whose
    # buffers are x's, must be too: before, it was donated and x left half-freed.
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    tree = {"x": x, "p": parts[1]}
    dst = {
        "x": NamedSharding(mesh, P()),
        "p": NamedSharding(Mesh(np.array(DEVICES[:2]), ("t",)), P()),
    }
    if how == "reshard":
        out = reshard.reshard(tree, dst, donate=True)
    else:
        out = reshard.plan(tree, dst).execute(tree, donate=True)
    _intact(x, value)
    _intact(parts[1], value[2:4])
    assert_bits(host(out["x"]), value)


@pytest.mark.parametrize("how", ["split", "concatenate", "reshard"])
def test_one_array_at_two_leaves_gives_results_that_share_buffers(how):
    # Consumed, x hands its buffers to two results at once; consuming (a part of) one
    # of them must leave the other whole.
    mesh = make_mesh((4, 2), ("stage", "tp"))
    value = np.arange(2**18, dtype=np.float32).reshape(512, 512)  # 1 MiB: handed over
    x = put(value, mesh, P("stage", "tp"))
    if how == "split":
        a, b = split_by_mesh_axis([x, x], "stage", donate=True)[1]
        want = value[128:256]
    elif how == "concatenate":
        parts = split_by_mesh_axis(x, "stage", donate=True)
        a, b = concatenate_by_mesh_axis([[p, p] for p in parts], "stage")
        want = value
        del parts
    else:
        a, b = reshard.reshard([x, x], x.sharding, donate=True)
        want = value
    assert x.is_deleted() and pointers(a) == pointers(b)
    del x
    pieces = split_by_mesh_axis(a, "tp")
    del a  # b is all that holds its buffers, with the pieces
    reshard.reshard(pieces[1], NamedSharding(pieces[1].sharding.mesh, P()), donate=True)
    _intact(b, want)


def test_parts_on_other_devices_do_not_hold_a_part_back():
    mesh, value, x = _rows_and_columns()
    last = split_by_mesh_axis(x, "stage")[3]  # devices 6, 7
    first = split_by_mesh_axis(x, "stage")[0]  # devices 0, 1
    del x
    out = reshard.reshard(first, NamedSharding(first.sharding.mesh, P()), donate=True)
    assert first.is_deleted()  # nothing live shares its devices
    assert_bits(host(out), value[:2])
    _intact(last, value[6:])


def test_the_record_of_shared_buffers_goes_with_the_arrays():
    import gc

    from reshard import _sharing

    gc.collect()
    before = len(_sharing._group_of)
    mesh = make_mesh((4, 2), ("stage", "tp"))
    x = put(np.arange(64, dtype=np.float32).reshape(8, 8), mesh, P("stage", "tp"))
    parts = split_by_mesh_axis({"a": x, "b": x}, "stage")
    joined = concatenate_by_mesh_axis(parts, "stage")
    y = reshard.reshard(x, x.sharding, may_alias=True)
    assert len(_sharing._group_of) > before
    del x, parts, joined, y
    gc.collect()
    assert len(_sharing._group_of) == before


@pytest.mark.parametrize("how", ["split", "concatenate"])
def test_two_handles_on_one_buffer_are_consumed_without_a_crash(how):
    # Before: the second donation ran on buffers the first had freed (segfault).
    mesh, value, x = _rows_and_columns()
    y = jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data for s in x.addressable_shards]
    )
    if how == "split":
        parts = split_by_mesh_axis([x, y], "stage", donate=True)
        got = [host(p[1]) for p in parts]
        assert_bits(np.concatenate(got), value)
    else:
        halves = split_by_mesh_axis(x, "stage", 2, donate=True)
        twins = [
            [
                h,
                jax.make_array_from_single_device_arrays(
                    h.shape, h.sharding, [s.data for s in h.addressable_shards]
                ),
            ]
            for h in halves
        ]
        joined = concatenate_by_mesh_axis(twins, "stage")
        assert_array(joined[1], value, NamedSharding(mesh, P("stage", "tp")))
        x, y = twins[0]
    assert x.is_deleted() and y.is_deleted()  # consumed, as on every process


def test_a_spared_donated_input_hands_no_shard_to_its_output():
    # x stays valid (its parts live), so its output must be a copy: handing shards
    # over would let the user's next donating step free them under x and the parts.
    mesh = make_mesh((4, 2), ("stage", "tp"))
    value = np.arange(2**18, dtype=np.float32).reshape(512, 512)  # 1 MiB: handed over
    x = put(value, mesh, P("stage", "tp"))
    parts = split_by_mesh_axis(x, "stage")
    y = reshard.reshard(x, x.sharding, donate=True)  # every shard stays: all kept
    assert not x.is_deleted()
    assert not set(pointers(y).values()) & set(pointers(x).values())
    jax.jit(lambda a: a * 2, donate_argnums=0)(y)  # the next step consumes y
    _intact(x, value)
    _intact(parts[0], value[:128])


def test_an_unreachable_input_not_yet_collected_does_not_hold_a_part_back():
    import gc

    class Box:  # a reference cycle: only the cycle collector frees it
        def __init__(self, x):
            self.x, self.me = x, self

    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    Box(x)
    del x
    gc.disable()
    try:
        out = reshard.reshard(parts[0], NamedSharding(parts[0].sharding.mesh, P()), donate=True)
    finally:
        gc.enable()
    assert parts[0].is_deleted()  # x was garbage: collected, and the part consumed
    assert_bits(host(out), value[:2])


def test_parts_of_an_unreachable_input_not_yet_collected_are_joined_and_consumed():
    # As above, for concatenate_by_mesh_axis: one donating call per part's device set,
    # and the garbage collected once for all of them, before any is prepared.
    import gc

    class Box:
        def __init__(self, x):
            self.x, self.me = x, self

    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    assert len(parts) > 1
    Box(x)
    del x
    gc.disable()
    try:
        out = concatenate_by_mesh_axis(parts, "stage")
    finally:
        gc.enable()
    assert all(p.is_deleted() for p in parts)
    assert_bits(host(out), value)
    assert out.sharding.mesh.devices.tolist() == mesh.devices.tolist()


def test_a_hand_made_handle_beside_a_kept_array_stays_too():
    # x stays (its parts live); h, made by hand on x's buffers (not in the record),
    # must stay as well: consuming it would free x's buffers. Before: split deleted x,
    # h and a part of x, then raised.
    mesh, value, x = _rows_and_columns()
    parts = split_by_mesh_axis(x, "stage")
    h = jax.make_array_from_single_device_arrays(
        x.shape, x.sharding, [s.data for s in x.addressable_shards]
    )
    split_by_mesh_axis([x, h], "tp", donate=True)
    reshard.reshard({"x": x, "h": h}, {"x": x.sharding, "h": x.sharding}, donate=True)
    _intact(x, value)
    _intact(h, value)
    _intact(parts[0], value[:2])


def test_a_failing_consume_leaves_every_input_intact(monkeypatch):
    from reshard import _compat

    mesh, value, x = _rows_and_columns()
    y = jax.make_array_from_single_device_arrays(  # a second handle: both copied
        x.shape, x.sharding, [s.data for s in x.addressable_shards]
    )
    z = put(value, mesh, P("stage", "tp"))  # alone: donated

    def broken(arrays):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(_compat, "prepare_donating_identity", broken)
    with pytest.raises(RuntimeError, match="injected failure"):
        split_by_mesh_axis([x, y, z], "stage", donate=True)
    monkeypatch.undo()
    for a in (x, y, z):
        _intact(a, value)


@pytest.mark.parametrize("fails", ["copy", "program"])
def test_concatenating_consumes_no_tree_when_a_later_one_fails(monkeypatch, fails):
    # Each tree is donated in a call of its own (one device set each). The copies and
    # programs of every tree come before any donation, so a failure in the second
    # tree's (an out-of-memory copy of linked inputs, say) leaves the first intact.
    from reshard import _compat

    mesh, value, x = _rows_and_columns()
    first, second = (jax.jit(lambda t: t + 0)(p) for p in split_by_mesh_axis(x, "stage", 2))
    twin = jax.make_array_from_single_device_arrays(  # shares second's buffers: copied
        second.shape, second.sharding, [s.data for s in second.addressable_shards]
    )
    calls = []
    real_put, real_prepare = jax.device_put, _compat.prepare_donating_identity

    def put_failing(*args, **kwargs):
        if fails == "copy" and kwargs.get("may_alias") is False:
            raise RuntimeError("injected failure")
        return real_put(*args, **kwargs)

    def prepare_failing(arrays):
        calls.append(len(arrays))
        if fails == "program" and len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_prepare(arrays)

    monkeypatch.setattr(jax, "device_put", put_failing)
    monkeypatch.setattr(_compat, "prepare_donating_identity", prepare_failing)
    trees = [{"w": first, "v": first}, {"w": second, "v": twin}]
    if fails == "program":
        trees[1] = {"w": second, "v": second}
    with pytest.raises(RuntimeError, match="injected failure"):
        concatenate_by_mesh_axis(trees, "stage")
    monkeypatch.undo()
    _intact(first, value[:4])
    _intact(second, value[4:])
    _intact(twin, value[4:])
    assert calls  # the first tree's program was made before the failure
    joined = concatenate_by_mesh_axis(trees, "stage")  # and all is there to join
    assert first.is_deleted() and second.is_deleted()
    assert_bits(host(joined["w"]), value)
    assert joined["w"].sharding == x.sharding


def test_linked_inputs_of_one_call_are_consumed_as_by_reshard():
    mesh, value, x = _rows_and_columns()
    y = reshard.reshard(x, x.sharding, may_alias=True)
    parts = split_by_mesh_axis([x, y], "stage", donate=True)
    assert x.is_deleted() and y.is_deleted()  # copied, then deleted (as reshard does)
    assert_bits(np.concatenate([host(p[1]) for p in parts]), value)
    x2 = put(value, mesh, P("stage", "tp"))
    y2 = reshard.reshard(x2, x2.sharding, may_alias=True)
    reshard.reshard([x2, y2], NamedSharding(mesh, P()), donate=True)
    assert x2.is_deleted() and y2.is_deleted()
