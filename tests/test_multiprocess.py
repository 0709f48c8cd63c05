"""Multi-controller resharding: several local JAX processes, checked on every process.

Each test launches real processes (``reshard._launch.launch_local``: gloo collectives on
127.0.0.1) that all run the same scenarios, as multi-controller JAX requires, and
check, on every process, the values of its addressable shards against a numpy ground
truth, the resulting sharding, the placement (exactly this process's destination
devices hold shards) and the memory kind. A scenario that fails reports its traceback
instead of stopping the others, so one launch covers many scenarios; the test then
asserts every scenario passed on every process.

Both packings of the collective executor run: host-packed (the CPU default) and
device-packed (the accelerator path, forced here on CPU).
"""

from __future__ import annotations

import ast
import collections
import functools
import math
import os
import re
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard._launch import launch_local

# The launched processes load this file by its path, with this directory not on their
# import path: add it, for the shared helpers (pytest has added it already here).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (  # noqa: E402
    as_bits,
    lossy_bf16_to_bits,
    random_values,
    surviving_mask,
)

HERE = f"{__file__}"
MISMATCHES: list[str] = []  # failed checks of the running scenario (in a child)

# --- runs inside every launched process ------------------------------------------


class _SlowFailureReader:
    """jax.distributed's client, but descheduled for 2 s before its first read of a
    failure reason where ``slow`` (then emptied)."""

    def __init__(self, client: Callable[[], Any], slow: list[bool]) -> None:
        self.client, self.slow = client, slow

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client(), name)

    def blocking_key_value_get(self, key: str, ms: int) -> Any:
        if self.slow and key.startswith("reshard/failure/"):
            self.slow.clear()
            time.sleep(2.0)
        return self.client().blocking_key_value_get(key, ms)


class _FailAfter:
    """Stands in for ``block_inputs``: the first ``calls`` calls pass through, then
    every call fails as if out of device memory."""

    def __init__(self, fn: Callable[..., Any], calls: int) -> None:
        self.fn, self.left = fn, calls

    def __call__(self, *args: Any) -> Any:
        if self.left <= 0:
            raise MemoryError("injected: out of device memory for the inputs")
        self.left -= 1
        return self.fn(*args)


def _fails_on(victim: int, call: Callable[[], Any], note: str = "", reported: str = "") -> None:
    """Runs ``call`` on every process where process ``victim`` fails in it (an injected
    ``MemoryError``): that process must raise its own error (with ``note`` among its
    notes), every other a ``RuntimeError`` naming it (followed by ``reported``) and its
    error, and no process may return. Records a mismatch instead of raising, as ``check`` does, so
    that every process goes on to the scenario's next collectives."""
    import jax

    me = jax.process_index()
    try:
        call()
        wrong = "nothing raised"
    except MemoryError as e:
        notes = getattr(e, "__notes__", [""])
        ok = me == victim and "injected" in str(e) and any(note in n for n in notes)
        wrong = "" if ok else f"{e!r}, notes {notes}"
    except RuntimeError as e:
        # Naming the victim, and why it failed (its error, which it posted).
        ok = me != victim and f"reshard failed on process(es) [{victim}]{reported}" in str(e)
        ok = ok and f"(process {victim}: MemoryError: injected" in str(e)
        wrong = "" if ok else repr(e)
    if wrong:
        MISMATCHES.append(f"process {me} (process {victim} failing): {wrong}")


def _ground_truth(shape: tuple[int, ...], dtype: Any, seed: int) -> np.ndarray:
    """The same array on every process (derived from the seed, not from a process id):
    random bits, so floats include NaNs with payloads, infinities and subnormals."""
    return random_values(np.random.default_rng(seed), shape, np.dtype(dtype).name)


def _random_layout(
    rng: np.random.Generator, count: int, ndim: int
) -> tuple[np.ndarray, tuple[str, ...], list[Any], list[int]]:
    """A random mesh over a random ordered subset of ``count`` devices (as positions,
    shaped) with 1-3 axes, a random spec for a rank-``ndim`` array on it, and per
    dimension the number of shards the spec cuts it into. Drawn from ``rng`` alone,
    so every process draws the same."""
    used = int(rng.integers(1, count + 1))
    chosen = rng.permutation(count)[:used]
    rank = int(rng.integers(1, 4))
    shape = [1] * rank
    left = used
    for a in range(rank - 1):  # a random factorization of ``used``
        divisors = [f for f in range(1, left + 1) if left % f == 0]
        shape[a] = int(rng.choice(divisors))
        left //= shape[a]
    shape[-1] = left
    names = tuple("xyz"[:rank])
    free = list(range(rank))
    entries: list[Any] = []
    cuts = []
    for _ in range(ndim):
        take = int(rng.integers(0, min(2, len(free)) + 1))
        axes = [free.pop(int(rng.integers(len(free)))) for _ in range(take)]
        entries.append(
            None if not axes else names[axes[0]] if take == 1 else tuple(names[a] for a in axes)
        )
        cuts.append(int(np.prod([shape[a] for a in axes], dtype=int)))
    return chosen.reshape(shape), names, entries, cuts


def _random_seed() -> int:
    """The seed of the random scenarios (``RESHARD_TEST_RANDOM_SEED``)."""
    return int(os.environ.get("RESHARD_TEST_RANDOM_SEED", "2026"))


def _scenarios() -> dict[str, Callable[[], None]]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import (
        _collective_common,
        _collective_device,
        _collective_executor,
        _collective_host,
        _compat,
        _execute,
    )

    devs = np.array(jax.devices())
    n = len(devs)
    me = jax.process_index()

    def ns(devices: Any, axes: tuple[str, ...], spec: P, mk: str | None = None) -> Any:
        return NamedSharding(Mesh(np.asarray(devices), axes), spec, memory_kind=mk)

    def make(host: np.ndarray, sharding: Any) -> Any:
        return jax.make_array_from_callback(
            host.shape, sharding, lambda idx: host[idx], dtype=host.dtype
        )

    def check(y: Any, host: np.ndarray, dst: Any) -> None:
        """Records mismatches instead of raising: a process that stopped half-way
        through a scenario would call different collectives than its peers (a hang)."""
        try:
            # For a PRNG-key array, `host` is its key data (one more trailing dimension).
            is_key = jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)
            want_shape = host.shape[:-1] if is_key else host.shape
            assert y.shape == want_shape, (y.shape, want_shape)
            assert y.sharding.is_equivalent_to(dst, y.ndim), (y.sharding, dst)
            want = {d for d in dst.device_set if d.process_index == me}
            got = {s.device for s in y.addressable_shards}
            assert got == want, f"placement: shards on {got}, expected {want}"
            for s in y.addressable_shards:
                data = jax.random.key_data(s.data) if is_key else s.data
                np.testing.assert_array_equal(as_bits(data), as_bits(host[s.index]))
                if dst.memory_kind is not None:
                    assert s.data.sharding.memory_kind == dst.memory_kind
        except AssertionError:
            MISMATCHES.append(traceback.format_exc())

    def expect(ok: bool, what: str) -> None:  # recorded, not raised: see check()
        if not ok:
            MISMATCHES.append(f"process {me}: {what}")

    def only_program(p: Any) -> Any:
        """The one collective program that plan ``p`` has built and cached."""
        programs = [
            v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
        ]
        assert len(programs) == 1, p._cache.keys()
        return programs[0]

    def move(host: np.ndarray, src: Any, dst: Any, executor: str = "collective", **kw: Any) -> None:
        x = make(host, src)
        assert reshard.plan(x, dst).executor == executor
        check(reshard.reshard(x, dst, **kw), host, dst)
        check(x, host, src)  # the input is untouched

    a = _ground_truth((48, 32), np.float32, 0)
    half = n // 2

    def disjoint() -> None:  # all of process 0's devices -> devices of the others
        move(a, ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t")))

    def overlapping() -> None:
        src = ns(devs[1 : half + 1], ("f",), P("f"))
        dst = ns(devs[half - 2 :].reshape(2, -1), ("d", "m"), P("m", "d"))
        move(a, src, dst)

    def shrink_8_to_6() -> None:  # 8 devices -> 6 of them, spanning every process
        keep = [d for i, d in enumerate(devs) if i not in (1, n - 2)]
        move(a, ns(devs, ("f",), P("f")), ns(keep, ("f",), P("f")))

    def grow() -> None:
        move(
            a, ns(devs[2:6], ("f",), P(None, "f")), ns(devs.reshape(2, -1), ("d", "m"), P("d", "m"))
        )

    def special_values_move_bit_for_bit() -> None:
        # NaNs with payloads and both signs, infinities, signed zeros, a subnormal
        # (bfloat16): every destination shard is put together from pieces of several
        # source shards, which a program moving floats may turn into canonical NaNs.
        special = [0x7FF0, 0x7F81, 0xFFC1, 0xFF80, 0x7F80, 0x8000, 0x0000, 0x0001]
        host = np.resize(np.array(special, np.uint16), 48 * 32).reshape(48, 32)
        host = host.view(jnp.bfloat16)
        move(host, ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t")))
        move(host, ns(devs[:half], ("f",), P(None, "f")), ns(devs, ("t",), P("t")))

    def replicated_sources() -> None:
        move(a, ns(devs[:half], ("f",), P()), ns(devs[half:], ("t",), P("t")))
        move(a, ns(devs.reshape(2, -1), ("r", "f"), P("f")), ns(devs[::-1], ("t",), P(None, "t")))

    def same_devices_relayout() -> None:
        move(a, ns(devs, ("f",), P("f")), ns(devs.reshape(2, -1), ("d", "m"), P("m", "d")))

    def unchanged_shards_kept_or_copied() -> None:
        sh = ns(devs, ("f",), P("f"))
        move(a, sh, sh)
        move(a, sh, sh, may_alias=False)
        # Whole shards traded between devices of each process, beside rows that cross
        # processes: off CPU (KEPT_ON_DEVICE) copied device to device, not by the host.
        traded = ns(np.concatenate([devs[1::-1], devs[2:][::-1]]), ("f",), P("f"))
        x = make(a, sh)
        p = reshard.plan(x, traded, cache=False)
        check(p.execute(x), a, traded)
        if _collective_executor.KEPT_ON_DEVICE and _collective_executor.PACK_ON_HOST:
            assert only_program(p).moved_whole[0], "no whole shard moved device to device"

    def no_union_device_on_some_processes() -> None:
        move(a, ns(devs[:1], ("f",), P()), ns(devs[-1:], ("t",), P()))

    def within_one_process() -> None:
        # Devices of one process only: that process moves everything, as
        # jax.device_put would, with no collective; the others make empty outputs. So
        # each process may also move its own arrays on its own devices (different
        # arguments on each), any number of times, and the processes stay in step.
        mine = np.array([d for d in devs if d.process_index == me])
        first = np.array([d for d in devs if d.process_index == 0])
        b = _ground_truth((16, 24), np.int32, 1)
        for donate in (False, True):
            src, dst = ns(first, ("f",), P("f")), ns(first[::-1], ("t",), P(None, "t"))
            x = make(a, src)
            p = reshard.plan(x, dst)
            assert p.executor == "host" and not p.crosses_processes, p.executor
            check(reshard.reshard(x, dst, donate=donate), a, dst)
            assert x.is_deleted() == donate
            src = ns(mine, ("f",), P("f"))
            for _ in range(me + 1):  # more calls on later processes
                x = make(b, src)
                for executor in ("auto", "host", "device", "collective", "device-packed"):
                    dst = ns(mine[::-1], ("t",), P(None, "t"))
                    packing = _collective_executor.PACK_ON_HOST
                    _collective_executor.PACK_ON_HOST = executor != "device-packed"
                    try:
                        executor = "collective" if executor == "device-packed" else executor
                        check(reshard.reshard(x, dst, executor=executor), b, dst)
                    finally:
                        _collective_executor.PACK_ON_HOST = packing
                if me == 0:  # a bad local call on one process: refused, not counted
                    try:
                        reshard.reshard(x, ns(mine, ("t",), P(None, None, "t")))
                        raise AssertionError("a spec longer than the rank was accepted")
                    except ValueError as e:
                        assert "has 3 entries but the array has rank 2" in str(e), e
                key = jax.random.key_data(jax.random.split(jax.random.key(me), 8))
                keys = jax.device_put(jax.random.wrap_key_data(key), src)
                kdst = {"k": ns(mine[::-1], ("t",), P("t")), "n": ns(mine, ("t",), P())}
                out = reshard.reshard({"k": keys, "n": 3}, kdst)
                check(out["k"], np.asarray(key), kdst["k"])
                assert int(out["n"]) == 3 and out["n"].sharding == kdst["n"]
        try:  # an executor of one process, on a plan that spans several, is refused
            reshard.plan(
                make(a, ns(devs, ("f",), P("f"))), ns(devs[::-1], ("t",), P("t")), executor="host"
            ).execute(make(a, ns(devs, ("f",), P("f"))))
            raise AssertionError("a one-process executor ran across processes")
        except ValueError as e:
            assert "runs in one process, but this plan's devices belong to processes" in str(e)
        move(a, ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t")))

    def a_local_call_in_another_thread_leaves_the_count_alone() -> None:
        # Process 0 plans a reshard within its own devices in a thread, held inside its
        # planning, while every process makes a collective reshard: a count raised for
        # the local call, even for a moment (counted, then taken back), showed process
        # 0 out of step and failed that collective reshard on every process.
        import threading

        from reshard import _api

        mine = np.array([d for d in devs if d.process_index == me])
        inside, release = threading.Event(), threading.Event()
        build = _api._build_plan

        def held(*args: Any) -> Any:
            if threading.current_thread() is not threading.main_thread():
                inside.set()
                release.wait(60)
            return build(*args)

        def local() -> None:
            x = make(a, ns(mine, ("f",), P("f")))
            dst = ns(mine[::-1], ("t",), P(None, "t"))
            check(reshard.reshard(x, dst), a, dst)

        thread = threading.Thread(target=local)
        _api._build_plan = held
        try:
            if me == 0:
                thread.start()
                assert inside.wait(60)
            move(a, ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t")))
        finally:
            release.set()
            if me == 0:
                thread.join(60)
            _api._build_plan = build

    def local_plans_leave_cached_collective_plans_alone() -> None:
        # The last process caches more plans within its own devices than the plan
        # cache holds (allowed: local calls may differ per process). They must not
        # evict a cached collective plan there alone: that process would check its
        # rebuilt plan (an all-gather) while the others ran the cached one, a hang.
        from reshard import _api

        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        mine = np.array([d for d in devs if d.process_index == me])
        saved = _api.PLAN_CACHE_SIZE
        _api.PLAN_CACHE_SIZE = 4
        reshard.clear_plan_cache()
        try:
            x = make(a, src)
            check(reshard.reshard(x, dst, cache_resharding_plans=True), a, dst)
            p = reshard.plan(x, dst)
            if me == jax.process_count() - 1:
                for k in range(2 * _api.PLAN_CACHE_SIZE):
                    local = ns(mine, ("l",), P("l"))
                    v = jax.ShapeDtypeStruct((len(mine) * (k + 1),), np.float32, sharding=local)
                    reshard.plan(v, ns(mine[::-1], ("l",), P("l")))
            if reshard.plan(x, dst) is not p:  # checked here, without collectives
                MISMATCHES.append(f"process {me}: a local plan evicted the collective one")
            check(p.execute(x), a, dst)  # (agreed on every process: no hang either way)
        finally:
            _api.PLAN_CACHE_SIZE = saved
            reshard.clear_plan_cache()

    def memory_kinds() -> None:
        move(
            a,
            ns(devs[:half], ("f",), P("f"), "pinned_host"),
            ns(devs[half:], ("t",), P(None, "t"), "device"),
        )
        move(
            a,
            ns(devs, ("f",), P("f"), "device"),
            ns(devs[::-1], ("t",), P(None, "t"), "pinned_host"),
        )
        # Offloaded and back on the devices the shards are on, across every process:
        # each process copies its own shards (no program), alone and in a tree with an
        # array that crosses processes (the program moves that one), donated too.
        on_device = ns(devs, ("f",), P("f"), "device")
        offloaded = ns(devs, ("f",), P("f"), "pinned_host")
        move(a, on_device, offloaded)
        move(a, offloaded, on_device)
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        for donate in (False, True):
            tree = {"opt": make(a, on_device), "w": make(a, src)}
            out = reshard.reshard(tree, {"opt": offloaded, "w": dst}, donate=donate)
            check(out["opt"], a, offloaded)
            check(out["w"], a, dst)
            assert all(v.is_deleted() for v in tree.values()) == donate
        # Those copies fail on process 0 (out of memory in the other kind, say): made
        # before the program's status is exchanged, so every process raises; the inputs
        # stay intact and the processes in step.
        copy_shards = _compat.copy_shards

        def failing_copy(*args: Any) -> Any:
            raise MemoryError("injected: out of memory changing memory kinds")

        tree = {"opt": make(a, on_device), "w": make(a, src)}
        if me == 0:
            _compat.copy_shards = failing_copy
        try:
            _fails_on(0, lambda: reshard.reshard(tree, {"opt": offloaded, "w": dst}, donate=True))
        finally:
            _compat.copy_shards = copy_shards
        check(tree["opt"], a, on_device)
        check(tree["w"], a, src)
        out = reshard.reshard(tree, {"opt": offloaded, "w": dst})
        check(out["opt"], a, offloaded)
        check(out["w"], a, dst)

    def output_is_what_device_put_returns() -> None:
        # Weakly typed input, host memory at the destination: the output is committed,
        # weak, and has device_put's aval (its mesh and memory space).
        src = ns(devs[:half], ("f",), P("f"))
        dst = ns(devs[half:], ("t",), P(None, "t"), "pinned_host")
        x = jax.jit(lambda: jnp.full((48, 32), 2.0), out_shardings=src)()
        assert x.weak_type
        y = reshard.reshard(x, dst)
        check(y, np.full((48, 32), 2.0, np.float32), dst)
        assert y.committed and y.weak_type
        assert y.aval == _compat.device_put_aval((48, 32), np.dtype(np.float32), dst, True)
        assert str(jax.typeof(y)) == "~float32<host>[48,32]"  # ~: weakly typed

    def whole_source_shards_sent_as_they_are() -> None:
        # Shards this small are normally packed; send every whole shard as it is.
        whole, _collective_host.WHOLE_BYTES = _collective_host.WHOLE_BYTES, (0, 2**30)
        reshard.clear_plan_cache()
        try:
            # Weight sync between equal layouts: what arrives is the destination shard.
            src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("f",), P("f"))
            move(a, src, dst)
            # The receiving processes cut their pieces out of the shards that arrive.
            move(a, src, ns(devs[half:], ("t",), P(None, "t")))
            # Several devices of a process need the same bytes: they cross once.
            move(a, src, ns(devs[half:], ("t",), P()))
            move(a, ns(devs[half:], ("t",), P(None, "t")), ns(devs[:half], ("f",), P("f")))
            for dt in (jnp.bfloat16, np.int8, np.bool_):
                move(_ground_truth((48, 32), dt, 3), src, dst)
            pinned = ns(devs[:half], ("f",), P("f"), "pinned_host")
            move(a, pinned, ns(devs[half:], ("f",), P("f")))
            move(a, src, ns(devs[half:], ("f",), P("f"), "unpinned_host"))
            # Each shard to its own device (kept) and, whole, to one on another process.
            move(a, src, ns(devs.reshape(2, -1), ("r", "f"), P("f")))
            x = make(a, src)  # the source buffers themselves were sent: donate them
            check(reshard.reshard(x, dst, donate=True), a, dst)
            assert x.is_deleted()
            # Shards larger than one buffer go as row ranges (here 3 of 512 bytes).
            _collective_host.WHOLE_BYTES = (0, 512)
            reshard.clear_plan_cache()
            move(a, src, ns(devs[half:], ("t",), P(None, "t")))
            move(a, src, dst)
        finally:
            _collective_host.WHOLE_BYTES = whole
            reshard.clear_plan_cache()

    def pytree_of_dtypes_and_keys() -> None:
        hosts = {
            name: _ground_truth((16, 8), dt, seed)
            for seed, (name, dt) in enumerate(
                [
                    ("f32", np.float32),
                    ("bf16", jnp.bfloat16),
                    ("f16", np.float16),
                    ("i8", np.int8),
                    ("u8", np.uint8),
                    ("i32", np.int32),
                    ("b", np.bool_),
                    ("c64", np.complex64),
                    ("i4", jnp.int4),
                ]
            )
        }
        src = ns(devs[:half], ("f",), P("f"))
        dst = {
            "arrays": ns(devs[::-1][:half], ("t",), P(None, "t")),
            "scalar": ns(devs[-1:], ("t",), P()),
            "keys": ns(devs[1:], ("t",), P()),
        }
        key_data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(7), n)))
        tree = {
            "arrays": {k: make(h, src) for k, h in hosts.items()},
            "scalar": make(np.asarray(3.5, np.float32), ns(devs[:1], ("f",), P())),
            "keys": jax.random.wrap_key_data(make(key_data, src)),
        }
        out = reshard.reshard(tree, dst)
        for k, h in hosts.items():
            check(out["arrays"][k], h, dst["arrays"])
        check(out["scalar"], np.asarray(3.5, np.float32), dst["scalar"])
        assert jax.dtypes.issubdtype(out["keys"].dtype, jax.dtypes.prng_key)
        check(out["keys"], key_data, dst["keys"])

    def cached_plan_reuses_the_program() -> None:
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        reshard.reshard(x, dst, cache_resharding_plans=True)
        p = reshard.plan(x, dst)
        program = only_program(p)
        compiled = dict(program._compiled)
        fillers = dict(program.fillers)
        check(reshard.reshard(x, dst, cache_resharding_plans=True), a, dst)
        assert program._compiled == compiled  # same executables, nothing recompiled
        if program.host_packed and program.local_devices:
            # A process hands filler to each stage it sends nothing in, made once.
            idle = {s for s, sends in enumerate(program.host.sends_in) if not sends}
            assert set(program.fillers) == set(fillers) == idle
            assert all(program.fillers[s] is fillers[s] for s in idle)
            if not any(d.process_index == me for d in devs[:half]):  # only receives
                assert idle == set(range(len(program.host.stages)))
        # A plan built afresh (cache off, the default) gets the same executables.
        fresh = reshard.plan(x, dst, cache=False)
        assert fresh is not p
        check(fresh.execute(x), a, dst)
        assert only_program(fresh)._compiled == compiled
        if program.host_packed:
            # ...and the same schedule, its copy tables with it: not built again.
            assert only_program(fresh).host is program.host
            # Other arguments, another schedule; none kept once the caches are cleared.
            other_dst = ns(devs[half:], ("t",), P("t"))
            other = reshard.plan(x, other_dst, cache=False)
            check(other.execute(x), a, other_dst)
            assert only_program(other).host is not program.host
            reshard.clear_plan_cache()
            again = reshard.plan(x, dst, cache=False)
            check(again.execute(x), a, dst)
            assert only_program(again).host is not program.host

    def donation_frees_sources_after_success() -> None:
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        check(reshard.reshard(x, dst, donate=True), a, dst)
        assert x.is_deleted()

    def donation_keeps_what_outputs_hold() -> None:
        # Hand every kept shard over, however small (this scenario's arrays are 6 KiB).
        saved = _execute.HANDOVER_BYTES
        _execute.HANDOVER_BYTES = 0
        try:
            handing_over()
        finally:
            _execute.HANDOVER_BYTES = saved

    def handing_over() -> None:
        def addresses(v: jax.Array) -> dict[int, int]:
            return {s.device.id: s.data.unsafe_buffer_pointer() for s in v.addressable_shards}

        def owned(host: np.ndarray, sharding: Any) -> Any:
            # In XLA's own buffers: make's may wrap the host array (zero-copy), which
            # JAX then declines to donate (it copies instead).
            return jax.jit(lambda v: v.copy())(make(host, sharding))

        # Every shard kept in place, on every process's devices: the output holds the
        # input's buffers, unchanged, and the input is consumed (as jax.device_put's).
        sh, other = ns(devs, ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = owned(a, sh)
        before = addresses(x)
        y = reshard.reshard(x, sh, donate=True)
        check(y, a, sh)
        expect(x.is_deleted(), "a donated input whose shards all stay was not deleted")
        expect(addresses(y) == before, "a shard that stays in place was copied")
        # Partly kept, on some processes only: the first half of the devices keep
        # their shards, the others trade places (on processes that keep nothing).
        w = owned(a, sh)
        before = addresses(w)
        traded = ns(np.concatenate([devs[:half], devs[half:][::-1]]), ("f",), P("f"))
        v = reshard.reshard(w, traded, donate=True)
        check(v, a, traded)
        expect(w.is_deleted(), "a partly kept donated input was not deleted")
        stayed = {d.id for d in devs[:half]}
        expect(
            all(p == before[d] for d, p in addresses(v).items() if d in stayed),
            "a shard that stays in place was copied",
        )
        # An earlier output passed with its input (they share every buffer).
        z = reshard.reshard(y, ns(devs, ("g",), P("g")))
        out = reshard.reshard({"y": y, "z": z}, {"y": sh, "z": other}, donate=True)
        check(out["y"], a, sh)
        check(out["z"], a, other)
        expect(y.is_deleted() and z.is_deleted(), "donated inputs that share buffers survived")
        # The same on the last process's devices only: the others see no sharing, and
        # every process must still end alike (both consumed).
        last = devs[-2:]
        p = owned(a, ns(last, ("r",), P()))
        q = reshard.reshard(p, ns(last[::-1], ("r",), P()))  # unchanged: shares it all
        moved = {"p": ns(last, ("r",), P()), "q": ns(devs[:2], ("s",), P())}
        out = reshard.reshard({"p": p, "q": q}, moved, donate=True)
        check(out["p"], a, moved["p"])
        check(out["q"], a, moved["q"])
        expect(p.is_deleted() and q.is_deleted(), "linked donated inputs survived")
        # Kept shards of two donated arrays on one device set in two orders.
        r, t = owned(a, ns(devs[:2], ("r",), P("r"))), owned(a, ns(devs[1::-1], ("r",), P("r")))
        moved = {"r": ns(devs[[0, -1]], ("r",), P("r")), "t": ns(devs[[-1, 0]], ("r",), P("r"))}
        out = reshard.reshard({"r": r, "t": t}, moved, donate=True)
        check(out["r"], a, moved["r"])
        check(out["t"], a, moved["t"])
        expect(r.is_deleted() and t.is_deleted(), "donated inputs in two orders survived")
        # Split parts of a mesh across processes, joined (which donates): deleted on
        # every process, also those that hold none of a part's devices.
        grid = ns(devs.reshape(2, -1), ("p", "d"), P("p"))
        parts = reshard.split_by_mesh_axis(make(a, grid), "p")
        check(reshard.concatenate_by_mesh_axis(parts, "p"), a, grid)
        expect(all(p.is_deleted() for p in parts), "a joined part was not deleted")
        # The same with no elements, in pinned host memory.
        empty = np.zeros((0, 32), np.float32)
        pinned = ns(devs.reshape(2, -1), ("p", "d"), P(None, "d"), "pinned_host")
        parts = reshard.split_by_mesh_axis(make(empty, pinned), "p")
        check(reshard.concatenate_by_mesh_axis(parts, "p"), empty, pinned)
        # Inputs linked by reshard (an unchanged may_alias copy) split with donation
        # together: consumed alike on every process, whichever of their buffers it
        # holds (before, a process holding none consumed both while the others kept
        # them); and both kept alike while a part of x lives.
        for where in (devs[-2:], devs):  # the last process's devices; every process's
            g = ns(np.asarray(where).reshape(2, -1), ("p", "d"), P("p"))
            x = owned(a, g)
            y = reshard.reshard(x, g, may_alias=True)
            parts = reshard.split_by_mesh_axis([x, y], "p", donate=True)
            expect(x.is_deleted() and y.is_deleted(), "linked inputs survived")
            check(reshard.concatenate_by_mesh_axis(parts, "p")[1], a, g)
            x = owned(a, g)
            y = reshard.reshard(x, g, may_alias=True)
            kept = reshard.split_by_mesh_axis(x, "d")
            reshard.split_by_mesh_axis([x, y], "p", donate=True)
            expect(not x.is_deleted() and not y.is_deleted(), "inputs with live parts consumed")
            check(x, a, g)
            check(y, a, g)
            del kept
        # Two arrays made zero-copy from one host array (one buffer address where the
        # host data is aligned, two copies where not): consumed on every process.
        g = ns(devs.reshape(2, -1), ("p", "d"), P("p"))
        x, y = make(a, g), make(a, g)
        parts = reshard.split_by_mesh_axis([x, y], "p", donate=True)
        expect(x.is_deleted() and y.is_deleted(), "inputs on one host array survived")
        check(reshard.concatenate_by_mesh_axis(parts, "p")[1], a, g)
        # Two handles on the same buffers (made by hand, unrecorded): copied, then
        # consumed on every process, with no donation of a buffer already donated.
        x = owned(a, g)
        y = jax.make_array_from_single_device_arrays(
            x.shape, g, [s.data for s in x.addressable_shards], dtype=x.dtype
        )
        parts = reshard.split_by_mesh_axis([x, y], "p", donate=True)
        expect(x.is_deleted() and y.is_deleted(), "twin handles survived")
        check(reshard.concatenate_by_mesh_axis(parts, "p")[1], a, g)
        # The split array dropped into a reference cycle, collected on process 0 only:
        # every process must still consume the parts alike (each collects before it
        # spares anything), and the join then moves with donation on every process.
        import gc

        class Box:
            def __init__(self, v: Any) -> None:
                self.v, self.me = v, self

        x = owned(a, g)
        parts = reshard.split_by_mesh_axis(x, "p")
        Box(x)
        del x
        gc.disable()
        try:
            if me == 0:
                gc.collect()
            y = reshard.concatenate_by_mesh_axis(parts, "p")
        finally:
            gc.enable()
        expect(all(p.is_deleted() for p in parts), "parts of a collected array kept")
        dst = ns(devs[::-1], ("r",), P("r"))
        check(reshard.reshard(y, dst, donate=True), a, dst)

    def failure_leaves_inputs_intact() -> None:
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        original = _collective_common.finish

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("injected failure after the transfer")

        # Every process fails at the same point, after all bytes moved.
        _collective_common.finish = broken
        try:
            reshard.reshard(x, dst, donate=True)
            raise AssertionError("the injected failure did not surface")
        except RuntimeError as e:
            assert "injected failure" in str(e)
        finally:
            _collective_common.finish = original
        assert not x.is_deleted()
        check(x, a, src)
        check(reshard.reshard(x, dst, donate=True), a, dst)  # and it can be retried

    def a_transfer_guard_on_one_process_fails_in_step() -> None:
        # jax.transfer_guard("disallow_explicit") set on one process only. Host-packed,
        # a process that places data refuses its first chunk; it used to raise before
        # the first stage (its filler and status were refused too), leaving its peers
        # in the stage's collectives until the watchdog (exit 75). Now it sends filler
        # and reports the refusal in the status, and every process raises at once, in
        # step; a process that only receives refuses its outputs after the last stage,
        # alone. Device-packed, the data moves by programs, which no guard counts
        # (nor jax.device_put's): the call succeeds everywhere. Fresh and cached plans.
        last = jax.process_count() - 1
        cross = (ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t")))
        within = (ns(devs, ("f",), P("f")), ns(devs, ("t",), P(None, "t")))
        for (src, dst), guarded, fails_all in (
            (cross, 0, True),  # process 0 sends
            (cross, last, False),  # the last process only receives
            (within, 0, True),  # process 0 sends and receives
        ):
            x = make(a, src)
            for cached in (False, True):
                if cached:
                    check(reshard.reshard(x, dst), a, dst)
                try:
                    with jax.transfer_guard("disallow_explicit" if me == guarded else "allow"):
                        y = reshard.reshard(x, dst, donate=True)
                    expect(
                        not _collective_executor.PACK_ON_HOST or (me != guarded and not fails_all),
                        f"process {me} did not raise (guarded: {guarded})",
                    )
                    check(y, a, dst)
                    x = make(a, src)  # (donated)
                except jax.errors.JaxRuntimeError as e:
                    expect(me == guarded and "Disallowed host-to-device" in str(e), str(e))
                    notes = "\n".join(getattr(e, "__notes__", []))
                    expect("a transfer guard refused" in notes, notes)
                    expect(("every other process raises too" in notes) == fails_all, notes)
                except RuntimeError as e:
                    expect(me != guarded and fails_all, str(e))
                    expect(f"reshard failed on process(es) [{guarded}]" in str(e), str(e))
                    expect("Disallowed host-to-device" in str(e), str(e))
                expect(not x.is_deleted(), "a failed call consumed its input")
                check(x, a, src)
                check(reshard.reshard(x, dst), a, dst)  # every process still in step
        # With host values put on every process beside the array: they were checked by
        # an all-gather after the transfers, which a guarded receiver, refusing its
        # outputs after the last stage, never joined (its peers waited for it until the
        # watchdog). Their digests are now posted before the transfers (and compared
        # after them). And a Python scalar alone: its type was found by a transfer,
        # refused before the check.
        src, dst = cross
        everywhere = ns(devs, ("e",), P())
        host = np.arange(8, dtype=np.float32)
        for tree, shardings, guarded in (
            ({"w": make(a, src), "h": host}, {"w": dst, "h": everywhere}, last),
            ({"s": 3}, {"s": everywhere}, 0),
        ):
            try:
                with jax.transfer_guard("disallow_explicit" if me == guarded else "allow"):
                    out = reshard.reshard(tree, shardings)
                expect(me != guarded, f"process {me} did not raise (guarded: {guarded})")
                if "h" in out:
                    check(out["w"], a, dst)
                    check(out["h"], host, everywhere)
                else:
                    check(out["s"], np.asarray(3, np.int32), everywhere)
            except jax.errors.JaxRuntimeError as e:
                expect(me == guarded and "Disallowed host-to-device" in str(e), str(e))
        check(
            reshard.reshard({"s": 3}, {"s": everywhere})["s"], np.asarray(3, np.int32), everywhere
        )

    def agreement_leaves_avoided_devices_out() -> None:
        # Recovering from lost devices: the check that every process built the same
        # plan ran an all-gather over every device, lost ones included (on real
        # hardware it would fail or hang there). Now no device takes part: it goes
        # through jax.distributed's key-value store. Without the store it runs on one
        # device per process, none of them lost; a process with no device left takes
        # no part.
        src = ns(devs.reshape(2, -1), ("r", "f"), P("f"))  # replicated over r
        lost = [d.id for d in devs.reshape(2, -1)[1][:2]]  # two devices of the 2nd row
        dst = ns(devs.reshape(2, -1)[0], ("f",), P("f"))
        whole = [d.id for d in devs.reshape(2, -1)[1]]  # the second call avoids these
        used: list[list[int]] = []
        exchanged: list[int] = []
        gather, exchange = _collective_executor._gather, _collective_executor._exchange
        client = _compat.distributed_client

        def spy_gather(mine: Any, devices: Any) -> Any:
            used[-1].extend(d.id for d in devices)
            return gather(mine, devices)

        def spy_exchange(*args: Any) -> Any:
            exchanged.append(1)
            return exchange(*args)

        _collective_executor._gather = spy_gather
        _collective_executor._exchange = spy_exchange
        try:
            for store in (True, False):
                if not store:
                    _compat.distributed_client = lambda: None  # type: ignore[assignment]
                used.append([])
                check(reshard.recover(make(a, src), dst, lost_devices=lost), a, dst)
                used.append([])
                check(reshard.reshard(make(a, src), dst, avoid_devices=whole), a, dst)
                if store and (exchanged != [1, 1] or used != [[], []]):
                    MISMATCHES.append(f"store: exchanged {exchanged}, gathered over {used}")
        finally:
            _collective_executor._gather = gather
            _collective_executor._exchange = exchange
            _compat.distributed_client = client  # type: ignore[assignment]
        for ids, avoided in zip(used[2:], (lost, whole), strict=True):
            alive_here = any(d.process_index == me and d.id not in avoided for d in devs)
            if set(ids) & set(avoided) or (alive_here and not ids):
                MISMATCHES.append(f"agreed over devices {ids}, avoiding {avoided}")

    def different_lost_devices_raise_on_every_process() -> None:
        # Processes that name different lost devices break the contract; the check
        # picked its devices by each process's own lost devices, so the processes
        # waited for each other in different all-gathers, or one of them went ahead
        # alone. Each raises now, at once, and all stay in step.
        src = ns(devs.reshape(2, -1), ("r", "f"), P("f"))  # replicated over r
        dst = ns(devs.reshape(2, -1)[0][-2:], ("f",), P("f"))
        first, theirs = devs.reshape(2, -1)[0][0].id, [d.id for d in devs[half:]]
        for mine in ([first] if me == 0 else [], theirs if me == 0 else []):
            try:
                reshard.recover(make(a, src), dst, lost_devices=mine)
                raise AssertionError("different lost devices did not raise")
            except ValueError as e:
                assert "different arguments on different processes" in str(e), e
        check(reshard.recover(make(a, src), dst, lost_devices=[first]), a, dst)
        # Onto a mesh, an uncommitted step counter is replicated on it, alike on every
        # process (it was committed to each process's own default device, so the
        # processes' states differed and the next step refused them).
        small = reshard.shrink_mesh(src.mesh, [first], "r")
        out = reshard.recover({"w": make(a, src), "step": jnp.int32(3)}, small, [first])
        check(out["w"], a, NamedSharding(small, P("f")))
        check(out["step"], np.array(3, np.int32), NamedSharding(small, P()))

    def a_device_failing_mid_move_is_marked_lost_on_every_process() -> None:
        # ElasticManager moving the state: a device fails there, and only its own
        # process's error names it (injected: packing on the host, or preparing the
        # inputs on the devices). The others' error said only which process failed, so
        # they raised while it marked the device lost and retried alone, waiting for
        # them. Their error now carries its error: every process marks the device lost
        # and retries the move together. Then two devices of two processes fail at
        # once: each of those processes' own error names only its own device, but
        # ElasticManager reads the failure every process has alike (naming both).
        grid = np.array([[devs[i], devs[half + i]] for i in range(half)])  # data x fsdp
        mesh = Mesh(grid, ("data", "fsdp"))
        host = _ground_truth((24, 4), np.float32, 9)
        if _collective_executor.PACK_ON_HOST:
            module, name = _collective_host, "_pack_stage"
        else:
            module, name = _collective_device, "block_inputs"
        original = getattr(module, name)
        for failing in ([grid[2][1]], [grid[2][1], grid[1][0]]):
            mine = [d for d in failing if d.process_index == me]
            fired = []

            def broken(*args: Any, mine: list[Any] = mine, fired: list[int] = fired) -> Any:
                if mine and not fired:
                    fired.append(1)
                    raise RuntimeError(f"UNAVAILABLE: device {mine[0].id} failed (injected)")
                return original(*args)

            manager = reshard.ElasticManager(mesh, "data")
            manager.mark_lost([grid[3][0]])
            setattr(module, name, broken)
            try:
                out, shape = manager.run_step(
                    lambda state, m: (state, dict(m.shape)),
                    {"w": make(host, ns(grid, ("data", "fsdp"), P("data")))},
                )
            finally:
                setattr(module, name, original)
            expect(bool(fired) == bool(mine), f"injected on {me}: {fired}")
            expect(shape == {"data": half - 1 - len(failing), "fsdp": 2}, f"mesh {shape}")
            lost = sorted(manager.lost_devices)
            expect(lost == sorted([grid[3][0].id, *(d.id for d in failing)]), f"lost {lost}")
            check(out["w"], host, NamedSharding(manager.mesh, P("data")))

    def different_arguments_raise_on_every_process() -> None:
        # Process 0 asks for another layout than the others: a broken contract that
        # would hang in mismatched collectives. Every process raises instead, and all
        # stay in step (the next reshard works). So does a schedule setting changed on
        # process 1 alone (same arguments, programs that would not match).
        src = ns(devs[:half], ("f",), P("f"))
        x = make(a, src)
        kind = "pinned_host" if me == 0 else "device"
        same = ns(devs[half:], ("t",), P(None, "t"))
        where, name = (
            (_collective_host, "CHUNK_BYTES")
            if _collective_executor.PACK_ON_HOST
            else (_collective_device, "GROUP_BYTES")
        )
        setting = getattr(where, name)
        for dst, changed in (
            (ns(devs[half:], ("t",), P("t") if me == 0 else P(None, "t")), False),  # layout
            (ns(devs[half:], ("t",), P(None, "t"), kind), False),  # memory kind only
            (same, me == 1),  # a setting only
        ):
            setattr(where, name, setting // 2 if changed else setting)
            try:
                reshard.reshard(x, dst)
                raise AssertionError("different arguments did not raise")
            except ValueError as e:
                assert "different arguments on different processes" in str(e), e
                assert "[1" in str(e), e  # names the processes that differ
            finally:
                setattr(where, name, setting)
        check(x, a, src)
        check(reshard.reshard(x, same), a, same)
        # An offload in place runs no program, but is still checked: process 0 asks
        # for another memory kind than the others.
        on_device = ns(devs, ("f",), P("f"), "device")
        y = make(a, on_device)
        differs = ns(devs, ("f",), P("f"), "pinned_host" if me == 0 else "unpinned_host")
        # Alone, and in a tree with an array the program moves (the program's check
        # covers the other one too).
        for tree, dst in ((y, differs), ({"o": y, "w": x}, {"o": differs, "w": same})):
            try:
                reshard.reshard(tree, dst)
                raise AssertionError("different memory kinds in place did not raise")
            except ValueError as e:
                assert "different arguments on different processes" in str(e), e
        check(y, a, on_device)
        offloaded = ns(devs, ("f",), P("f"), "pinned_host")
        check(reshard.reshard(y, offloaded), a, offloaded)
        # A leaf that is a host value on process 0 and an array on the others, beside
        # an array that crosses processes (a review found it waiting for the watchdog
        # while the host values were compared before the transfers: process 0 waited
        # there, the others in the plan's check); and host values put on devices of
        # every process on process 0 only, on the others on their own devices.
        host = np.arange(8, dtype=np.float32)
        every = ns(devs, ("e",), P())
        mine = ns(np.array(jax.local_devices()), ("l",), P())
        for tree, dst, why in (
            (
                {"w": x, "h": host if me == 0 else make(host, every)},
                {"w": same, "h": every},
                "different plans",
            ),
            (
                {"w": x, "h": host, "g": host},
                {"w": same, "h": every, "g": every if me == 0 else mine},
                "different numbers of host values",
            ),
            # A tree of host values alone on process 0, which has no program to check
            # (it waited for its peers' digests while they waited in the plan's check).
            ({"h": host if me == 0 else make(host, every)}, {"h": every}, "different plans"),
            (
                {"h": host} if me == 0 else {"w": x, "h": host},
                {"h": every} if me == 0 else {"w": same, "h": every},
                "different plans",
            ),
        ):
            try:
                reshard.reshard(tree, dst)
                raise AssertionError("different arguments did not raise")
            except ValueError as e:
                assert "different arguments on different processes" in str(e), e
                assert why in str(e), e
        check(reshard.reshard({"w": x, "h": host}, {"w": same, "h": every})["h"], host, every)

    def calls_in_another_order_raise_on_every_process() -> None:
        # Two plans, each checked across processes on its first run, then called in
        # another order on process 0. Their collectives match (same bytes, same
        # devices), so each call met the other plan's and returned its data, wrong,
        # without an error. Every process raises instead, the inputs intact, and all
        # stay in step (the next calls work). The plans differ in element type, or
        # only where their programs are alike: in the destination's memory kind, or a
        # key array against its own uint32 data.
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        pinned = ns(devs[half:], ("t",), P(None, "t"), "pinned_host")
        key_data = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), 16)))
        b = _ground_truth(a.shape, np.int32, 1)
        c = _ground_truth(a.shape, a.dtype, 2)
        for x, z, hx, hz, dx, dz in (
            (make(a, src), make(b, src), a, b, dst, dst),
            (make(a, src), make(c, src), a, c, dst, pinned),
            (jax.random.wrap_key_data(make(key_data, src)), make(key_data, src),
             key_data, key_data, ns(devs[half:], ("t",), P("t")),
             ns(devs[half:], ("t",), P("t"))),
        ):  # fmt: skip
            for v, d in ((x, dx), (z, dz)):
                reshard.reshard(v, d, cache_resharding_plans=True)
            for v, d in ((x, dx), (z, dz)) if me == 0 else ((z, dz), (x, dx)):
                try:
                    reshard.reshard(v, d, cache_resharding_plans=True)
                    raise AssertionError(f"calls in another order did not raise ({d})")
                except RuntimeError as e:
                    assert "reshard calls differ across processes" in str(e), e
                    assert "[0] | [1" in str(e), e  # names the processes that differ
            check(x, hx, src)
            check(z, hz, src)
            check(reshard.reshard(x, dx, cache_resharding_plans=True), hx, dx)
            check(reshard.reshard(z, dz, cache_resharding_plans=True), hz, dz)

    def a_call_failing_on_one_process_is_not_paired_with_its_next() -> None:
        # Process 1's call fails before its collectives (bad input, caught by the user)
        # while the others' call waits in them. Process 1's next call would meet that
        # call in the same collectives (same plan) and both would return each other's
        # data; the counts of calls each process has started tell them apart, and
        # every process raises instead, the inputs intact.
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs, ("t",), P(None, "t"))
        b = _ground_truth(a.shape, a.dtype, 1)
        x1, x2 = make(a, src), make(b, src)
        plan = reshard.plan(x1, dst, cache=False)
        plan.execute(x1)  # checked once by every process (agree), then reused
        if me == 1:
            try:
                reshard.reshard(x1, P(None, "t"))  # a PartitionSpec, not a sharding
                raise AssertionError("a PartitionSpec did not raise")
            except ValueError as e:
                assert "Wrap a PartitionSpec in NamedSharding" in str(e), e
        try:
            plan.execute(x2 if me == 1 else x1)
            raise AssertionError("calls out of step did not raise")
        except RuntimeError as e:
            assert "out of step across processes" in str(e), e
            counts = ast.literal_eval(re.search(r"\{[^}]*\}", str(e)).group(0))
            ahead = {p: c - counts[0] for p, c in counts.items()}
            assert ahead == {p: int(p == 1) for p in range(jax.process_count())}, counts
        check(x1, a, src)
        check(x2, b, src)
        # Only for the rest of the suite: bring the counts back in step by hand, past
        # every count used so far (the checks' keys in the store name the call).
        _collective_common._calls_started = ((_collective_common._calls_started >> 20) + 1) << 20
        check(plan.execute(x2), b, dst)

    def failed_calls_leave_no_keys_behind() -> None:
        # A failed call posts why in jax.distributed's key-value store (here every
        # process refuses it: DataLossError). Where the successful calls run a cached
        # plan (no first-run check, which deleted them), the keys stayed for the life of
        # the job: one per process per failed call. Each process now deletes its own
        # once every process has gone on (a collective call of them all).
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        client = _compat.distributed_client()
        # (Earlier scenarios set the count of calls far ahead and back: their keys stay.)
        before = {k for k, _ in client.key_value_dir_get("reshard/")}
        check(reshard.reshard(x, dst, cache_resharding_plans=True), a, dst)
        failures = 6
        for _ in range(failures):
            try:
                reshard.reshard(x, dst, avoid_devices=devs[:half])
                raise AssertionError("avoiding every source device lost no data")
            except reshard.DataLossError:
                pass
            check(reshard.reshard(x, dst, cache_resharding_plans=True), a, dst)
        keys = {k for k, _ in client.key_value_dir_get("reshard/")} - before
        # (The peers may not have deleted theirs of the last failure yet: a refusal is
        # posted where each check of the call would be, the plan's and the values'.)
        assert len(keys) <= 2 * jax.process_count(), sorted(keys)
        assert all(k.split("/")[1] in ("agree", "values") for k in keys), sorted(keys)

    def a_call_refused_on_one_process_fails_every_process_at_once() -> None:
        # Process 1 alone refuses a call (bad input there) that the others make too,
        # the first run of a plan, so they wait in its check: while planning, in
        # Plan.execute, and while planning a recovery. They used to wait for a check
        # that never came (30 minutes by default), or to meet process 1's next call
        # there and go out of step for good. Now process 1 posts its refusal where its
        # check would be, and they raise at once, naming it and its error; every
        # process has started as many calls, so all stay in step (the next calls
        # work). A fallback to waiting would raise "waited ..." after AGREE_WAIT_S
        # instead, and fail the checks below.
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        narrow = make(np.ascontiguousarray(a[:, : a.shape[1] // 2]), src)
        wait = _collective_executor.AGREE_WAIT_S
        _collective_executor.AGREE_WAIT_S = 60.0
        try:
            plan = reshard.plan(x, dst, cache=False)  # its first run checks it
            for call, why in (
                (lambda: reshard.reshard(x, P(None, "t") if me == 1 else dst),
                 "Wrap a PartitionSpec in NamedSharding"),
                (lambda: plan.execute(narrow if me == 1 else x), "the plan was built for"),
                (lambda: reshard.recover(x, dst, lost_devices=dst.mesh.devices.flat[:1]
                                         if me == 1 else []), "uses avoided devices"),
            ):  # fmt: skip
                try:
                    call()
                    raise AssertionError("a call refused on process 1 did not raise")
                except ValueError as e:
                    assert me == 1 and why in str(e), e
                except RuntimeError as e:
                    assert me != 1, e
                    assert "process 1 refused this call before moving any data" in str(e), e
                    assert "(ValueError: " in str(e) and why in str(e), e
        finally:
            _collective_executor.AGREE_WAIT_S = wait
        # A call of host values alone: process 1's refusal is read where the plan or
        # the values are compared; it used to leave the others in an all-gather until
        # the watchdog. The same for a Python int that process 1 alone cannot type (x64
        # off there only).
        every = ns(devs, ("e",), P())
        host = np.arange(8, dtype=np.float32)
        for tree, shardings, x64, why in (
            ({"h": host}, {"h": P() if me == 1 else every}, False, "Wrap a PartitionSpec"),
            ({"i": 2**40}, {"i": every}, me != 1, "too large to convert to int32"),
        ):
            try:
                with jax.enable_x64(x64):
                    reshard.reshard(tree, shardings)
                raise AssertionError("a call refused on process 1 did not raise")
            except (ValueError, OverflowError) as e:
                assert me == 1 and why in str(e), e
            except RuntimeError as e:
                assert me != 1, e
                assert "process 1 refused this call before moving any data" in str(e), e
                assert why in str(e), e
        check(reshard.reshard({"h": host}, {"h": every})["h"], host, every)
        # A recovery onto a mesh of process 1's own devices, refused there alone, is a
        # call within one process: neither counted nor reported, so all stay in step.
        if me == 1:
            mine = Mesh(np.array(jax.local_devices()), ("l",))
            try:
                reshard.recover(make(a, NamedSharding(mine, P("l"))), mine, [mine.devices[0]])
                raise AssertionError("a recovery onto a lost device did not raise")
            except ValueError as e:
                assert "uses avoided devices" in str(e), e
        check(x, a, src)
        check(reshard.reshard(x, dst), a, dst)
        check(plan.execute(x), a, dst)

    def a_process_failing_mid_reshard_fails_every_process() -> None:
        # Host-packed. One process fails in a middle stage (out of host memory while
        # packing, or while taking its destination blocks). It still takes part in
        # every stage, sending filler, and reports the failure in the last one: every
        # process raises (no hang, no partial results), the inputs stay intact, and
        # all stay in step (the next reshard works).
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        procs = jax.process_count()
        sizes = ("CHUNK_BYTES", "STAGE_BYTES", "WHOLE_BYTES", "WHOLE_STAGE_BYTES")
        saved = {k: getattr(_collective_host, k) for k in sizes}
        pack, destinations = _collective_host._pack_stage, _collective_host._destinations
        buffers = _collective_host._SourceBuffers

        class FailingBuffers(buffers):  # type: ignore[misc, valid-type]
            def __missing__(self, li: int) -> Any:
                raise MemoryError("injected: out of host memory finding the sources")

        def failing_pack(program: Any, s: int, views: Any) -> Any:
            if s == 2:
                raise MemoryError("injected: out of host memory while packing")
            return pack(program, s, views)

        def failing_destinations(*args: Any) -> Any:
            raise MemoryError("injected: out of host memory for the destination blocks")

        # Process 0 sends, the last process receives; shards packed, or sent whole in
        # row ranges (where the filler stands in for source rows, not packed chunks).
        cases = [
            (victim, name, broken, whole)
            for victim, name, broken in (
                (0, "_pack_stage", failing_pack),
                (procs - 1, "_destinations", failing_destinations),
                # The receiving process needs no source buffers while packing (it sends
                # filler): it finds them before the last stage, and reports a failure.
                (procs - 1, "_SourceBuffers", FailingBuffers),
            )
            for whole in (False, True)
        ]
        for victim, name, broken, whole in cases:
            # Small buffers, so that there are many stages.
            _collective_host.CHUNK_BYTES = _collective_host.STAGE_BYTES = 256
            # Replicated destinations need all of every source shard: sent whole.
            to = ns(devs[half:], ("t",), P()) if whole else dst
            if whole:
                _collective_host.WHOLE_BYTES = (0, 256)
                _collective_host.WHOLE_STAGE_BYTES = 256
            if me == victim:
                setattr(_collective_host, name, broken)
            try:
                p = reshard.plan(x, to, cache=False)
                _fails_on(victim, functools.partial(p.execute, x, donate=True))
            finally:
                _collective_host._pack_stage, _collective_host._destinations = pack, destinations
                _collective_host._SourceBuffers = buffers
                for k, v in saved.items():
                    setattr(_collective_host, k, v)
            program = only_program(p)
            assert len(program.host.stages) > 3, len(program.host.stages)
            assert any(ch.whole for ch in program.host.chunks) == whole
            assert not x.is_deleted()
            check(x, a, src)
            check(reshard.reshard(x, to), a, to)

        # The copies within a process (a relayout over every device) fail on process 0:
        # they are done before the last stage, which reports the failure, with many
        # stages (the copies run beside the first ones) or one.
        src, dst = ns(devs, ("f",), P("f")), ns(devs, ("t",), P(None, "t"))
        x = make(a, src)
        local_tasks = _collective_host._local_tasks

        def failing_local_tasks(*args: Any) -> Any:
            def fail() -> None:
                raise MemoryError("injected: failure copying within the process")

            return [(1, fail)]

        for many in (True, False):
            if many:
                _collective_host.CHUNK_BYTES = _collective_host.STAGE_BYTES = 256
            if me == 0:
                _collective_host._local_tasks = failing_local_tasks
            try:
                p = reshard.plan(x, dst, cache=False)
                _fails_on(
                    0,
                    functools.partial(p.execute, x, donate=True),
                    "every other process raises too",
                )
            finally:
                _collective_host._local_tasks = local_tasks
                for k, v in saved.items():
                    setattr(_collective_host, k, v)
            program = only_program(p)
            stages = len(program.host.stages)
            assert stages > 1 if many else stages == 1, (many, stages)
            assert any(program.host.local_copies), "no copies within a process"
            assert not x.is_deleted()
            check(x, a, src)
            check(reshard.reshard(x, dst), a, dst)

        if not _collective_executor.KEPT_ON_DEVICE:
            return
        # Copying the shards an array keeps on its devices (off CPU, by copy programs)
        # fails on process 0: dispatched before the last stage, which reports it.
        from reshard import _local_executor

        same = ns(devs, ("f",), P("f"))
        srcs = {"moved": ns(devs[:half], ("f",), P("f")), "kept": same}
        dsts = {"moved": ns(devs[half:], ("t",), P(None, "t")), "kept": same}
        tree = {k: make(a, s) for k, s in srcs.items()}
        in_place = _local_executor.copies_in_place

        def failing_in_place(*args: Any) -> Any:
            raise MemoryError("injected: out of device memory copying kept shards")

        if me == 0:
            _local_executor.copies_in_place = failing_in_place
        try:
            _fails_on(0, lambda: reshard.reshard(tree, dsts, may_alias=False))
        finally:
            _local_executor.copies_in_place = in_place
        for k in tree:
            check(tree[k], a, srcs[k])
        out = reshard.reshard(tree, dsts, may_alias=False)
        for k in tree:
            check(out[k], a, dsts[k])

    def reversed_move_fails_on_every_process(x: Any) -> str:
        # A reshard of ``x`` onto the devices in reverse order, which a failure injected
        # on process 1 ("device 3 failed") makes raise on every process, naming it.
        try:
            reshard.reshard(x, ns(devs[::-1], ("x",), P("x")))
        except RuntimeError as e:
            assert "device 3 failed (injected)" in str(e), e
            return str(e)
        raise AssertionError("the injected failure did not raise")

    def a_slow_peer_still_reads_why_a_call_failed() -> None:
        # Process 1 fails mid-move and posts why; every process raises. Process 1 then
        # makes its next call, a cached plan whose copies all stay within processes (no
        # stage, no status: nothing exchanged), while process 0 is slow to read the
        # reason. Deleting earlier posts there (4413046) lost it: process 0's error read
        # "its own error says why", and an elastic loop would mark no device lost on it.
        a8 = np.arange(n * 8, dtype=np.float32).reshape(n * 4, 2)
        x = make(a8, ns(devs, ("x",), P("x")))
        rotated = [d for p in range(jax.process_count()) for d in np.roll(
            [d for d in devs if d.process_index == p], -1)]  # fmt: skip
        local = ns(rotated, ("x",), P("x"))
        check(reshard.reshard(x, local, cache_resharding_plans=True), a8, local)
        real_client, pack = _compat.distributed_client, _collective_host._pack_stage
        slow = [True] if me == 0 else []

        def failing(*args: Any) -> Any:
            raise RuntimeError("UNAVAILABLE: device 3 failed (injected)")

        _compat.distributed_client = lambda: _SlowFailureReader(real_client, slow)
        _collective_host._pack_stage = failing if me == 1 else pack
        try:
            reversed_move_fails_on_every_process(x)
        finally:
            _compat.distributed_client, _collective_host._pack_stage = real_client, pack
        check(reshard.reshard(x, local, cache_resharding_plans=True), a8, local)

    def a_failure_within_one_process_keeps_the_last_reason() -> None:
        # Device-packed (host-packed, a call within one process has no failure to
        # post). Process 1 fails while preparing its inputs and posts why; every
        # process raises. Process 1 then makes a collective call within its own devices
        # that fails too, while process 0 is slow to read the first reason. That call
        # is not counted (no peer makes it), so its reason, posted, took the first
        # call's key: process 0's error named the second failure, and process 0 left
        # the scenario early. A call within one process posts nothing now.
        a8 = np.arange(n * 8, dtype=np.float32).reshape(n * 4, 2)
        x = make(a8, ns(devs, ("x",), P("x")))
        mine = [d for d in devs if d.process_index == 1]
        on_1 = make(a8, ns(mine, ("x",), P("x")))
        mine_rotated = ns(np.roll(mine, -1), ("x",), P("x"))
        real_client, build = _compat.distributed_client, _collective_device.block_inputs

        def failing(*args: Any) -> Any:
            raise RuntimeError(f"{'a failure within' if failed else 'device 3 failed'} (injected)")

        failed, slow = [], [True] if me == 0 else []
        _compat.distributed_client = lambda: _SlowFailureReader(real_client, slow)
        _collective_device.block_inputs = failing if me == 1 else build
        assert "a failure within" not in reversed_move_fails_on_every_process(x)
        failed.append(True)
        try:  # within process 1 (the others have no part in it)
            y = reshard.reshard(on_1, mine_rotated, executor="collective")
            if me == 1:
                raise AssertionError("the failure within process 1 did not raise")
            check(y, a8, mine_rotated)
        except RuntimeError as e:
            assert me == 1 and "a failure within (injected)" in str(e), e
        finally:
            _compat.distributed_client, _collective_device.block_inputs = real_client, build
        check(
            reshard.reshard(x, ns(devs[::-1], ("x",), P("x"))), a8, ns(devs[::-1], ("x",), P("x"))
        )

    def a_process_failing_after_the_transfer_fails_alone() -> None:
        # Host-packed. A failure after every stage was called (here: unpacking what
        # arrived) cannot corrupt what the others receive: that process raises, the
        # others return complete results, and all stay in step.
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        x = make(a, src)
        victim = jax.process_count() - 1  # receives
        take = _collective_host._take

        def failing_take(*args: Any) -> None:
            raise MemoryError("injected: failure while unpacking")

        if me == victim:
            _collective_host._take = failing_take
        try:
            y = reshard.reshard(x, dst)
            assert me != victim, "the unpacking failure did not surface"
            check(y, a, dst)
        except MemoryError as e:
            assert me == victim and "injected" in str(e), e
        finally:
            _collective_host._take = take
        check(x, a, src)
        check(reshard.reshard(x, dst), a, dst)

    def a_process_failing_before_the_program_fails_every_process() -> None:
        # Device-packed. One process fails while building its inputs (out of device
        # memory for the placeholders, say), for the first group of arrays or a later
        # one. It tells the others before anyone calls that group's program: every
        # process raises (no hang, no partial results), the inputs stay intact, and
        # all stay in step (the next reshard works).
        src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t"))
        tree = {"a": a, "b": a[::-1].copy()}
        x = {k: make(v, src) for k, v in tree.items()}
        build = _collective_device.block_inputs
        saved = _collective_device.GROUP_BYTES
        # A sender, then a receiver; with one group, then failing in the second.
        for victim, group_bytes, fail_at in ((0, saved, 0), (jax.process_count() - 1, 1, 1)):
            failing_build = _FailAfter(build, fail_at)
            _collective_device.GROUP_BYTES = group_bytes
            if me == victim:
                _collective_device.block_inputs = failing_build
            try:
                p = reshard.plan(x, {"a": dst, "b": dst}, cache=False)
                _fails_on(
                    victim,
                    functools.partial(p.execute, x, donate=True),
                    "told the other processes",
                    " while preparing",
                )
            finally:
                _collective_device.block_inputs = build
                _collective_device.GROUP_BYTES = saved
            program = only_program(p)
            assert len(program.groups) == fail_at + 1, program.groups
            for k, v in tree.items():
                assert not x[k].is_deleted()
                check(x[k], v, src)
                check(reshard.reshard(x[k], dst), v, dst)

    def device_packed_in_groups() -> None:
        # Device-packed, placeholders bounded: every array its own group (program).
        src = ns(devs[:half], ("f",), P("f"))
        dst = ns(devs[half:].reshape(2, -1), ("d", "m"), P("m", "d"))
        tree = {
            f"w{i}": _ground_truth((48, 32), dt, 10 + i)
            for i, dt in enumerate([np.float32, jnp.bfloat16, np.int8, jnp.int4, np.bool_])
        }
        x = {k: make(v, src) for k, v in tree.items()}
        # And pieces bounded: every array its own group again, but the groups run back
        # to back (each still exchanging its status first).
        for bound in ("GROUP_BYTES", "COPIES_PER_PROGRAM"):
            saved = getattr(_collective_device, bound)
            setattr(_collective_device, bound, 1)
            try:
                p = reshard.plan(x, dict.fromkeys(tree, dst), cache=False)
                y = p.execute(x)
            finally:
                setattr(_collective_device, bound, saved)
            program = only_program(p)
            assert program.groups == [[k] for k in range(len(tree))], program.groups
            for k, v in tree.items():
                check(y[k], v, dst)
                check(x[k], v, src)

    def sixty_four_bit_types_with_x64_on() -> None:
        # With jax_enable_x64 on (a Python int is then a 64-bit integer inside a
        # program, where the device-packed program's looked-up starts are 32-bit).
        with jax.enable_x64(True):
            for dt in (np.int64, np.float64):
                host = _ground_truth((48, 32), dt, 9)
                move(host, ns(devs[:half], ("f",), P("f")), ns(devs[half:], ("t",), P(None, "t")))
                move(host, ns(devs[1 : half + 1], ("f",), P(None, "f")), ns(devs, ("t",), P("t")))
        # Made with it on, moved with it off: still whole (a program traced with it off
        # keeps only the low 32 bits of each element).
        for dt in (np.uint64, np.complex128):
            host = _ground_truth((16, 8), dt, 10)
            src, dst = ns(devs[:half], ("f",), P("f")), ns(devs[::-1], ("t",), P(None, "t"))
            with jax.enable_x64(True):
                x = make(host, src)
                u = jnp.asarray(host)  # uncommitted: put from each process's host copy
            check(reshard.reshard(x, dst), host, dst)
            check(x, host, src)
            check(reshard.reshard(u, dst), host, dst)

    def host_values_put_on_every_process() -> None:
        # Host values put on devices of every process (a Python scalar, numpy arrays of
        # several types, one in host memory) are checked for equality across processes
        # by a digest each, and come out as jax.device_put types them. (jax.device_put
        # all-gathers the whole value, over devices laid out as processes x local
        # devices, which processes of different device counts cannot form; it also
        # raises for NaNs and float64 values, and crashes on 2-bit types: below.)
        uneven = len(set(collections.Counter(d.process_index for d in devs).values())) > 1
        b = _ground_truth((n, 2 * n), np.float32, 7)
        f64 = np.arange(n * 12, dtype=np.float64).reshape(2 * n, 6) / 7
        bf = _ground_truth((5, 3 * n), jnp.bfloat16, 5)
        i4 = _ground_truth((n, 2), jnp.int4, 6)
        i2 = np.resize(np.array([-2, -1, 0, 1]), (3, n)).astype(jnp.int2)
        x = {"py": 3, "f64": f64, "bf": bf, "i4": i4, "i2": i2, "one": np.ones(3, np.int8)}
        # Uncommitted arrays (each process's own, on its default device), as host values.
        u = jnp.arange(2 * n, dtype=jnp.float32) / 3
        x.update({"u": u, "weak": jnp.asarray(2.0), "step": jnp.int32(7)})
        dst = {
            "py": ns(devs, ("a",), P()),
            "f64": ns(devs, ("a",), P("a")),
            "bf": ns(devs[::-1], ("a",), P(None, "a")),
            "i4": ns(devs, ("a",), P("a"), "pinned_host"),
            "i2": ns(devs, ("a",), P(None, "a")),
            "one": ns(devs[-1:], ("a",), P()),  # one process's device: not checked
            "u": ns(devs[::-1], ("a",), P("a")),
            "weak": ns(devs, ("a",), P(), "pinned_host"),
            "step": ns(devs[1:], ("a",), P()),
            "arr": ns(devs[::-1], ("a",), P(None)),
        }
        x["arr"] = make(b, ns(devs[:1], ("a",), P()))
        # An uncommitted array put on devices of some processes but not all (jax 0.10's
        # jax.device_put fails there on some processes, "must have one shard each"),
        # and uncommitted key arrays (jax.device_put refuses them across processes),
        # on devices of every process (checked), reversed, in host memory, or of one.
        last = jax.process_count() - 1
        some = [d for d in devs if d.process_index != last]
        x["part"] = jnp.arange(3 * len(some), dtype=jnp.int16).reshape(3, len(some))
        dst["part"] = ns(some, ("a",), P())
        keys = {
            "key": (jax.random.key(0), ns(devs, ("a",), P())),
            "keys": (jax.random.split(jax.random.key(1), n), ns(devs[::-1], ("a",), P("a"))),
            "keys_host": (
                jax.random.split(jax.random.key(2, impl="rbg"), (2, n)),
                ns(devs, ("a",), P(None, "a"), "pinned_host"),
            ),
            "key_one": (jax.random.key(3, impl="rbg"), ns(devs[-1:], ("a",), P())),
        }
        for k, (v, d) in keys.items():
            assert not v.committed, k
            x[k], dst[k] = v, d
        y = reshard.reshard(x, dst)
        for k, (v, d) in keys.items():
            check(y[k], np.asarray(jax.random.key_data(v)), d)
            assert y[k].committed and y[k].dtype == v.dtype, (k, y[k].dtype)
            assert jax.random.key_impl(y[k]) == jax.random.key_impl(v), k
            if me == last and k == "key_one":
                assert y[k].sharding == jax.device_put(v, d).sharding, k
        # On a sharding neither named nor single-device, such a key is refused alike on
        # every process, before anything moves.
        from jax._src import sharding_impls

        named = dst["key"]
        g = sharding_impls.GSPMDSharding(named._device_assignment, named._to_xla_hlo_sharding(0))
        try:
            reshard.reshard({"k": jax.random.key(0)}, g)
            raise AssertionError("an uncommitted key put on a GSPMDSharding did not raise")
        except ValueError as e:
            assert "leaf ['k']: an uncommitted key array can be put on devices" in str(e), e
        # So is a committed one (jax.device_put raised on every process).
        try:
            reshard.reshard({"k": y["key"]}, g)
            raise AssertionError("a key moved onto a GSPMDSharding across processes did not raise")
        except ValueError as e:
            message = str(e)
            assert "leaf ['k']: a key array on a NamedSharding -> GSPMDSharding" in message, e
            assert f"devices of processes {list(range(jax.process_count()))}" in message, e
        # Between devices of one process, it moves there (jax.device_put); the others'
        # results hold no shard (jax.device_put refused the sharding there), beside a
        # leaf that crosses processes; donated, it is consumed on every process. So is
        # an uncommitted one put there.
        first = [d for d in devs if d.process_index == 0]
        k0 = reshard.reshard(jax.random.key(5), ns(first, ("a",), P()))
        on_first = ns(first[::-1], ("a",), P())
        g0 = sharding_impls.GSPMDSharding(
            on_first._device_assignment, on_first._to_xla_hlo_sharding(0)
        )
        both = reshard.reshard(
            {"k": k0, "arr": make(b, ns(devs[:1], ("a",), P())), "u": jax.random.key(5)},
            {"k": g0, "arr": dst["arr"], "u": g0},
            donate=True,
        )
        check(both["arr"], b, dst["arr"])
        assert k0.is_deleted()
        data = np.asarray(jax.random.key_data(jax.random.key(5)))
        for k in ("k", "u"):
            assert both[k].sharding == g0 and both[k].dtype == k0.dtype, (k, both[k].sharding)
            for shard in both[k].addressable_shards:
                assert np.array_equal(np.asarray(jax.random.key_data(shard.data)), data), k
            assert len(both[k].addressable_shards) == (len(first) if me == 0 else 0), k
        want = {
            "py": (np.array(3, np.int32), True),
            "f64": (f64.astype(np.float32), False),
            "bf": (bf, False),
            "i4": (i4, False),
            "i2": (i2, False),
            "one": (np.ones(3, np.int8), False),
            "u": (np.asarray(u), False),
            "weak": (np.array(2.0, np.float32), True),
            "step": (np.array(7, np.int32), False),
            "arr": (b, False),
            "part": (np.arange(3 * len(some), dtype=np.int16).reshape(3, len(some)), False),
        }
        for k, (host, weak) in want.items():
            check(y[k], host, dst[k])
            assert y[k].committed and y[k].dtype == host.dtype and y[k].weak_type == weak, k
            assert y[k].aval == _compat.device_put_aval(host.shape, host.dtype, dst[k], weak), k
            if not uneven and k in ("py", "i4", "one", "u", "weak", "step", "part"):
                # jax.device_put itself, where it can run, gives the same array. (Not
                # for the others: jax 0.10 compares the values it gathers with == and
                # raises that they differ for a NaN, or for a float64 value, which it
                # compares with the float32 values it gathered; on int2 it crashes.)
                same = jax.device_put(x[k], dst[k])
                assert (y[k].aval, y[k].sharding) == (same.aval, same.sharding), k
        # A value that differs between processes raises on every process, naming it,
        # and leaves the processes in step.
        for v in (np.full(4, me), jnp.full(4, me), jax.random.key(me)):
            try:
                reshard.reshard({"v": v, "w": 1.5}, {"v": dst["py"], "w": dst["py"]})
                raise AssertionError("no error for values that differ between processes")
            except ValueError as e:
                assert "leaf ['v']: the value to be put on devices of every process" in str(e)
                assert "the type it takes differs" not in str(e), e
        # Types that JAX makes the same (float64 and float32 with x64 off) are the same
        # argument, as for jax.device_put: a tree of that value alone passes the check
        # of its plan's first run too.
        halves = np.arange(4.0) / 2
        for _ in range(2):
            got = reshard.reshard({"v": halves.astype(np.float64 if me == 0 else np.float32)},
                                  {"v": dst["py"]})["v"]  # fmt: skip
            check(got, halves.astype(np.float32), dst["py"])
        # The same bytes typed differently (x64 on process 0 only): the error says so.
        try:
            with jax.enable_x64(me == 0):
                reshard.reshard({"v": np.arange(4.0)}, {"v": dst["py"]})
            raise AssertionError("no error for values typed differently across processes")
        except ValueError as e:
            assert "the type it takes differs between processes, here ['v']: " in str(e), e
            assert f"float{64 if me == 0 else 32}[4]" in str(e) and "jax_enable_x64" in str(e), e
        move(b, ns(devs[:1], ("a",), P()), ns(devs[::-1], ("a",), P(None, "a")))

    def random_cases() -> None:
        # Seeded, so that every process draws the same cases: random device subsets
        # of every process, meshes, specs, shapes, element types and memory kinds.
        # RESHARD_TEST_RANDOM_CASES and RESHARD_TEST_RANDOM_SEED draw more or other
        # cases, for a longer search outside the suite.
        rng = np.random.default_rng(_random_seed())
        dtypes = [
            np.float32,
            jnp.bfloat16,
            jnp.float8_e5m2,
            jnp.float4_e2m1fn,
            np.int8,
            np.bool_,
            jnp.int4,
            np.complex64,
        ]
        kinds = [None, "device", "pinned_host"]
        for case in range(int(os.environ.get("RESHARD_TEST_RANDOM_CASES", "16"))):
            ndim = int(rng.choice([0, 1, 2, 2, 3, 3]))
            layouts = [_random_layout(rng, n, ndim) for _ in range(2)]
            shape = tuple(
                math.lcm(a, b) * int(rng.integers(1, 5))
                for a, b in zip(layouts[0][3], layouts[1][3], strict=True)
            )
            dtype = dtypes[int(rng.integers(len(dtypes)))]
            src, dst = (
                ns(devs[pos], names, P(*entries), kinds[int(rng.integers(len(kinds)))])
                for pos, names, entries, _ in layouts
            )
            # Both layouts may fall within one process: that process then moves the
            # array alone, with the host executor, and the others hold none of it.
            processes = {d.process_index for d in (*src.device_set, *dst.device_set)}
            executor = "collective" if len(processes) > 1 else "host"
            move(_ground_truth(shape, dtype, case), src, dst, executor)

    def random_trees() -> None:
        # The options together, seeded like random_cases: a pytree of 1-4 random
        # arrays (some moving within one process, some across) with a PRNG-key array
        # and a Python scalar, through reshard.reshard or plan().execute, cached or
        # not, called once or twice, donating or not, with any may_alias, and now and
        # then avoiding devices that no destination uses (DataLossError, raised by
        # every process, exactly where some box then has no copy left). The default 5
        # on 8 devices include both: avoided devices with and without a loss.
        # RESHARD_TEST_RANDOM_TREES draws more of them.
        rng = np.random.default_rng(_random_seed() + 1)
        dtypes = [np.float32, jnp.bfloat16, np.int8, np.bool_, jnp.int4, np.complex64]
        kinds = [None, "device", "pinned_host"]
        keys = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(3), 2 * n)))
        for case in range(int(os.environ.get("RESHARD_TEST_RANDOM_TREES", "5"))):
            hosts, srcs, dsts = {}, {}, {}
            for i in range(int(rng.integers(1, 5))):
                k = f"a{i}"
                ndim = int(rng.choice([0, 1, 2, 2, 3]))
                layouts = [_random_layout(rng, n, ndim) for _ in range(2)]
                shape = tuple(
                    math.lcm(a, b) * int(rng.integers(1, 4))
                    for a, b in zip(layouts[0][3], layouts[1][3], strict=True)
                )
                dtype = dtypes[int(rng.integers(len(dtypes)))]
                srcs[k], dsts[k] = (
                    ns(devs[pos], names, P(*entries), kinds[int(rng.integers(len(kinds)))])
                    for pos, names, entries, _ in layouts
                )
                hosts[k] = _ground_truth(shape, dtype, 100 + 10 * case + i)
            donate, cache, twice, via_plan = (bool(rng.integers(2)) for _ in range(4))
            may_alias = [None, True, False][int(rng.integers(3))]
            avoid: list[Any] = []
            used = {d for s in dsts.values() for d in s.device_set}
            free = [d for d in devs if d not in used]
            if free and rng.integers(3) == 0:
                avoid = list(rng.choice(free, int(rng.integers(1, len(free) + 1)), replace=False))
            # The ground truth of a loss: some element has no holder left.
            gone = {d.id for d in avoid}
            lost = any(not surviving_mask(h.shape, srcs[k], gone).all() for k, h in hosts.items())
            mesh = next(iter(dsts.values())).mesh
            replicated = ns(mesh.devices, mesh.axis_names, P())
            targets = {**dsts, "key": replicated, "py": replicated}
            for _ in range(1 + twice):
                x: dict[Any, Any] = {k: make(h, srcs[k]) for k, h in hosts.items()}
                x["key"] = jax.random.wrap_key_data(make(keys, ns(devs, ("k",), P())))
                x["py"] = 3
                try:
                    if via_plan:
                        p = reshard.plan(x, targets, cache=cache, avoid_devices=avoid)
                        y = p.execute(x, donate=donate, may_alias=may_alias)
                    else:
                        y = reshard.reshard(
                            x,
                            targets,
                            donate=donate,
                            may_alias=may_alias,
                            cache_resharding_plans=cache,
                            avoid_devices=avoid,
                        )
                except reshard.DataLossError:
                    if not lost:
                        MISMATCHES.append(f"case {case}: DataLossError, but nothing is lost")
                    for k, h in hosts.items():
                        check(x[k], h, srcs[k])  # the inputs are intact
                    continue
                if lost:
                    MISMATCHES.append(f"case {case}: a loss that raised no DataLossError")
                for k, h in hosts.items():
                    check(y[k], h, dsts[k])
                    if donate:
                        if not x[k].is_deleted():
                            MISMATCHES.append(f"case {case}: donated leaf {k} not deleted")
                    else:
                        check(x[k], h, srcs[k])
                check(y["key"], keys, replicated)
                check(y["py"], np.asarray(3, np.int32), replicated)

    host_only = (
        a_process_failing_mid_reshard_fails_every_process,
        a_slow_peer_still_reads_why_a_call_failed,
        a_process_failing_after_the_transfer_fails_alone,
        within_one_process,  # (whatever the packing: run once per layout)
        a_local_call_in_another_thread_leaves_the_count_alone,
        local_plans_leave_cached_collective_plans_alone,
    )
    device_only = (
        a_process_failing_before_the_program_fails_every_process,
        device_packed_in_groups,
        a_failure_within_one_process_keeps_the_last_reason,
    )
    return {
        f.__name__: f
        for f in (
            *(host_only if _collective_executor.PACK_ON_HOST else device_only),
            disjoint,
            overlapping,
            shrink_8_to_6,
            grow,
            replicated_sources,
            special_values_move_bit_for_bit,
            same_devices_relayout,
            unchanged_shards_kept_or_copied,
            no_union_device_on_some_processes,
            memory_kinds,
            whole_source_shards_sent_as_they_are,
            output_is_what_device_put_returns,
            pytree_of_dtypes_and_keys,
            cached_plan_reuses_the_program,
            donation_frees_sources_after_success,
            donation_keeps_what_outputs_hold,
            failure_leaves_inputs_intact,
            a_transfer_guard_on_one_process_fails_in_step,
            agreement_leaves_avoided_devices_out,
            different_lost_devices_raise_on_every_process,
            a_device_failing_mid_move_is_marked_lost_on_every_process,
            different_arguments_raise_on_every_process,
            a_call_failing_on_one_process_is_not_paired_with_its_next,
            a_call_refused_on_one_process_fails_every_process_at_once,
            failed_calls_leave_no_keys_behind,
            calls_in_another_order_raise_on_every_process,
            sixty_four_bit_types_with_x64_on,
            host_values_put_on_every_process,
            random_cases,
            random_trees,
        )
    }


def _run_scenarios(
    packs: Sequence[str],
    only: Sequence[str] | None = None,
    device_skips: Sequence[str] = (),
) -> dict[str, dict[str, str]]:
    """Runs every scenario (or those named in ``only``; device-packed, none named in
    ``device_skips``) in this process, once per packing in ``packs`` ("host", "device",
    or "host-kept": host-packed with kept shards copied by PjRt, as off CPU), one after
    the other in one launch (a launch costs seconds); returns packing -> name -> "ok"
    or the traceback."""
    import jax

    from reshard import _collective_executor

    assert jax.process_count() > 1
    reports: dict[str, dict[str, str]] = {}
    for pack in packs:
        _collective_executor.PACK_ON_HOST = pack != "device"
        _collective_executor.KEPT_ON_DEVICE = True if pack == "host-kept" else None
        report = reports[pack] = {}
        for name, fn in _scenarios().items():
            if (only is not None and name not in only) or (
                pack == "device" and name in device_skips
            ):
                continue
            MISMATCHES.clear()
            try:
                fn()
                report[name] = "\n".join(MISMATCHES) or "ok"
            except Exception:
                report[name] = traceback.format_exc()
    return reports


def _across_halves(seed: int) -> tuple[Any, Any, Any]:
    """fsdp on the first half of the devices, tp on the second, and a 48x48 array
    sharded the first way."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = np.array(jax.devices())
    half = len(devs) // 2
    a = NamedSharding(Mesh(devs[:half], ("f",)), P("f"))
    b = NamedSharding(Mesh(devs[half:], ("t",)), P(None, "t"))
    host = _ground_truth((48, 48), np.float32, seed)
    x = jax.make_array_from_callback(host.shape, a, lambda idx: host[idx], dtype=host.dtype)
    return a, b, x


def _interrupted_between_stages() -> list[str]:
    """Process 1 is interrupted (SIGINT) between two stages of a cached host-packed
    reshard of a tree with a host value (checked across processes after the stages),
    catches the ``KeyboardInterrupt`` and goes on, as a notebook would; then every
    process reshards again; then process 1 is interrupted while process 0 fails
    (packing), then a last call. Each call's outcome, per process."""
    import os
    import signal
    import time

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _collective_executor, _collective_host

    _collective_host.CHUNK_BYTES = _collective_host.STAGE_BYTES = 1024
    a, b, x = _across_halves(5)
    host = _ground_truth((48, 48), np.float32, 5)
    # On devices of every process: checked across processes, by a gather.
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("a",)), P())
    tree, dst = {"x": x, "step": np.int32(3)}, {"x": b, "step": everywhere}
    reshard.reshard(tree, dst, cache_resharding_plans=True)  # checked, cached
    compiled = _collective_executor.CollectiveProgram.compiled
    pack = _collective_host._pack_stage
    me, call = jax.process_index(), [0]
    stages: list[int] = []

    def interrupting(self: Any, s: int) -> Any:
        stages.append(s)
        if me == 1 and call[0] in (0, 2) and s == 1:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs here, in the main thread
        return compiled(self, s)

    def failing(*args: Any) -> Any:
        if me == 0 and call[0] == 2:
            raise MemoryError("injected: out of host memory while packing")
        return pack(*args)

    _collective_executor.CollectiveProgram.compiled = interrupting  # type: ignore[method-assign]
    _collective_host._pack_stage = failing
    outcomes = []
    for call[0] in range(4):
        try:
            y = reshard.reshard(tree, dst, cache_resharding_plans=True)
            same = int(y["step"]) == 3 and all(
                np.array_equal(as_bits(s.data), as_bits(host[s.index]))
                for s in y["x"].addressable_shards
            )
            outcomes.append(f"returned, {'right' if same else 'WRONG'} values")
        except KeyboardInterrupt as e:
            notes = " ".join(getattr(e, "__notes__", []))
            how = "held" if "was held until" in notes else notes
            if e.__cause__ is not None:
                how += f" from {type(e.__cause__).__name__}"
            outcomes.append(f"interrupted, {how}")
        except Exception as e:
            outcomes.append(f"{type(e).__name__}")
    assert len(set(stages)) > 2, stages  # several stages per call
    assert not x.is_deleted()
    return outcomes


def _interrupted_twice_waiting_for_a_peer() -> str:
    """Process 0 makes a call that process 1 never makes, and is interrupted twice
    while it waits in the plan's first-run check: the first interrupt is held, the
    second stops the call. What process 0 saw, and after how long."""
    import os
    import signal
    import threading
    import time

    import jax

    import reshard

    _, b, x = _across_halves(6)
    if jax.process_index() == 1:
        time.sleep(6)
        return "skipped"

    def interrupt() -> None:
        for _ in range(2):
            time.sleep(2)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    t = time.monotonic()
    try:
        reshard.reshard(x, b)
        return "returned"
    except KeyboardInterrupt:
        return f"interrupted after {time.monotonic() - t:.1f} s"


def _reshard_until_killed(victim: int, kill_at: int) -> int:
    """Reshards back and forth across processes; process ``victim`` dies mid-way."""
    import os
    import signal

    import jax

    import reshard

    a, b, x = _across_halves(3)
    for i in range(10_000):
        if i == kill_at and jax.process_index() == victim:
            print("dying now", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        x = reshard.reshard(x, b if i % 2 == 0 else a, cache_resharding_plans=True)
        jax.block_until_ready(x)
    return i


def _skip_a_reshard(skipper: int, limit_s: float, pack_on_host: bool, change: bool) -> None:
    """Every process reshards once; then process ``skipper`` gets stuck instead of
    making the second call (or, with ``change``, makes it with another destination,
    which the others' cached plan is not checked against), and the others wait for it
    with the watchdog on."""
    import os
    import time

    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _collective_executor

    _collective_executor.PACK_ON_HOST = pack_on_host
    os.environ["RESHARD_COLLECTIVE_TIMEOUT_S"] = str(limit_s)
    _, b, x = _across_halves(4)
    jax.block_until_ready(reshard.reshard(x, b, cache_resharding_plans=True))
    # The watchdog stayed quiet. (Not flushed: the watchdog's exit must flush it.)
    print("first reshard done")
    if jax.process_index() == skipper:
        if not change:
            time.sleep(90)
        b = NamedSharding(b.mesh, P("t"))
    jax.block_until_ready(reshard.reshard(x, b, cache_resharding_plans=True))


def _skip_a_host_value_call(limit_s: float) -> None:
    """Every process puts a host value on devices of every process once; then process
    1 gets stuck instead of making the second such call, and process 0 waits for it in
    the values' check with the watchdog on."""
    import os
    import time

    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard

    os.environ["RESHARD_COLLECTIVE_TIMEOUT_S"] = str(limit_s)
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("a",)), P())
    jax.block_until_ready(reshard.reshard({"step": 3}, everywhere))
    print("first call done", flush=True)
    if jax.process_index() == 1:
        time.sleep(90)
    jax.block_until_ready(reshard.reshard({"step": 4}, everywhere))


# --- tests -------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_a_process_killed_mid_reshard_fails_the_others_in_bounded_time() -> None:
    # A long grace period: the survivors must fail on their own (broken gloo
    # connection or heartbeat), not be killed by the launcher.
    results = launch_local(
        f"{HERE}:_reshard_until_killed",
        num_processes=3,
        devices_per_process=2,
        args=[1, 20],
        check=False,
        heartbeat_timeout_s=5,
        peer_failure_grace_s=60,
        timeout_s=100,
    )
    dead = results[1]
    assert dead.returncode == -9 and "dying now" in dead.stdout, dead.describe()
    for r in (results[0], results[2]):
        assert not r.ok and not r.terminated, r.describe()
        assert r.duration_s - dead.duration_s < 30, [x.describe() for x in results]
        assert ("Gloo" in r.stderr) or ("detected fatal errors" in r.stderr), r.stderr[-2000:]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "pack,change", [("host", False), ("device", False), ("host", True)],
    ids=["host-skips", "device-skips", "host-changes-its-destination"],
)  # fmt: skip
def test_a_process_skipping_a_call_ends_every_process_with_the_watchdog_on(
    pack: str, change: bool
) -> None:
    # A changed destination on a later call is the same to the others: their plan is
    # cached and checked once, so they run its transfers while the changed process
    # waits to check its new plan.
    from reshard._collective_executor import TIMEOUT_EXIT_CODE

    limit_s = 4.0
    # Once with stdout buffered, as outside the launcher: what a process printed before
    # the watchdog ended it still reaches its stdout.
    buffered = pack == "host" and not change
    results = launch_local(
        f"{HERE}:_skip_a_reshard",
        num_processes=3,
        devices_per_process=2,
        args=[2, limit_s, pack == "host", change],
        check=False,
        heartbeat_timeout_s=5,
        peer_failure_grace_s=60,
        timeout_s=100,
        env={"PYTHONUNBUFFERED": ""} if buffered else None,
    )
    described = [r.describe() for r in results]
    for r in results:
        # (The stuck process is aborted by JAX when its peers are gone: no flush.)
        if not (buffered and r.process_id == 2):
            assert "first reshard done" in r.stdout, described
        assert not r.ok and not r.terminated, described  # each ended on its own
    for r in results[:2]:  # they waited for process 2: the watchdog ended them
        assert r.returncode == TIMEOUT_EXIT_CODE, described
        assert "RESHARD_COLLECTIVE_TIMEOUT_S" in r.stderr, r.stderr[-2000:]
        assert r.duration_s < limit_s + 30, described
    # The stuck process learned that its peers are gone long before its sleep ended.
    assert results[2].duration_s < 60, described


@pytest.mark.timeout(90)
def test_an_interrupt_between_stages_is_held_until_the_process_is_done() -> None:
    # Interrupted between two stages and going on, process 1 met its peers' unfinished
    # call with its next one: every process hung. Held, it ends process 1's call after
    # the last stage, with no results; process 0's call returns, and both stay in step.
    # Held past the check of host values after the stages too (it raised before it, and
    # the others waited there); and raised from the call's error where it failed too.
    results = launch_local(f"{HERE}:_interrupted_between_stages", 2, 2, timeout_s=60)
    ok = "returned, right values"
    assert results[0].value == [ok, ok, "MemoryError", ok], results[0].value
    assert results[1].value == [
        "interrupted, held",
        ok,
        "interrupted, held from RuntimeError",
        ok,
    ], results[1].value
    assert "interrupt held until" in results[1].stderr, results[1].stderr[-2000:]


@pytest.mark.timeout(90)
def test_a_second_interrupt_stops_a_call_waiting_for_a_peer() -> None:
    # A peer that never comes: the first interrupt is held (and seen within a second,
    # not after the store's next minute), the second stops the call at once.
    results = launch_local(
        f"{HERE}:_interrupted_twice_waiting_for_a_peer", 2, 2, timeout_s=60, check=False
    )
    assert results[1].value == "skipped", results[1].describe()
    # (Interrupted at ~2 s and ~4 s: the first was held, the second seen at once.)
    got = re.fullmatch(r"interrupted after ([0-9.]+) s", str(results[0].value))
    assert got and 3.5 < float(got.group(1)) < 15, results[0].describe()


_WATCHED_WITH_A_FULL_STDERR = """
import fcntl, os, sys, time
from reshard._collective_executor import watchdog
flags = fcntl.fcntl(2, fcntl.F_GETFL)
fcntl.fcntl(2, fcntl.F_SETFL, flags | os.O_NONBLOCK)
try:
    while True:
        os.write(2, b"x" * 4096)
except BlockingIOError:
    pass
fcntl.fcntl(2, fcntl.F_SETFL, flags)
print("stderr full", flush=True)
with watchdog(0.5):
    time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_the_watchdog_ends_its_process_though_stderr_is_a_full_pipe() -> None:
    # Its message to stderr, which nobody reads here, must not keep it from exiting: it
    # did, for good, while the process's peers waited in their collectives.
    import subprocess

    from reshard._collective_executor import TIMEOUT_EXIT_CODE

    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-c", _WATCHED_WITH_A_FULL_STDERR]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as child:
        try:
            returncode = child.wait(timeout=30)
        finally:
            child.kill()
        assert child.stdout is not None
        assert child.stdout.read() == b"stderr full\n"
    assert returncode == TIMEOUT_EXIT_CODE


@pytest.mark.timeout(120)
def test_a_process_skipping_a_host_value_call_ends_the_others_with_the_watchdog_on() -> None:
    # Host values put on devices of every process are checked by a collective: a
    # process that skips the call leaves the others in it, which the watchdog ends.
    from reshard._collective_executor import TIMEOUT_EXIT_CODE

    limit_s = 4.0
    results = launch_local(
        f"{HERE}:_skip_a_host_value_call",
        num_processes=2,
        devices_per_process=1,
        args=[limit_s],
        check=False,
        heartbeat_timeout_s=5,
        peer_failure_grace_s=60,
        timeout_s=100,
    )
    described = [r.describe() for r in results]
    assert all("first call done" in r.stdout for r in results), described
    assert results[0].returncode == TIMEOUT_EXIT_CODE, described
    assert "RESHARD_COLLECTIVE_TIMEOUT_S" in results[0].stderr, described
    assert results[0].duration_s < limit_s + 30, described
    assert not results[1].ok and results[1].duration_s < 60, described  # its peer is gone


def _skip_a_first_run(wait_s: float) -> str:
    """Process 1 skips a call whose plan runs for the first time; process 0 waits in
    the check of that plan (no watchdog) and gives up after ``wait_s``."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _collective_executor

    _collective_executor.AGREE_WAIT_S = wait_s
    devs = np.array(jax.devices())
    x = jax.make_array_from_callback(
        (8,), NamedSharding(Mesh(devs[:1], ("a",)), P()), lambda i: np.arange(8.0)[i], dtype=float
    )
    if jax.process_index() == 1:
        time.sleep(2 * wait_s)  # (then leaves, without the call)
        return "skipped"
    try:
        reshard.reshard(x, NamedSharding(Mesh(devs[1:], ("b",)), P()))
    except RuntimeError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_a_first_run_check_waits_for_a_skipped_call_only_so_long() -> None:
    results = launch_local(f"{HERE}:_skip_a_first_run", 2, 1, args=[1.0], timeout_s=40)
    assert results[1].value == "skipped"
    assert results[0].value.startswith("reshard: waited 1 s for processes [1] to check"), results
    assert "skipped the call, or are out of step" in results[0].value


def test_collective_timeout_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from reshard._collective_executor import ENV_TIMEOUT_S, collective_timeout_s

    monkeypatch.delenv(ENV_TIMEOUT_S, raising=False)
    assert collective_timeout_s() == 0
    monkeypatch.setenv(ENV_TIMEOUT_S, " 2.5 ")
    assert collective_timeout_s() == 2.5
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv(ENV_TIMEOUT_S, bad)
        with pytest.raises(ValueError, match=ENV_TIMEOUT_S):
            collective_timeout_s()


SCENARIOS = [
    "disjoint",
    "overlapping",
    "shrink_8_to_6",
    "grow",
    "replicated_sources",
    "special_values_move_bit_for_bit",
    "same_devices_relayout",
    "unchanged_shards_kept_or_copied",
    "no_union_device_on_some_processes",
    "memory_kinds",
    "whole_source_shards_sent_as_they_are",
    "output_is_what_device_put_returns",
    "pytree_of_dtypes_and_keys",
    "cached_plan_reuses_the_program",
    "donation_frees_sources_after_success",
    "donation_keeps_what_outputs_hold",
    "failure_leaves_inputs_intact",
    "a_transfer_guard_on_one_process_fails_in_step",
    "agreement_leaves_avoided_devices_out",
    "different_lost_devices_raise_on_every_process",
    "a_device_failing_mid_move_is_marked_lost_on_every_process",
    "different_arguments_raise_on_every_process",
    "a_call_failing_on_one_process_is_not_paired_with_its_next",
    "a_call_refused_on_one_process_fails_every_process_at_once",
    "failed_calls_leave_no_keys_behind",
    "calls_in_another_order_raise_on_every_process",
    "sixty_four_bit_types_with_x64_on",
    "host_values_put_on_every_process",
    "random_cases",
    "random_trees",
]
# Scenarios of random cases (and the widest trees), which compile device-packed
# programs per case.
RANDOM_SCENARIOS = [
    "random_cases",
    "random_trees",
    "pytree_of_dtypes_and_keys",
    "sixty_four_bit_types_with_x64_on",
]
# Failures part-way through: the host-packed schedule's filler stages and status.
HOST_SCENARIOS = [
    "within_one_process",
    "a_local_call_in_another_thread_leaves_the_count_alone",
    "local_plans_leave_cached_collective_plans_alone",
    "a_process_failing_mid_reshard_fails_every_process",
    "a_slow_peer_still_reads_why_a_call_failed",
    "a_process_failing_after_the_transfer_fails_alone",
]
# Failures before the device-packed program: the status exchanged before calling it.
DEVICE_SCENARIOS = [
    "a_process_failing_before_the_program_fails_every_process",
    "device_packed_in_groups",
    "a_failure_within_one_process_keeps_the_last_reason",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("procs,devices", [(2, 4), (4, 2)], ids=["2x4", "4x2"])
def test_every_scenario_on_every_process(procs: int, devices: int) -> None:
    # Both packings in one launch: host-packed first, then device-packed. The random
    # scenarios, whose device-packed programs compile for each case (~21 s of 4 x 2's
    # ~69 s), run device-packed in the 2 x 4 layout only (host-packed in both).
    skips = RANDOM_SCENARIOS if (procs, devices) == (4, 2) else []
    results = launch_local(
        f"{HERE}:_run_scenarios",
        num_processes=procs,
        devices_per_process=devices,
        args=[["host", "device"], None, skips],
        timeout_s=200,
    )
    assert len(results) == procs
    failures = []
    for r in results:
        assert sorted(r.value) == ["device", "host"]
        for pack, report in r.value.items():
            want = SCENARIOS + (HOST_SCENARIOS if pack == "host" else DEVICE_SCENARIOS)
            want = [n for n in want if pack == "host" or n not in skips]
            assert sorted(report) == sorted(want), (pack, report.keys())
            failures += [
                f"process {r.process_id}, {pack}-packed, {name}:\n{tb}"
                for name, tb in report.items()
                if tb != "ok"
            ]
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("procs,devices", [(3, 2), (2, 3)], ids=["3x2", "2x3"])
def test_random_cases_with_odd_counts_of_processes_and_devices(procs: int, devices: int) -> None:
    # The named scenarios cut arrays in halves of 8 devices; the random cases draw
    # meshes over whatever devices there are: 3 processes (a status summed over an odd
    # count, sources preferred in a process of three), or 3 devices per process.
    results = launch_local(
        f"{HERE}:_run_scenarios",
        num_processes=procs,
        devices_per_process=devices,
        args=[["host", "device"], ["random_cases"]],
        timeout_s=120,
    )
    assert len(results) == procs
    for r in results:
        want = {"random_cases": "ok"}
        assert r.value == {"host": want, "device": want}, f"process {r.process_id}: {r.value}"


@pytest.mark.timeout(150)
def test_processes_with_different_device_counts() -> None:
    # Hosts of different sizes (a trainer's of 3 devices, a sampler's of 1, ...): the
    # random moves and trees between them, and host values put on devices of every
    # process, which jax.device_put cannot do there (it fails to lay the devices out as
    # processes x local devices, to check that the values agree).
    # (random_trees moves 1-4 random arrays per tree, within and across processes.)
    # Also host-packed with kept shards copied by PjRt, as off CPU (KEPT_ON_DEVICE).
    only = ["host_values_put_on_every_process", "random_trees"]
    packs = ["host", "device", "host-kept"]
    results = launch_local(
        f"{HERE}:_run_scenarios",
        num_processes=3,
        devices_per_process=[3, 1, 2],
        args=[packs, only],
        timeout_s=120,
    )
    for r in results:
        want = {name: "ok" for name in only}
        assert r.value == dict.fromkeys(packs, want), f"process {r.process_id}: {r.value}"


@pytest.mark.timeout(150)
def test_failures_mid_reshard_with_kept_shards_copied_on_device() -> None:
    # Host-packed with kept shards copied by PjRt, as off CPU (KEPT_ON_DEVICE): a
    # process failing in those copies, as in the other failures mid-reshard, makes every
    # process raise; whole shards traded within processes are copied device to device.
    only = ["a_process_failing_mid_reshard_fails_every_process", "unchanged_shards_kept_or_copied"]
    results = launch_local(
        f"{HERE}:_run_scenarios",
        num_processes=2,
        devices_per_process=4,
        args=[["host-kept"], only],
        timeout_s=120,
    )
    for r in results:
        assert r.value == {"host-kept": dict.fromkeys(only, "ok")}, f"{r.process_id}: {r.value}"


def _many_small_stages(reps: int) -> list[bool]:
    """A case a fuzzer found: 144 small host-packed stages across 3 processes x 2
    devices, repeated; whether each call's shards here match numpy."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _collective_host as ch

    ch.CHUNK_BYTES, ch.STAGE_BYTES, ch.MIN_STAGE_BYTES = 64, 256, 64
    ch.WHOLE_BYTES, ch.WHOLE_ARRIVING_BYTES, ch.WHOLE_STAGE_BYTES = (128, 256), 64, 512
    ch.BUNDLED = False
    devs = np.array(jax.devices())
    host = _ground_truth((768, 160), np.int8, 16)
    src = NamedSharding(Mesh(devs[[2, 5]], ("x",)), P("x", None))
    mesh = Mesh(devs[[5, 2, 4, 1, 3]].reshape(1, 1, 5), ("x", "y", "z"))
    dst = NamedSharding(mesh, P(None, "z"))
    x = jax.make_array_from_callback(host.shape, src, lambda i: host[i], dtype=host.dtype)
    reshard.plan(x, dst, executor="collective", cache=False)
    out = []
    for _ in range(reps):
        y = reshard.reshard(x, dst, executor="collective", cache_resharding_plans=True)
        out.append(
            y.sharding == dst
            and all(
                as_bits(s.data).tobytes() == as_bits(host[s.index]).tobytes()
                for s in y.addressable_shards
            )  # fmt: skip
        )
    return out


@pytest.mark.timeout(150)
def test_many_small_stages_in_flight_do_not_deadlock() -> None:
    # Every stage was dispatched as soon as it was packed, several in flight at once;
    # XLA may run one program's parts on a process's devices at different times, and
    # then two stages' collectives met in different orders on different processes: all
    # three waited until RESHARD_COLLECTIVE_TIMEOUT_S (one run in three under load, with
    # this case, before stages went one at a time).
    results = launch_local(
        f"{HERE}:_many_small_stages", 3, 2, args=[2], timeout_s=120,
        env={"RESHARD_COLLECTIVE_TIMEOUT_S": "60"},
    )  # fmt: skip
    assert [r.value for r in results] == [[True, True]] * 3


def _inexact_type_across_processes() -> dict[str, Any]:
    """Programs made lossy for bfloat16 on every process (NaNs made canonical, as a
    TPU does to float16; see ``reshard._exact``), device packing asked for: each
    process measures the type on its own devices, all choose host packing, and every
    bit arrives. Returns the packing chosen and whether each array here is exact."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _collective_device, _collective_executor, _local_executor

    lossy = lossy_bf16_to_bits(_local_executor.to_bits)
    _local_executor.to_bits = _collective_device.to_bits = lossy
    _collective_executor.PACK_ON_HOST = False
    devs = np.array(jax.devices())
    src = NamedSharding(Mesh(devs[:2], ("a",)), P("a"))  # process 0's devices
    dst = NamedSharding(Mesh(devs[1:3], ("b",)), P(None, "b"))  # across both
    hosts = [_ground_truth((16, 24), jnp.bfloat16, 21), _ground_truth((16, 24), np.float32, 22)]
    xs = [
        jax.make_array_from_callback(h.shape, src, lambda i, h=h: h[i], dtype=h.dtype)
        for h in hosts
    ]
    p = reshard.plan(xs, [dst, dst])
    ys = p.execute(xs)
    (program,) = [
        v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
    ]
    exact = [
        y.sharding == dst
        and all(
            as_bits(s.data).tobytes() == as_bits(h[s.index]).tobytes() for s in y.addressable_shards
        )  # fmt: skip
        for y, h in zip(ys, hosts, strict=True)
    ]
    return {"host_packed": program.host_packed, "exact": exact}


@pytest.mark.timeout(120)
def test_types_programs_change_are_packed_on_host_by_every_process() -> None:
    results = launch_local(f"{HERE}:_inexact_type_across_processes", 2, 2, timeout_s=90)
    assert [r.value for r in results] == [{"host_packed": True, "exact": [True, True]}] * 2


# --- in this process: the schedule, and the executor with one controller ----------


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6)), min_size=0, max_size=60),
)
def test_color_edges_gives_permutations_in_max_degree_rounds(
    edges: list[tuple[int, int]],
) -> None:
    from reshard._collective_executor import color_edges

    colours = color_edges(edges)
    assert len(colours) == len(edges)
    senders = {(u, c) for (u, _), c in zip(edges, colours, strict=True)}
    receivers = {(v, c) for (_, v), c in zip(edges, colours, strict=True)}
    # A colour is a round: nobody sends twice or receives twice in it.
    assert len(senders) == len(edges) and len(receivers) == len(edges)
    degree = max(
        [sum(1 for u, _ in edges if u == k) for k in range(7)]
        + [sum(1 for _, v in edges if v == k) for k in range(7)]
    )
    assert set(colours) == set(range(degree))  # König: max degree rounds, no more


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pack_on_host", [True, False], ids=["host-packed", "device-packed"])
def test_collective_executor_in_one_process(
    pack_on_host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _collective_executor

    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    devs = np.array(jax.devices())
    host = _ground_truth((48, 32), np.float32, 1)
    cases = [
        (
            NamedSharding(Mesh(devs[:4], "f"), P("f")),
            NamedSharding(Mesh(devs[4:], "t"), P(None, "t")),
        ),
        (NamedSharding(Mesh(devs, "f"), P("f")), NamedSharding(Mesh(devs[:6], "t"), P("t"))),
        (
            NamedSharding(Mesh(devs[:4], "f"), P(), memory_kind="pinned_host"),
            NamedSharding(Mesh(devs.reshape(2, 4), ("d", "m")), P("m", "d")),
        ),
    ]
    for src, dst in cases:
        x = jax.device_put(host, src)
        p = reshard.plan(x, dst, executor="collective")
        assert p.executor == "collective"
        y = p.execute(x)
        assert y.sharding == dst
        for s in y.addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), host[s.index])
        assert {s.device for s in y.addressable_shards} == set(dst.device_set)
        np.testing.assert_array_equal(np.asarray(x), host)  # input untouched
