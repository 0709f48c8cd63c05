"""Pure geometry and planner: exact against numpy masks, synthetic devices."""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import meshes, specs
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding

from reshard import DataLossError
from reshard._api import shard_specs
from reshard._geometry import (
    box_from_index,
    intersect,
    merge_boxes,
    named_shard_boxes,
    subtract,
    subtract_many,
    volume,
)
from reshard._planner import LeafSpec, ShardSpec, lower_bound_bytes, plan_leaves

sys.path.insert(0, str(Path(__file__).parent.parent / "benchmarks"))
from bench_planner import llm_leaves, synthetic_leaf  # noqa: E402


def mask(shape, box):
    m = np.zeros(shape, bool)
    m[tuple(slice(a, b) for a, b in box)] = True
    return m


@st.composite
def boxes_in(draw, shape):
    out = []
    for n in shape:
        a = draw(st.integers(0, n))
        b = draw(st.integers(a, n))
        out.append((a, b))
    return tuple(out)


@given(data=st.data(), shape=st.lists(st.integers(1, 6), min_size=0, max_size=3).map(tuple))
def test_intersect_and_subtract_match_masks(data, shape):
    a, b = data.draw(boxes_in(shape)), data.draw(boxes_in(shape))
    ma, mb = mask(shape, a), mask(shape, b)
    inter = intersect(a, b)
    if inter is None:
        assert not (ma & mb).any()
    else:
        np.testing.assert_array_equal(mask(shape, inter), ma & mb)
    parts = subtract(a, b)
    assert len(parts) <= 2 * len(shape) or volume(a) == 0
    covered = np.zeros(shape, int)
    for p in parts:
        covered += mask(shape, p)
    np.testing.assert_array_equal(covered, (ma & ~mb).astype(int))  # disjoint and exact


@given(data=st.data(), shape=st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple))
def test_subtract_many_and_merge(data, shape):
    box = data.draw(boxes_in(shape))
    holes = data.draw(st.lists(boxes_in(shape), max_size=3))
    parts = subtract_many(box, holes)
    want = mask(shape, box)
    for h in holes:
        want &= ~mask(shape, h)
    got = np.zeros(shape, int)
    for p in merge_boxes(parts):
        got += mask(shape, p)
    np.testing.assert_array_equal(got, want.astype(int))
    assert len(merge_boxes(parts)) <= len(parts)


def test_box_from_index():
    assert box_from_index((slice(None), slice(2, 4)), (3, 8)) == ((0, 3), (2, 4))
    assert box_from_index((), ()) == ()
    with pytest.raises(ValueError, match="strided shard index"):
        box_from_index((slice(0, 4, 2),), (4,))


@settings(max_examples=50)
@given(data=st.data())
def test_named_shard_boxes_match_jax(data):
    mesh = data.draw(meshes())
    ndim = data.draw(st.integers(0, 3))
    spec = data.draw(specs(mesh, ndim))
    s = NamedSharding(mesh, spec)
    counts = [1] * ndim
    for d, e in enumerate(spec):
        axes = () if e is None else (e,) if isinstance(e, str) else e
        for a in axes:
            counts[d] *= mesh.shape[a]
    shape = tuple(c * data.draw(st.integers(1, 3)) for c in counts)
    boxes = named_shard_boxes(shape, mesh.devices.shape, mesh.axis_names, tuple(spec))
    jax_map = s.devices_indices_map(shape)
    for pos in itertools.product(*(range(n) for n in mesh.devices.shape)):
        dev = mesh.devices[pos]
        assert boxes[pos] == box_from_index(jax_map[dev], shape)


def spec_of(shape, src, dst, itemsize=4):
    def shards(side):
        return tuple(ShardSpec(dev, mk, proc, box) for dev, mk, proc, box in side)

    return LeafSpec("x", shape, itemsize, shards(src), shards(dst))


def check_plan_covers_exactly(lp):
    """Every destination shard is written exactly once, from source shards holding it."""
    spec = lp.spec
    written = {di: np.zeros(spec.shape, int) for di in range(len(spec.dst))}
    for p in lp.kept + lp.moved:
        assert intersect(p.box, spec.src[p.src].box) == p.box  # source holds the piece
        assert intersect(p.box, spec.dst[p.dst].box) == p.box
        written[p.dst] += mask(spec.shape, p.box)
    for di, si in lp.reused:
        assert spec.src[si].box == spec.dst[di].box
        written[di] += mask(spec.shape, spec.dst[di].box)
    for di, d in enumerate(spec.dst):
        np.testing.assert_array_equal(written[di], mask(spec.shape, d.box).astype(int))
    for p in lp.moved:
        assert spec.src[p.src].location != spec.dst[p.dst].location
    for p in lp.kept:
        assert spec.src[p.src].location == spec.dst[p.dst].location


@settings(max_examples=60)
@given(data=st.data())
def test_random_synthetic_plans_are_exact_and_minimal(data):
    ndim = data.draw(st.integers(1, 3))
    shape = tuple(data.draw(st.sampled_from([4, 8, 12])) for _ in range(ndim))

    def side(offset):
        n_axes = data.draw(st.integers(1, 2))
        mesh_shape = tuple(data.draw(st.sampled_from([1, 2, 4])) for _ in range(n_axes))
        names = ("p", "q")[:n_axes]
        spec = []
        free = list(names)
        for _ in range(ndim):
            if free and data.draw(st.booleans()):
                spec.append(free.pop(0))
            else:
                spec.append(None)
        boxes = named_shard_boxes(shape, mesh_shape, names, spec)
        n = len(boxes)
        ids = data.draw(st.permutations(range(offset, offset + 16)))[:n]
        mks = [data.draw(st.sampled_from(["device", "pinned_host"])) for _ in range(n)]
        return tuple((ids[i], mks[i], ids[i] // 4, b) for i, b in enumerate(boxes.values()))

    src = side(0)
    dst = side(data.draw(st.sampled_from([0, 4, 16])))
    try:
        spec = spec_of(shape, src, dst)
    except ValueError:
        return
    (lp,), stats = plan_leaves([spec])
    check_plan_covers_exactly(lp)
    assert stats.bytes_moved == stats.bytes_lower_bound == lower_bound_bytes(spec)
    assert stats.bytes_moved + stats.bytes_kept == stats.bytes_total
    assert sum(stats.send_bytes.values()) == sum(stats.recv_bytes.values()) == stats.bytes_moved


def test_same_process_sources_preferred():
    # Box replicated on devices 0 (process 0) and 8 (process 1); destination on
    # device 9 (process 1) must read from device 8.
    box = ((0, 8),)
    spec = spec_of((8,), [(0, "device", 0, box), (8, "device", 1, box)], [(9, "device", 1, box)])
    (lp,), _ = plan_leaves([spec])
    assert [lp.spec.src[p.src].device for p in lp.moved] == [8]


def test_balance_across_leaves_and_merging():
    # 4 replicas, 8 destination shards in two leaves: each replica sends 2 pieces.
    rep = [(i, "device", 0, ((0, 16),)) for i in range(4)]
    dst = [(10 + i, "device", 0, ((2 * i, 2 * i + 2),)) for i in range(8)]
    plans, stats = plan_leaves([spec_of((16,), rep, dst), spec_of((16,), rep, dst)])
    assert stats.max_send_bytes == stats.mean_send_bytes
    for lp in plans:
        check_plan_covers_exactly(lp)
    # A destination shard made of two adjacent source boxes from one device merges.
    src = [(0, "device", 0, ((0, 4),)), (1, "device", 0, ((4, 8),))]
    (lp,), _ = plan_leaves([spec_of((8,), src, [(5, "device", 0, ((0, 8),))])])
    assert len(lp.moved) == 2  # two sources: cannot merge
    # Around a locally kept corner, two slabs come from device 2: they merge into one.
    src = [
        (0, "device", 0, ((0, 4), (0, 4))),
        (1, "device", 0, ((4, 8), (0, 4))),
        (2, "device", 0, ((0, 8), (4, 8))),
    ]
    (lp,), _ = plan_leaves([spec_of((8, 8), src, [(0, "device", 0, ((0, 8), (0, 8)))])])
    check_plan_covers_exactly(lp)
    assert sorted((lp.spec.src[p.src].device, p.box) for p in lp.moved) == [
        (1, ((4, 8), (0, 4))),
        (2, ((0, 8), (4, 8))),
    ]


def test_balance_across_leaves_of_the_same_geometry():
    # Identical leaves (layers of a model) whose box has two replicas: each copy takes
    # part in the balancing, so both replicas send; sharing the first copy's pieces
    # sent everything from device 0.
    box = ((0, 8),)
    src = [(0, "device", 0, box), (1, "device", 0, box)]
    dst = [(2, "device", 0, box)]
    plans, stats = plan_leaves([spec_of((8,), src, dst) for _ in range(4)])
    assert stats.send_bytes == {0: 64, 1: 64}
    assert stats.bytes_moved == stats.bytes_lower_bound == 128
    assert stats.transfers == 4
    for lp in plans:
        check_plan_covers_exactly(lp)
    # Without a choice the copies still share the representative's pieces.
    plans, _ = plan_leaves([spec_of((8,), src[:1], dst) for _ in range(3)])
    assert plans[1].moved is plans[0].moved and plans[2].moved is plans[0].moved


def test_avoid_devices_and_data_loss():
    a, b = ((0, 4),), ((4, 8),)
    src = [(0, "device", 0, a), (1, "device", 0, b), (2, "device", 0, a), (3, "device", 0, b)]
    dst = [(4, "device", 0, ((0, 8),))]
    (lp,), _ = plan_leaves([spec_of((8,), src, dst)], avoid_devices={0, 1})
    assert sorted(lp.spec.src[p.src].device for p in lp.moved) == [2, 3]
    with pytest.raises(DataLossError) as e:
        plan_leaves([spec_of((8,), src, dst)], avoid_devices={1, 3})
    assert e.value.missing == [("x", b)]


def test_uneven_tiling_rejected():
    src = [(0, "device", 0, ((0, 6),)), (1, "device", 0, ((4, 8),))]
    with pytest.raises(ValueError, match="do not tile the array"):
        plan_leaves([spec_of((8,), src, [(2, "device", 0, ((0, 8),))])])


def test_shard_specs_of_real_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("x", "y"))
    s = NamedSharding(mesh, jax.sharding.PartitionSpec("y"), memory_kind="pinned_host")
    got = shard_specs(s, (4, 2))
    assert [g.device for g in got] == [d.id for d in mesh.devices.flat]
    assert {g.memory_kind for g in got} == {"pinned_host"}
    assert [g.box for g in got] == [((0, 2), (0, 2)), ((2, 4), (0, 2))] * 2


def test_thousands_of_synthetic_devices():
    """The planner benchmark's workload, scaled to stay quick: 4096 -> 3072 devices."""
    t0 = time.perf_counter()
    leaves = llm_leaves(8, 4096, 3072)
    plans, stats = plan_leaves(leaves)
    elapsed = time.perf_counter() - t0
    assert stats.bytes_moved == stats.bytes_lower_bound == sum(lower_bound_bytes(s) for s in leaves)
    assert stats.max_send_bytes <= 1.05 * stats.mean_send_bytes
    assert len(plans) == 8
    print(f"planned 8 leaves 4096->3072 devices in {elapsed:.1f}s, {stats.transfers} transfers")


def test_shrinking_data_axis_on_synthetic_devices():
    """Elastic shrink (data 64 -> 48, fsdp kept): most shards stay in place."""
    src = ((64, 64), ("data", "fsdp"), ("fsdp",), list(range(4096)))
    dst = ((48, 64), ("data", "fsdp"), ("fsdp",), list(range(3072)))
    leaf = synthetic_leaf("w", (8192, 1024), 2, src, dst)
    (lp,), stats = plan_leaves([leaf])
    assert stats.bytes_moved == 0 and len(lp.reused) == 3072


def test_stats_of_distinct_leaves_with_nothing_to_move():
    # Regression: two leaves that move nothing must still count their own bytes.
    a = spec_of((8,), [(0, "device", 0, ((0, 8),))], [(0, "device", 0, ((0, 8),))])
    b = spec_of(
        (2, 3),
        [(1, "device", 0, ((0, 2), (0, 3)))],
        [(1, "device", 0, ((0, 2), (0, 3)))],
        itemsize=2,
    )
    _, stats = plan_leaves([a, b, a])
    assert stats.array_bytes == 8 * 4 + 6 * 2 + 8 * 4
    assert stats.bytes_kept == stats.bytes_total == stats.array_bytes
    assert stats.bytes_moved == 0 and stats.peak_extra_bytes == {}
