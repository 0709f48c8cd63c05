"""The host-packed schedule, run in numpy with pretend processes: no network needed.

A real plan over the 8 simulated devices is split among 2-4 pretend processes. For
each process a ``HostSchedule`` is built; every process packs its chunks
(``_fill``), the chunks are handed from sender to receiver as the ``ppermute``
pairs say, and every process unpacks what it got (``_take``) and makes its local
copies (``_copy_local``). Every destination block must equal the numpy ground truth.
Tiny chunk and stage sizes make pieces split across chunks and stages.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import jax
import numpy as np
import pytest
from helpers import meshes, random_values, shard_counts, specs
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import NamedSharding

import reshard
from reshard import _buffers
from reshard import _collective_host as host
from reshard import _local_executor as local
from reshard._collective_common import all_copies

NUMERIC = ["float32", "bfloat16", "int8", "uint16", "int32", "bool", "complex64"]


@st.composite
def trees(draw):
    """1-3 arrays with even shards on random meshes of the 8 devices."""
    leaves = []
    for _ in range(draw(st.integers(1, 3))):
        src_mesh, dst_mesh = draw(meshes()), draw(meshes())
        ndim = draw(st.integers(0, 3))
        src = NamedSharding(src_mesh, draw(specs(src_mesh, ndim)))
        dst = NamedSharding(dst_mesh, draw(specs(dst_mesh, ndim)))
        shape = tuple(
            math.lcm(a, b) * draw(st.integers(1, 3))
            for a, b in zip(shard_counts(src, ndim), shard_counts(dst, ndim), strict=True)
        )
        leaves.append((src, dst, shape, draw(st.sampled_from(NUMERIC))))
    return leaves


def simulate(leaves, processes: int, alias: bool, seed: int, mode: str = "tables") -> None:
    """Runs the host schedule of a plan of ``leaves`` split among ``processes``:
    ``mode`` "ops" copies op by op (``_fill``, ``_take``, ``_copy_local``), "tables"
    as the executor does, each position's ops of a stage in one C call where the
    extension is built, "refused" with every C call refused (op by op again)."""
    rng = np.random.default_rng(seed)
    truths = [np.asarray(random_values(rng, shape, dt)) for _, _, shape, dt in leaves]
    xs = [
        jax.ShapeDtypeStruct(t.shape, t.dtype, sharding=src)
        for t, (src, _, _, _) in zip(truths, leaves, strict=True)
    ]
    p = reshard.plan(xs, [dst for _, dst, _, _ in leaves], executor="host")
    lps = p.leaf_plans
    ids = sorted({s.device for lp in lps for s in (*lp.spec.src, *lp.spec.dst)})
    position = {d: k for k, d in enumerate(ids)}
    process = [k * processes // len(ids) for k in range(len(ids))]
    blocks, _, copies = all_copies(lps, position, alias)
    itemsizes = [t.dtype.itemsize for t in truths]

    # Source blocks per position, and destination blocks (filled with garbage).
    views: dict[int, dict[int, np.ndarray]] = {}
    outs: dict[int, dict[int, np.ndarray]] = {}
    expect: dict[tuple[int, int], np.ndarray] = {}
    for li, lp in enumerate(lps):
        t = truths[li].reshape(blocks[li].src_block) if blocks[li].scalar else truths[li]
        for s in lp.spec.src:
            idx = tuple(slice(a, b) for a, b in s.box)
            views.setdefault(position[s.device], {})[li] = np.ascontiguousarray(t[idx])
        reused = {lp.spec.dst[di].device for di, _ in lp.reused} if alias else set()
        for d in lp.spec.dst:
            if d.device in reused:
                continue
            idx = tuple(slice(a, b) for a, b in d.box)
            pos = position[d.device]
            garbage = rng.integers(0, 256, math.prod(blocks[li].dst_block) * itemsizes[li])
            outs.setdefault(pos, {})[li] = garbage.astype(np.uint8).view(truths[li].dtype)
            outs[pos][li] = outs[pos][li].reshape(blocks[li].dst_block)
            expect[(pos, li)] = t[idx].reshape(blocks[li].dst_block)

    scheds = [host.HostSchedule(copies, blocks, itemsizes, process, me) for me in range(processes)]
    for sched in scheds:
        assert sched.pack_tables is sched.unpack_tables is sched.local_tables is None
        if mode != "ops":  # the executor builds them at a schedule's second run
            sched.ran()
            assert sched.pack_tables is None
            sched.ran()
            assert sched.pack_tables is not None and sched.local_tables is not None
    # Every process builds the same chunks and stages: they must agree for ppermute.
    for s in scheds[1:]:
        assert [(c.perm, c.nbytes) for c in s.chunks] == [
            (c.perm, c.nbytes) for c in scheds[0].chunks
        ]
        assert s.stages == scheds[0].stages
    chunks, stages = scheds[0].chunks, scheds[0].stages
    assert sorted(ci for st_ in stages for ci in st_) == list(range(len(chunks)))
    dtypes = [t.dtype for t in truths]
    sent_bytes = 0
    for s, stage in enumerate(stages):
        sent: dict[int, list[np.ndarray]] = {}  # sending position -> its chunk buffers
        for me, sched in enumerate(scheds):
            for pos, ops in sched.pack[s].items():
                assert process[pos] == me
                bufs = [np.zeros(chunks[ci].nbytes, np.uint8) for ci in stage]
                found = None if mode == "ops" else sched.pack_tables[s][pos]
                assert mode == "ops" or (found is not None) is _buffers.NATIVE_COPY  # (rank <= 3)
                if found is None:
                    host._fill(bufs, views[pos], ops)
                else:
                    host._fill_by_table(bufs, views[pos], ops, found)
                sent[pos] = bufs
        for k, ci in enumerate(stage):
            ch = chunks[ci]
            for pos, items in ch.sends.items():
                if ch.whole:  # the source shard itself is sent, nothing packed
                    ((cp, _),) = items
                    sent.setdefault(pos, [np.zeros(0, np.uint8)] * len(stage))
                    rows = tuple(slice(a, a + n) for a, n in zip(cp[4], cp[3], strict=True))
                    sent[pos][k] = views[pos][cp[0]][rows].reshape(-1).view(np.uint8)
                    sent_bytes += ch.nbytes
                else:
                    sent_bytes += sum(math.prod(c[3]) * itemsizes[c[0]] for c, _ in items)
        # A ppermute delivers one buffer per receiver: what lands where.
        landed: dict[int, list[np.ndarray]] = {}
        for k, ci in enumerate(stage):
            receivers = [b for _, b in chunks[ci].perm]
            assert len(set(receivers)) == len(receivers)
            for a, b in chunks[ci].perm:
                landed.setdefault(b, [np.zeros(0, np.uint8)] * len(stage))[k] = sent[a][k]
        for me, sched in enumerate(scheds):
            for pos, (_, ops) in sched.unpack[s].items():
                assert process[pos] == me
                assert all(process[op[1]] == me for op in ops)  # reads what reached it
                outs.setdefault(pos, {})
            if mode == "ops":
                for pos, (_, ops) in sched.unpack[s].items():
                    host._take(landed, outs[pos], ops, dtypes)
                continue
            found = sched.unpack_tables[s]
            for pos in sched.unpack[s]:  # (rank <= 3)
                assert (found[1][pos] is not None) is _buffers.NATIVE_COPY
            # The executor's own tasks, split by bands as it runs them (parts of
            # several threads' worth run here one after another).
            for _, task in host._unpack_tasks(sched.unpack[s], found, landed, outs, dtypes):
                task()
    for me, sched in enumerate(scheds):
        for li, per_pos in enumerate(sched.local_copies):
            assert all(process[pos] == me for pos in per_pos)
            if mode == "ops":
                for pos, cps in per_pos.items():
                    host._copy_local(outs[pos][li], views, cps)
        if mode != "ops":
            for _, task in host._local_tasks(sched, outs, views):
                task()

    for (pos, li), want in expect.items():
        np.testing.assert_array_equal(outs[pos][li].view(np.uint8), want.view(np.uint8))
    # What crosses processes: at most every crossing piece once, and at least every
    # byte some other process needs, once per such process.
    cross = sum(math.prod(c[3]) * itemsizes[c[0]] for c in copies if process[c[1]] != process[c[2]])
    needed: dict[tuple[int, int, int], np.ndarray] = {}
    for li, s_, d, shape, s0, _ in copies:
        if process[s_] != process[d]:
            mask = needed.setdefault((li, s_, process[d]), np.zeros(blocks[li].src_block, bool))
            mask[tuple(slice(a, a + n) for a, n in zip(s0, shape, strict=True))] = True
    union = sum(int(m.sum()) * itemsizes[li] for (li, _, _), m in needed.items())
    assert union <= sent_bytes <= cross


@contextlib.contextmanager
def tiny_buffers() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "CHUNK_BYTES", 192)
        mp.setattr(host, "STAGE_BYTES", 512)
        # Copies in bands of ~100 bytes, split into up to 3 parts from 64 bytes on.
        mp.setattr(_buffers, "BAND_BYTES", 100)
        mp.setattr(local, "COPY_THREADS", 3)
        mp.setattr(local, "THREADED_COPY_BYTES", 32)
        yield


@settings(max_examples=60)
@given(
    trees(),
    st.integers(2, 4),
    st.booleans(),
    st.integers(0, 2**16),
    st.sampled_from([(1, 0), (1, 64), (0, 100), (0, 2**30), (64, 2**30)]),
    st.booleans(),
    st.sampled_from(["tables", "ops", "refused"]),
)
def test_host_schedule_moves_every_byte_once(
    leaves, processes, alias, seed, whole, bundled, mode
) -> None:
    """``whole``: the sizes of whole shards sent as they are ((1, 0): none);
    ``bundled``: whether smaller shards needed whole are packed whole."""
    with tiny_buffers(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "WHOLE_BYTES", whole)
        mp.setattr(host, "BUNDLED", bundled)
        if mode == "refused" and _buffers._fastcopy is not None:
            refuse_c_copies(mp)
        simulate(leaves, processes, alias, seed, mode)


def refuse_c_copies(mp: pytest.MonkeyPatch) -> list[int]:
    """Makes every ``copy_pieces`` call refuse its buffers, as the C code refuses
    one that is not C-contiguous (before writing anything); counts the calls."""
    import types

    real = _buffers._fastcopy
    calls = [0]

    def copy_pieces(*args):
        calls[0] += 1
        raise BufferError("not C-contiguous")

    names = {k: getattr(real, k) for k in dir(real) if not k.startswith("_")}
    names["copy_pieces"] = copy_pieces
    mp.setattr(_buffers, "_fastcopy", types.SimpleNamespace(**names))
    return calls


def test_tables_fall_back_op_by_op_when_refused() -> None:
    """Every stage's packing and unpacking and every local copy falls back to its
    ops, exactly, when the C call refuses."""
    if _buffers._fastcopy is None or not _buffers.NATIVE_COPY:
        pytest.skip("reshard._fastcopy is not built or is switched off")
    with tiny_buffers(), pytest.MonkeyPatch.context() as mp:
        calls = refuse_c_copies(mp)
        simulate(fsdp_to_tp(), 2, False, 0, "refused")
    assert calls[0] > 0


def test_llm_like_tree_splits_into_chunks_and_stages() -> None:
    """Row-sharded on 4 devices to column-sharded on the other 4: every piece is a
    strided column block, cut into chunks and stages."""
    with tiny_buffers():
        simulate(fsdp_to_tp(), 2, True, 0)


@pytest.mark.parametrize("alias", [False, True])
def test_arrays_of_one_geometry_get_their_own_copies_and_pieces(alias: bool) -> None:
    """A model's layers repeat shapes: their copies and the schedule's geometry are
    worked out once per shape, and each array still gets copies of its own index."""
    from reshard._collective_common import _leaf_copies

    leaves = fsdp_to_tp() * 3 + [fsdp_to_tp()[0][:2] + ((64, 32), "int8")] * 2
    xs = [jax.ShapeDtypeStruct(shape, dt, sharding=s) for s, _, shape, dt in leaves]
    p = reshard.plan(xs, [d for _, d, _, _ in leaves], executor="host", cache=False)
    assert p.leaf_plans[0].moved is p.leaf_plans[2].moved  # (shared: the case tested)
    ids = sorted({s.device for lp in p.leaf_plans for s in (*lp.spec.src, *lp.spec.dst)})
    position = {d: k for k, d in enumerate(ids)}
    blocks, keep, copies = all_copies(p.leaf_plans, position, alias)
    one_by_one = [_leaf_copies(li, lp, position, alias) for li, lp in enumerate(p.leaf_plans)]
    assert blocks == [b for b, _, _ in one_by_one]
    assert keep == [k for _, _, k in one_by_one] and keep[0] is not keep[2]
    assert copies == [c for _, cs, _ in one_by_one for c in cs]
    with tiny_buffers():
        simulate(leaves, 2, alias, 0)


def fsdp_to_tp() -> list:
    devs = np.array(jax.devices())
    src = NamedSharding(jax.sharding.Mesh(devs[:4], ("f",)), jax.sharding.PartitionSpec("f"))
    dst = NamedSharding(jax.sharding.Mesh(devs[4:], ("t",)), jax.sharding.PartitionSpec(None, "t"))
    return [(src, dst, (64, 32), "bfloat16"), (src, dst, (32, 16), "float32")]


def blocks_and_copies(leaves) -> tuple:
    """Block shapes and copies of the plan of ``leaves`` (device ids are positions)."""
    xs = [jax.ShapeDtypeStruct(shape, dt, sharding=s) for s, _, shape, dt in leaves]
    p = reshard.plan(xs, [d for _, d, _, _ in leaves], executor="host")
    ids = sorted({s.device for lp in p.leaf_plans for s in (*lp.spec.src, *lp.spec.dst)})
    position = {d: k for k, d in enumerate(ids)}
    blocks, _, copies = all_copies(p.leaf_plans, position, True)
    return blocks, copies


def test_a_process_that_needs_whole_source_shards_gets_them_unpacked() -> None:
    """fsdp -> tp across processes: the other process needs every byte of each source
    shard, so each shard is sent once as it is (nothing packed) and the receiving
    process cuts the four column blocks out of it."""
    leaves = fsdp_to_tp()
    blocks, copies = blocks_and_copies(leaves)
    process = [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "WHOLE_BYTES", (0, 2**30))
        simulate(leaves, 2, True, 2)
        sender = host.HostSchedule(copies, blocks, [2, 4], process, 0)
        receiver = host.HostSchedule(copies, blocks, [2, 4], process, 1)
    assert all(ch.whole for ch in sender.chunks) and not any(sender.pack)
    # One shard per source device and array lands, spread over the receiving devices.
    lands = [b for ch in sender.chunks for _, b in ch.perm]
    assert len(lands) == 8 and sorted(set(lands)) == [4, 5, 6, 7]
    takes = [op for st_ in receiver.unpack for _, ops in st_.values() for op in ops]
    assert len(takes) == 2 * 4 * 4  # every (array, source, destination) piece once
    assert not receiver.arrive_whole  # every destination block is assembled
    # The receiving process sends nothing: filler in every stage (_filler_stage).
    assert all(sender.sends_in) and not any(receiver.sends_in)


def test_a_schedule_of_large_ops_builds_its_tables_at_its_first_run() -> None:
    """Its tables at the first run where its ops copy EAGER_TABLE_OP_BYTES or more on
    average (a call that builds the schedule then copies by them too), at the second
    where they are smaller: each process by its own ops (tables are its own copies; the
    collectives do not change)."""
    if not _buffers.NATIVE_COPY:
        pytest.skip("reshard._fastcopy is not built or is switched off")
    leaves = fsdp_to_tp()  # the sender packs 768 B per op, the receiver cuts 192 B
    blocks, copies = blocks_and_copies(leaves)
    process = [0, 0, 0, 0, 1, 1, 1, 1]
    for eager, expect in [(1 << 18, (2, 2)), (1 << 8, (1, 2)), (1 << 7, (1, 1))]:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(host, "EAGER_TABLE_OP_BYTES", eager)
            for me in (0, 1):
                sched = host.HostSchedule(copies, blocks, [2, 4], process, me)
                assert sched.tables_at == expect[me]
                for run in range(1, 3):
                    sched.ran()
                    assert (sched.pack_tables is not None) is (run >= expect[me])
    # Calls in two threads sharing a schedule may count past tables_at together: the
    # next run still builds them.
    sched = host.HostSchedule(copies, blocks, [2, 4], process, 1)
    sched.runs = sched.tables_at
    assert sched.pack_tables is None
    sched.ran()
    assert sched.pack_tables is not None and sched.unpack_tables is not None


@pytest.mark.parametrize("bundled", [True, False])
def test_small_shards_needed_whole_are_packed_whole(bundled) -> None:
    """fsdp -> tp, shards below WHOLE_BYTES[0]: each sender packs each source shard
    once, whole (one contiguous copy; not four column blocks, one per device), and the
    receiving process cuts the four pieces out of it. Without bundling, four pieces."""
    leaves = fsdp_to_tp()
    blocks, copies = blocks_and_copies(leaves)
    process = [0, 0, 0, 0, 1, 1, 1, 1]
    with tiny_buffers(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "BUNDLED", bundled)
        simulate(leaves, 2, True, 5)
        sender = host.HostSchedule(copies, blocks, [2, 4], process, 0)
        receiver = host.HostSchedule(copies, blocks, [2, 4], process, 1)
    packs = [op for st_ in sender.pack for ops in st_.values() for op in ops]
    takes = [op for st_ in receiver.unpack for _, ops in st_.values() for op in ops]
    assert not any(ch.whole for ch in sender.chunks)
    assert len(takes) >= 2 * 4 * 4  # every (array, source, destination) piece, or parts
    if bundled:
        # Whole source blocks, cut into rows only where a chunk is full.
        assert {(op[3], op[5][1:]) for op in packs} == {(0, (32,)), (1, (16,))}
        assert all(op[6] is not None for op in takes)  # every piece is cut out
        # One sender per landing device and round: source i lands on one device.
        assert len({pr for ch in sender.chunks for pr in ch.perm}) == 4
    else:
        assert len(packs) >= 2 * 4 * 4 and all(op[6] is None for op in takes)


def test_large_source_shards_are_sent_in_row_ranges() -> None:
    """Shards larger than the largest buffer sent whole go as zero-copy row ranges; the
    receiving process cuts each piece's rows out of every range it overlaps."""
    leaves = fsdp_to_tp()  # source blocks of 1024 and 512 bytes
    blocks, copies = blocks_and_copies(leaves)
    process = [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "WHOLE_BYTES", (0, 256))
        simulate(leaves, 2, True, 3)
        sender = host.HostSchedule(copies, blocks, [2, 4], process, 0)
        receiver = host.HostSchedule(copies, blocks, [2, 4], process, 1)
    assert all(ch.whole and ch.nbytes <= 256 for ch in sender.chunks) and not any(sender.pack)
    sent = [(ch.nbytes, len(ch.perm)) for ch in sender.chunks]
    assert sum(n * pairs for n, pairs in sent) == 4 * (1024 + 512)  # every byte once
    takes = [op for st_ in receiver.unpack for _, ops in st_.values() for op in ops]
    assert len(takes) == 4 * 4 * (4 + 2)  # per source, destination and row range


def test_stages_keep_every_chunk_in_order() -> None:
    sizes = [5, 5, 5, 7, 1, 9]
    chunks = [host.Chunk((), n, {}) for n in sizes]
    st_ = host.stages_of(chunks, limit=10)
    assert [ci for s in st_ for ci in s] == list(range(len(sizes)))
    assert all(sum(sizes[ci] for ci in s) <= 10 or len(s) == 1 for s in st_)


def test_stages_split_for_overlap_but_not_below_min_bytes() -> None:
    large = [host.Chunk((), 100, {}) for _ in range(8)]
    # 800 bytes into at least 4 stages of at most 1000: 200 bytes each.
    assert len(host.stages_of(large, limit=1000, min_stages=4)) == 4
    # Not below 400 bytes a stage to get there: 2 stages.
    assert len(host.stages_of(large, limit=1000, min_stages=4, min_bytes=400)) == 2
    # A small plan is one stage; the limit still caps stages.
    assert host.stages_of(large[:3], limit=1000, min_stages=4, min_bytes=400) == [[0, 1, 2]]
    assert len(host.stages_of(large, limit=300, min_stages=4, min_bytes=400)) == 3


def test_same_layout_on_other_devices_sends_every_shard_whole() -> None:
    """Weight sync between equal layouts: every shard is sent as it is and arrives as
    the destination shard; nothing is packed, unpacked or copied."""
    devs = np.array(jax.devices())
    spec = jax.sharding.PartitionSpec("f")
    src = NamedSharding(jax.sharding.Mesh(devs[:4], ("f",)), spec)
    dst = NamedSharding(jax.sharding.Mesh(devs[4:], ("f",)), spec)
    leaves = [(src, dst, (64, 32), "bfloat16"), (src, dst, (32,), "float32")]
    blocks, copies = blocks_and_copies(leaves)
    process = [0, 0, 0, 0, 1, 1, 1, 1]

    # Shards this small (1 KiB) are packed together by default: one ppermute, not two.
    sched = host.HostSchedule(copies, blocks, [2, 4], process, 1)
    assert len(sched.chunks) == 1 and not sched.chunks[0].whole and not sched.arrive_whole

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "WHOLE_BYTES", (0, 2**30))
        simulate(leaves, 2, True, 1)
        for me in (0, 1):
            sched = host.HostSchedule(copies, blocks, [2, 4], process, me)
            assert sched.chunks and all(ch.whole for ch in sched.chunks)
            assert not any(sched.pack) and not any(sched.local_copies)
            ops = [op for st_ in sched.unpack for _, pos_ops in st_.values() for op in pos_ops]
            assert all(op[6] is None and op[7] is None for op in ops)  # adopted as they are
            assert len(sched.arrive_whole) == (8 if me == 1 else 0)


def test_shards_that_arrive_whole_are_sent_whole_from_a_lower_size() -> None:
    """Between WHOLE_ARRIVING_BYTES and WHOLE_BYTES[0], a shard goes whole only where
    it is exactly a destination shard (no copy at either end); a relayout's shard of
    the same size is packed."""
    devs = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devs[:4], ("f",))
    same = NamedSharding(jax.sharding.Mesh(devs[4:], ("f",)), jax.sharding.PartitionSpec("f"))
    src = NamedSharding(mesh, jax.sharding.PartitionSpec("f"))
    tp = fsdp_to_tp()[0][1]
    # Source shards of 16 x 32 x 2 = 1 KiB each, both leaves.
    leaves = [(src, same, (64, 32), "bfloat16"), (src, tp, (64, 32), "bfloat16")]
    blocks, copies = blocks_and_copies(leaves)
    process = [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(host, "WHOLE_BYTES", (2048, 2**30))
        mp.setattr(host, "WHOLE_ARRIVING_BYTES", 1024)
        simulate(leaves, 2, True, 4)
        sched = host.HostSchedule(copies, blocks, [2, 2], process, 1)
        whole_leaves = {
            cp[0] for ch in sched.chunks if ch.whole for cps in ch.sends.values() for cp, _ in cps
        }
        packed_leaves = {
            cp[0]
            for ch in sched.chunks
            if not ch.whole
            for cps in ch.sends.values()
            for cp, _ in cps
        }
        assert whole_leaves == {0} and packed_leaves == {1}
        assert sched.arrive_whole == {(0, p) for p in range(4, 8)}
        # Above both thresholds, both leaves are packed.
        mp.setattr(host, "WHOLE_ARRIVING_BYTES", 2048)
        sched = host.HostSchedule(copies, blocks, [2, 2], process, 1)
        assert not any(ch.whole for ch in sched.chunks) and not sched.arrive_whole


def test_fingerprint_is_by_value_alone() -> None:
    """Equal values made of distinct objects (as two processes hold them) get one
    fingerprint; any change, deep in a tuple or of a type, another one."""
    from reshard._collective_executor import fingerprint

    def pair(x: int, y: int) -> tuple[int, int]:
        return tuple([x, y])  # (a new object each time: constants would be shared)

    def value(last: int, flag: bool | int = True) -> tuple:
        rows = [(0, 1, 4, pair(4096, 256), pair(0, 0), pair(0, last))]
        return ([0, 1, 2], rows, ["bfloat16", "float32"], (flag, False), None, "pinned_host")

    a = value(7)
    shared = pair(0, 0)  # one object referred to twice, where the other value has two
    b = (a[0], [(*a[1][0][:4], shared, pair(0, 7))], *a[2:])
    c = (a[0], [(*a[1][0][:4], shared, shared)], *a[2:])
    assert b[1][0][4] is not a[1][0][4] and c[1][0][4] is c[1][0][5]
    assert fingerprint(a) == fingerprint(b) == fingerprint(value(7))
    assert fingerprint(c) == fingerprint(value(0))
    assert len({fingerprint(value(7)), fingerprint(value(8)), fingerprint(value(7, 1))}) == 3
    # What marshal cannot write is written by repr, still by value.
    assert fingerprint([np.int64(3)]) == fingerprint([np.int64(3)]) != fingerprint([3])


def test_a_program_fingerprints_by_marshal_the_same_for_equal_plans(monkeypatch) -> None:
    """The fingerprint that processes compare is made from plain values (marshal, not
    its slower fallback): equal for two plans of one move built apart, different for
    another move."""
    import marshal

    from reshard import _collective_executor as ce

    seen: list = []
    real = ce.fingerprint

    def spy(what):
        seen.append(what)
        return real(what)

    monkeypatch.setattr(ce, "fingerprint", spy)
    monkeypatch.setattr(jax, "process_count", lambda: 2)  # (only to build a fingerprint)

    def program(dst_index: int) -> bytes:
        leaves = fsdp_to_tp()
        xs = [jax.ShapeDtypeStruct(shape, dt, sharding=s) for s, _, shape, dt in leaves]
        dsts = [(d, s)[dst_index] for s, d, _, _ in leaves]
        p = reshard.plan(xs, dsts, executor="collective", cache=False)
        dtypes = [np.dtype(dt) for _, _, _, dt in leaves]
        described = (  # as run_collective describes a call
            [(leaf.kind, str(leaf.dtype)) for leaf in p.planned_leaves],
            [x.sharding.memory_kind for x in xs],
            [d.memory_kind for d in dsts],
        )
        return ce.CollectiveProgram(
            p.leaf_plans,
            dtypes,
            alias=[False] * len(dtypes),
            pack_on_host=True,
            described=described,
        ).fingerprint

    first, again, other = program(0), program(0), program(1)
    assert len(seen) == 3
    for what in seen:
        marshal.dumps(what, 2)  # raises ValueError where the fallback would be taken
    assert first == again != other and len(first) == 16


def test_a_refused_call_is_posted_where_its_check_would_be(monkeypatch) -> None:
    """The checks' keys in the key-value store name the call; a call that fails before
    its check posts a refusal there (once, and never after its check), which a peer's
    check of that call raises on, naming the process and its error. A successful check,
    or a later call every process reached, deletes this process's earlier posts. (One process, the store faked; the real one
    is exercised across processes in test_multiprocess.)"""
    from reshard import _collective_common as common
    from reshard import _collective_executor as ce

    class Store:
        def __init__(self) -> None:
            self.kv: dict[str, str] = {}

        def key_value_set(self, key: str, value: str, allow_overwrite: bool = False) -> None:
            assert allow_overwrite or key not in self.kv
            self.kv[key] = value

        def blocking_key_value_get(self, key: str, timeout_ms: int) -> str:
            if key not in self.kv:
                raise RuntimeError("DEADLINE_EXCEEDED: no such key (a peer that never came)")
            return self.kv[key]

        def key_value_delete(self, key: str) -> None:
            self.kv.pop(key, None)

    store = Store()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(ce._compat, "distributed_client", lambda: store)
    monkeypatch.setattr(common, "_posts", [])
    monkeypatch.setattr(ce, "AGREE_WAIT_S", 0.5)  # (a wait: a test failure, not a hang)
    monkeypatch.setattr(common, "_calls_started", 5)

    # Posted where either check of the call would be: the plan's, and that of the host
    # values put on every process (``values_everywhere``).
    refusal = "!ValueError: bad input"
    ce.refuse_call(ValueError("bad input"))
    assert store.kv == {"reshard/agree/5/0": refusal, "reshard/values/5/0": refusal}
    ce.refuse_call(TypeError("raised again on the way out"))  # one post per call
    assert store.kv == {"reshard/agree/5/0": refusal, "reshard/values/5/0": refusal}

    common._calls_started = 6  # a check that succeeds: the older post goes
    store.kv["reshard/agree/6/1"] = b"\x01\x02".hex()
    assert ce._exchange(store, b"\x01\x02") == {0: b"\x01\x02", 1: b"\x01\x02"}
    assert store.kv == {"reshard/agree/6/0": "0102", "reshard/agree/6/1": "0102"}
    ce.refuse_call(ValueError("after its check"))  # its peers may be in collectives
    assert store.kv["reshard/agree/6/0"] == "0102"
    store.kv.pop("reshard/values/6/0")  # (posted there: no values check in this call)

    common._calls_started = 7  # the values' digests: posted at once, read when asked
    read = ce.values_everywhere(b"\x05\x06", [])
    assert store.kv["reshard/values/7/0"] == "0506"
    store.kv["reshard/values/7/1"] = "!ValueError: its own bad value"
    with pytest.raises(RuntimeError, match=r"process 1 refused this call"):
        read()
    ce.refuse_call(ValueError("its check posted"))  # not over its posted digests
    assert store.kv["reshard/values/7/0"] == "0506"
    assert store.kv.pop("reshard/agree/7/0").startswith("!ValueError: its check posted")
    del store.kv["reshard/values/7/0"], store.kv["reshard/values/7/1"]

    common._calls_started = 7  # the peer refused this call: raise at once, by name
    store.kv["reshard/agree/7/1"] = "!ValueError: its own bad input"
    with pytest.raises(RuntimeError, match=r"process 1 refused this call before moving any "
                       r"data \(ValueError: its own bad input\)"):  # fmt: skip
        ce._exchange(store, b"\x03")
    assert store.kv["reshard/agree/7/0"] == "03"

    common._calls_started = 8  # a peer that never posts: the wait's own error
    with pytest.raises(RuntimeError, match=r"waited 0.5 s for processes \[1\]"):
        ce._exchange(store, b"\x04")
    long = "x" * 5000
    common._calls_started = 9
    ce.refuse_call(ValueError(long))  # a long message is cut
    assert store.kv["reshard/agree/9/0"] == "!" + ("ValueError: " + long)[:2000] + " ..."
    assert store.kv["reshard/values/9/0"] == store.kv["reshard/agree/9/0"]

    # A later call that every process reached (a cached plan's: no check) deletes this
    # process's posts of earlier calls, failure reasons too, and nothing of the peers'.
    common._calls_started = 10
    common.post_failure(RuntimeError("device 3 lost"))
    common.forget_earlier_posts()
    assert sorted(store.kv) == [
        "reshard/agree/6/1",
        "reshard/agree/7/1",
        "reshard/failure/10/0",
    ], store.kv
    common._calls_started = 11
    common.forget_earlier_posts()
    assert sorted(store.kv) == ["reshard/agree/6/1", "reshard/agree/7/1"], store.kv


@pytest.mark.parametrize("kept_on_device", [False, True])
def test_kept_shards_off_cpu_are_no_part_of_the_host_schedule(monkeypatch, kept_on_device) -> None:
    """Host-packed off CPU (``KEPT_ON_DEVICE``), a shard a destination keeps as it is on
    its device is copied there, and a whole source shard that becomes the destination
    shard of another device of the process is copied device to device, both by PjRt at
    the end: the schedule neither copies them through host memory nor makes destination
    blocks for them. Shards cut into pieces still go by it. The values are numpy's."""
    from reshard import _collective_executor as ce

    devs = np.array(jax.devices())
    mesh = jax.sharding.Mesh(devs, ("a",))
    traded = jax.sharding.Mesh(devs[[0, 1, 2, 3, 7, 6, 5, 4]], ("a",))
    src = NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
    dst = NamedSharding(traded, jax.sharding.PartitionSpec("a"))
    x = jax.ShapeDtypeStruct((64, 8), np.float32, sharding=src)
    p = reshard.plan(x, dst, executor="collective", cache=False)
    program = ce.CollectiveProgram(
        p.leaf_plans, [np.float32], alias=[False], pack_on_host=True, kept_on_device=kept_on_device
    )
    # (One process: the traded rows of devices 4-7 are copies within it.)
    local_blocks = {pos for per_pos in program.host.local_copies for pos in per_pos}
    stays = {program.position[d.id] for d in devs[:4]}  # (devices 0-3 keep their rows)
    traded_pos = {program.position[d.id] for d in devs[4:]}
    assert program.copy_kept == (kept_on_device,)
    assert set(program.reused[0]) == (stays if kept_on_device else set())
    moved = {program.position[d.id]: program.position[d.id ^ 3] for d in devs[4:]}
    assert program.moved_whole[0] == (moved if kept_on_device else {})
    assert local_blocks == (set() if kept_on_device else traded_pos | stays)
    made = host._destinations(program, [dst])
    assert {pos for pos, m in made.items() if m} == (
        set() if kept_on_device else stays | traded_pos
    )
    # Column blocks of the rows: cut into pieces, through host memory either way.
    cut = NamedSharding(mesh, jax.sharding.PartitionSpec(None, "a"))
    q = reshard.plan(x, cut, executor="collective", cache=False)
    cutting = ce.CollectiveProgram(
        q.leaf_plans, [np.float32], alias=[False], pack_on_host=True, kept_on_device=kept_on_device
    )
    assert cutting.moved_whole == [{}]
    assert {pos for per_pos in cutting.host.local_copies for pos in per_pos} == set(range(8))
    # Run, with the setting forced.
    values = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
    monkeypatch.setattr(ce, "KEPT_ON_DEVICE", kept_on_device)
    monkeypatch.setattr(ce, "PACK_ON_HOST", True)
    for to in (dst, cut):
        arr = jax.device_put(values, src)
        out = reshard.reshard(arr, to, executor="collective", may_alias=False)
        assert out.sharding == to
        for shard in out.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), values[shard.index])
    # Whole shards to the other half of the devices, into another memory kind too.
    bits = values.view(np.uint32).astype(np.uint16).view(jax.numpy.bfloat16)
    for spec in (jax.sharding.PartitionSpec("a"), jax.sharding.PartitionSpec()):
        for kinds in (("device", "pinned_host"), ("pinned_host", "device")):
            a, b = (
                NamedSharding(jax.sharding.Mesh(half, ("a",)), spec, memory_kind=k)
                for half, k in zip((devs[:4], devs[4:]), kinds, strict=True)
            )
            arr = jax.device_put(bits, a)
            q = reshard.plan(arr, b, executor="collective", cache=False)
            out = q.execute(arr)
            got = [v for v in q._cache.values() if isinstance(v, ce.CollectiveProgram)]
            assert bool(got[0].moved_whole[0]) == kept_on_device
            assert out.sharding == b
            for shard in out.addressable_shards:
                assert shard.data.sharding.memory_kind == kinds[1]
                np.testing.assert_array_equal(
                    np.asarray(shard.data).view(np.uint16), bits[shard.index].view(np.uint16)
                )
