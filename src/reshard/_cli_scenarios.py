"""The demo's workload: an LLM-shaped tree, four scenarios, timing and verification.

``reshard demo`` (``_cli_demo``) parses the command line, sets up devices and prints;
this module does the work on whatever ``jax.devices()`` are there, in one process or in
each process of a multi-process run (:func:`process_main`), and returns plain,
JSON-ready results.

The scenarios, on ``N`` devices:

1. *trainer -> sampler*: fsdp on the first half of the devices -> tensor parallel on the
   other half (RL post-training moves weights like this every step);
2. *relayout*: fsdp over all devices -> data=2 x model=N/2 on the same devices;
3. *elastic shrink*: from hybrid sharding (replica=2 x fsdp=N/2) the last quarter of
   the devices is lost; fsdp on the survivors, read only from surviving replicas;
4. *elastic regrow*: the shrunk state back onto all devices (replica=2 x fsdp=N/2).

The parameter tree looks like a decoder-only transformer: bf16 matrices, f32 norms and
an f32 embedding.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ._cli_render import device_ranges, plan_report
from ._timing import fresh_arrays

LAYERS = 8
# Bytes per d_model**2 of the tree below: per layer 4 d*d attention + 3 d*3d MLP
# matrices in bf16 (26 bytes), plus a 4d x d f32 embedding (16 bytes).
_BYTES_PER_D2 = LAYERS * 26 + 16
_SEED = 0


# ----------------------------------------------------------------------------------
# The parameter tree and its shardings
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Param:
    """One parameter: shape, dtype name and role (how tensor parallelism splits it)."""

    shape: tuple[int, ...]
    dtype: str
    role: str  # "col": split outputs, "row": split inputs, "embed", "norm"


def shard_unit(n: int) -> int:
    """Every dimension is a multiple of this, so every scenario's shard counts divide."""
    half, survivors = n // 2, n - lost_count(n)
    return math.lcm(n, 2, half, survivors)


def lost_count(n: int) -> int:
    """How many devices the elastic scenario loses: a quarter, from one replica."""
    return max(1, n // 4)


def tree_bytes(d: int) -> int:
    """Bytes of ``model_tree``'s tree of width ``d``."""
    norms = (2 * LAYERS + 1) * d * 4
    return _BYTES_PER_D2 * d * d + norms


def model_width(size_mb: float, n: int) -> int:
    """``model_tree``'s width ``d`` for ``n`` devices: about ``size_mb`` MiB, rounded to a
    multiple of ``shard_unit(n)`` (at least one)."""
    unit = shard_unit(n)
    return max(unit, round(math.sqrt(size_mb * 2**20 / _BYTES_PER_D2) / unit) * unit)


def model_tree(size_mb: float, n: int) -> tuple[dict[str, Any], int]:
    """A decoder-only transformer's parameters (as ``Param``s) of about ``size_mb`` MiB.

    Returns:
      The tree and its model width ``d``.
    """
    d = model_width(size_mb, n)
    ffn, vocab = 3 * d, 4 * d

    def layer() -> dict[str, Any]:
        return {
            "attn_norm": Param((d,), "float32", "norm"),
            "attn": {k: Param((d, d), "bfloat16", "row" if k == "o" else "col") for k in "qkvo"},
            "mlp_norm": Param((d,), "float32", "norm"),
            "mlp": {
                "gate": Param((d, ffn), "bfloat16", "col"),
                "up": Param((d, ffn), "bfloat16", "col"),
                "down": Param((ffn, d), "bfloat16", "row"),
            },
        }

    tree = {
        "embed": Param((vocab, d), "float32", "embed"),
        "layers": [layer() for _ in range(LAYERS)],
        "final_norm": Param((d,), "float32", "norm"),
    }
    return tree, d


def spec_for(p: Param, style: str) -> tuple[Any, ...]:
    """The partition spec of a parameter under a parallelism style.

    ``fsdp``: every array split along its first dimension. ``tp``: Megatron tensor
    parallelism (columns of "col" matrices, rows of "row" matrices, vocabulary of the
    embedding, norms replicated). ``2d``: fsdp over ``data`` combined with tp over
    ``model``.
    """
    matrix = p.role != "norm"
    if style == "fsdp":
        return ("fsdp", None) if matrix else ("fsdp",)
    if style == "tp":
        return {"col": (None, "tp"), "row": ("tp", None), "embed": ("tp", None)}.get(p.role, ())
    if style == "2d":
        cols = ("data", "model")
        return {"col": cols, "row": cols[::-1], "embed": cols[::-1]}.get(p.role, ())
    raise AssertionError(style)


def _is_param(x: Any) -> bool:
    return isinstance(x, Param)


def host_tree(tree: dict[str, Any]) -> dict[str, Any]:
    """Deterministic numpy values for the tree (same in every process)."""
    import jax
    import ml_dtypes

    rng = np.random.default_rng(_SEED)

    def make(p: Param) -> np.ndarray:
        if p.role == "norm":
            return 1.0 + rng.standard_normal(p.shape, dtype=np.float32) * 0.1
        v = rng.standard_normal(p.shape, dtype=np.float32) * 0.02
        return v.astype(ml_dtypes.bfloat16) if p.dtype == "bfloat16" else v

    return jax.tree.map(make, tree, is_leaf=_is_param)


@dataclass(frozen=True)
class Scenario:
    """One reshard of the demo: meshes, styles, lost devices and where the input is."""

    key: str
    title: str
    story: str
    src_mesh: Any
    src_style: str
    dst_mesh: Any
    dst_style: str
    lost: tuple[Any, ...] = ()
    input_from: str = ""  # key of an earlier scenario whose output is the input


def scenarios(devices: list[Any]) -> list[Scenario]:
    """The four scenarios over ``devices`` (in ``jax.devices()`` order)."""
    from jax.sharding import Mesh

    n, half = len(devices), len(devices) // 2
    devs = np.array(devices, dtype=object)
    lost = tuple(devices[n - lost_count(n) :])
    survivors = devs[: n - len(lost)]
    hsdp = Mesh(devs.reshape(2, half), ("replica", "fsdp"))

    def ids(ds: Any) -> str:
        return device_ranges(d.id for d in np.asarray(ds).ravel())

    return [
        Scenario(
            "disjoint",
            "trainer -> sampler",
            f"RL weight sync: fsdp on devices {ids(devs[:half])} -> tp on devices "
            f"{ids(devs[half:])} (disjoint device sets)",
            Mesh(devs[:half], ("fsdp",)),
            "fsdp",
            Mesh(devs[half:], ("tp",)),
            "tp",
        ),
        Scenario(
            "relayout",
            "relayout",
            f"same devices {ids(devs)}: fsdp={n} -> data=2 x model={half}",
            Mesh(devs, ("fsdp",)),
            "fsdp",
            Mesh(devs.reshape(2, half), ("data", "model")),
            "2d",
        ),
        Scenario(
            "shrink",
            f"shrink {n} -> {len(survivors)}",
            f"elastic: replica=2 x fsdp={half} on {ids(devs)}, devices {ids(lost)} lost -> "
            f"fsdp on survivors {ids(survivors)}, reading surviving replicas only",
            hsdp,
            "fsdp",
            Mesh(survivors, ("fsdp",)),
            "fsdp",
            lost=lost,
        ),
        Scenario(
            "regrow",
            f"regrow {len(survivors)} -> {n}",
            f"elastic: fsdp on {ids(survivors)} -> replica=2 x fsdp={half} on {ids(devs)}",
            Mesh(survivors, ("fsdp",)),
            "fsdp",
            hsdp,
            "fsdp",
            input_from="shrink",
        ),
    ]


# ----------------------------------------------------------------------------------
# Running, timing, verifying
# ----------------------------------------------------------------------------------


def verify(out: Any, host: Any, dst: Any) -> dict[str, Any]:
    """Checks every local shard of ``out`` bit for bit against numpy, and its placement.

    Placement: the result's sharding is the destination, and this process holds
    exactly the destination's shards, each on the device the destination assigns it.
    """
    import jax

    from ._errors import format_box
    from ._geometry import box_from_index

    problems: list[str] = []
    shards = 0
    flat_out = jax.tree_util.tree_flatten_with_path(out)[0]
    flat_host, flat_dst = jax.tree.leaves(host), jax.tree.leaves(dst)
    me = jax.process_index()
    for (path, arr), h, want in zip(flat_out, flat_host, flat_dst, strict=True):
        where = jax.tree_util.keystr(path)
        if not arr.sharding.is_equivalent_to(want, arr.ndim):
            problems.append(f"{where}: sharding {arr.sharding} is not {want}")
        expected = {
            d: box_from_index(i, h.shape)
            for d, i in want.devices_indices_map(h.shape).items()
            if d.process_index == me
        }
        got = {s.device: s for s in arr.addressable_shards}
        if set(got) != set(expected):
            problems.append(
                f"{where}: shards on devices {sorted(d.id for d in got)}, expected "
                f"{sorted(d.id for d in expected)}"
            )
        for dev, s in got.items():
            box = box_from_index(s.index, h.shape)
            if expected.get(dev) != box:
                problems.append(
                    f"{where}: device {dev.id} holds {box}, expected {expected.get(dev)}"
                )
            a, b = np.asarray(s.data), h[s.index]
            # Compare bits, not values: NaN != NaN, and -0.0 == 0.0 would hide errors.
            unsigned = f"u{a.dtype.itemsize}"
            if a.shape != b.shape:
                problems.append(f"{where}: device {dev.id} holds shape {a.shape}, not {b.shape}")
            elif not np.array_equal(a.view(unsigned), b.view(unsigned)):
                bad = int(np.count_nonzero(a.view(unsigned) != b.view(unsigned)))
                problems.append(
                    f"{where}: device {dev.id} holds different values ({bad} of {a.size} "
                    f"elements of box {format_box(box)})"
                )
            shards += 1
    return {
        "ok": not problems,
        "arrays": len(flat_host),
        "shards": shards,
        "problems": problems[:10],
    }


def _median_ms(times: list[float]) -> float:
    return statistics.median(times) * 1e3


def run_demo(
    size_mb: float,
    repeats: int,
    max_blocks: int,
    step: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Runs every scenario on ``jax.devices()`` and returns a JSON-ready result.

    Args:
      size_mb: about how many MiB of parameters.
      repeats: timed repetitions of each of ``reshard`` and ``jax.device_put``.
      max_blocks: heatmap blocks per side in the plan reports.
      step: called with a description before each unit of work (progress bars).

    Returns:
      ``{"devices", "processes", "tree", "scenarios": [...]}``; each scenario holds its
      plan report, timings and verification.
    """
    import jax

    devices = jax.devices()
    tree, d = model_tree(size_mb, len(devices))
    step("building the parameter tree")
    host = host_tree(tree)
    leaves = jax.tree.leaves(host)
    result: dict[str, Any] = {
        "devices": len(devices),
        "processes": jax.process_count(),
        "platform": jax.default_backend(),
        "tree": {
            "arrays": len(leaves),
            "bytes": int(sum(x.nbytes for x in leaves)),
            "d_model": d,
            "layers": LAYERS,
        },
        "scenarios": [],
    }
    outputs: dict[str, Any] = {}
    todo = scenarios(devices)
    needed = {s.input_from for s in todo}
    for sc in todo:
        step(f"{sc.title}: placing the input")
        if sc.input_from:
            x = outputs.pop(sc.input_from)
        else:
            src = _shardings(tree, sc.src_mesh, sc.src_style)
            x = jax.tree.map(_place, host, src)
        report, out = _run_scenario(sc, tree, host, x, repeats, max_blocks, step)
        result["scenarios"].append(report)
        if sc.key in needed:
            outputs[sc.key] = out
        # Drop this scenario's arrays before the next one allocates its own.
        del x, out
    return result


def _shardings(tree: Any, mesh: Any, style: str) -> Any:
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    return jax.tree.map(
        lambda p: NamedSharding(mesh, PartitionSpec(*spec_for(p, style))), tree, is_leaf=_is_param
    )


def _place(h: np.ndarray, sharding: Any) -> Any:
    """A global array from host values; works in multi-process runs too."""
    import jax

    # dtype: a process holding none of the shards cannot infer it from the callback.
    return jax.make_array_from_callback(h.shape, sharding, lambda index: h[index], dtype=h.dtype)


def _run_scenario(
    sc: Scenario,
    tree: Any,
    host: Any,
    x: Any,
    repeats: int,
    max_blocks: int,
    step: Callable[[str], None],
) -> tuple[dict[str, Any], Any]:
    """Plans, runs, verifies and times one scenario; returns its report and output."""
    import jax

    import reshard

    jax.block_until_ready(x)
    dst = _shardings(tree, sc.dst_mesh, sc.dst_style)
    lost = [dv.id for dv in sc.lost]
    step(f"{sc.title}: planning")
    t0 = time.perf_counter()
    plan = reshard.plan(x, dst, avoid_devices=lost, cache=False)
    plan_ms = (time.perf_counter() - t0) * 1e3

    def run_reshard(t: Any) -> Any:
        return reshard.reshard(t, dst, avoid_devices=lost, cache_resharding_plans=True)

    def run_device_put(t: Any) -> Any:
        return jax.device_put(t, dst)

    step(f"{sc.title}: first reshard")
    out = jax.block_until_ready(run_reshard(x))
    step(f"{sc.title}: verifying")
    check = verify(out, host, dst)
    sent_by_lost = sum(plan.stats.send_bytes.get(i, 0) for i in lost)
    if sent_by_lost:
        check["ok"] = False
        check["problems"].append(f"the plan reads {sent_by_lost} bytes from lost devices")
    times: dict[str, list[float]] = {"reshard": [], "device_put": []}
    errors: dict[str, str] = {}
    skipped = None
    if jax.process_count() > 1:
        # Seen with jax 0.10.2 on 2 processes: device_put between different device sets
        # raises, and a same-device relayout hung in every process (no error, no end).
        skipped = "not run: jax.device_put refuses or hangs on multi-process reshards"
        errors["device_put"] = skipped
    # A warm-up of each (compilation, caches), then alternate the two so that a noisy
    # neighbour on the machine slows both alike. Each call gets new array objects over
    # the same buffers, as after a training step: on one array, a repeated device_put
    # would reuse the host copy that jax keeps from its first call (see fresh_arrays).
    for r in range(repeats + 1):
        for name, fn in (("reshard", run_reshard), ("device_put", run_device_put)):
            if name in errors:
                continue
            step(f"{sc.title}: timing {name} ({r}/{repeats})")
            arg = fresh_arrays(x)
            t0 = time.perf_counter()
            try:
                y = jax.block_until_ready(fn(arg))
            except Exception as e:  # device_put refuses some reshards (multi-process)
                if name == "reshard":
                    raise
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                continue
            if r:
                times[name].append(time.perf_counter() - t0)
            del y, arg
    timing: dict[str, Any] = {
        "plan_ms": plan_ms,
        "repeats": repeats,
        "reshard_ms": [t * 1e3 for t in times["reshard"]],
        "device_put_ms": [t * 1e3 for t in times["device_put"]],
        "reshard_median_ms": _median_ms(times["reshard"]),
        "device_put_median_ms": _median_ms(times["device_put"]) if times["device_put"] else None,
        "device_put_error": None if skipped else errors.get("device_put"),
        "device_put_skipped": skipped,
    }
    report = {
        "key": sc.key,
        "title": sc.title,
        "story": sc.story,
        "lost_devices": lost,
        "executor": plan.executor,
        **plan_report(plan.leaf_plans, plan.stats, max_blocks=max_blocks),
        "timing": timing,
        "verify": check,
    }
    return report, out


def process_main(size_mb: float, repeats: int, max_blocks: int) -> dict[str, Any]:
    """Entry point of each process of ``reshard demo --processes P`` (via the launcher).

    Steps go to stderr, which the launcher shows when a process fails or hangs.
    """
    return run_demo(
        size_mb, repeats, max_blocks, lambda what: print(what, file=sys.stderr, flush=True)
    )
