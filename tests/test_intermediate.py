"""find_intermediate_sharding / reshard_with_intermediate_sharding: every rule, every error.

Rules are checked on real meshes of the 8 CPU devices; rules that need more devices use
meshes that repeat one device (``find_intermediate_sharding`` reads only mesh shapes).
"""

from __future__ import annotations

import doctest
import math

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import AxisType, Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import (
    INTERMEDIATE_REPLICA_SUFFIX,
    INTERMEDIATE_SPLIT_SUFFIX,
    NoIntermediateShardingError,
    NoIntermediateShardingNeededError,
    _api,
    _intermediate,
    find_intermediate_sharding,
    reshard_with_intermediate_sharding,
)

DEVICES = jax.devices()


def sharding(shape, names, spec, ids=None, memory_kind=None):
    ids = range(math.prod(shape)) if ids is None else ids
    mesh = Mesh(np.array([DEVICES[i] for i in ids]).reshape(shape), names)
    return NamedSharding(mesh, spec, memory_kind=memory_kind)


def fake_sharding(shape, names, spec):
    """A sharding on a mesh of any size, every position holding device 0."""
    return NamedSharding(
        Mesh(np.array([DEVICES[0]] * math.prod(shape)).reshape(shape), names), spec
    )


def test_constants():
    assert INTERMEDIATE_SPLIT_SUFFIX == "_intermediate_split"
    assert INTERMEDIATE_REPLICA_SUFFIX == "_intermediate_replica"
    assert issubclass(NoIntermediateShardingNeededError, NoIntermediateShardingError)
    assert issubclass(NoIntermediateShardingError, ValueError)


# --------------------------------------------------------------------------- found


def test_rows_on_8_to_columns_on_4():
    src = sharding((8,), ("fsdp",), P("fsdp", None), memory_kind="pinned_host")
    dst = sharding((4,), ("tp",), P(None, "tp"), ids=[4, 5, 6, 7])
    inter, replica_axes = find_intermediate_sharding(src, dst)
    assert replica_axes == ["fsdp_intermediate_replica"]
    assert dict(inter.mesh.shape) == {"fsdp_intermediate_replica": 8, "fsdp_intermediate_split": 1}
    assert inter.spec == P("fsdp_intermediate_split", None)
    assert inter.memory_kind == "pinned_host"  # the input's memory kind is kept
    assert list(inter.mesh.devices.flat) == list(src.mesh.devices.flat)


def test_replica_axes_first_and_other_axes_in_place():
    # Mesh (x=2, fsdp=4); only fsdp is split: replica first, then x, then the split axis.
    src = sharding((2, 4), ("x", "fsdp"), P("fsdp", None), ids=[7, 6, 5, 4, 3, 2, 1, 0])
    dst = sharding((2,), ("tp",), P(None, "tp"))
    inter, replica_axes = find_intermediate_sharding(src, dst)
    assert replica_axes == ["fsdp_intermediate_replica"]
    assert inter.mesh.axis_names == ("fsdp_intermediate_replica", "x", "fsdp_intermediate_split")
    assert inter.mesh.devices.shape == (4, 2, 1)
    assert [d.id for d in inter.mesh.devices.flat] == [7, 6, 5, 4, 3, 2, 1, 0]
    assert inter.spec == P("fsdp_intermediate_split", None)


def test_two_candidates_in_mesh_axis_order():
    # Spec names "b" before "a"; the replica axes still follow the mesh order a, b.
    src = sharding((2, 4), ("a", "b"), P("b", "a"))
    dst = sharding((1,), ("t",), P(None, None))
    inter, replica_axes = find_intermediate_sharding(src, dst)
    assert replica_axes == ["a_intermediate_replica", "b_intermediate_replica"]
    assert inter.mesh.axis_names == (
        "a_intermediate_replica",
        "b_intermediate_replica",
        "a_intermediate_split",
        "b_intermediate_split",
    )
    assert inter.mesh.devices.shape == (2, 4, 1, 1)
    assert inter.spec == P("b_intermediate_split", "a_intermediate_split")


def test_one_element_tuple_entry_is_a_single_axis():
    src = sharding((8,), ("fsdp",), P(("fsdp",), None))
    dst = sharding((4,), ("tp",), P(None, "tp"))
    inter, _ = find_intermediate_sharding(src, dst)
    assert inter.spec == P("fsdp_intermediate_split", None)


def test_empty_output_spec_reads_as_all_none():
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    empty = find_intermediate_sharding(src, sharding((4,), ("tp",), P()))
    explicit = find_intermediate_sharding(src, sharding((4,), ("tp",), P(None, None)))
    assert empty == explicit


def test_axis_types_are_inherited():
    mesh = Mesh(np.array(DEVICES), ("fsdp",), axis_types=(AxisType.Explicit,))
    src = NamedSharding(mesh, P("fsdp", None))
    inter, _ = find_intermediate_sharding(src, sharding((4,), ("tp",), P(None, "tp")))
    assert inter.mesh.axis_types == (AxisType.Explicit, AxisType.Explicit)


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("which", ["in", "out"])
def test_error_not_named_sharding(which):
    named = sharding((8,), ("fsdp",), P("fsdp"))
    single = SingleDeviceSharding(DEVICES[0])
    args = (single, named) if which == "in" else (named, single)
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"only between two NamedShardings; got in_sharding=.*SingleDeviceSharding",
    ):
        find_intermediate_sharding(*args)


@pytest.mark.parametrize("which", ["in", "out"])
def test_error_unconstrained_entry(which):
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp"))
    loose = P(P.UNCONSTRAINED, "tp") if which == "out" else P("fsdp", P.UNCONSTRAINED)
    if which == "out":
        dst = NamedSharding(dst.mesh, loose)
    else:
        src = NamedSharding(src.mesh, loose)
    with pytest.raises(
        NoIntermediateShardingError, match=rf"the {which} spec has an UNCONSTRAINED entry"
    ):
        find_intermediate_sharding(src, dst)


@pytest.mark.parametrize("kind", ["reduced", "unreduced"])
@pytest.mark.parametrize("which", ["in", "out"])
def test_error_reduced_or_unreduced_axes(which, kind):
    # Not a plain ValueError from iterating such a spec: the helper's own error, so
    # that reshard_with_intermediate_sharding reshards directly.
    explicit = (AxisType.Explicit,) * 2
    src_mesh = Mesh(np.array(DEVICES).reshape(4, 2), ("fsdp", "r"), axis_types=explicit)
    dst_mesh = Mesh(np.array(DEVICES[:4]).reshape(2, 2), ("tp", "r"), axis_types=explicit)
    src_spec, dst_spec = P("fsdp", None), P(None, "tp")
    if which == "in":
        src_spec = P("fsdp", None, **{kind: {"r"}})
    else:
        dst_spec = P(None, "tp", **{kind: {"r"}})
    src, dst = NamedSharding(src_mesh, src_spec), NamedSharding(dst_mesh, dst_spec)
    with pytest.raises(
        NoIntermediateShardingError, match=rf"the {which} spec has reduced or unreduced axes"
    ):
        find_intermediate_sharding(src, dst)
    if kind == "reduced":
        value = np.arange(64, dtype=np.float32).reshape(8, 8)
        x = jax.device_put(value, src)
        y = reshard.reshard_with_intermediate_sharding(x, src, dst)
        assert y.sharding == dst
        np.testing.assert_array_equal(np.asarray(y), value)
        assert {s.device: s.index for s in y.addressable_shards} == dst.devices_indices_map(
            value.shape
        )


def test_error_axis_names_would_clash():
    # The input mesh already has an axis named like one the detour would add.
    src = sharding((4, 2), ("x", "x" + reshard.INTERMEDIATE_SPLIT_SUFFIX), P("x", None))
    dst = sharding((2,), ("t",), P(None, "t"))
    with pytest.raises(NoIntermediateShardingError, match=r"would name axes .* twice"):
        find_intermediate_sharding(src, dst)


def test_error_spec_lengths_differ():
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp", None))
    with pytest.raises(
        NoIntermediateShardingError, match=r"specs have different lengths \(2 and 3\)"
    ):
        find_intermediate_sharding(src, dst)


def test_error_empty_input_spec_has_no_more_shards():
    src = sharding((8,), ("fsdp",), P())
    dst = sharding((4,), ("tp",), P(None, None))
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"no more shards than the output \(shard counts per dimension: in \[1, 1\], out \[1, 1\]\)",
    ):
        find_intermediate_sharding(src, dst)


def test_error_largest_counts_do_not_divide():
    src = sharding((4,), ("a",), P("a"))
    dst = sharding((3,), ("b",), P("b"))
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"largest input shard count does not divide by the largest output one \(shard counts per dimension: in \[4\], out \[3\]\)",
    ):
        find_intermediate_sharding(src, dst)


def test_error_not_more_shards():
    src = sharding((4,), ("a",), P("a", None))
    dst = sharding((2, 2), ("x", "y"), P("x", "y"))
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"no more shards than the output.*in \[4, 1\], out \[2, 2\]",
    ):
        find_intermediate_sharding(src, dst)


def test_error_totals_do_not_divide():
    src = sharding((6,), ("a",), P("a", None))
    dst = sharding((2, 2), ("x", "y"), P("x", "y"))
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"shard total is not a multiple of the output's.*in \[6, 1\], out \[2, 2\]",
    ):
        find_intermediate_sharding(src, dst)


def test_not_needed_when_a_dimension_shares_a_factor():
    src = sharding((8,), ("fsdp",), P("fsdp"))
    dst = sharding((4,), ("tp",), P("tp"))
    with pytest.raises(
        NoIntermediateShardingNeededError,
        match=r"common divisor.*in \[8\], out \[4\].*reshard directly",
    ):
        find_intermediate_sharding(src, dst)


def test_error_no_candidate_when_split_dim_uses_two_axes():
    src = sharding((2, 4), ("a", "b"), P(("a", "b"), None))
    dst = sharding((4,), ("tp",), P(None, "tp"))
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"no dimension can be split.*single mesh axis \(shard counts per dimension: in \[8, 1\], out \[1, 4\]\)",
    ) as info:
        find_intermediate_sharding(src, dst)
    assert not isinstance(info.value, NoIntermediateShardingNeededError)


def test_error_candidate_axis_does_not_factor():
    # 12 devices: dimension 0 goes 3 -> 2 ways (coprime, 2 does not divide 3).
    src = fake_sharding((3, 4), ("a", "b"), P("a", "b"))
    dst = fake_sharding((2,), ("t",), P("t", None))
    with pytest.raises(
        NoIntermediateShardingError,
        match=r"dimension 0 is sharded 3 ways over 'a', which does not factor by the output's 2 ways",
    ):
        find_intermediate_sharding(src, dst)


def test_large_synthetic_mesh():
    # 64 positions: (dp=8, fsdp=8) rows -> tp=4 columns.
    src = fake_sharding((8, 8), ("dp", "fsdp"), P("fsdp", None))
    dst = fake_sharding((4,), ("tp",), P(None, "tp"))
    inter, replica_axes = find_intermediate_sharding(src, dst)
    assert replica_axes == ["fsdp_intermediate_replica"]
    assert inter.mesh.devices.shape == (8, 8, 1)
    assert inter.mesh.axis_names == ("fsdp_intermediate_replica", "dp", "fsdp_intermediate_split")


# --------------------------------------------------------------------------- reshard


def owned(value, s):
    return jax.jit(lambda a: a.copy())(jax.device_put(value, s))


@pytest.fixture
def spy(monkeypatch):
    """Records the shardings ``reshard._api.reshard`` is called with, and runs it."""
    calls = []
    real = _api.reshard

    def recording(x, target, **kwargs):
        leaves = jax.tree.leaves(x)
        calls.append(([leaf.sharding for leaf in leaves], target, kwargs))
        return real(x, target, **kwargs)

    monkeypatch.setattr(_api, "reshard", recording)
    return calls


def test_route_through_intermediate(spy):
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp"), ids=[4, 5, 6, 7])
    value = np.arange(8 * 8, dtype=np.float32).reshape(8, 8)
    tree = {"w": owned(value, src), "b": owned(value[:, :4] * 2, src)}
    out = reshard_with_intermediate_sharding(tree, src, dst)
    for name, want in [("w", value), ("b", value[:, :4] * 2)]:
        assert out[name].sharding == dst
        np.testing.assert_array_equal(np.asarray(out[name]), want)
        for shard in out[name].addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    inter, _ = find_intermediate_sharding(src, dst)
    (first_in, first_to, first_kw), (second_in, second_to, _) = spy
    assert first_in == [src, src] and first_to == inter and first_kw["donate"] is False
    # The second leg starts from the first replica: the sub-mesh of device 0 alone.
    kept = Mesh(inter.mesh.devices[:1], inter.mesh.axis_names)
    assert second_in == [NamedSharding(kept, inter.spec)] * 2 and second_to == dst


def test_direct_when_not_needed(spy):
    src = sharding((8,), ("fsdp",), P("fsdp"))
    dst = sharding((4,), ("tp",), P("tp"), ids=[4, 5, 6, 7])
    value = np.arange(16, dtype=np.int8)
    out = reshard_with_intermediate_sharding(owned(value, src), src, dst, may_alias=False)
    assert out.sharding == dst
    np.testing.assert_array_equal(np.asarray(out), value)
    assert len(spy) == 1 and spy[0][1] == dst and spy[0][2]["may_alias"] is False


def test_direct_when_none_exists(spy):
    src = SingleDeviceSharding(DEVICES[0])
    dst = sharding((4,), ("tp",), P("tp"))
    out = reshard_with_intermediate_sharding(jax.device_put(np.arange(8.0), src), src, dst)
    assert out.sharding == dst and len(spy) == 1
    np.testing.assert_array_equal(np.asarray(out), np.arange(8.0))


def test_donate_consumes_input_and_keeps_memory_kind():
    src = sharding((2, 4), ("x", "fsdp"), P("fsdp", None), memory_kind="pinned_host")
    dst = sharding((2,), ("tp",), P(None, "tp"), ids=[6, 7], memory_kind="pinned_host")
    value = np.arange(8 * 4, dtype=np.float32).reshape(8, 4)
    x = owned(value, src)
    out = reshard_with_intermediate_sharding(x, src, dst, donate=True)
    assert x.is_deleted()
    assert out.sharding == dst and out.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(out), value)


def test_donate_refuses_a_bad_destination_before_consuming_the_input(spy):
    # The route exists (fsdp -> tp over half the devices), but tp cannot divide 6
    # columns by 4: the error must come before the first leg frees x.
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp"), ids=[4, 5, 6, 7])
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    x = owned(value, src)
    with pytest.raises(ValueError, match="cannot be divided"):
        reshard_with_intermediate_sharding(x, src, dst, donate=True)
    assert not spy  # nothing was moved, so nothing was donated
    assert not x.is_deleted() and x.sharding == src
    np.testing.assert_array_equal(np.asarray(x), value)


@pytest.mark.parametrize("donate", [False, True])
def test_errors_name_the_callers_destination(donate):
    # A rank-1 array cannot take a 2-entry spec: the error names out_sharding's spec,
    # not the intermediate one built from it, whether donating or not.
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp"))
    x = owned(np.arange(16, dtype=np.float32), sharding((8,), ("fsdp",), P("fsdp")))
    with pytest.raises(ValueError, match=r"destination spec P\(None, 'tp'\) has 2 entries"):
        reshard_with_intermediate_sharding(x, src, dst, donate=donate)
    assert not x.is_deleted()


def test_prng_keys_take_the_route():
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp"))
    keys = owned(jax.random.split(jax.random.key(3), (8, 4)), src)
    out = reshard_with_intermediate_sharding(keys, src, dst)
    assert out.sharding == dst
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(out)), np.asarray(jax.random.key_data(keys))
    )


def test_docstring_examples_run():
    assert doctest.testmod(_intermediate, raise_on_error=True).attempted > 0


def test_public_exports():
    for name in [
        "find_intermediate_sharding",
        "reshard_with_intermediate_sharding",
        "NoIntermediateShardingError",
        "NoIntermediateShardingNeededError",
        "INTERMEDIATE_SPLIT_SUFFIX",
        "INTERMEDIATE_REPLICA_SUFFIX",
    ]:
        assert getattr(reshard, name) is getattr(_intermediate, name)


# --------------------------------------------------------------------------- property


@st.composite
def sharding_pairs(draw):
    """Two shardings of one rank on synthetic meshes of up to 3 axes."""
    rank = draw(st.integers(1, 3))

    def one(prefix):
        sizes = draw(st.lists(st.sampled_from([1, 2, 3, 4, 6, 8]), min_size=1, max_size=3))
        names = tuple(f"{prefix}{i}" for i in range(len(sizes)))
        where = [draw(st.integers(-1, rank - 1)) for _ in names]
        entries = []
        for dim in range(rank):
            axes = tuple(n for n, w in zip(names, where, strict=True) if w == dim)
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return fake_sharding(tuple(sizes), names, P(*entries))

    return one("i"), one("o")


def counts(s):
    return [
        math.prod(s.mesh.shape[a] for a in (() if e is None else (e,) if isinstance(e, str) else e))
        for e in s.spec
    ]


@settings(max_examples=25)
@given(pair=sharding_pairs())
def test_rules_hold_on_random_shardings(pair):
    src_s, dst_s = pair
    src, dst = counts(src_s), counts(dst_s)
    fails = (
        max(src) % max(dst) or math.prod(src) <= math.prod(dst) or math.prod(src) % math.prod(dst)
    )
    not_needed = not fails and math.prod(map(math.gcd, src, dst)) != 1
    split = [i for i, e in enumerate(src_s.spec) if isinstance(e, str) and src[i] > dst[i]]
    none_found = fails or not split or any(src[i] % dst[i] for i in split)
    try:
        inter, replica_axes = find_intermediate_sharding(src_s, dst_s)
    except NoIntermediateShardingNeededError:
        assert not_needed
        return
    except NoIntermediateShardingError:
        assert none_found and not not_needed
        return
    assert not none_found and not not_needed
    assert list(inter.mesh.devices.flat) == list(src_s.mesh.devices.flat)
    assert replica_axes == [
        n for n in inter.mesh.axis_names if n.endswith(INTERMEDIATE_REPLICA_SUFFIX)
    ]
    assert list(inter.mesh.axis_names[: len(replica_axes)]) == replica_axes
    got = counts(inter)
    for i, entry in enumerate(src_s.spec):
        if isinstance(entry, str) and src[i] > dst[i]:
            assert inter.spec[i] == entry + INTERMEDIATE_SPLIT_SUFFIX and got[i] == dst[i]
            assert inter.mesh.shape[entry + INTERMEDIATE_REPLICA_SUFFIX] == src[i] // dst[i]
        else:
            assert inter.spec[i] == entry and got[i] == src[i]


@pytest.mark.parametrize("cache", [False, True])
def test_sidechannel_names_are_the_same_calls(cache: bool) -> None:
    """Newer Pathways releases add side-channel variants; code calling them runs here."""
    from reshard import _api

    devices = np.array(jax.devices()[:8])
    src = NamedSharding(Mesh(devices, ("fsdp",)), P("fsdp", None))
    dst = NamedSharding(Mesh(devices[:4], ("tp",)), P(None, "tp"))
    value = np.arange(64.0, dtype=np.float32).reshape(8, 8)
    reshard.clear_plan_cache()
    x = jax.device_put(value, src)
    y = reshard.sidechannel_reshard(
        {"w": x}, {"w": dst}, donate=False, may_alias=None, cache_resharding_plans=cache
    )
    z = reshard.sidechannel_reshard_with_intermediate_sharding(
        x, src, dst, donate=True, may_alias=None, cache_resharding_plans=cache
    )
    for out in (y["w"], z):
        np.testing.assert_array_equal(np.asarray(out), value)
        assert out.sharding == dst
    assert x.is_deleted()  # donated by the second call only
    # Cached only when asked: the tree's plan, and for the move through the intermediate
    # sharding its check of the final destination and its two moves.
    assert _api.plan_cache_size() == (4 if cache else 0)


@pytest.mark.parametrize("x", [{}, {"opt": None}, None, []])
@pytest.mark.parametrize("donate", [False, True])
def test_tree_without_arrays_comes_back_as_it_is(x, donate):
    # Before: the split of the intermediate found no leaf to read the replica count
    # from and raised, naming an argument this function does not take.
    src = sharding((8,), ("fsdp",), P("fsdp", None))
    dst = sharding((4,), ("tp",), P(None, "tp"), ids=[4, 5, 6, 7])
    assert find_intermediate_sharding(src, dst)[1]  # the path with a split
    assert reshard_with_intermediate_sharding(x, src, dst, donate=donate) == x


@pytest.mark.parametrize("donate", [False, True])
def test_input_sharding_on_an_abstract_mesh_goes_direct(spy, donate):
    # jax.typeof(x).sharding of an explicitly sharded array is on an AbstractMesh,
    # which names no devices to build the intermediate mesh from.
    mesh = Mesh(np.array(DEVICES), ("fsdp",), axis_types=(AxisType.Explicit,))
    x = jax.device_put(np.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("fsdp", None)))
    src = jax.typeof(x).sharding
    dst = NamedSharding(
        Mesh(np.array(DEVICES[:4]), ("tp",), axis_types=(AxisType.Explicit,)), P(None, "tp")
    )
    with pytest.raises(NoIntermediateShardingError, match="abstract mesh"):
        find_intermediate_sharding(src, dst)
    out = reshard_with_intermediate_sharding(x, src, dst, donate=donate)
    assert out.sharding == dst and len(spy) == 1
    np.testing.assert_array_equal(np.asarray(out), np.arange(64.0).reshape(8, 8))
    assert x.is_deleted() == donate
