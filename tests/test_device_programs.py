"""The device executor's compiled programs: in chunks of a bounded number of pieces,
one program for the chunks of repeated layers, and found again by the plans rebuilt
for each call."""

from __future__ import annotations

import gc

import jax
import numpy as np
import pytest
from helpers import CompileCounter, check_result, place, random_values
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from test_reshard import cases

import reshard
from reshard import _collective_device, _collective_executor, _local_executor, _programs

DEVS = jax.devices()


def mesh(ids, names=("a",)):
    return Mesh(np.array([DEVS[i] for i in ids]).reshape(-1, *([2] * (len(names) - 1))), names)


@st.composite
def items(draw):
    """What ``_chunked`` takes: (what an item does, its pieces, its payload), some
    items doing the same as others."""
    kinds = draw(st.lists(st.integers(1, 9), min_size=1, max_size=6))  # pieces per kind
    order = draw(st.lists(st.integers(0, len(kinds) - 1), max_size=60))
    return [((f"kind{k}", kinds[k]), kinds[k], n) for n, k in enumerate(order)]


@given(its=items(), per=st.integers(1, 12))
def test_chunks_hold_every_item_once_in_bounded_programs(its, per):
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_local_executor, "PIECES_PER_PROGRAM", per)
        chunks = _local_executor._chunked(its)
    by_payload = {n: (what, pieces) for what, pieces, n in its}
    got = [n for _, payloads in chunks for n in payloads]
    assert sorted(got) == sorted(by_payload)
    # Items that do the same thing keep their order (the program's inputs follow it).
    for kind in {what for what, _, _ in its}:
        assert [n for n in got if by_payload[n][0] == kind] == [
            n for what, _, n in its if what == kind
        ]
    for key, payloads in chunks:
        assert key.desc == tuple(by_payload[n][0] for n in payloads)
        weight = sum(by_payload[n][1] for n in payloads)
        assert weight <= per or len(payloads) == 1
    # A kind with enough items for full programs runs them as one program: its full
    # chunks are one key (one object, so that looking it up is cheap).
    keys: dict[object, list[object]] = {}
    for key, _ in chunks:
        keys.setdefault(key.desc, []).append(key)
    for kind in {what for what, _, _ in its}:
        pieces = kind[1]
        count = sum(what == kind for what, _, _ in its)
        full = max(1, per // pieces)
        if count >= 2 * full:
            desc = (kind,) * full
            assert len(keys[desc]) >= count // full - 1
            assert all(k is keys[desc][0] for k in keys[desc])


def test_interleaved_layers_fill_programs_of_their_own(monkeypatch):
    # Two kinds of arrays taking turns (a model's layers: attention, MLP, ...): each
    # kind fills programs of its own, one compiled program per kind, however many
    # layers; what is left over is packed in order.
    monkeypatch.setattr(_local_executor, "PIECES_PER_PROGRAM", 4)
    a, b = ("a", 1), ("b", 2)
    its = [(a if n % 2 else b, a[1] if n % 2 else b[1], n) for n in range(19)]
    chunks = _local_executor._chunked(its)
    assert [(k.desc, p) for k, p in chunks] == [
        ((b, b), [0, 2]),
        ((b, b), [4, 6]),
        ((b, b), [8, 10]),
        ((b, b), [12, 14]),
        ((b, b), [16, 18]),
        ((a, a, a, a), [1, 3, 5, 7]),
        ((a, a, a, a), [9, 11, 13, 15]),
        ((a,), [17]),
    ]
    assert len({k for k, _ in chunks}) == 3, chunks


@settings(max_examples=20, deadline=None)
@given(
    picked=st.lists(st.tuples(cases(), st.integers(1, 3)), min_size=1, max_size=4),
    per=st.sampled_from([1, 2, 3, 5]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("executor", ["device", "collective-device"])
def test_random_trees_in_small_programs(executor, picked, per, seed):
    # Trees of random arrays, each repeated (the layers of a model), on the device
    # executor with programs of a few pieces each, and device-packed in groups of a
    # few pieces each: values, shardings and placement bit for bit, on a plan
    # rebuilt for the call and on a cached one.
    rng = np.random.default_rng(seed)
    truths, xs, dsts = [], [], []
    for (src, dst, shape, dtype), times in picked:
        for _ in range(times):
            truth = random_values(rng, shape, dtype)
            truths.append(truth)
            xs.append(place(truth, src))
            dsts.append(dst)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_local_executor, "PIECES_PER_PROGRAM", per)
        m.setattr(_collective_device, "COPIES_PER_PROGRAM", per)
        m.setattr(_collective_executor, "PACK_ON_HOST", False)
        for cache in (False, True):
            ys = reshard.reshard(
                xs, dsts, executor=executor.split("-")[0], cache_resharding_plans=cache
            )
            for y, truth, dst in zip(ys, truths, dsts, strict=True):
                check_result(y, truth, dst)


def _rows_to_columns():
    """Rows over devices 0-3, and columns over 4-7: each destination shard is cut
    from every source shard."""
    return NamedSharding(mesh([0, 1, 2, 3]), P("a")), NamedSharding(
        mesh([4, 5, 6, 7]), P(None, "a")
    )


def _layers(n, rows=8):
    """``n`` arrays of one geometry (the repeated layers of a model), rows over 4
    devices, and their destination: columns over 4 others (4 pieces per shard)."""
    src, dst = _rows_to_columns()
    truths = [np.arange(rows * 16, dtype=np.float32).reshape(rows, 16) + k for k in range(n)]
    return [place(t, src) for t in truths], dst, truths


def _compiles(fn):
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        fn()
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    return counter.count


def _fresh():
    """No compiled program left: none cached, none held by a plan still alive (plans
    share their programs while any holds them)."""
    reshard.clear_plan_cache()  # (and the shared programs)
    gc.collect()


def _compiles_and_largest_program(n):
    """Compilations of a first relayout of ``n`` layers, and the most pieces one of
    its programs takes."""
    _fresh()
    xs, dst, truths = _layers(n)
    p = reshard.plan(xs, dst, executor="device")
    ys = []
    count = _compiles(lambda: ys.extend(p.execute(xs)))
    for y, truth in zip(ys, truths, strict=True):
        check_result(y, truth, dst)
    program = next(v for k, v in p._cache.items() if k.startswith("device_program"))
    return count, max(
        sum(len(item[2]) if what == "build" else 1 for item in desc.desc)
        for what, chunks in (("cut", program.cuts), ("build", program.outputs))
        for by_dev in chunks.values()
        for desc, _ in by_dev
    )


def test_repeated_layers_compile_as_many_programs_however_many_there_are(monkeypatch):
    # Before programs were cut in chunks, each device's program covered the whole
    # tree: its size, compile time and memory grew with the layers (2000 small arrays:
    # 8.5 GiB and ~4 minutes on 8 CPU devices). Now 8 layers and 64 compile the same
    # programs, and each holds at most PIECES_PER_PROGRAM pieces.
    monkeypatch.setattr(_local_executor, "PIECES_PER_PROGRAM", 4)
    _compiles_and_largest_program(8)  # (what a first call compiles once per process)
    (few, few_size), (many, many_size) = map(_compiles_and_largest_program, (8, 64))
    assert few > 0
    assert many == few
    assert max(few_size, many_size) <= 4


def test_uncached_plans_find_all_their_programs_beyond_the_shared_cache(monkeypatch):
    # A plan rebuilt for each call (the default) whose programs outnumber the shared
    # cache's bound must not compile them again at every call, as a cache pushing its
    # own entries out in turn would; nor may the call's other entries (the copies of
    # an array's shards that stay where they are) push them out.
    monkeypatch.setattr(_local_executor, "PIECES_PER_PROGRAM", 1)
    monkeypatch.setattr(_programs, "PROGRAM_CACHE_SIZE", 4)
    _fresh()
    src, dst = _rows_to_columns()
    truths = [np.arange(8 * k * 16, dtype=np.float32).reshape(8 * k, 16) for k in (1, 2, 3)]
    dsts = [dst] * 3 + [NamedSharding(mesh([0, 1, 4, 5]), P("a"))]  # 2 shards stay
    truths.append(np.arange(64, dtype=np.float32))
    xs = [place(t, src) for t in truths]

    def run():
        ys = reshard.reshard(xs, dsts, executor="device")
        for y, truth, d in zip(ys, truths, dsts, strict=True):
            check_result(y, truth, d)

    assert _compiles(run) > 4  # more programs than the shared cache holds
    assert _compiles(run) == 0
    assert _compiles(run) == 0
    # The programs go with the plans' entry when the cache drops it: compiled again.
    _fresh()
    assert _compiles(run) > 4


def test_equal_programs_of_other_plans_are_shared(monkeypatch):
    # Another tree of the same layers (more of them, say) finds the programs of the
    # first while they are held: its full chunks are the same programs.
    monkeypatch.setattr(_local_executor, "PIECES_PER_PROGRAM", 4)
    _fresh()
    xs, dst, truths = _layers(8)
    more, _, more_truths = _layers(16)

    def run(xs, truths):
        for y, truth in zip(reshard.reshard(xs, dst, executor="device"), truths, strict=True):
            check_result(y, truth, dst)

    assert _compiles(lambda: run(xs, truths)) > 0
    assert _compiles(lambda: run(more, more_truths)) == 0


def test_uncached_plans_hold_at_most_the_bound_of_programs(monkeypatch):
    # Plans rebuilt for each call, several in turn: a plan's programs are one entry of
    # the shared cache, weighed as as many, so that what the cache keeps alive stays
    # within PROGRAM_CACHE_SIZE programs however many plans are in use, plus those of
    # the plan that compiled last (pinned, on top of the bound).
    import weakref

    monkeypatch.setattr(_local_executor, "PIECES_PER_PROGRAM", 2)
    monkeypatch.setattr(_programs, "PROGRAM_CACHE_SIZE", 16)
    _fresh()
    src, dst = _rows_to_columns()
    held = weakref.WeakSet()  # every program the cache held at some point

    def pinned():
        return len(_programs._programs.get(_programs._programs.pinned, ()))

    def run_plans():
        for plans in range(1, 7):
            for k in range(1, plans + 1):  # every plan so far, each a shape of its own
                truth = np.arange(8 * k * 16, dtype=np.float32).reshape(8 * k, 16)
                y = reshard.reshard(place(truth, src), dst, executor="device")
                check_result(y, truth, dst)
                for entry in list(_programs._programs.values()):
                    if isinstance(entry, _programs.Programs):
                        held.update(entry.values())
                assert 0 < pinned() <= 16  # (each plan alone fits)
                assert _programs.size() <= 16 + pinned()

    assert _compiles(run_plans) > 32  # more programs than the bound were made
    gc.collect()
    assert 0 < len(held) <= 16 + pinned(), len(held)


def test_a_pinned_plan_leaves_the_bound_to_the_others(monkeypatch):
    # The plan whose programs compiled last stays however many it holds, on top of
    # the bound: the other entries (a call's copy programs, schedules) still have the
    # bound to themselves, and are not built again at each call.
    from reshard import _programs as programs

    monkeypatch.setattr(programs, "PROGRAM_CACHE_SIZE", 3)
    programs.clear()
    big = programs.shared("plan", programs.Programs)
    big.update((k, object()) for k in range(5))
    programs.grown("plan", big)
    built = []
    for _ in range(3):
        for key in ("a", "b", "c"):
            programs.shared(key, lambda key=key: built.append(key) or key)
    assert built == ["a", "b", "c"]
    assert programs.size() == 5 + 3
    programs.shared("d", lambda: "d")  # the oldest of the others goes, not the plan
    assert list(programs._programs) == ["plan", "b", "c", "d"]
    programs.clear()


def test_device_packed_groups_bound_their_pieces_and_run_back_to_back(monkeypatch):
    # Device-packed, arrays also run in groups of at most COPIES_PER_PROGRAM pieces
    # (one program each, so that none grows with the tree), and groups of the same
    # arrays (repeated layers) compile once. Unlike the groups that bound
    # placeholders, nothing waits for one to finish before the next starts.
    groups = _programs.consecutive_groups
    assert groups([0, 0, 0, 0], 6, [2, 3, 1, 4], 5) == [[0, 1], [2, 3]]
    assert groups([3, 3, 0], 6, [9, 1, 1], 5) == [[0], [1, 2]]  # over either alone
    assert groups([3, 3, 1], 6, [1, 1, 1], 5) == [[0, 1], [2]]
    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", False)
    monkeypatch.setattr(_collective_device, "COPIES_PER_PROGRAM", 32)  # 2 arrays
    waits = []
    real_wait = jax.block_until_ready

    def counted(x):
        waits.append(1)
        return real_wait(x)

    monkeypatch.setattr(_collective_device.jax, "block_until_ready", counted)
    counts = []
    for n in (4, 16):
        _programs.clear()
        xs, dst, truths = _layers(n)  # 16 pieces per array
        p = reshard.plan(xs, dst, executor="collective")

        ys = []
        waits.clear()
        counts.append(_compiles(lambda p=p, xs=xs, ys=ys: ys.extend(p.execute(xs))))
        assert not waits
        for y, truth in zip(ys, truths, strict=True):
            check_result(y, truth, dst)
        (program,) = [
            v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
        ]
        assert program.groups == [[k, k + 1] for k in range(0, n, 2)]
    assert counts[0] > 0
    assert counts[1] == counts[0], counts
    # Groups that bound placeholders still wait for the programs before them: here
    # every array's placeholders are over the bound alone.
    monkeypatch.setattr(_collective_device, "GROUP_BYTES", 1)
    xs, dst, truths = _layers(3)
    waits.clear()
    p = reshard.plan(xs, dst, executor="collective")
    ys = p.execute(xs)
    (program,) = [
        v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
    ]
    assert program.groups == [[0], [1], [2]]
    assert len(waits) == 2
    for y, truth in zip(ys, truths, strict=True):
        check_result(y, truth, dst)


def test_a_program_failing_after_others_ran_loses_nothing(monkeypatch):
    # Programs of one piece each: the fifth fails after four have run. Donated
    # inputs survive intact, and the same call then succeeds.
    monkeypatch.setattr(_local_executor, "PIECES_PER_PROGRAM", 1)
    xs, dst, truths = _layers(3)
    real = _local_executor.DeviceProgram.compiled
    calls = []

    def failing(self, what, desc, device_id):
        fn = real(self, what, desc, device_id)

        def run(*args):
            calls.append(what.__name__)
            if len(calls) == 5:
                raise RuntimeError("injected failure")
            return fn(*args)

        return run

    monkeypatch.setattr(_local_executor.DeviceProgram, "compiled", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        reshard.reshard(xs, dst, donate=True, executor="device")
    assert len(calls) == 5
    src = xs[0].sharding
    for x, truth in zip(xs, truths, strict=True):
        assert not x.is_deleted()
        check_result(x, truth, src)
    monkeypatch.setattr(_local_executor.DeviceProgram, "compiled", real)
    for y, truth in zip(
        reshard.reshard(xs, dst, donate=True, executor="device"), truths, strict=True
    ):
        check_result(y, truth, dst)
    assert all(x.is_deleted() for x in xs)


def test_weak_and_strong_arrays_of_one_geometry_share_each_program(monkeypatch):
    # jax.jit compiles anew for an argument that differs only by its weak type (an
    # array made from a Python scalar, a step count say), and the cache counted the
    # two executables as one program. Now each program is compiled once, for strong
    # types: a weak array's relayout, and its copies of the shards that stay on their
    # device, compile nothing more. The outputs keep the input's weak type, as
    # jax.device_put's do, and every bit.
    _fresh()
    src, dst = _rows_to_columns()
    stays = NamedSharding(mesh([0, 1, 3, 2]), P("a"))  # two shards stay where they are
    copied = []
    real = _local_executor.copies_in_place
    monkeypatch.setattr(
        _local_executor, "copies_in_place", lambda xs: copied.append(len(xs)) or real(xs)
    )
    truth = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) - 100.5
    strong = place(truth, src)
    weak = jax.jit(lambda: jax.numpy.full(truth.shape, 1.0), out_shardings=src)()
    assert weak.aval.weak_type and not strong.aval.weak_type
    for target in (dst, stays):
        compiled = _compiles(
            lambda t=target: check_result(reshard.reshard(strong, t, executor="device"), truth, t)
        )
        assert compiled > 0
        before, out = _programs.size(), []
        assert (
            _compiles(lambda t=target, o=out: o.append(reshard.reshard(weak, t, executor="device")))
            == 0
        )
        check_result(out[0], np.ones_like(truth), target)
        assert out[0].aval.weak_type and jax.device_put(weak, target).aval.weak_type
        assert _programs.size() == before
    assert copied == [2, 2]  # (the second target's staying shards, each call)
