"""Benchmark: ``reshard`` across 2 local JAX processes against the ppermute floor.

Multi-controller JAX on one machine: 2 processes x 4 simulated CPU devices, gloo
collectives over loopback (``reshard._launch.launch_local``). An LLM-shaped pytree
(bf16 matrices, f32 norms) moves from process 0's devices, sharded fsdp-style along
rows, to process 1's devices, sharded tp-style along columns, so every moved byte
crosses the process boundary.

The floor is what this engine cannot beat: one plain ``shard_map`` +
``jax.lax.ppermute`` program that moves the same number of bytes
(``plan.stats.bytes_moved``) from each of process 0's devices to one device of
process 1, on the same union mesh, from buffers that already exist (nothing to
pack). Over gloo a few large buffers move slower than many smaller ones at once, so
the floor is timed with the bytes cut into 1 to 64 buffers per pair. Two ratios are
printed against it. The strict one takes the fastest of those rows; being the least of
eight noisy medians, that floor is biased low (whichever chunking had the luckiest
rounds wins). The unbiased one takes the chunking that was fastest in separate rounds
timed before, at its time in the same rounds as the reshards. A second reshard row moves the same tree to the same fsdp layout on process
1 (weight sync between equal layouts), where every shard travels whole. Under each
reshard row, "its own chunks" moves that reshard's own chunks (the same ``ppermute``s,
stages and buffer sizes, less the failure-status sum of its last stage) from buffers
that already exist: the reshard without its host work, which splits its distance
from the floor into the shape of its transfers and the packing, cutting and array
making around them. A last line times the fastest floor again, side by side with
the same floor while the receiving process does the relayout's copies alone, with the
executor's own copy routine (``copy_into``: the C extension where it is built, else
numpy), the column blocks of every matrix, at once, on the executor's copy threads: the
least any relayout that copies each byte once adds on this machine. A CPU line sums
both processes' CPU time per call (every thread, ``getrusage``): where the processes
keep every core busy, as on a 2-core machine, the time follows it. The next gives
each process's (the sender's, then the receiver's), for the reshards' own chunks too:
where a reshard's extra CPU lands. Times are
medians of several runs in one launch, every method timed once per round in turn, each
reshard on new array objects over the same buffers (``fresh_arrays``: as after a
training step, nothing cached on the arrays by an earlier call is reused); the ratio
``reshard / floor`` is the figure of merit (target: at most 1.5).

The machine's load moves the floor from launch to launch, so ``--launches N`` repeats
the whole 2-process run and prints each launch's ratios and their median. The quick
tree's ratios are higher than the full tree's (about 2.0-2.8x for the relayout on this
project's 2-core machine): with 40 MiB in 38 arrays, the fixed costs per reshard and
the copies of its many small pieces weigh more.

Run:
    python benchmarks/bench_multiprocess.py            # ~40 MB tree (quick)
    python benchmarks/bench_multiprocess.py --full     # ~290 MB tree
    python benchmarks/bench_multiprocess.py --full --launches 5 --no-single
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from typing import Any

import numpy as np

FLOOR_CHUNKS = (1, 4, 16, 24, 32, 40, 48, 64)


def llm_tree_shapes(full: bool) -> dict[str, tuple[tuple[int, ...], str]]:
    """Leaf path -> (shape, dtype) of an LLM-shaped parameter tree."""
    d, ff, layers, vocab = (1024, 4096, 8, 16384) if full else (512, 2048, 4, 8192)
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"embed": ((vocab, d), "bfloat16")}
    for i in range(layers):
        for name in ("wq", "wk", "wv", "wo"):
            shapes[f"layer{i}.{name}"] = ((d, d), "bfloat16")
        shapes[f"layer{i}.w_up"] = ((d, ff), "bfloat16")
        shapes[f"layer{i}.w_gate"] = ((d, ff), "bfloat16")
        shapes[f"layer{i}.w_down"] = ((ff, d), "bfloat16")
        shapes[f"layer{i}.norm1"] = ((d,), "float32")
        shapes[f"layer{i}.norm2"] = ((d,), "float32")
    shapes["final_norm"] = ((d,), "float32")
    return shapes


def _truth(shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """The values of one leaf, the same on every process (the ground truth)."""
    return (np.arange(int(np.prod(shape))) % 251).astype(dtype).reshape(shape)


def _index(host: np.ndarray, idx: Any) -> np.ndarray:
    return host[idx]


def _ones(n: int, idx: Any) -> np.ndarray:
    return np.ones(n, np.uint8)


def _sync() -> None:
    """All processes reach this point before the clock starts."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices("bench")


def _time(
    fns: dict[str, tuple[Any, Any]], reps: int, cpu: dict[str, list[float]] | None = None
) -> dict[str, list[float]]:
    """Seconds per call of each ``(function, tree)``, interleaved: every rep times each
    function once, so a change in machine load hits all of them alike (this machine is
    shared). The order rotates from rep to rep, so no function always runs after the
    same one (what ran before decides, for one, how much of the memory a run gets is
    warm). A function with a tree gets it as new array objects each time, made before
    the clock starts (``fresh_arrays``: as after a training step, nothing cached on the
    arrays by an earlier call is reused); one without is called with no argument.
    With ``cpu``, also this process's CPU seconds per call (user and system, every
    thread: ``getrusage``), by function name."""
    import resource

    import jax

    from reshard._timing import fresh_arrays

    for fn, tree in fns.values():  # warm-up: compiles and caches
        jax.block_until_ready(fn() if tree is None else fn(fresh_arrays(tree)))
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            fn, tree = fns[name]
            arg = None if tree is None else fresh_arrays(tree)
            _sync()
            u0 = resource.getrusage(resource.RUSAGE_SELF) if cpu is not None else None
            t0 = time.perf_counter()
            out = fn() if arg is None else fn(arg)
            jax.block_until_ready(out)
            times[name].append(time.perf_counter() - t0)
            if cpu is not None and u0 is not None:
                u1 = resource.getrusage(resource.RUSAGE_SELF)
                used = u1.ru_utime - u0.ru_utime + u1.ru_stime - u0.ru_stime
                cpu.setdefault(name, []).append(used)
            del out, arg
    return times


def _tree(full: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """The source tree on the first half of the devices, and the destination shardings."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = np.array(jax.devices())
    half = len(devs) // 2
    src_mesh, dst_mesh = Mesh(devs[:half], ("fsdp",)), Mesh(devs[half:], ("tp",))
    tree: dict[str, Any] = {}
    dst: dict[str, Any] = {}
    for path, (shape, dtype) in llm_tree_shapes(full).items():
        src_sh = NamedSharding(src_mesh, P("fsdp") if len(shape) == 2 else P())
        dst[path] = NamedSharding(dst_mesh, P(None, "tp") if len(shape) == 2 else P())
        host = _truth(shape, dtype)
        tree[path] = jax.make_array_from_callback(
            shape, src_sh, functools.partial(_index, host), dtype=host.dtype
        )
    return tree, dst


def _same_layout(tree: dict[str, Any]) -> dict[str, Any]:
    """Destinations with the source's layout on the other half of the devices (weight
    sync between equal layouts: every shard moves whole)."""
    import jax
    from jax.sharding import Mesh, NamedSharding

    devs = np.array(jax.devices())
    mesh = Mesh(devs[len(devs) // 2 :], ("fsdp",))
    return {path: NamedSharding(mesh, x.sharding.spec) for path, x in tree.items()}


def _verify(out: dict[str, Any], full: bool) -> None:
    """Every destination shard this process holds equals the ground truth."""
    for path, (shape, dtype) in llm_tree_shapes(full).items():
        host = _truth(shape, dtype)
        for s in out[path].addressable_shards:
            np.testing.assert_array_equal(np.asarray(s.data), host[s.index])


def worker_single(full: bool, reps: int) -> dict[str, Any]:
    """One process, 8 devices: the collective executor against the local one."""
    import jax

    import reshard
    from reshard import _collective_executor

    tree, dst = _tree(full)

    def run_with(p: Any, pack: bool | None) -> Any:
        # The packing is chosen when a call looks its program up: set it every call,
        # since the methods are timed in turn.
        def call(t: Any) -> Any:
            _collective_executor.PACK_ON_HOST = pack
            return p.execute(t)

        return call

    fns: dict[str, tuple[Any, Any]] = {}
    for name, executor, pack in (
        ("local executor (host)", "host", None),
        ("collective, host-packed", "collective", True),
        ("collective, device-packed", "collective", False),
    ):
        p = reshard.plan(tree, dst, executor=executor)
        fns[name] = (run_with(p, pack), tree)
        _verify(fns[name][0](tree), full)
    fns["jax.device_put"] = (lambda t: jax.device_put(t, dst), tree)
    times = _time(fns, reps)  # in turn, order rotating, as the 2-process table
    _collective_executor.PACK_ON_HOST = None
    return {"times": times, "bytes_moved": reshard.plan(tree, dst).stats.bytes_moved}


def worker(full: bool, reps: int) -> dict[str, Any]:
    """Runs in each launched process; returns this process's timings."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard

    devs = np.array(jax.devices())
    half = len(devs) // 2
    tree, dst = _tree(full)
    p = reshard.plan(tree, dst, executor="collective")
    moved = p.stats.bytes_moved
    _verify(p.execute(tree), full)  # correctness once, on this process's shards

    # The floor: the same bytes in plain ppermutes, each of process 0's devices to one
    # device of process 1. Over gloo one huge buffer is slower than a few chunks, so
    # several chunkings are timed and the fastest is the floor.
    union = Mesh(devs, ("r",))
    per_device = moved // half  # bytes each of process 0's devices sends
    pairs = [(i, i + half) for i in range(half)]
    fns: dict[str, tuple[Any, Any]] = {}
    floor_fns: dict[int, Any] = {}
    for chunks in FLOOR_CHUNKS:
        # Separate input buffers, returned as they arrive: nothing but the network.
        n = -(-per_device // chunks)
        bufs = [
            jax.make_array_from_callback(
                (len(devs) * n,),
                NamedSharding(union, P("r")),
                functools.partial(_ones, n),
                dtype=np.uint8,
            )
            for _ in range(chunks)
        ]
        fn = jax.jit(
            jax.shard_map(
                lambda *xs: tuple(jax.lax.ppermute(x, "r", pairs) for x in xs),
                mesh=union,
                in_specs=P("r"),
                out_specs=P("r"),
            )
        )
        floor_fns[chunks] = functools.partial(fn, *bufs)
        fns[str(chunks)] = (floor_fns[chunks], None)
    fns["reshard"] = (lambda t: reshard.reshard(t, dst, cache_resharding_plans=True), tree)
    # Weight sync between equal layouts moves the same bytes: every shard whole.
    same = _same_layout(tree)
    assert reshard.plan(tree, same).stats.bytes_moved == moved
    _verify(reshard.reshard(tree, same), full)
    fns["same"] = (lambda t: reshard.reshard(t, same, cache_resharding_plans=True), tree)
    program = _program(p)  # built by the verified run above
    same_plan = reshard.plan(tree, same, executor="collective")
    jax.block_until_ready(same_plan.execute(tree))  # builds its program
    fns["own"] = (_own_chunks(program), None)
    fns["same own"] = (_own_chunks(_program(same_plan)), None)
    # The least of eight noisy medians is biased low: whichever chunking had the
    # luckiest rounds wins. So the floor's chunking is also chosen in rounds of its own,
    # before the timed ones, and the reshards are compared with that chunking's time in
    # the same rounds as theirs (an unbiased floor), as well as with the fastest row.
    calibration = _time({str(c): (floor_fns[c], None) for c in FLOOR_CHUNKS}, reps)
    chosen = _agreed_fastest({c: statistics.median(calibration[str(c)]) for c in FLOOR_CHUNKS})
    cpu: dict[str, list[float]] = {}
    times = _time(fns, reps, cpu)
    reshard_t = times.pop("reshard")
    same_t = times.pop("same")
    own = {"relayout": times.pop("own"), "same": times.pop("same own")}
    floors = times
    # The least any fsdp -> tp relayout adds to the floor: the receiving process's one
    # copy per byte (each destination block's column block cut out of every source
    # shard that arrived), done by copy_into alone, at once, while the fastest floor moves
    # the bytes, timed side by side with that floor.
    best = _agreed_fastest({c: statistics.median(floors[str(c)]) for c in FLOOR_CHUNKS})
    cut = _relayout_cut(full) if jax.process_index() == 1 else None

    def floor_and_cut() -> Any:
        out = floor_fns[best]()
        if cut is not None:
            cut()
        return out

    with_cut = _time({"floor": (floor_fns[best], None), "cut": (floor_and_cut, None)}, reps)
    return {
        "bytes_moved": moved,
        "array_bytes": p.stats.array_bytes,
        "leaves": len(tree),
        "collectives": getattr(program, "collectives", None),
        "floor_s": floors,
        "reshard_s": reshard_t,
        "same_s": same_t,
        "own_s": own,
        "cut_s": with_cut,
        "cpu_s": cpu,
        "cut_chunks": best,
        "chosen_chunks": chosen,
    }


def _agreed_fastest(medians: dict[int, float]) -> int:
    """The floor chunking whose slowest process had the least median; every process
    gets the same answer."""
    from jax.experimental import multihost_utils

    keys = sorted(medians)
    mine = np.array([medians[k] for k in keys])
    every = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, len(keys))
    return keys[int(np.argmin(every.max(axis=0)))]


def _relayout_cut(full: bool) -> Any:
    """A function doing the copies the receiving process of the fsdp -> tp relayout
    does, as the executor copies them: for every matrix (all 4 source shards arrived,
    here one block), each of its 4 devices' column block out of every row, by one
    ``copy_pieces`` call per matrix split by bands between the copy threads."""
    from reshard import _buffers, _local_executor
    from reshard._buffers import copy_into, copy_pieces, piece_table

    tasks: list[Any] = []
    for shape, dtype in llm_tree_shapes(full).values():
        if len(shape) != 2:
            continue  # the norms: 4 KiB each
        src = np.ones(shape, dtype)
        width = shape[1] // 4
        dsts = [np.zeros((shape[0], width), dtype) for _ in range(4)]
        cols = [(slice(0, shape[0]), slice(k * width, (k + 1) * width)) for k in range(4)]
        everything = (slice(0, shape[0]), slice(0, width))
        size = np.dtype(dtype).itemsize
        tables = [
            piece_table([(0, c, everything)], [shape], d.shape, size)
            for c, d in zip(cols, dsts, strict=True)
        ]

        def cut(part: int, parts: int, src=src, dsts=dsts, cols=cols, tables=tables) -> None:
            native = _buffers.NATIVE_COPY and all(t is not None for t in tables)
            if native and copy_pieces([src], list(zip(dsts, tables, strict=True)), part, parts):
                return
            if part == 0:  # without the C extension: numpy, piece by piece
                for d, c in zip(dsts, cols, strict=True):
                    copy_into(d, src[c])

        tasks += _local_executor.banded_tasks(src.nbytes, cut)
    return lambda: _local_executor.run_copies(tasks)


def _program(plan: Any) -> Any:
    """The collective program that ``plan`` has built and cached."""
    return next(v for v in plan._cache.values() if hasattr(v, "collectives"))


def _own_chunks(program: Any) -> Any:
    """A function that moves a host-packed program's own chunks, stage by stage, with
    the same ``ppermute``s and buffer sizes, from buffers that already exist: the
    reshard's transfers without its host work (packing, unpacking, making arrays) and
    without the failure-status ``psum`` of its last stage (~1-2 ms over gloo here).
    Each stage is waited for before the next is called, as reshard does (until
    2026-12-06 they were all called at once, which reshard never does; one at a time
    the relayout's row read 1.11-1.20x the floor in its first three launches, inside
    the 1.07-1.28x read before)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from reshard._collective_common import AXIS

    n = len(program.devices)
    calls = []
    for stage in program.host.stages:
        chunks = [program.host.chunks[ci] for ci in stage]
        bufs = [
            jax.make_array_from_callback(
                (n * ch.nbytes,),
                program.block_sharding,
                functools.partial(_ones, ch.nbytes),
                dtype=np.uint8,
            )
            for ch in chunks
        ]
        perms = [ch.perm for ch in chunks]

        def body(*xs: Any, perms: Any = perms) -> Any:
            return tuple(
                jax.lax.ppermute(x, AXIS, list(perm)) for x, perm in zip(xs, perms, strict=True)
            )

        fn = jax.jit(jax.shard_map(body, mesh=program.mesh, in_specs=P(AXIS), out_specs=P(AXIS)))
        calls.append(functools.partial(fn, *bufs))
    return lambda: [jax.block_until_ready(call()) for call in calls]


def _table(
    v: list[dict[str, Any]], reps: int, launch: int, launches: int
) -> tuple[float, float, float, float]:
    """Prints one launch's table; returns its (relayout, same layout) ratios to the
    fastest floor row, then to the floor of the chunking chosen in earlier rounds."""

    def median_of_max(key: str, sub: str | None = None) -> float:
        # A run ends when its slowest process ends: the max over processes per rep.
        series = [x[key][sub] if sub is not None else x[key] for x in v]
        return statistics.median(max(ts) for ts in zip(*series, strict=True))

    floors = {c: median_of_max("floor_s", str(c)) for c in FLOOR_CHUNKS}
    fastest = min(floors, key=floors.__getitem__)
    floor = floors[fastest]
    ours = median_of_max("reshard_s")
    same = median_of_max("same_s")
    mb = v[0]["bytes_moved"] / 2**20
    if launches > 1:
        print(f"launch {launch + 1} of {launches}")
    print(
        f"2 processes x 4 CPU devices (gloo), {v[0]['leaves']} leaves, "
        f"{v[0]['array_bytes'] / 2**20:.0f} MiB tree, {mb:.0f} MiB moved across processes "
        f"(fsdp on process 0 -> tp on process 1), reshard uses {v[0]['collectives']} "
        f"ppermutes; medians of {reps}"
    )
    print(f"{'method':<34}{'median ms':>10}{'MiB/s':>8}{'vs floor':>10}")
    rows = [(f"ppermute, {c} chunk(s) per pair", t) for c, t in floors.items()]
    rows.append(("reshard (collective executor)", ours))
    rows.append(("  its own chunks, nothing else", median_of_max("own_s", "relayout")))
    rows.append(("reshard, same layout (fsdp->fsdp)", same))
    rows.append(("  its own chunks, nothing else", median_of_max("own_s", "same")))
    for name, t in rows:
        print(f"{name:<34}{t * 1e3:>10.1f}{mb / t:>8.0f}{t / floor:>10.2f}")
    chosen = floors[v[0]["chosen_chunks"]]
    print(
        f"floor = fastest ppermute row: relayout {ours / floor:.2f}x, same layout "
        f"{same / floor:.2f}x (the least of {len(floors)} noisy medians: biased low)"
    )
    print(
        f"floor = the chunking chosen in earlier rounds ({v[0]['chosen_chunks']} chunks): "
        f"relayout {ours / chosen:.2f}x, same layout {same / chosen:.2f}x"
    )

    # CPU: per rep, both processes' CPU seconds summed, then the median over reps.
    def cpu_of(name: str) -> float:
        series = [x["cpu_s"][name] for x in v]
        return statistics.median(sum(ts) for ts in zip(*series, strict=True))

    cpu_floor, cpu_ours, cpu_same = (cpu_of(n) for n in (str(fastest), "reshard", "same"))
    print(
        f"CPU per call, both processes (core-ms): fastest floor row {cpu_floor * 1e3:.0f}, "
        f"relayout {cpu_ours * 1e3:.0f} ({cpu_ours / cpu_floor:.2f}x), "
        f"same layout {cpu_same * 1e3:.0f} ({cpu_same / cpu_floor:.2f}x)"
    )

    # Per process (the median of each process's own series): where the extra CPU of a
    # reshard lands, on the sending process or the receiving one, launch by launch.
    def cpu_by_process(name: str) -> str:
        return " + ".join(f"{statistics.median(x['cpu_s'][name]) * 1e3:.0f}" for x in v)

    print(
        "CPU per call by process (core-ms, process 0 sends + process 1 receives): "
        f"fastest floor row {cpu_by_process(str(fastest))}, relayout "
        f"{cpu_by_process('reshard')} (its own chunks {cpu_by_process('own')}), same layout "
        f"{cpu_by_process('same')} (its own chunks {cpu_by_process('same own')})"
    )
    print("target: reshard within 1.5x of the floor")
    cut = median_of_max("cut_s", "cut") / median_of_max("cut_s", "floor")
    print(
        f"the least a relayout adds: the fastest row's floor ({v[0]['cut_chunks']} chunks) "
        f"with the receiver's cut alone done at the same time took {cut:.2f}x its time"
    )
    return ours / floor, same / floor, ours / chosen, same / chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="~290 MB tree instead of ~40 MB")
    parser.add_argument("--reps", type=int, default=7, help="timed runs per method")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the launch")
    parser.add_argument(
        "--launches",
        type=int,
        default=1,
        help="launch the 2-process run this many times and print the median ratio",
    )
    parser.add_argument(
        "--no-single",
        dest="single",
        action="store_false",
        help="skip the one-process table (collective vs local executor)",
    )
    args = parser.parse_args(argv)
    if args.reps < 1 or args.launches < 1:
        parser.error("--reps and --launches must be at least 1")

    from reshard._launch import launch_local

    # Per launch: (relayout, same layout) / the fastest floor row, then / the floor of
    # the chunking chosen in earlier rounds.
    ratios: list[tuple[float, float, float, float]] = []
    for launch in range(args.launches):
        results = launch_local(
            f"{__file__}:worker",
            num_processes=2,
            devices_per_process=4,
            args=[args.full, args.reps],
            timeout_s=args.timeout,
        )
        ratios.append(_table([r.value for r in results], args.reps, launch, args.launches))
    if args.launches > 1:
        # The machine's load moves the floor between launches: each ratio is taken
        # within one launch, and their median is the figure to quote.
        names = (
            "relayout, vs the fastest row",
            "same layout, vs the fastest row",
            "relayout, vs the chosen chunking",
            "same layout, vs the chosen chunking",
        )
        for k, name in enumerate(names):
            values = [r[k] for r in ratios]
            listed = ", ".join(f"{x:.2f}" for x in values)
            print(f"{name}: {listed}; median {statistics.median(values):.2f}x")
    if args.single:
        (one,) = launch_local(
            f"{__file__}:worker_single",
            num_processes=1,
            devices_per_process=8,
            args=[args.full, args.reps],
            timeout_s=args.timeout,
        )
        times = {k: statistics.median(ts) for k, ts in one.value["times"].items()}
        local = times["local executor (host)"]
        mb = one.value["bytes_moved"] / 2**20
        print(f"\n1 process x 8 CPU devices, same tree and reshard, {mb:.0f} MiB moved")
        print(f"{'method':<34}{'median ms':>10}{'MiB/s':>8}{'vs local':>10}")
        for name, t in times.items():
            print(f"{name:<34}{t * 1e3:>10.1f}{mb / t:>8.0f}{t / local:>10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
