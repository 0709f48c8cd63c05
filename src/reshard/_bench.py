"""The benchmark suite: ``reshard`` against ``jax.device_put``, ``jax.jit`` identity and
the memcpy floor, side by side in one run, on simulated CPU devices.

Run it with ``reshard bench`` or ``python benchmarks/bench.py``. Every number printed
is a median of repeated runs in this process (the machine is shared and noisy), and
the table shows ratios, which survive noise far better than absolute times.

Peak memory is measured in a fresh subprocess per scenario: the rise of the process's
peak RSS across one reshard, as a multiple of the destination bytes.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ._timing import fresh_arrays

SCENARIOS = ("disjoint", "sync", "relayout", "shrink", "leaves", "narrow", "offload", "blocks")
# What `reshard bench` prints under the table: how to read this suite's columns.
FOOTER = (
    "times are medians of one run; ratios are the suite's own (vs_device_put > 1: "
    "reshard is faster; vs_floor: reshard time / memcpy of the moved bytes, though a "
    "default call also copies the shards already in place)"
)


def setup_devices(n: int = 8) -> None:
    """Simulates ``n`` CPU devices, whatever ``JAX_PLATFORMS`` says; before JAX starts.

    The suite is defined on CPU devices, as the demo is (the same settings).
    """
    from ._cli_demo import configure_cpu_devices

    configure_cpu_devices(n)


@dataclasses.dataclass
class Row:
    scenario: str
    leaves: int
    dst_bytes: int
    bytes_moved: int
    reshard_s: float
    device_put_s: float
    jit_s: float | None
    floor_s: float
    rss_rise_x: float | None = None
    device_put_rss_rise_x: float | None = None

    @property
    def vs_device_put(self) -> float:
        return self.device_put_s / self.reshard_s

    @property
    def vs_jit(self) -> float | None:
        return None if self.jit_s is None else self.jit_s / self.reshard_s

    @property
    def vs_floor(self) -> float:
        return self.reshard_s / self.floor_s if self.floor_s else float("nan")

    def as_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(vs_device_put=self.vs_device_put, vs_jit=self.vs_jit, vs_floor=self.vs_floor)
        return d


def llm_shapes(size_mb: float) -> dict[str, tuple[tuple[int, ...], str]]:
    """An LLM-shaped parameter set: bf16 matrices, f32 norms and embedding.

    Every dimension that gets sharded divides by 4, 6 and 8, so one tree serves all
    scenarios. ``size_mb`` picks the number of layers (about 57 MB each) and the
    embedding size.
    """
    d, ffn = 1536, 6144
    layer_mb = d * (3 * d + d + 2 * ffn) * 2 / 2**20
    vocab = 12288 if size_mb >= 150 else max(48, int(size_mb * 2**20 * 0.25 / (d * 4)) // 48 * 48)
    emb_mb = vocab * d * 4 / 2**20
    layers = max(1, round((size_mb - emb_mb) / layer_mb)) if size_mb >= 60 else 0
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"embed": ((vocab, d), "float32")}
    if layers == 0:
        # Small trees (tests, quick runs): shrink the matrices instead of the layers.
        dd = max(48, int((size_mb * 2**20 * 0.75 / 2 / 18) ** 0.5) // 48 * 48)
        shapes.update(
            {
                "l0.qkv": ((dd, 3 * dd), "bfloat16"),
                "l0.o": ((dd, dd), "bfloat16"),
                "l0.up": ((dd, 4 * dd), "bfloat16"),
                "l0.down": ((4 * dd, dd), "bfloat16"),
                "l0.norm": ((dd,), "float32"),
            }
        )
        return shapes
    for i in range(layers):
        shapes[f"l{i}.qkv"] = ((d, 3 * d), "bfloat16")
        shapes[f"l{i}.o"] = ((d, d), "bfloat16")
        shapes[f"l{i}.up"] = ((d, ffn), "bfloat16")
        shapes[f"l{i}.down"] = ((ffn, d), "bfloat16")
        shapes[f"l{i}.norm1"] = ((d,), "float32")
        shapes[f"l{i}.norm2"] = ((d,), "float32")
    return shapes


def _make_tree(
    shapes: dict[str, tuple[tuple[int, ...], str]], shardings: dict[str, Any]
) -> dict[str, Any]:
    """Fills arrays on their devices directly (no host copy inflates the RSS peak)."""
    import jax
    import jax.numpy as jnp

    def filler(shape: tuple[int, ...], dtype: str, sharding: Any) -> Any:
        def fill(k: Any) -> Any:
            return jax.random.normal(k, shape, jnp.float32).astype(dtype)

        return jax.jit(fill, out_shardings=sharding)

    out = {}
    fns: dict[tuple[Any, ...], Any] = {}  # one compiled filler per distinct leaf kind
    for i, (name, (shape, dtype)) in enumerate(shapes.items()):
        key = (shape, dtype, shardings[name])
        if key not in fns:
            fns[key] = filler(shape, dtype, shardings[name])
        out[name] = fns[key](jax.random.key(i))
    return jax.block_until_ready(out)


def scenario(name: str, size_mb: float) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """Builds ``(source tree, destination shardings, same device set?)`` for a scenario."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devs = np.array(jax.devices())
    shapes: dict[str, tuple[tuple[int, ...], str]]
    src: Any
    dst: Any
    if name == "leaves":
        n = 512
        shapes = {f"w{i:03d}": ((128, 128), "float32") for i in range(n)}
        one_src = NamedSharding(Mesh(devs[:4], ("a",)), P("a"))
        one_dst = NamedSharding(Mesh(devs[4:8], ("b",)), P("b"))
        return (
            _make_tree(shapes, dict.fromkeys(shapes, one_src)),
            dict.fromkeys(shapes, one_dst),
            False,
        )
    if name == "offload":
        # Optimizer state offloaded to host memory between steps: 512 arrays of 64 KiB
        # that only change memory kind, on the same devices.
        shapes = {f"m{i:03d}": ((128, 128), "float32") for i in range(512)}
        mesh = Mesh(devs[:8], ("fsdp",))
        return (
            _make_tree(shapes, dict.fromkeys(shapes, NamedSharding(mesh, P("fsdp")))),
            dict.fromkeys(shapes, NamedSharding(mesh, P("fsdp"), memory_kind="pinned_host")),
            True,
        )
    if name == "blocks":
        # Many small layers re-laid out from FSDP rows to 2-D (data, model) blocks on the
        # same devices: 512 arrays of 256 KiB, each destination shard cut from 4 source
        # shards (32 pieces per array, 16k per call).
        shapes = {f"b{i:03d}": ((256, 256), "float32") for i in range(512)}
        rows = NamedSharding(Mesh(devs[:8], ("fsdp",)), P("fsdp"))
        blocks = NamedSharding(Mesh(devs[:8].reshape(2, 4), ("data", "model")), P("data", "model"))
        return _make_tree(shapes, dict.fromkeys(shapes, rows)), dict.fromkeys(shapes, blocks), True
    if name == "narrow":
        # Narrow matrices (MoE routers: one column per expert) from row shards to
        # column shards on other devices: every piece is 32-byte rows.
        shapes = {f"router{i:02d}": ((16384, 32), "float32") for i in range(32)}
        rows = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
        cols = NamedSharding(Mesh(devs[4:8], ("expert",)), P(None, "expert"))
        return (
            _make_tree(shapes, dict.fromkeys(shapes, rows)),
            dict.fromkeys(shapes, cols),
            False,
        )
    shapes = llm_shapes(size_mb)

    def fsdp(mesh: Mesh) -> dict[str, Any]:
        return {k: NamedSharding(mesh, P(mesh.axis_names[0])) for k in shapes}

    if name == "disjoint":
        src = fsdp(Mesh(devs[:4], ("fsdp",)))
        tp = Mesh(devs[4:8], ("tp",))
        dst = {
            k: NamedSharding(tp, P(None, "tp") if len(s) == 2 else P())
            for k, (s, _) in shapes.items()
        }
        return _make_tree(shapes, src), dst, False
    if name == "sync":
        # Weight sync between equal layouts (trainer -> sampler with the same
        # sharding): every shard only changes devices.
        return (
            _make_tree(shapes, fsdp(Mesh(devs[:4], ("fsdp",)))),
            fsdp(Mesh(devs[4:8], ("fsdp",))),
            False,
        )
    if name == "relayout":
        src = fsdp(Mesh(devs[:8], ("fsdp",)))
        mesh = Mesh(devs[:8].reshape(2, 4), ("data", "model"))
        dst = {
            k: NamedSharding(mesh, P("data", "model") if len(s) == 2 else P("model"))
            for k, (s, _) in shapes.items()
        }
        return _make_tree(shapes, src), dst, True
    if name == "shrink":
        return (
            _make_tree(shapes, fsdp(Mesh(devs[:8], ("fsdp",)))),
            fsdp(Mesh(devs[:6], ("fsdp",))),
            False,
        )
    raise ValueError(f"unknown scenario {name!r}; choose from {SCENARIOS}")


def interleaved_times(fns: dict[str, Callable[[Any], Any]], x: Any, reps: int) -> dict[str, float]:
    """Median seconds of each ``fn(x)``, the methods timed in turn: every round times
    each method once, in an order that rotates from round to round (no method always
    runs first, or after the same one), so a change in the machine's load hits all of
    them alike. Each call gets fresh array objects (``fresh_arrays``, made outside the
    timing) and is timed until every leaf of its output is ready."""
    import jax

    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(reps):
        k = rep % len(names)
        for name in names[k:] + names[:k]:
            arg = fresh_arrays(x)
            t0 = time.perf_counter()
            out = jax.block_until_ready(fns[name](arg))
            times[name].append(time.perf_counter() - t0)
            del out, arg
            gc.collect()
    return {name: statistics.median(ts) for name, ts in times.items()}


def _floor_time(nbytes: int, reps: int) -> float:
    """Best time to copy ``nbytes`` once with numpy into a preallocated buffer."""
    import numpy as np

    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(max(reps, 3)):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def run_scenario(name: str, size_mb: float, reps: int) -> Row:
    import jax

    import reshard

    x, dst, same_devices = scenario(name, size_mb)
    p = reshard.plan(x, dst)
    dst_bytes = p.stats.bytes_total

    def ours(t: Any) -> Any:
        return reshard.reshard(t, dst, cache_resharding_plans=True)

    def baseline(t: Any) -> Any:
        return jax.device_put(t, dst)

    fns: dict[str, Callable[[Any], Any]] = {"ours": ours, "device_put": baseline}
    if same_devices:
        fns["jit"] = jax.jit(lambda t: t, out_shardings=dst)
    for fn in fns.values():  # warm-up: the plan cache, jit's compilation
        jax.block_until_ready(fn(x))
    t = interleaved_times(fns, x, reps)
    # The floor of DESIGN.md: the moved bytes copied once. (A default call, without
    # may_alias, also copies the destination shards already in place, bytes_kept:
    # ours/floor counts that copy against reshard.)
    floor = _floor_time(p.stats.bytes_moved, reps)
    return Row(
        name,
        len(x),
        dst_bytes,
        p.stats.bytes_moved,
        t["ours"],
        t["device_put"],
        t.get("jit"),
        floor,
    )


def _peak_rss_bytes() -> int:
    """The process's peak RSS (VmHWM) in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _trim_heap() -> None:
    """Returns freed heap memory to the OS, so memory freed while the inputs were built
    cannot be reused unseen (it would hide part of the rise)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


def _reset_peak_rss() -> None:
    """Resets the peak RSS to the current RSS (Linux: ``clear_refs`` value 5), so the
    next reading measures only what follows, not the building of the inputs."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # pragma: no cover - not Linux
        pass


def _rss_child(name: str, size_mb: float, which: str, parent: int) -> None:
    """In a fresh process: the peak-RSS rise of one reshard / device_put."""
    from ._launch import set_parent_death_signal

    set_parent_death_signal(signal.SIGKILL)  # a killed `reshard bench` takes us along
    if os.getppid() != parent:  # it died before we asked
        return
    setup_devices(8)
    import jax

    import reshard

    x, dst, _ = scenario(name, size_mb)
    p = reshard.plan(x, dst)
    gc.collect()
    _trim_heap()
    _reset_peak_rss()
    before = _peak_rss_bytes()
    out = reshard.reshard(x, dst) if which == "reshard" else jax.device_put(x, dst)
    jax.block_until_ready(out)
    rise = _peak_rss_bytes() - before
    print(json.dumps({"rise": rise, "dst_bytes": p.stats.bytes_total}))


def measure_rss(name: str, size_mb: float, which: str) -> float:
    code = (
        "import sys; from reshard._bench import _rss_child; "
        f"_rss_child({name!r}, {size_mb!r}, {which!r}, {os.getpid()})"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        check=True,
    )
    d = json.loads(res.stdout.strip().splitlines()[-1])
    return d["rise"] / d["dst_bytes"]


def run(
    scenarios: tuple[str, ...] = SCENARIOS,
    size_mb: float = 300,
    reps: int = 5,
    rss: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Runs the suite; returns one ``Row`` per scenario. Devices must be set up."""
    rows = []
    for name in scenarios:
        if progress:
            progress(f"timing {name}")
        row = run_scenario(name, size_mb, reps)
        gc.collect()
        if rss:
            if progress:
                progress(f"peak memory {name}")
            row.rss_rise_x = measure_rss(name, size_mb, "reshard")
            row.device_put_rss_rise_x = measure_rss(name, size_mb, "device_put")
        rows.append(row)
    return rows


def format_table(rows: list[Row]) -> str:
    """Plain-text table of medians and ratios."""
    head = (
        f"{'scenario':<9} {'leaves':>6} {'moved':>9} {'reshard':>9} {'device_put':>10} "
        f"{'jit':>9} {'floor':>8} {'dp/ours':>8} {'jit/ours':>8} {'ours/floor':>10} "
        f"{'rss ours':>8} {'rss dp':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        jit = f"{r.jit_s * 1e3:7.1f}ms" if r.jit_s is not None else f"{'n/a':>9}"
        vj = f"{r.vs_jit:7.1f}x" if r.vs_jit is not None else f"{'n/a':>8}"
        rss = f"{r.rss_rise_x:7.2f}x" if r.rss_rise_x is not None else f"{'-':>8}"
        rdp = (
            f"{r.device_put_rss_rise_x:6.2f}x"
            if r.device_put_rss_rise_x is not None
            else f"{'-':>7}"
        )
        lines.append(
            f"{r.scenario:<9} {r.leaves:>6} {r.bytes_moved / 2**20:7.1f}Mi "
            f"{r.reshard_s * 1e3:7.1f}ms {r.device_put_s * 1e3:8.1f}ms {jit} "
            f"{r.floor_s * 1e3:6.1f}ms {r.vs_device_put:7.2f}x {vj} {r.vs_floor:9.2f}x {rss} {rdp}"
        )
    lines.append(
        "times are medians, the methods timed in turn; dp/ours and jit/ours > 1 mean "
        "reshard is faster; ours/floor is reshard time over one numpy memcpy of the moved "
        "bytes (a default call also copies the shards already in place); rss = peak-RSS "
        "rise in a fresh process / destination bytes"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    from ._cli import positive_int, size_mb

    # The same limits as `reshard bench`: no traceback for --reps 0 or --size-mb -4.
    ap.add_argument("--size-mb", type=size_mb, default=300)
    ap.add_argument("--reps", type=positive_int, default=5)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--no-rss", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    names = tuple(s.strip() for s in a.scenarios.split(",") if s.strip())
    bad = [s for s in names if s not in SCENARIOS]
    if not names:
        ap.error(f"--scenarios names no scenario; choose from {','.join(SCENARIOS)}")
    if bad:
        ap.error(f"unknown scenario(s) {bad}; choose from {','.join(SCENARIOS)}")
    setup_devices(8)
    rows = run(
        names, a.size_mb, a.reps, rss=not a.no_rss, progress=lambda m: print(m, file=sys.stderr)
    )
    print(json.dumps([r.as_dict() for r in rows], indent=1) if a.json else format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
