"""Bad input gets a clear error naming the leaf or argument; failures lose nothing;
cached plans do not recompile."""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import CompileCounter, check_result, failing_identity_after, place, pointers
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _buffers, _collective_executor, _compat, _local_executor

DEVS = jax.devices()


def sharding(ids, spec=None, **kw):
    spec = P("a") if spec is None else spec
    return NamedSharding(Mesh(np.array([DEVS[i] for i in ids]), ("a",)), spec, **kw)


@pytest.fixture
def tree():
    return {
        "w": place(np.arange(32.0).reshape(8, 4), sharding([0, 1, 2, 3])),
        "b": place(np.arange(8, dtype=np.int32), sharding([0, 1])),
    }


def test_non_sharding_leaf_names_path(tree):
    with pytest.raises(
        ValueError, match=r"sharding at \['b'\] must be a jax.sharding.Sharding, got str"
    ):
        reshard.reshard(tree, {"w": sharding([4, 5]), "b": "replicated"})


def test_none_stands_where_x_has_no_leaves(tree):
    # jax.tree.map over a state with a None field gives None there (Pathways accepts
    # it, as does jax.device_put); over a leaf it is still an error.
    state = {**tree, "ema": None}
    shardings = jax.tree.map(lambda _: sharding([4, 5]), state)
    assert shardings["ema"] is None
    out = reshard.reshard(state, shardings)
    assert out["ema"] is None
    for k in tree:
        assert out[k].sharding == sharding([4, 5])
        np.testing.assert_array_equal(np.asarray(out[k]), np.asarray(tree[k]))
    with pytest.raises(ValueError, match=r"at \['w'\] .*got NoneType.*here it has 1"):
        reshard.reshard(state, {**shardings, "w": None})
    with pytest.raises(ValueError, match="at the root .*got NoneType"):
        reshard.reshard(state, None)
    assert reshard.reshard({"a": None, "b": ()}, None) == {"a": None, "b": ()}


def test_partition_spec_gets_a_hint(tree):
    with pytest.raises(
        ValueError,
        match=r"root must be a jax.sharding.Sharding, got (P|PartitionSpec): .*Wrap a PartitionSpec in NamedSharding",
    ):
        reshard.reshard(tree, P("a"))


def test_sharding_tree_not_a_prefix(tree):
    with pytest.raises(
        ValueError,
        match=r"must be a tree prefix of x: at the root the sharding tree has a dict with "
        r"keys \['other', 'w'\], but x has a dict with keys \['b', 'w'\]",
    ):
        reshard.reshard(tree, {"w": sharding([4, 5]), "other": sharding([4, 5])})
    with pytest.raises(
        ValueError, match="root the sharding tree has a list of 1, but x has a dict"
    ):
        reshard.reshard(tree, [sharding([4, 5])])
    deep = {"layers": [tree, tree], "head": tree["w"]}
    with pytest.raises(
        ValueError,
        match=r"at x\['layers'\]\[1\] the sharding tree has a tuple of 2, but x has a dict",
    ):
        reshard.reshard(deep, {"layers": [None, (None, None)], "head": sharding([4, 5])})
    with pytest.raises(
        ValueError, match=r"at x\['w'\] the sharding tree has a list of 1, but x has a leaf"
    ):
        reshard.reshard(tree, {"w": [sharding([4, 5])], "b": sharding([4, 5])})


def test_prefix_error_names_what_differs_where_types_agree():
    import dataclasses

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class Params:
        w: object
        tag: str = dataclasses.field(metadata={"static": True}, default="a")

    x = Params(place(np.zeros(4, np.float32), sharding([0, 1])), tag="a")
    with pytest.raises(
        ValueError, match=r"whose node data differs: .*\('b',\).* against .*\('a',\)"
    ):
        reshard.reshard(x, Params(sharding([4, 5]), tag="b"))
    many = {f"k{i:02d}": np.zeros(2) for i in range(12)}
    shardings = {k: sharding([4, 5]) for k in list(many)[:11]} | {"extra": sharding([4, 5])}
    with pytest.raises(
        ValueError, match=r"only the sharding tree has \['extra'\], only x has \['k11'\]"
    ):
        reshard.reshard(many, shardings)
    # Keys on one side only: the other side is not listed as having none.
    fewer = {k: sharding([4, 5]) for k in list(many)[:11]}
    with pytest.raises(ValueError, match=r"\(only x has \['k11'\]\)") as info:
        reshard.reshard(many, fewer)
    assert "only the sharding tree" not in str(info.value)


def test_prefix_error_prints_no_values():
    """JAX's own message prints x's subtrees; ours names keys and types only, so no
    array is fetched to build it and a large model gives a short message."""
    leaves = [place(np.full((64, 64), 7.25, np.float32), sharding([0, 1])) for _ in range(40)]
    with pytest.raises(ValueError) as info:
        reshard.reshard(leaves, tuple([sharding([4, 5])] * 40))
    message = str(info.value)
    assert "a tuple of 40, but x has a list of 40" in message
    assert "7.25" not in message and len(message) < 300


def test_indivisible_shape_names_leaf(tree):
    with pytest.raises(
        ValueError, match=r"leaf \['b'\]: shape \(8,\) cannot be divided by the destination"
    ):
        reshard.reshard(tree, {"w": sharding([4, 5]), "b": sharding([2, 3, 4])})


def test_spec_longer_than_rank(tree):
    mesh = Mesh(np.array(DEVS[:4]).reshape(2, 2), ("x", "y"))
    with pytest.raises(
        ValueError,
        match=r"leaf \['b'\]: destination spec .* has 2 entries but the array has rank 1",
    ):
        reshard.reshard(tree, {"w": sharding([4, 5]), "b": NamedSharding(mesh, P("x", "y"))})


def test_mesh_with_a_device_twice(tree):
    with pytest.raises(
        ValueError, match=r"leaf \['w'\]: the destination mesh lists device\(s\) \[4\]"
    ):
        reshard.reshard(tree, {"w": sharding([4, 5, 4, 6]), "b": sharding([2, 3])})
    assert not tree["w"].is_deleted()


def test_unconstrained_destination_dimension(tree):
    # jax.device_put and jit's out_shardings refuse it; so does a reshard, before moving.
    dst = sharding([4, 5], P("a", P.UNCONSTRAINED))
    with pytest.raises(ValueError, match=r"leaf \['w'\]: destination spec .* UNCONSTRAINED"):
        reshard.reshard(tree, {"w": dst, "b": sharding([2, 3])}, donate=True)
    assert not tree["w"].is_deleted() and not tree["b"].is_deleted()


@pytest.mark.parametrize(
    "mesh,what",
    [
        (jax.sharding.AbstractMesh((2,), ("a",)), r"mesh \(AbstractMesh\) has no devices"),
        (Mesh(np.empty((0,), object), ("a",)), "has no devices"),
    ],
    ids=["abstract-mesh", "empty-mesh"],
)
def test_destination_or_source_without_devices(tree, mesh, what):
    with pytest.raises(ValueError, match=r"leaf \['b'\]: the destination sharding" + ".*" + what):
        reshard.reshard(tree, {"w": sharding([4, 5]), "b": NamedSharding(mesh, P())})
    if isinstance(mesh, jax.sharding.AbstractMesh):
        abstract = jax.ShapeDtypeStruct((8,), np.float32, sharding=NamedSharding(mesh, P("a")))
        with pytest.raises(ValueError, match=r"leaf <root>: the source sharding.*" + what):
            reshard.plan(abstract, sharding([4, 5]))


@pytest.mark.parametrize(
    "leaf,error,message",
    [
        ("hello", TypeError, "is not a valid JAX type"),
        (2**40, OverflowError, "too large to convert"),
        (np.array([object()]), TypeError, "not a valid JAX array type"),
    ],
    ids=["str", "big-int", "object-ndarray"],
)
def test_leaf_jax_device_put_refuses_is_named_before_anything_moves(tree, leaf, error, message):
    # The same exception type as jax.device_put's, raised while planning, with the leaf.
    tree["cfg"] = leaf
    with pytest.raises(error, match=r"leaf \['cfg'\]: .*" + message):
        reshard.reshard(tree, sharding([4, 5, 6, 7], P()), donate=True)
    assert not tree["w"].is_deleted() and not tree["b"].is_deleted()


def test_deleted_input(tree):
    tree["w"].delete()
    with pytest.raises(ValueError, match=r"leaf \['w'\] is a deleted jax.Array"):
        reshard.reshard(tree, sharding([4, 5]))


def test_donated_input_cannot_be_reused(tree):
    reshard.reshard(tree, sharding([4, 5]), donate=True)
    assert tree["w"].is_deleted() and tree["b"].is_deleted()
    with pytest.raises(ValueError, match="deleted jax.Array"):
        reshard.reshard(tree, sharding([6, 7]))


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
@pytest.mark.parametrize("kept_first", [True, False])
def test_donating_an_array_that_stands_at_two_leaves(handover_all, executor, kept_first):
    # One leaf keeps the array's sharding (its shards are handed over), the other is
    # relaid. Donated once, the handed-over shards must live on in the output: freeing
    # the array for the relaid leaf used to delete them, or fail on the second leaf.
    truth = np.arange(32.0).reshape(8, 4)
    a = place(truth, sharding(range(8)))
    dsts = [sharding(range(8)), sharding(range(8), P())]
    if not kept_first:
        dsts.reverse()
    before = pointers(a)
    out = reshard.reshard([a, a], dsts, donate=True, executor=executor)
    for y, d in zip(out, dsts, strict=True):
        assert not y.is_deleted() and y.sharding == d
        np.testing.assert_array_equal(np.asarray(y), truth)
    # Consumed, and nothing of it is left but what the kept leaf took over.
    assert a.is_deleted()
    assert pointers(out[0] if kept_first else out[1]) == before
    b = place(truth, sharding(range(8)))
    reshard.reshard([b, b], [sharding(range(4)), sharding(range(4, 8))], donate=True)
    assert b.is_deleted()


EXECUTORS = [("host", None), ("device", None), ("collective", True), ("collective", False)]
EXECUTOR_IDS = ["host", "device", "host-packed", "device-packed"]
STAYS = [0, 1, 2, 3]  # devices that keep their shards in TRADED
TRADED = [0, 1, 2, 3, 7, 6, 5, 4]


def _key_data(v):
    return jax.random.key_data(v) if jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key) else v


def _input(kind, src):
    """A (fresh) input on ``src`` and its values."""
    if kind == "weak":
        return jax.jit(lambda: jnp.full((8, 4), 2.0), out_shardings=src)(), np.full((8, 4), 2.0)
    if kind == "key":
        data = np.arange(16, dtype=np.uint32).reshape(8, 2)
        return place(jax.random.wrap_key_data(data), src), data
    if kind == "int4":  # (on CPU its buffers' layout reads as unpacked, jax 0.10)
        truth = (np.arange(32) % 7).astype(jnp.int4).reshape(8, 4)
        return place(truth, src), truth
    if kind == "bfloat16":
        truth = np.arange(32.0).astype(jnp.bfloat16).reshape(8, 4)
        return place(truth, src), truth
    truth = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    return place(truth, src), truth


@pytest.mark.parametrize("executor,pack_on_host", EXECUTORS, ids=EXECUTOR_IDS)
@pytest.mark.parametrize("kind", ["float", "weak", "key", "pinned_host", "int4", "bfloat16"])
@pytest.mark.parametrize("made_by", ["xla", "reshard"])
def test_donating_an_array_that_partly_stays_consumes_it(
    handover_all, monkeypatch, executor, pack_on_host, kind, made_by
):
    # Devices 0-3 keep their shards, 4-7 trade places. The output holds the kept
    # buffers unchanged and the input reads as deleted, as jax.device_put's does. It
    # used to read as valid with its other buffers freed: using it crashed the process.
    # An input a CPU executor made (an earlier reshard's output: host memory on lease
    # from the pool) copies them: its small shards share one block, which a kept
    # shard would hold whole (see the next test for shards of their own).
    if pack_on_host is not None:
        monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    memory_kind = "pinned_host" if kind == "pinned_host" else None
    src = sharding(range(8), memory_kind=memory_kind)
    dst = sharding(TRADED, memory_kind=memory_kind)
    x, truth = _input(kind, src)
    if made_by == "reshard":
        x = reshard.reshard(x, src, executor="host")  # a copy, on lease
        on_lease = _buffers.lease_test()(pointers(_key_data(x)).values())
        assert on_lease == (kind != "int4")  # (PjRt copies int4 from host memory)
    before = pointers(_key_data(x))
    y = reshard.reshard(x, dst, donate=True, executor=executor)
    assert x.is_deleted()
    with pytest.raises(RuntimeError, match="deleted"):
        jax.jit(lambda v: v)(x)
    kept = {d: p for d, p in pointers(_key_data(y)).items() if d.id in STAYS}
    # Copied: kept shards in a host memory kind always are, and ours of one block.
    if kind == "pinned_host" or (made_by == "reshard" and kind != "int4"):
        assert not set(kept.values()) & set(before.values())
    else:
        assert kept == {d: p for d, p in before.items() if d.id in STAYS}  # handed over
    del x
    gc.collect()
    for _ in range(2):  # memory the pool lends out again meanwhile is not y's
        junk = reshard.reshard(_input(kind, src)[0], dst, executor="host")
        del junk
        gc.collect()
    expect = jax.device_put(_input(kind, src)[0], dst)
    assert y.sharding == dst and y.committed and y.aval == expect.aval
    if kind != "key":
        assert y.weak_type == (kind == "weak")
    np.testing.assert_array_equal(np.asarray(_key_data(y)), truth)
    for shard in _key_data(y).addressable_shards:  # each on its device, at its index
        assert shard.index == dst.devices_indices_map(truth.shape)[shard.device]
        np.testing.assert_array_equal(np.asarray(shard.data), truth[shard.index])
    np.testing.assert_array_equal(np.asarray(_key_data(jax.jit(lambda v: v)(y))), truth)


@pytest.mark.parametrize(
    "executor,pack_on_host,dtype",
    [
        (*e, dt)
        for e, dt in zip(EXECUTORS, [np.float32, jnp.bfloat16, np.bool_, np.complex64], strict=True)
    ],
    ids=EXECUTOR_IDS,
)
def test_donating_an_earlier_reshards_output_hands_over_what_stays(
    handover_all, monkeypatch, executor, pack_on_host, dtype
):
    # Shards of 1 MiB or more that a CPU executor made each have a block of their own,
    # on lease from the pool: donated, those that stay are handed over as the same
    # memory (they were copied whole before), and the pool lends none of it out while
    # the output lives, however much it lends meanwhile.
    if pack_on_host is not None:
        monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    src, dst = sharding(range(8)), sharding(TRADED)
    rows = (1 << 20) // (256 * np.dtype(dtype).itemsize)  # 1 MiB shards
    truth = (np.arange(8 * rows * 256) % 251).astype(dtype).reshape(8 * rows, 256)
    x = reshard.reshard(place(truth, src), src, executor="host")  # a copy, on lease
    before = pointers(x)
    assert _buffers.lease_test()(before.values())
    y = reshard.reshard(x, dst, donate=True, executor=executor)
    assert x.is_deleted()
    assert {d: p for d, p in pointers(y).items() if d.id in STAYS} == {
        d: p for d, p in before.items() if d.id in STAYS
    }
    del x
    for _ in range(3):
        junk = reshard.reshard(place(truth[::-1].copy(), src), dst, executor="host")
        del junk
        gc.collect()
    check_result(y, truth, dst)
    held = [p for d, p in pointers(y).items() if d.id in STAYS]
    assert all(_buffers.lease_test()([p]) for p in held)
    del y
    gc.collect()
    assert not _buffers.lease_test()(held)  # given back once the output went


def test_handing_an_earlier_reshards_output_over_is_no_transfer_to_guard(handover_all):
    # The new handles over the same host memory move no bytes: a guard on transfers
    # from the host does not refuse them (the device executor moves the rest device
    # to device, which that guard allows).
    src, dst = sharding(range(8)), sharding(TRADED)
    truth = np.arange(8 * 1024 * 256, dtype=np.float32).reshape(8 * 1024, 256)
    x = reshard.reshard(place(truth, src), src, executor="host")
    with jax.transfer_guard_host_to_device("disallow_explicit"):
        y = reshard.reshard(x, dst, donate=True, executor="device")
    assert x.is_deleted()
    check_result(y, truth, dst)


@pytest.mark.parametrize("executor,pack_on_host", EXECUTORS, ids=EXECUTOR_IDS)
def test_donating_copies_what_small_arrays_keep_and_hands_big_ones_over(
    monkeypatch, executor, pack_on_host
):
    # Re-homing an input costs more than copying a few KiB, so an array keeping under
    # HANDOVER_BYTES in place is copied and its input freed whole; a bigger one's
    # kept shards are handed over. Both inputs read as deleted.
    if pack_on_host is not None:
        monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    src, dst = sharding(range(8)), sharding(TRADED)
    small = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    big = np.arange(8 * 131072, dtype=np.float32).reshape(8, 131072)  # keeps 2 MiB
    x = {"small": place(small, src), "big": place(big, src)}
    before = {k: pointers(v) for k, v in x.items()}
    y = reshard.reshard(x, dst, donate=True, executor=executor)
    assert x["small"].is_deleted() and x["big"].is_deleted()
    check_result(y["small"], small, dst)
    check_result(y["big"], big, dst)
    stays = [d for d in before["big"] if d.id in STAYS]
    assert not set(pointers(y["small"]).values()) & set(before["small"].values())
    assert [pointers(y["big"])[d] for d in stays] == [before["big"][d] for d in stays]


@pytest.mark.parametrize(
    "executor,pack_on_host",
    [*EXECUTORS, ("collective", "kept-on-device")],
    ids=[*EXECUTOR_IDS, "host-packed-kept-on-device"],
)
def test_outputs_share_buffers_with_the_input_only_where_asked(monkeypatch, executor, pack_on_host):
    if pack_on_host == "kept-on-device":  # kept shards copied by PjRt, as off CPU
        monkeypatch.setattr(_collective_executor, "KEPT_ON_DEVICE", True)
        pack_on_host = True
    if pack_on_host is not None:
        monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    src, traded = sharding(range(8)), sharding(TRADED)
    truth = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    x = place(truth, src)
    mine = set(pointers(x).values())

    def run(dst, **kw):
        y = reshard.reshard(x, dst, executor=executor, **kw)
        np.testing.assert_array_equal(np.asarray(y), truth)
        assert y.sharding == dst
        return pointers(y)

    # By default an array is a copy that shares nothing (as Pathways returns), also
    # an unchanged one (jax.device_put would return the input itself).
    assert not set(run(traded).values()) & mine
    assert not set(run(src).values()) & mine
    assert run(src, may_alias=True) == pointers(x)
    assert not set(run(src, may_alias=False).values()) & mine
    shared = run(traded, may_alias=True)  # asked for: the kept shards are handed over
    assert {d.id for d, p in shared.items() if p in mine} == set(STAYS)
    assert not x.is_deleted()
    # The RL weight sync: a sampler copy made on devices that overlap the trainer's,
    # then the trainer's step donates its parameters. The copy must live on, also
    # for a leaf whose layout the sync keeps (a replicated norm, say).
    params = {"w": place(truth, src), "norm": place(truth, src)}
    sampler = reshard.reshard(
        params, {"w": traded, "norm": src}, executor=executor, cache_resharding_plans=True
    )
    params = jax.jit(lambda p: jax.tree.map(lambda v: v * 2, p), donate_argnums=0)(params)
    for k in ("w", "norm"):
        np.testing.assert_array_equal(np.asarray(sampler[k]), truth)
        np.testing.assert_array_equal(np.asarray(params[k]), truth * 2)


def test_donating_while_a_numpy_view_of_a_kept_shard_lives():
    # JAX declines to donate a buffer a numpy view holds and copies it instead: the
    # input is consumed all the same and the output holds every value.
    truth = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    x = place(truth, sharding(range(8)))
    view = np.asarray(x.addressable_shards[0].data)
    y = reshard.reshard(x, sharding(TRADED), donate=True)
    assert x.is_deleted()
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda v: v + 1)(y)), truth + 1)
    np.testing.assert_array_equal(view, truth[:1])


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_donating_two_arrays_that_share_buffers(executor):
    # An earlier reshard's output that took over its input's buffers, donated with
    # that input: freeing one used to free the other's output (returned deleted), or
    # fail on a buffer already freed after deleting the inputs.
    truth = np.arange(32.0).reshape(8, 4)
    same, other = sharding(range(4)), sharding(range(4, 8), P())
    for keep in (True, False):
        x = place(truth, same)
        y = reshard.reshard(x, sharding(range(4), P("a", None)), executor=executor, may_alias=True)
        assert pointers(y) == pointers(x)  # handed over, not copied
        dst = {"x": same if keep else other, "y": other}
        out = reshard.reshard({"x": x, "y": y}, dst, donate=True, executor=executor)
        for k, v in out.items():
            assert not v.is_deleted() and v.sharding == dst[k]
            np.testing.assert_array_equal(np.asarray(v), truth)
        # Both consumed. Kept: out["x"] holds a copy of what both inputs shared
        # (donating one would free it under the other).
        assert x.is_deleted() and y.is_deleted()


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_donating_arrays_on_one_device_set_in_two_orders(handover_all, executor):
    # Two donated arrays keep shards on devices {0, 1}, listed in other orders: one jit
    # cannot take both. It used to fail after freeing the other inputs.
    truth = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    a, b = place(truth, sharding([0, 1])), place(truth, sharding([1, 0]))
    gone = place(truth, sharding([2, 3]))
    before = {"a": pointers(a)[DEVS[0]], "b": pointers(b)[DEVS[0]]}
    dst = {"a": sharding([0, 4]), "b": sharding([5, 0]), "gone": sharding([6, 7])}
    out = reshard.reshard({"a": a, "b": b, "gone": gone}, dst, donate=True, executor=executor)
    assert a.is_deleted() and b.is_deleted() and gone.is_deleted()
    for k, v in out.items():
        check_result(v, truth, dst[k])
    assert {k: pointers(out[k])[DEVS[0]] for k in before} == before  # handed over


def _executor_outputs():
    """Two arrays the host executor made (a relayout each), on two device sets: their
    buffers are host memory XLA adopted without owning it."""
    truth = {"a": np.arange(8 * 8192, dtype=np.float32).reshape(8, 8192)}
    truth["b"] = truth["a"] + 1
    cols = {"a": sharding([0, 1, 2, 3], P(None, "a")), "b": sharding([4, 5, 6, 7], P(None, "a"))}
    rows = {"a": sharding([0, 1, 2, 3]), "b": sharding([4, 5, 6, 7])}
    x = {k: place(v, cols[k]) for k, v in truth.items()}
    made = reshard.reshard(x, rows, executor="host")
    assert all(_buffers.lease_test()(pointers(v).values()) for v in made.values())
    assert not any(_buffers.lease_test()(pointers(v).values()) for v in x.values())
    return made, truth, rows


def test_donating_the_executors_outputs_on_two_device_sets(handover_all, monkeypatch):
    # A donating identity copies the buffers XLA does not own (the CPU executors'
    # outputs): run on the second device set after the first set's inputs were
    # consumed, that copy running out of memory lost the first set's inputs. No
    # identity runs for them: the outputs take the same host memory, on lease from
    # the pool, with no copy (before session 48 they were copied whole, a second
    # copy of every donated array kept in place), and keep it from the pool.
    made, truth, rows = _executor_outputs()
    held = {k: pointers(v) for k, v in made.items()}
    ran: list[int] = []
    real = failing_identity_after(monkeypatch, ran)
    copied: list[int] = []
    monkeypatch.setattr(_compat, "fresh_copies", lambda xs: copied.append(len(xs)) or [])
    out = reshard.reshard(made, rows, donate=True)
    assert ran == [] and copied == []
    assert {k: pointers(v) for k, v in out.items()} == held
    for k, v in out.items():
        assert made[k].is_deleted()
        check_result(v, truth[k], rows[k])
    del made
    gc.collect()
    # The pool lends none of that memory out again while the outputs live ...
    for _ in range(3):
        junk = reshard.reshard(
            {k: place(v * 0 - 1, rows[k]) for k, v in truth.items()},
            {k: sharding([7, 6, 5, 4] if k == "a" else [3, 2, 1, 0], P(None, "a")) for k in rows},
        )
        del junk
        gc.collect()
    for k, v in out.items():
        check_result(v, truth[k], rows[k])
    assert all(_buffers.lease_test()(pointers(v).values()) for v in out.values())
    # ... and takes it back once they go.
    addresses = [a for v in out.values() for a in pointers(v).values()]
    del out, v
    gc.collect()
    assert not _buffers.lease_test()(addresses)
    # Arrays XLA made (not from the executors) are still handed over, no copy.
    ours = {k: place(v, rows[k]) for k, v in truth.items()}
    before = {k: pointers(v) for k, v in ours.items()}
    monkeypatch.setattr(_compat, "prepare_donating_identity", real)
    out = reshard.reshard(ours, rows, donate=True)
    assert {k: pointers(v) for k, v in out.items()} == before


def test_a_failed_copy_of_donated_kept_shards_consumes_nothing(handover_all, monkeypatch):
    # Kept shards that two donated arrays share (an array and an earlier reshard's
    # output that took its buffers over) are copied before anything is donated: a
    # failure there consumes nothing.
    truth = np.arange(32.0, dtype=np.float32).reshape(8, 4)
    same = sharding(range(4))
    x = place(truth, same)
    y = reshard.reshard(x, sharding(range(4), P("a", None)), may_alias=True)
    assert pointers(y) == pointers(x)

    def fail(xs):
        raise MemoryError("out of memory (injected)")

    monkeypatch.setattr(_compat, "fresh_copies", fail)
    with pytest.raises(MemoryError, match="injected"):
        reshard.reshard({"x": x, "y": y}, {"x": same, "y": sharding(range(4, 8), P())}, donate=True)
    check_result(x, truth, same)
    check_result(y, truth, y.sharding)


@pytest.mark.parametrize("pack_on_host", [True, False], ids=["host-packed", "device-packed"])
def test_donating_an_empty_array_twice_beside_one_handed_over(
    handover_all, monkeypatch, pack_on_host
):
    # The empty array is copied (nothing to hand over), the other handed over: the
    # empty pieces in the device-packed program failed to compile (jax 0.10, Shardy).
    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    empty = np.zeros((0, 24), np.float32)
    truth = np.arange(48.0, dtype=np.float32)
    zero, x = place(empty, sharding(range(8), P(None, "a"))), place(truth, sharding([6, 7]))
    dst = [zero.sharding, x.sharding, zero.sharding]
    out = reshard.reshard([zero, x, zero], dst, executor="collective", donate=True)
    assert zero.is_deleted() and x.is_deleted()
    for y, v, d in zip(out, [empty, truth, empty], dst, strict=True):
        check_result(y, v, d)


def test_no_identity_runs_in_unpinned_host_or_on_devices_to_avoid():
    from reshard import _execute

    x = place(np.arange(8.0), sharding([0, 1]))
    assert _execute._identity_may_run(x.sharding, frozenset())
    assert not _execute._identity_may_run(x.sharding, frozenset({1}))
    unpinned = jax.device_put(np.arange(8.0), sharding([0, 1], memory_kind="unpinned_host"))
    assert not _execute._identity_may_run(unpinned.sharding, frozenset())


def test_donating_leaves_that_jax_device_put_moves():
    # Key arrays on a sharding that is neither named nor single-device (JAX's internal
    # GSPMDSharding here) go through jax.device_put; donated, they are freed too, and
    # no output shares their buffers, even where nothing changes.
    sharding_impls = pytest.importorskip("jax._src.sharding_impls")
    named = sharding(range(8))
    gspmd = sharding_impls.GSPMDSharding(named._device_assignment, named._to_xla_hlo_sharding(1))
    data = np.arange(16, dtype=np.uint32).reshape(8, 2)
    for dst in (sharding(range(4)), gspmd):
        k = jax.device_put(jax.random.wrap_key_data(data), gspmd)
        plan = reshard.plan([k, k], [dst, dst], cache=False)
        assert "2 host leaf/leaves via jax.device_put" in str(plan)
        out = plan.execute([k, k], donate=True)
        assert k.is_deleted()
        for y in out:
            assert not y.is_deleted() and y.sharding.is_equivalent_to(dst, 1)
            np.testing.assert_array_equal(np.asarray(jax.random.key_data(y)), data)
    # The same keys also at a planned leaf that keeps them in place: that output holds
    # their buffers, which freeing the device_put leaf's source used to delete.
    half, rest = sharding(range(4)), sharding(range(4, 8))
    elsewhere = sharding_impls.GSPMDSharding(rest._device_assignment, rest._to_xla_hlo_sharding(1))
    k = jax.device_put(jax.random.wrap_key_data(data), half)
    out = reshard.reshard({"keep": k, "g": k}, {"keep": half, "g": elsewhere}, donate=True)
    for y in out.values():
        assert not y.is_deleted()
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(y)), data)
    # Replicated onto more devices, jax.device_put hands the source's buffers over even
    # when asked for a copy: freeing the donated source deleted four of the output's
    # shards, and a jit on it crashed the process.
    everywhere = sharding(range(8), P())
    wider = sharding_impls.GSPMDSharding(
        everywhere._device_assignment, everywhere._to_xla_hlo_sharding(1)
    )
    k = jax.device_put(jax.random.wrap_key_data(data), sharding(range(4, 8), P()))
    y = reshard.reshard(k, wider, donate=True)
    assert k.is_deleted() and not y.is_deleted()
    assert not any(s.data.is_deleted() for s in jax.random.key_data(y).addressable_shards)
    out = jax.jit(lambda v: jax.random.key_data(v) + 1)(y)
    np.testing.assert_array_equal(np.asarray(out), data + 1)
    # Replicated to sharded on the same devices: jax 0.10 gives the output's first
    # shard a smaller buffer at the address of the input's replica. Taken for the input's
    # own, it was re-homed: that shard became the whole replica ((8, 2) for (2, 2)),
    # and a jit on the output crashed the process.
    four = sharding(range(4))
    sharded = sharding_impls.GSPMDSharding(four._device_assignment, four._to_xla_hlo_sharding(1))
    for may_alias in (None, True, False):
        k = jax.device_put(jax.random.wrap_key_data(data), sharding(range(4), P()))
        y = reshard.reshard(k, sharded, donate=True, may_alias=may_alias)
        assert k.is_deleted()
        churn = [jnp.full((8, 2), 7, np.uint32) + i for i in range(32)]  # reuse freed memory
        assert [s.data.shape for s in jax.random.key_data(y).addressable_shards] == [(2, 2)] * 4
        out = jax.jit(lambda v: jax.random.key_data(v) + 1)(y)
        np.testing.assert_array_equal(np.asarray(out), data + 1)
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(y)), data)
        del churn


def test_a_may_alias_output_of_jax_device_put_keeps_its_input_from_donation():
    """Output and input share buffers (a key array on a GSPMDSharding, to the same
    layout as a NamedSharding): as for planned leaves, donating the input later must
    not consume it while the output lives."""
    sharding_impls = pytest.importorskip("jax._src.sharding_impls")
    four = sharding(range(4))
    gspmd = sharding_impls.GSPMDSharding(four._device_assignment, four._to_xla_hlo_sharding(1))
    data = np.arange(16, dtype=np.uint32).reshape(8, 2)
    x = jax.device_put(jax.random.wrap_key_data(data), gspmd)
    y = reshard.reshard(x, four, may_alias=True)
    shared = {s.data.unsafe_buffer_pointer() for s in jax.random.key_data(y).addressable_shards}
    assert shared == {
        s.data.unsafe_buffer_pointer() for s in jax.random.key_data(x).addressable_shards
    }
    z = reshard.reshard(x, sharding(range(4, 8)), donate=True)
    assert not x.is_deleted() and not y.is_deleted()
    for v in (x, y, z):
        np.testing.assert_array_equal(np.asarray(jax.random.key_data(v)), data)


def test_donating_zero_copy_replicas_frees_them_all():
    # device_put of an aligned host array to a replicated sharding gives every CPU
    # device a buffer at one address: several buffers, not one. Donated with a split
    # part that shares two of them, the others were taken for freed already.
    from reshard import _compat

    host = _compat.aligned_empty((64,), np.dtype(np.float32))
    host[:] = np.arange(64)
    grid = Mesh(np.array(DEVS).reshape(2, 4), ("a", "d"))
    x = jax.device_put(host, NamedSharding(grid, P()))
    buffers = [s.data for s in x.addressable_shards]
    assert len({b.unsafe_buffer_pointer() for b in buffers}) == 1
    part = reshard.split_by_mesh_axis(x, "d")[1]  # x's buffers on devices 1 and 5
    dst = {"part": part.sharding, "x": sharding([1, 7], P())}
    out = reshard.reshard({"part": part, "x": x}, dst, donate=True, may_alias=False)
    assert x.is_deleted() and all(b.is_deleted() for b in buffers)
    for v in out.values():
        np.testing.assert_array_equal(np.asarray(v), np.arange(64))


def test_bad_executor_name(tree):
    with pytest.raises(ValueError, match=r"executor must be one of .* got 'gpu'"):
        reshard.reshard(tree, sharding([4, 5]), executor="gpu")


def test_plan_runs_on_an_equivalent_source_sharding():
    """A plan built for ``P('a')`` runs on the same layout spelled ``P('a', None)``
    (what ``jax.jit(out_shardings=...)`` hands back), on every executor; a different
    layout or memory kind is still refused."""
    planned, spelled = sharding([0, 1, 2, 3]), sharding([0, 1, 2, 3], P("a", None))
    assert planned != spelled and planned.is_equivalent_to(spelled, 2)
    truth = np.arange(64, dtype=np.float32).reshape(16, 4)
    dst = sharding([4, 5], P(None, "a"))
    for executor in ("host", "device", "collective"):
        p = reshard.plan(
            jax.ShapeDtypeStruct(truth.shape, truth.dtype, sharding=planned),
            dst,
            executor=executor,
            cache=False,
        )
        x = jax.jit(lambda t: t + 0, out_shardings=spelled)(place(truth, planned))
        assert x.sharding == spelled
        check_result(p.execute(x, donate=True), truth, dst)
        assert x.is_deleted()
    for other in (sharding([1, 0, 2, 3]), sharding([0, 1, 2, 3], memory_kind="pinned_host")):
        with pytest.raises(ValueError, match="the plan was built for"):
            p.execute(place(truth, other))
    # Shardings whose text is the same (a Mesh's leaves out its devices) are told apart.
    with pytest.raises(
        ValueError,
        match=r"differ in their devices: the plan's are \[0, 1, 2, 3\], the array's \[1, 0, 2, 3\]$",
    ):
        p.execute(place(truth, sharding([1, 0, 2, 3])))
    # Only the shape or dtype differs: the message does not blame the devices.
    for wrong in (truth[:8], truth.astype(np.int32)):
        with pytest.raises(ValueError, match="the plan was built for") as info:
            p.execute(place(wrong, planned))
        assert "differ in their devices" not in str(info.value)


def test_plan_checks_leaves_placed_by_device_put(tree):
    """NumPy arrays and scalars (placed by ``jax.device_put``) are checked against the
    plan like arrays are, with the leaf named."""
    host = {"w": tree["w"], "h": np.ones(4, np.float32), "n": 3}
    dst = {"w": sharding([4, 5]), "h": sharding([4, 5]), "n": sharding([4, 5], P())}
    p = reshard.plan(host, dst, cache=False)
    out = p.execute({"w": tree["w"], "h": np.zeros(4, np.float32), "n": 5})
    np.testing.assert_array_equal(np.asarray(out["h"]), np.zeros(4, np.float32))
    assert int(out["n"]) == 5
    # A step counter that became an array is still a scalar of the plan's shape.
    out = p.execute({"w": tree["w"], "h": np.zeros(4, np.float32), "n": jax.numpy.int32(6)})
    assert int(out["n"]) == 6 and out["n"].sharding == dst["n"]
    bad = [
        (
            "h",
            np.ones(16, np.float32),
            ValueError,
            r"leaf \['h'\]: the plan was built for float32\[4\]",
        ),
        (
            "h",
            np.ones(4, np.int32),
            ValueError,
            r"float32\[4\] placed by jax.device_put, got int32\[4\]",
        ),
        ("h", "oops", TypeError, r"leaf \['h'\]: .*not a valid JAX type"),
        ("n", np.ones(2), ValueError, r"leaf \['n'\]: the plan was built for a Python scalar\[\]"),
        ("h", tree["w"], ValueError, r"leaf \['h'\]: .*float32\[4\].*got float32\[8, 4\]"),
    ]
    for key, value, error, message in bad:
        with pytest.raises(error, match=message):
            p.execute({"w": tree["w"], "h": np.ones(4, np.float32), "n": 3} | {key: value})


def test_reshard_refuses_a_shape_dtype_struct_with_a_hint(tree):
    sds = jax.ShapeDtypeStruct((8, 4), np.float32, sharding=tree["w"].sharding)
    with pytest.raises(ValueError, match=r"leaf \['w'\] is a jax.ShapeDtypeStruct.*reshard.plan"):
        reshard.reshard({"w": sds, "b": tree["b"]}, sharding([4, 5]))


def test_plan_used_on_other_input(tree):
    p = reshard.plan(tree, sharding([4, 5]))
    with pytest.raises(ValueError, match="the plan was built for"):
        p.execute({"w": tree["w"], "b": place(np.arange(8, dtype=np.int32), sharding([2, 3]))})
    with pytest.raises(ValueError, match="x has structure"):
        p.execute([tree["w"], tree["b"]])


def test_avoided_destination_device(tree):
    with pytest.raises(ValueError, match=r"destination sharding uses avoided devices \[4\]"):
        reshard.reshard(tree, sharding([4, 5]), avoid_devices=[DEVS[4]])


def test_leaves_moved_by_device_put_neither_land_on_nor_read_avoided_devices():
    # A numpy leaf, and a key array on a GSPMDSharding (JAX's own path), go through
    # jax.device_put, which cannot be steered away from a device.
    from jax._src.sharding_impls import GSPMDSharding

    named = sharding([0, 1, 2, 3], P("a"))
    gspmd = GSPMDSharding(named._device_assignment, named._to_xla_hlo_sharding(1))
    keys = jax.device_put(jax.random.split(jax.random.key(0), 8), gspmd)
    dst = sharding([4, 5, 6, 7], P("a"))
    with pytest.raises(ValueError, match=r"leaf \[1\]: its source uses avoided devices \[0\]"):
        reshard.reshard([np.arange(4.0), keys], dst, avoid_devices=[0])
    with pytest.raises(ValueError, match=r"leaf <root>: the destination .* avoided devices \[4\]"):
        reshard.reshard(np.arange(4.0), dst, avoid_devices=[4])
    assert not keys.is_deleted()
    elsewhere = sharding([4, 5], P("a"))  # neither side on an avoided device: moved
    out = reshard.reshard([np.arange(4.0), keys], elsewhere, avoid_devices=[6, 7])
    np.testing.assert_array_equal(np.asarray(out[0]), np.arange(4.0))
    np.testing.assert_array_equal(jax.random.key_data(out[1]), jax.random.key_data(keys))
    assert out[1].sharding.device_set == elsewhere.device_set


def test_a_struct_source_with_an_unconstrained_entry_is_refused():
    # Where its data lives is left to a compiler; it used to plan as if replicated.
    mesh = Mesh(np.array(DEVS[:4]), ("a",))
    loose = NamedSharding(mesh, P(None, P.UNCONSTRAINED))
    s = jax.ShapeDtypeStruct((4, 8), np.float32, sharding=loose)
    with pytest.raises(ValueError, match=r"leaf \['w'\]: source spec .* UNCONSTRAINED"):
        reshard.plan({"w": s}, sharding([4, 5, 6, 7]))


def test_a_device_stands_for_its_single_device_sharding(tree):
    out = reshard.reshard(tree, {"w": DEVS[6], "b": sharding([4, 5])})
    assert out["w"].sharding == SingleDeviceSharding(DEVS[6])
    np.testing.assert_array_equal(np.asarray(out["w"]), np.arange(32.0).reshape(8, 4))
    assert out["b"].sharding == sharding([4, 5])
    assert (
        reshard.reshard(tree["b"], DEVS[7]).sharding == jax.device_put(tree["b"], DEVS[7]).sharding
    )


def test_avoid_devices_forms(tree):
    # Devices, ids of either int kind, and None (nothing to avoid) are accepted;
    # device 7 holds none of the tree, so every form plans the same.
    for avoid in ([DEVS[7]], [np.int64(7)], (d for d in [7]), None):
        out = reshard.reshard(tree, sharding([4, 5]), avoid_devices=avoid)
        np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(tree["w"]))


def test_avoid_devices_takes_any_device_but_checks_bare_ids(tree, monkeypatch):
    # A jax.Device is one JAX has, whatever its backend: on a machine with an
    # accelerator, a CPU device's id need not be one of the default backend's. Only
    # bare ids are checked (here the known ids are narrowed to stand for another
    # default backend).
    from reshard import _api

    monkeypatch.setattr(_api, "_all_device_ids", lambda: frozenset(range(4)))
    out = reshard.reshard(tree, sharding([4, 5]), avoid_devices=[DEVS[7]])
    np.testing.assert_array_equal(np.asarray(out["w"]), np.asarray(tree["w"]))
    with pytest.raises(ValueError, match=r"device id\(s\) \[7\] that JAX does not have"):
        reshard.reshard(tree, sharding([4, 5]), avoid_devices=[7])


@pytest.mark.parametrize(
    ("avoid", "error", "message"),
    [
        ([99], ValueError, r"device id\(s\) \[99\] that JAX does not have"),
        ([0, -1], ValueError, r"device id\(s\) \[-1\]"),
        (["0"], TypeError, "neither a device nor a device id"),
        ([True], TypeError, "neither a device nor a device id"),
        (3, TypeError, "must be an iterable of devices or device ids"),
        ("01", TypeError, "must be an iterable of devices or device ids"),
        (DEVS[0], TypeError, "must be an iterable of devices or device ids"),
    ],
)
def test_error_bad_avoid_devices(tree, avoid, error, message):
    with pytest.raises(error, match=message):
        reshard.reshard(tree, sharding([4, 5]), avoid_devices=avoid, donate=True)
    assert not tree["w"].is_deleted()


def test_error_shape_dtype_struct_without_sharding(tree):
    sds = {"w": jax.ShapeDtypeStruct((8, 4), np.float32), "b": tree["b"]}
    for f in (reshard.plan, reshard.reshard):
        with pytest.raises(ValueError, match=r"leaf \['w'\] is a jax.ShapeDtypeStruct without"):
            f(sds, sharding([4, 5]))


def test_data_loss_is_reported_before_moving(tree):
    with pytest.raises(reshard.DataLossError, match=r"\['w'\]\[2:4, 0:4\]") as e:
        reshard.reshard(tree, sharding([4, 5]), avoid_devices=[1])
    assert e.value.missing == [("['b']", ((4, 8),)), ("['w']", ((2, 4), (0, 4)))]
    assert not tree["w"].is_deleted()


def test_data_loss_boxes_of_key_arrays_have_their_rank():
    # Planned as key data (one more dimension), reported as the key array's boxes.
    keys = place(jax.random.split(jax.random.key(0), 8), sharding([0, 1, 2, 3]))
    with pytest.raises(reshard.DataLossError) as e:
        reshard.reshard({"k": keys}, sharding([4, 5]), avoid_devices=[1])
    assert e.value.missing == [("['k']", ((2, 4),))]
    assert "['k'][2:4]" in str(e.value)


@pytest.mark.parametrize("executor", ["host", "device"])
@pytest.mark.parametrize("copied_whole", [False, True])
def test_failure_mid_run_loses_nothing(tree, monkeypatch, executor, copied_whole):
    """Inject a failure after some outputs exist: donated inputs must survive intact.
    ``copied_whole``: ``w`` only changes devices (copied shard by shard by PjRt) and
    exists when ``b``'s assembly fails; else both are relaid and the second fails."""
    before = {k: np.asarray(v).copy() for k, v in tree.items()}
    real = _local_executor._compat.assemble
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == (1 if copied_whole else 2):
            raise RuntimeError("injected failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(_local_executor._compat, "assemble", flaky)
    to = sharding([4, 5, 6, 7])
    dst = {"w": to if copied_whole else sharding([4, 5, 6, 7], P(None, "a")), "b": to}
    with pytest.raises(RuntimeError, match="injected failure"):
        reshard.reshard(tree, dst, donate=True, executor=executor)
    for k, v in tree.items():
        assert not v.is_deleted()
        np.testing.assert_array_equal(np.asarray(v), before[k])


def test_multi_process_without_collective_is_a_clear_error(tree, monkeypatch):
    from reshard import _plan

    p = reshard.plan(tree, sharding([4, 5]), executor="host", cache=False)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    # Within one process (this one), a local executor runs, as jax.device_put would.
    assert p.processes == {0} and not p.crosses_processes
    np.testing.assert_array_equal(np.asarray(p.execute(tree)["w"]), np.asarray(tree["w"]))
    monkeypatch.setattr(_plan.Plan, "processes", property(lambda self: frozenset({0, 1})))
    with pytest.raises(
        ValueError,
        match=r"runs in one process, but this plan's devices belong to processes \[0, 1\]",
    ):
        p.execute(tree)


def test_mixed_platforms_error(tree, monkeypatch):
    class FakeDevice:
        id = 99
        platform = "gpu"
        process_index = 0

    class FakeSharding(SingleDeviceSharding):
        @property
        def device_set(self):
            return {FakeDevice()}

    fake = FakeSharding(DEVS[0])
    with pytest.raises(ValueError, match=r"mix platforms \['cpu', 'gpu'\]"):
        reshard.plan(tree["b"], fake, cache=False)


def test_cached_plans_do_not_recompile():
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        src = sharding([0, 1, 2, 3])
        dst = NamedSharding(Mesh(np.array(DEVS[4:8]).reshape(2, 2), ("x", "y")), P("y", "x"))
        x = place(np.arange(64.0).reshape(8, 8), src)
        reshard.clear_plan_cache()
        reshard.reshard(x, dst, executor="device", cache_resharding_plans=True)
        first = counter.count
        assert first > 0  # the device path compiles its slicing/assembly programs
        p1 = reshard.plan(x, dst, executor="device")
        for _ in range(3):
            y = reshard.reshard(x, dst, executor="device", cache_resharding_plans=True)
        assert counter.count == first
        assert reshard.plan(x, dst, executor="device") is p1
        np.testing.assert_array_equal(np.asarray(y), np.arange(64.0).reshape(8, 8))
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)


# (Host packing in one process copies between devices on the host: no programs.)
@pytest.mark.parametrize("pack_on_host", [None, False], ids=["device", "collective-device"])
def test_uncached_plans_share_compiled_programs(monkeypatch, pack_on_host):
    # With cache_resharding_plans=False (the default) each call plans afresh; equal
    # plans must still share their compiled programs (seconds each on the device
    # paths), so only the first call compiles.
    from reshard import _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    executor = "device" if pack_on_host is None else "collective"
    src = sharding([0, 1, 2, 3])
    dst = NamedSharding(Mesh(np.array(DEVS[4:8]).reshape(2, 2), ("x", "y")), P("y", "x"))
    truth = np.arange(64.0).reshape(8, 8)
    xs = [place(truth, src) for _ in range(4)]  # new arrays each step, as in training
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        reshard.clear_plan_cache()
        for step, x in enumerate(xs[:3]):
            y = reshard.reshard(x, dst, executor=executor)
            np.testing.assert_array_equal(np.asarray(y), truth)
            assert y.sharding == dst
            if step == 0:
                first = counter.count
                assert first > 0
        assert counter.count == first
        reshard.clear_plan_cache()  # forgets the programs too
        reshard.reshard(xs[3], dst, executor=executor)
        assert counter.count > first
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)


@pytest.mark.parametrize("pack_on_host", [None, False], ids=["device", "collective-device"])
def test_compiled_programs_are_bounded_and_freed(monkeypatch, pack_on_host):
    # Shapes that keep changing compile new programs each call; the cache keeps only
    # the last PROGRAM_CACHE_SIZE programs (the device executor's 8 of one plan in one
    # entry; those of the plan that compiled last on top), and the ones it drops are
    # freed (nothing else holds them: JAX's own caches would keep them for good).
    import gc
    import weakref

    from reshard import _collective_executor, _programs

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    monkeypatch.setattr(_programs, "PROGRAM_CACHE_SIZE", 10)
    executor = "device" if pack_on_host is None else "collective"
    reshard.clear_plan_cache()
    src = sharding([0, 1, 2, 3])
    dst = NamedSharding(Mesh(np.array(DEVS[4:8]).reshape(2, 2), ("x", "y")), P("y", "x"))
    dropped = []
    for n in range(1, 5):
        before = list(_programs._programs.values())
        truth = np.arange(64 * n, dtype=np.float32).reshape(8 * n, 8)
        y = reshard.reshard(place(truth, src), dst, executor=executor)
        check_result(y, truth, dst)
        store = _programs._programs
        assert _programs.size() <= 10 + store.weights.get(store.pinned, 0)
        dropped += [weakref.ref(p) for p in before if p not in _programs._programs.values()]
        del before
    gc.collect()
    assert dropped and not [r for r in dropped if r() is not None]


def test_a_cached_plan_keeps_its_programs_when_the_shared_cache_drops_them(monkeypatch):
    # With more plans in use than the shared cache holds (the device executor's plans
    # here are 8 programs each), a plan from the plan cache still runs its own.
    from reshard import _programs

    monkeypatch.setattr(_programs, "PROGRAM_CACHE_SIZE", 2)
    reshard.clear_plan_cache()
    src = sharding([0, 1, 2, 3])
    dst = NamedSharding(Mesh(np.array(DEVS[4:8]).reshape(2, 2), ("x", "y")), P("y", "x"))
    xs = [place(np.arange(64.0 * n, dtype=np.float32).reshape(8 * n, 8), src) for n in (1, 2)]
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        for x in xs:  # the second plan's programs push the first's out of _programs
            reshard.reshard(x, dst, executor="device", cache_resharding_plans=True)
        first = counter.count
        for x in xs:
            y = reshard.reshard(x, dst, executor="device", cache_resharding_plans=True)
            check_result(y, np.asarray(x), dst)
        assert counter.count == first
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)


def test_plan_cache_is_bounded(monkeypatch):
    from reshard import _api

    monkeypatch.setattr(_api, "PLAN_CACHE_SIZE", 3)
    reshard.clear_plan_cache()
    src = sharding([0, 1])
    for n in range(6):
        reshard.plan(
            jax.ShapeDtypeStruct((2 * (n + 1),), np.float32, sharding=src), sharding([2, 3])
        )
    assert _api.plan_cache_size() == 3


def test_cached_lookup_of_live_arrays_skips_the_leaf_checks(tree, monkeypatch):
    # A call whose leaves are all live jax.Arrays finds its cached plan by what the
    # arrays are (the quick key), without building the per-leaf key again; the result
    # is the same plan object and the same values.
    from reshard import _api, _execute

    reshard.clear_plan_cache()
    dst = {"w": sharding([4, 5]), "b": sharding([6, 7])}
    first = reshard.plan(tree, dst)
    calls = {"leaf_info": 0, "check_leaf": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return wrapper

    monkeypatch.setattr(_api, "_leaf_info", counted("leaf_info", _api._leaf_info))
    monkeypatch.setattr(_execute, "_check_leaf", counted("check_leaf", _execute._check_leaf))
    # New array objects over new buffers, as after a training step.
    again = {k: place(np.asarray(v), v.sharding) for k, v in tree.items()}
    assert reshard.plan(again, dst) is first
    out = reshard.reshard(again, dst, cache_resharding_plans=True)
    assert calls == {"leaf_info": 0, "check_leaf": 0}
    check_result(out["w"], np.arange(32, dtype=np.float32).reshape(8, 4), dst["w"])
    check_result(out["b"], np.arange(8, dtype=np.int32), dst["b"])
    # One sharding for the whole tree takes the shortcut too.
    whole = reshard.plan(tree, sharding([4, 5]))
    calls["leaf_info"] = 0
    assert reshard.plan(again, sharding([4, 5])) is whole
    assert calls["leaf_info"] == 0
    # Plan.execute still checks what it is given.
    with pytest.raises(ValueError, match=r"leaf \['b'\]: the plan was built for int32\[8\]"):
        first.execute({"w": again["w"], "b": place(np.arange(8.0), sharding([0, 1]))})
    assert calls["check_leaf"] > 0
    # Leaves the shortcut does not take (a ShapeDtypeStruct, a deleted array) go the
    # full way, with its errors.
    spec = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    assert reshard.plan(spec, dst) is first
    assert calls["leaf_info"] == 2
    with pytest.raises(ValueError, match="holds no data"):
        reshard.reshard(spec, dst, cache_resharding_plans=True)
    again["w"].delete()
    with pytest.raises(ValueError, match=r"leaf \['w'\] is a deleted jax.Array"):
        reshard.reshard(again, dst, cache_resharding_plans=True)
    reshard.clear_plan_cache()
    assert not _api._quick


def test_a_plan_the_cache_drops_is_not_kept_alive_by_the_quick_lookup(monkeypatch):
    # The shortcut holds keys, not plans: an evicted plan (and the compiled programs
    # it holds) is freed as it was without the shortcut.
    import gc
    import weakref

    from reshard import _api

    monkeypatch.setattr(_api, "PLAN_CACHE_SIZE", 1)
    reshard.clear_plan_cache()
    x = place(np.arange(8.0), sharding([0, 1]))
    first = reshard.plan(x, sharding([2, 3]))
    assert reshard.plan(x, sharding([2, 3])) is first  # found by the shortcut
    gone = weakref.ref(first)
    del first
    reshard.plan(x, sharding([4, 5]))  # evicts it
    gc.collect()
    assert gone() is None
    # The shortcut's entry for it now leads nowhere, and the call plans again.
    again = reshard.plan(x, sharding([2, 3]))
    check_result(again.execute(x), np.arange(8.0, dtype=np.float32), sharding([2, 3]))


def test_a_cached_plan_follows_each_input_weak_type():
    # Weakly and strongly typed arrays of one shape, dtype and sharding share a plan;
    # each output is typed as its own input, as jax.device_put types it.
    reshard.clear_plan_cache()
    src, dst = sharding([0, 1]), sharding([2, 3])
    weak = place(jax.numpy.full((8,), 2.0), src)
    strong = place(np.full((8,), 2.0, np.float32), src)
    assert weak.weak_type and not strong.weak_type
    for x in (weak, strong, weak, strong):
        y = reshard.reshard(x, dst, cache_resharding_plans=True)
        assert y.weak_type == x.weak_type == jax.device_put(x, dst).weak_type
        check_result(y, np.full((8,), 2.0, np.float32), dst)
    assert reshard.plan(weak, dst) is reshard.plan(strong, dst)


_CALLS = [  # (tree maker, destination maker, executor, avoid_devices)
    (lambda a: {"w": a["f8x4@01"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", ()),
    (lambda a: {"w": a["f8x4@01"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "host", ()),
    (lambda a: {"w": a["f8x4@01"], "b": a["i8@01"]}, lambda: sharding([6, 7]), "auto", ()),
    (
        lambda a: {"w": a["f8x4@01"], "b": a["i8@01"]},
        lambda: {"w": sharding([4, 5]), "b": sharding([6, 7])},
        "auto",
        (),
    ),
    (lambda a: {"w": a["f8x4@0123"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", ()),
    (lambda a: {"w": a["i8x4@01"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", ()),
    (lambda a: {"w": a["f4x8@01"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", ()),
    (lambda a: {"v": a["f8x4@01"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", ()),
    (lambda a: [a["f8x4@01"], a["i8@01"]], lambda: sharding([4, 5]), "auto", ()),
    (lambda a: {"w": a["f8x4@0123r"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", [3]),
    (lambda a: {"w": a["f8x4@0123r"], "b": a["i8@01"]}, lambda: sharding([4, 5]), "auto", ()),
    (lambda a: a["f8x4@01"], lambda: sharding([4, 5], P(None, "a")), "auto", ()),
    (lambda a: {"w": a["f8x4@01"], "b": np.arange(8)}, lambda: sharding([4, 5]), "auto", ()),
]


def _call_arrays():
    out = {}
    for name, (shape, dtype, ids) in {
        "f8x4@01": ((8, 4), np.float32, [0, 1]),
        "f8x4@0123": ((8, 4), np.float32, [0, 1, 2, 3]),
        "i8x4@01": ((8, 4), np.int32, [0, 1]),
        "f4x8@01": ((4, 8), np.float32, [0, 1]),
        "i8@01": ((8,), np.int32, [0, 1]),
    }.items():
        out[name] = place(np.arange(np.prod(shape)).astype(dtype).reshape(shape), sharding(ids))
    out["f8x4@0123r"] = place(np.ones((8, 4), np.float32), sharding([0, 1, 2, 3], P()))
    return out


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(0, len(_CALLS) - 1), min_size=1, max_size=14))
def test_the_quick_lookup_leaves_the_plan_cache_as_the_full_one_does(calls):
    # The same calls with and without the shortcut: every call gets a plan for its own
    # leaves, and the plan cache holds the same plans in the same LRU order after each
    # call (processes must evict cross-process plans alike, whichever way they look
    # them up). A cache of two makes the shortcut lead to evicted plans too.
    from reshard import _api

    arrays = _call_arrays()
    runs = []
    for use_quick in (True, False):
        saved = (_api.PLAN_CACHE_SIZE, _api._quick_key)
        _api.PLAN_CACHE_SIZE = 2
        if not use_quick:
            _api._quick_key = lambda *a: None
        try:
            reshard.clear_plan_cache()
            seen = []
            for c in calls:
                make_tree, make_dst, executor, avoid = _CALLS[c]
                x = make_tree(arrays)
                p = reshard.plan(x, make_dst(), executor=executor, avoid_devices=avoid)
                full = _api._plan(
                    x, make_dst(), executor=executor, avoid_devices=avoid, cache=False
                )[0]
                assert p.leaves == full.leaves and p.treedef == full.treedef
                assert p.executor == full.executor and p.avoid_devices == full.avoid_devices
                assert [p is q for q in _api._local_cache.values()].count(True) == 1
                seen.append([(k.value, id(v)) for k, v in _api._local_cache.items()])
            runs.append([[k for k, _ in step] for step in seen])
        finally:
            _api.PLAN_CACHE_SIZE, _api._quick_key = saved
            reshard.clear_plan_cache()
    assert runs[0] == runs[1]


class Layer:
    """A pytree node whose metadata is a numpy array (``==`` gives an array)."""

    def __init__(self, w, perm):
        self.w, self.perm = w, perm


jax.tree_util.register_pytree_node(
    Layer, lambda n: ((n.w,), n.perm), lambda perm, children: Layer(children[0], perm)
)


def test_tree_with_array_metadata_is_planned_without_the_cache(tree):
    # The same tree rebuilt (as each training step does) cannot be compared with the
    # cached one; it must still be planned and moved, as with the cache off.
    reshard.clear_plan_cache()
    dst = sharding([4, 5])
    for _ in range(3):
        layer = Layer(tree["w"], np.array([1, 0]))
        assert isinstance(reshard.plan(layer, dst), reshard.Plan)
        out = reshard.reshard(layer, dst, cache_resharding_plans=True)
        np.testing.assert_array_equal(np.asarray(out.w), np.arange(32.0).reshape(8, 4))
        np.testing.assert_array_equal(out.perm, [1, 0])
        assert out.w.sharding == dst


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_donating_host_memory_from_jit_outputs(executor):
    """jax 0.10 gives a jit output on a pinned_host SingleDeviceSharding a *device*
    memory space; a program that donates it aborts the process. Donating such an
    array (large enough to be handed over, were it in device memory) must work as
    jax.device_put(..., donate=True) does."""
    truth = np.arange(1 << 18, dtype=np.float32)  # 1 MiB
    pinned = SingleDeviceSharding(DEVS[0], memory_kind="pinned_host")
    for dst in (pinned, sharding([0, 1], P(), memory_kind="pinned_host")):
        x = jax.jit(lambda v: v, out_shardings=pinned)(truth)
        y = reshard.reshard(x, dst, donate=True, executor=executor)
        assert x.is_deleted()
        check_result(y, truth, dst)


def test_which_arrays_a_donating_program_may_take():
    from reshard import _compat

    truth = np.arange(8.0, dtype=np.float32)
    kinds = {}
    for kind in ("device", "pinned_host", "unpinned_host"):
        s = SingleDeviceSharding(DEVS[0], memory_kind=kind)
        kinds[kind, "put"] = jax.device_put(truth, s)
        kinds[kind, "jit"] = jax.jit(lambda v: v, out_shardings=s)(truth)
    assert {k: _compat.may_donate(a) for k, a in kinds.items()} == {
        ("device", "put"): True,
        ("device", "jit"): True,
        ("pinned_host", "put"): True,
        ("pinned_host", "jit"): str(jax.typeof(kinds["pinned_host", "jit"])).find("<host>") >= 0,
        ("unpinned_host", "put"): False,
        ("unpinned_host", "jit"): False,
    }


def test_arrays_placed_by_jax_device_put_are_copies_too():
    """Key arrays on shardings that are neither named nor single-device go through
    jax.device_put; by default they too come back as copies, not as the input."""
    from jax._src.sharding_impls import GSPMDSharding

    s = GSPMDSharding.get_replicated(DEVS[:2])
    k = jax.device_put(jax.random.split(jax.random.key(0), 4), s)
    assert [leaf.kind for leaf in reshard.plan(k, s).leaves] == ["host"]
    y = reshard.reshard(k, s)
    assert y is not k
    assert not set(pointers(jax.random.key_data(y)).values()) & set(
        pointers(jax.random.key_data(k)).values()
    )
    np.testing.assert_array_equal(jax.random.key_data(y), jax.random.key_data(k))
    z = reshard.reshard(k, s, may_alias=True)
    assert pointers(jax.random.key_data(z)) == pointers(jax.random.key_data(k))


@pytest.mark.parametrize("executor", ["host", "device"])
def test_uncached_plans_share_their_jobs_by_geometry(monkeypatch, executor):
    # A plan built anew for each call (uncached, the default) takes its per-array jobs
    # (copies and copy tables) from equal plans before it, by geometry, pieces and the
    # copy settings; each job still names its own plan's leaf. The store is bounded,
    # and clear_plan_cache empties it.
    from reshard import _execute, _programs

    reshard.clear_plan_cache()
    src = sharding([0, 1, 2, 3])
    dst = NamedSharding(Mesh(np.array(DEVS[4:8]).reshape(2, 2), ("x", "y")), P("y", "x"))
    truths = [
        np.arange(256.0 * k, 256.0 * (k + 1), dtype=np.float32).reshape(16, 16) for k in range(3)
    ]
    xs = [place(t, src) for t in truths]
    plans = []
    for x, t in zip(xs, truths, strict=True):
        p = reshard.plan(x, dst, executor=executor, cache=False)
        check_result(p.execute(x), t, dst)
        plans.append(p)
    (a,), (b,), (c,) = (_execute._jobs(p) for p in plans)
    assert plans[0] is not plans[1] and a.plan is plans[0].leaf_plans[0]
    assert b.plan is plans[1].leaf_plans[0] and b.plan is not a.plan
    assert b.copies is a.copies and b.tables is a.tables and c.dst_of is a.dst_of
    # Another copy setting makes other copies: a job of its own.
    monkeypatch.setattr(_buffers, "ROW_ITEM_BYTES", _buffers.ROW_ITEM_BYTES + 1)
    p = reshard.plan(xs[0], dst, executor=executor, cache=False)
    check_result(p.execute(xs[0]), truths[0], dst)
    assert _execute._jobs(p)[0].copies is not a.copies
    # Another dtype too.
    y = place(truths[1].astype(np.int32), src)
    q = reshard.plan(y, dst, executor=executor, cache=False)
    check_result(q.execute(y), truths[1].astype(np.int32), dst)
    assert _execute._jobs(q)[0].copies is not a.copies

    # Bounded by count, and by pieces in all; emptied with the plan cache.
    def fill(sizes):
        for n in sizes:
            z = place(np.arange(256.0 * n, dtype=np.float32).reshape(16 * n, 16), src)
            check_result(
                reshard.plan(z, dst, executor=executor, cache=False).execute(z), np.asarray(z), dst
            )

    monkeypatch.setattr(_programs, "JOB_CACHE_SIZE", 2)
    fill(range(2, 6))
    assert len(_programs._jobs) == 2
    pieces = sum(map(len, a.copies))  # every job here has as many
    assert _programs._jobs.total == 2 * pieces
    monkeypatch.setattr(_programs, "JOB_CACHE_SIZE", 100)
    monkeypatch.setattr(_programs, "JOB_CACHE_PIECES", 3 * pieces)
    fill(range(6, 11))
    assert len(_programs._jobs) == 3 and _programs._jobs.total == 3 * pieces
    reshard.clear_plan_cache()
    assert not _programs._jobs and _programs._jobs.total == 0
    monkeypatch.setattr(_programs, "JOB_CACHE_PIECES", pieces - 1)  # one job is over it
    fill([2])
    assert not _programs._jobs
    # An entry over the budget alone is not kept, and pushes nothing out.
    store = _programs._Store(len)
    assert store.entry("a", lambda: "aa", 10, 5) == "aa"
    assert store.entry("b", lambda: "bbb", 10, 5) == "bbb"
    assert store.entry("c", lambda: "c" * 6, 10, 5) == "cccccc"
    assert list(store) == ["a", "b"] and store.total == 5
    store.entry("d", lambda: "d", 10, 5)  # least recently used out to fit
    assert list(store) == ["b", "d"] and store.total == 4


@pytest.mark.parametrize("pack_on_host", [True, False], ids=["host-packed", "device-packed"])
def test_collective_memory_kind_changes_in_place_take_no_program(monkeypatch, pack_on_host):
    # Offloading to host memory on the devices the shards are on needs nothing from
    # another process: PjRt copies each process's shards, and the collective program
    # (its stages, its agreement check) is built for the other arrays only, or not at all.
    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    devs = jax.devices()
    mesh = Mesh(np.array(devs), ("a",))
    on_device = NamedSharding(mesh, P("a"), memory_kind="device")
    offloaded = NamedSharding(mesh, P("a"), memory_kind="pinned_host")
    other = NamedSharding(Mesh(np.array(devs[::-1]), ("a",)), P(None, "a"))
    truth = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    keys = lambda c: [k for k in c if isinstance(k, tuple) and k[0] == "collective_program"]  # noqa: E731

    x = {"opt": place(truth, on_device)}
    p = reshard.plan(x, {"opt": offloaded}, executor="collective", cache=False)
    y = p.execute(x)
    check_result(y["opt"], truth, offloaded)
    assert keys(p._cache) == []
    y = p.execute({"opt": place(truth, on_device)}, donate=True)
    check_result(y["opt"], truth, offloaded)

    x = {"opt": place(truth, offloaded), "w": place(truth, on_device)}
    dst = {"opt": on_device, "w": other}
    p = reshard.plan(x, dst, executor="collective", cache=False)
    y = p.execute(x)
    check_result(y["opt"], truth, on_device)
    check_result(y["w"], truth, other)
    (key,) = keys(p._cache)
    assert key[-1] == (1,)  # the program moves "w" alone (index 1 of the tree's arrays)
    check_result(x["opt"], truth, offloaded)  # inputs intact


def _in_a_child(script: str, *args: str, timeout: float) -> str:
    """Runs ``script`` in a fresh Python (8 simulated CPU devices, set by the script),
    where a crash cannot take pytest down; asserts it exited with 0; its stdout."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**env, "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0, (run.returncode, run.stdout[-2000:], run.stderr[-3000:])
    return run.stdout


_DONATING_WHILE_ANOTHER_THREAD_READS = """
import os, sys, threading
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, jax, reshard
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

executor, trials = sys.argv[1], int(sys.argv[2])
mesh = Mesh(np.array(jax.devices()[:4]), "a")
src, relaid = NamedSharding(mesh, P("a")), NamedSharding(mesh, P(None, "a"))
elsewhere = NamedSharding(Mesh(np.array(jax.devices()[4:]), "a"), P("a"))
host = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)  # 2 MiB: handed over
outcomes = {}
for trial in range(trials):
    x = jax.device_put(host, src)
    # One thread reads x (relaid: copied; or the same sharding with may_alias=True:
    # its output shares x's buffers), the other donates x at the same time.
    alias = trial % 2 == 1
    got = {}

    def read():
        try:
            if alias:
                got["y"] = reshard.reshard(x, src, may_alias=True, executor=executor)
            else:
                got["y"] = reshard.reshard(x, relaid, executor=executor)
        except (ValueError, RuntimeError) as e:  # deleted (donated first): clean
            got["y"] = type(e).__name__

    def donate():
        got["z"] = reshard.reshard(x, elsewhere, donate=True, executor=executor)

    threads = [threading.Thread(target=read), threading.Thread(target=donate)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    y, z = got["y"], got["z"]
    assert np.array_equal(np.asarray(z), host)
    if not isinstance(y, str):
        # Returned: never an output deleted under it by the other thread's donation.
        assert not y.is_deleted(), trial
        assert np.array_equal(np.asarray(y), host), trial
        y = "returned"
    outcomes[y] = outcomes.get(y, 0) + 1
print(sorted(outcomes.items()))
"""


@pytest.mark.parametrize("executor", ["host", "device"])
def test_donating_an_input_another_thread_reads_neither_crashes_nor_frees_its_output(
    executor: str,
) -> None:
    # jaxlib 0.10 crashed the process (a failed check, or a segmentation fault) when a
    # donation deleted an array another thread was reading (a numpy view of its
    # buffers, or a program on them); and a may_alias=True output could come back
    # already deleted when its input's donation in another thread had decided to
    # consume it before the output was recorded. In a child process: a crash must not
    # take pytest down.
    out = _in_a_child(_DONATING_WHILE_ANOTHER_THREAD_READS, executor, "80", timeout=240)
    assert "returned" in out, out


_DONATED_BETWEEN_PLANNING_AND_MOVING = """
import os, sys, threading, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, jax, reshard
from reshard import _api
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()[:4]), "a")
src, relaid = NamedSharding(mesh, P("a")), NamedSharding(mesh, P(None, "a"))
elsewhere = NamedSharding(Mesh(np.array(jax.devices()[4:]), "a"), P("a"))
x = jax.device_put(np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024), src)
execute_plan, planned = _api.execute_plan, threading.Event()

def late(*args, **kwargs):  # thread A: planned (x checked), moves only once B donated x
    if threading.current_thread().name == "A":
        planned.set()
        time.sleep(0.3)
    return execute_plan(*args, **kwargs)

_api.execute_plan = late
got = {}

def a():
    try:
        reshard.reshard(x, relaid, executor=sys.argv[1])
        got["a"] = "returned"
    except ValueError as e:
        got["a"] = str(e)

def b():
    planned.wait()
    reshard.reshard(x, elsewhere, donate=True, executor=sys.argv[1])

threads = [threading.Thread(target=a, name="A"), threading.Thread(target=b, name="B")]
[t.start() for t in threads]
[t.join() for t in threads]
print(x.is_deleted(), got["a"])
"""


@pytest.mark.parametrize("executor", ["host", "device"])
def test_an_input_donated_between_planning_and_moving_raises_cleanly(executor: str) -> None:
    # Checked while planning, then donated by another thread before the move read it:
    # the move read a deleted array (a segmentation fault on the host executor).
    out = _in_a_child(_DONATED_BETWEEN_PLANNING_AND_MOVING, executor, timeout=120)
    assert out.startswith("True leaf <root> was deleted while this call started"), out


_USING_CONSUMED_KEY_ARRAYS = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import numpy as np, jax, reshard
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

sharding = NamedSharding(Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y")), P("y"))
keys = jax.random.split(jax.random.key(3), 8)
jax.device_put(keys, sharding)[0]  # (the crash needed this indexing run once, live)


def use(a):
    try:
        a[0]
        return "used"
    except RuntimeError as e:
        return "deleted" if "deleted" in str(e) else repr(e)


x = jax.device_put(keys, sharding)
parts = reshard.split_by_mesh_axis(x, "x", donate=True)
part = jax.device_put(parts[1], parts[1].sharding, may_alias=False)
joined = reshard.concatenate_by_mesh_axis([parts[0], part], "x")
y = jax.device_put(keys, sharding)
reshard.reshard(y, NamedSharding(sharding.mesh, P("x")), donate=True)
print(use(x), use(part), use(y), use(joined))
"""


def test_key_arrays_consumed_by_the_seed_helpers_raise_when_used() -> None:
    # A key array donated through its data reads as deleted, but indexing it crashed
    # the process (jax 0.10; pure JAX does the same after donating one to jax.jit)
    # where a deleted array raises: split_by_mesh_axis(donate=True) and
    # concatenate_by_mesh_axis now delete what they consume in every case.
    out = _in_a_child(_USING_CONSUMED_KEY_ARRAYS, timeout=120)
    assert out.split() == ["deleted", "deleted", "deleted", "used"], out
