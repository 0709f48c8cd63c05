"""``reshard plan``: explain a reshard of synthetic devices, without data or hardware.

The source and destination are each a ``NamedSharding`` written as text: a mesh shape,
its axis names, a partition spec and the device ids laid out on the mesh (row-major, as
``Mesh(np.array(ids).reshape(mesh_shape), axis_names)`` would). Shard boxes come from
``named_shard_boxes``, so thousands of devices cost nothing but planning time.

The argument parsers here raise ``argparse.ArgumentTypeError`` / ``UsageError`` with
one line that says what was wrong and how to write it: they are the user's first
contact with the vocabulary (mesh, axes, spec, devices).
"""

from __future__ import annotations

import argparse
import bisect
import functools
import itertools
import json
import math
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from ._cli import UsageError, add_output_arguments, positive_int
from ._cli_render import device_ranges, plan_report, render_report
from ._errors import DataLossError
from ._geometry import named_shard_boxes
from ._plan import ARRAY, LeafInfo, Plan, human_bytes
from ._planner import LeafSpec, ShardSpec, plan_leaves

# ----------------------------------------------------------------------------------
# Argument types (argparse calls these; their messages end up after "argument --x: ")
# ----------------------------------------------------------------------------------


# The most devices a side may have: plans of 16,384 take about a second; far more
# would only exhaust memory building the id lists.
MAX_DEVICES = 1 << 20
# The most elements an array may have: exabytes are fine, but sizes beyond any float
# (a 160-digit shape, say) would break the statistics' means and ratios.
MAX_ELEMENTS = 1 << 100
# The most pieces a plan may cut: 1024 sources to 1024 replicas of the whole array
# (~1M pieces) plan in ~10 s and ~0.6 GB here; 4M take ~45 s and ~2 GB.
MAX_PIECES = 1 << 22


def _shown(text: str) -> str:
    """``text`` quoted for a message, cut short when long (a 5,000-digit size, say)."""
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text):,} characters)"


def _int_list(text: str, what: str, example: str, *, minimum: int) -> tuple[int, ...]:
    parts = [p.strip() for p in re.split(r"[,x]", text.strip())]
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{_shown(text)} is not a {what}; write sizes separated by ',' or 'x', e.g. {example}"
        ) from None
    if any(v < minimum for v in values):
        raise argparse.ArgumentTypeError(
            f"{_shown(text)}: every size of a {what} must be >= {minimum}, e.g. {example}"
        )
    return values


def shape_arg(text: str) -> tuple[int, ...]:
    """``'8192,8192'`` or ``'8192x8192'`` -> ``(8192, 8192)``; ``''`` is a scalar."""
    if not text.strip():
        return ()
    shape = _int_list(text, "shape", "--shape 8192,8192", minimum=0)
    if math.prod(shape) > MAX_ELEMENTS:
        raise argparse.ArgumentTypeError(
            f"{_shown(text)}: an array of more than 2**100 elements; at most that many are planned"
        )
    return shape


def mesh_arg(text: str) -> tuple[int, ...]:
    """``'64x64'`` or ``'64,64'`` -> ``(64, 64)``."""
    sizes = _int_list(text, "mesh shape", "--src-mesh 64x64", minimum=1)
    if math.prod(sizes) > MAX_DEVICES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: a mesh of {math.prod(sizes)} devices; at most {MAX_DEVICES} are planned"
        )
    return sizes


def axes_arg(text: str) -> tuple[str, ...]:
    """``'data,model'`` -> ``('data', 'model')``."""
    names = tuple(p.strip() for p in text.split(","))
    bad = [n for n in names if not n.isidentifier()]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{text!r}: mesh axis names must be distinct identifiers separated by ',', "
            "e.g. --src-axes data,model"
        )
    replicated = [n for n in names if n in _NONE_WORDS]
    if replicated:
        # A spec would read such a name as a replicated dimension, not as the axis.
        raise argparse.ArgumentTypeError(
            f"{text!r}: {replicated[0]!r} means a replicated dimension in a spec and "
            "cannot name a mesh axis; e.g. --src-axes data,model"
        )
    return names


SpecEntry = str | tuple[str, ...] | None
_NONE_WORDS = {"", "none", "None", "-", "_"}


def spec_arg(text: str) -> tuple[SpecEntry, ...]:
    """``'data+fsdp,None'`` -> ``(('data', 'fsdp'), None)``: one entry per dimension.

    An entry is an axis name, several names joined by ``+`` (major to minor, as a tuple
    in ``PartitionSpec``), or ``None``/``-`` for a replicated dimension. A spec shorter
    than the array rank leaves the remaining dimensions replicated.
    """
    if not text.strip() or text.strip() in ("()", "replicated"):
        return ()
    entries: list[SpecEntry] = []
    for raw in text.split(","):
        p = raw.strip()
        if p in _NONE_WORDS:
            entries.append(None)
            continue
        names = tuple(n.strip() for n in p.split("+"))
        if not all(n.isidentifier() for n in names):
            raise argparse.ArgumentTypeError(
                f"{text!r}: a spec entry is an axis name, names joined by '+', or None, "
                "separated by ',', e.g. --src-spec data,model or --src-spec data+model,None"
            )
        entries.append(names[0] if len(names) == 1 else names)
    return tuple(entries)


def devices_arg(text: str) -> tuple[int, ...]:
    """``'0-3,8,10-11'`` -> ``(0, 1, 2, 3, 8, 10, 11)``: ids in the order written."""
    ids: list[int] = []
    for raw in text.split(","):
        p = raw.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", p)
        if m is not None and any(len(g.lstrip("0")) > 18 for g in m.groups() if g is not None):
            raise argparse.ArgumentTypeError(
                f"{text[:40]!r}{'...' if len(text) > 40 else ''}: device ids are below "
                "10**18, e.g. --src-devices 0-4095"
            )
        if m is None or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise argparse.ArgumentTypeError(
                f"{text!r}: write device ids as ids and inclusive ranges separated by ',', "
                "e.g. --src-devices 0-4095 or --avoid 3,7,10-11"
            )
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if len(ids) + hi - lo + 1 > MAX_DEVICES:
            raise argparse.ArgumentTypeError(
                f"{text!r} lists more than {MAX_DEVICES} devices, the most that are planned"
            )
        ids.extend(range(lo, hi + 1))
    if len(set(ids)) != len(ids):
        dup = sorted(i for i, c in Counter(ids).items() if c > 1)[:5]
        raise argparse.ArgumentTypeError(f"{text!r} lists device(s) {dup} more than once")
    return tuple(ids)


# The memory kinds of JAX's devices (CPU, GPU and TPU alike).
MEMORY_KINDS = ("device", "pinned_host", "unpinned_host")


def _jax_has(dt: np.dtype[Any]) -> bool:
    """Whether JAX makes arrays of ``dt`` (traced only: nothing is allocated)."""
    import jax
    import jax.numpy as jnp

    try:
        jax.eval_shape(lambda: jnp.zeros((0,), dt))
    except TypeError:
        return False
    return True


def dtype_arg(text: str) -> np.dtype[Any]:
    """A numpy dtype name, or one of JAX's extra types (``bfloat16``, ``int4``, ...)."""
    import ml_dtypes  # a dependency of jax; provides bfloat16, float8_*, int4

    name = text.strip()
    try:
        if hasattr(ml_dtypes, name):
            dt = np.dtype(getattr(ml_dtypes, name))
            # bfloat16, float8_*, int4, ...: raw bytes to numpy, or (float8_e5m2, with
            # numpy 2.4 and ml_dtypes 0.6) a float. Not its complex32 types, whose kind
            # changed between ml_dtypes releases ("W", then "V" in 0.7): ask JAX.
            ok = dt.kind in "Vf" and dt.names is None and _jax_has(dt)
        else:
            dt = np.dtype(name)
            # Numbers and bools of the widths JAX has: not strings, objects, dates,
            # records ("i4,f4") or raw bytes, nor float128.
            ok = dt.kind in "biufc" and dt.itemsize <= (16 if dt.kind == "c" else 8)
        ok = ok and dt.itemsize > 0 and dt.isnative  # (JAX has no byte-swapped types)
    except Exception:  # numpy raises TypeError, ValueError or SyntaxError (",8")
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype of JAX arrays; write a numpy or JAX dtype name, "
            "e.g. --dtype bfloat16 (or float32, int8, float8_e4m3fn)"
        )
    return dt


# ----------------------------------------------------------------------------------
# Synthetic shardings
# ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    """One side of a synthetic reshard: a ``NamedSharding`` with integer device ids."""

    name: str  # "source" or "destination": used in messages
    flag: str  # "--src" or "--dst": used in messages
    mesh: tuple[int, ...]
    axes: tuple[str, ...]
    spec: tuple[SpecEntry, ...]
    devices: tuple[int, ...]
    memory_kind: str

    def describe(self) -> str:
        spec = ", ".join(
            "None" if e is None else (e if isinstance(e, str) else "+".join(e)) for e in self.spec
        )
        memory = "" if self.memory_kind == "device" else f", memory kind {self.memory_kind}"
        return (
            f"mesh {'x'.join(map(str, self.mesh))} ({', '.join(self.axes)}), spec ({spec}), "
            f"devices {device_ranges(self.devices)}{memory}"
        )


def make_side(
    name: str,
    flag: str,
    mesh: tuple[int, ...],
    axes: tuple[str, ...] | None,
    spec: tuple[SpecEntry, ...] | None,
    devices: tuple[int, ...] | None,
    memory_kind: str,
    rank: int,
) -> Side:
    """Fills defaults and checks a side for consistency, with messages that say the fix.

    Defaults: axes ``a0,a1,...``; spec: dimension ``i`` sharded over axis ``i`` (as far
    as the rank allows); devices ``0..n-1``.
    """
    if axes is None:
        axes = ("data", "model") if len(mesh) == 2 else tuple(f"a{i}" for i in range(len(mesh)))
    if len(axes) != len(mesh):
        raise UsageError(
            f"{flag}-axes names {len(axes)} axis/axes {list(axes)} but {flag}-mesh "
            f"{'x'.join(map(str, mesh))} has {len(mesh)}; give one name per mesh dimension"
        )
    if spec is None:
        spec = tuple(axes[:rank])
    if len(spec) > rank:
        raise UsageError(
            f"{flag}-spec has {len(spec)} entries but the array has rank {rank}; "
            f"use at most {rank} entries"
        )
    used = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
    unknown = [a for a in used if a not in axes]
    if unknown:
        raise UsageError(
            f"{flag}-spec uses axis/axes {unknown} that {flag}-axes {','.join(axes)} does "
            "not define; use the mesh's axis names"
        )
    if len(set(used)) != len(used):
        raise UsageError(f"{flag}-spec uses a mesh axis twice ({used}); use each axis at most once")
    n = math.prod(mesh)
    if devices is None:
        devices = tuple(range(n))
    if len(devices) != n:
        raise UsageError(
            f"{flag}-devices lists {len(devices)} device(s) but {flag}-mesh "
            f"{'x'.join(map(str, mesh))} has {n} positions; give exactly {n} ids, "
            f"e.g. {flag}-devices 0-{n - 1}"
        )
    return Side(name, flag, mesh, axes, spec, devices, memory_kind)


def process_sizes(text: str) -> tuple[int, ...]:
    """Devices per process: one count for every process (``4``), or a count for each
    process in turn (``6,2``: ids 0-5 and 6-7) (argparse type)."""
    return tuple(positive_int(part) for part in text.split(","))


def process_of(device: int, sizes: Sequence[int]) -> int:
    """The process of synthetic device ``device``, with ``sizes`` devices per process
    (``process_sizes``): ``device // sizes[0]`` for one count, else the process whose
    run of ids holds it."""
    if len(sizes) == 1:
        return device // sizes[0]
    ends = list(itertools.accumulate(sizes))
    if device >= ends[-1]:
        raise UsageError(
            f"device {device} is beyond the {ends[-1]} devices that --devices-per-process "
            f"{','.join(map(str, sizes))} gives its processes (ids 0-{ends[-1] - 1})"
        )
    return bisect.bisect_right(ends, device)


def shard_specs(
    side: Side, shape: tuple[int, ...], devices_per_process: Sequence[int]
) -> tuple[ShardSpec, ...]:
    """The planner's view of a synthetic side: device ids laid out row-major on the mesh."""
    try:
        boxes = named_shard_boxes(shape, side.mesh, side.axes, side.spec)
    except ValueError as e:
        raise UsageError(
            f"{side.flag}-spec cannot shard shape {list(shape)}: {e}; pick a --shape "
            "divisible by the shard counts, or another spec"
        ) from None
    positions = sorted(boxes)  # row-major, the order of Mesh(np.array(ids).reshape(mesh))
    return tuple(
        ShardSpec(dev, side.memory_kind, process_of(dev, devices_per_process), boxes[pos])
        for dev, pos in zip(side.devices, positions, strict=True)
    )


def piece_bound(src: Sequence[ShardSpec], dst: Sequence[ShardSpec]) -> int:
    """How many pieces a plan of one array may cut, at most: for every destination
    shard, the distinct source boxes it overlaps (before the planner drops what stays
    in place). Planning time and memory grow with it."""
    if not dst:
        return 0
    ndim = len(dst[0].box)
    # A synthetic side's boxes tile each dimension into sorted, disjoint intervals.
    cuts = [sorted({s.box[d] for s in src}) for d in range(ndim)]
    starts = [[lo for lo, _ in c] for c in cuts]
    stops = [[hi for _, hi in c] for c in cuts]

    @functools.cache
    def overlaps(d: int, lo: int, hi: int) -> int:
        return max(0, bisect.bisect_left(starts[d], hi) - bisect.bisect_right(stops[d], lo))

    return sum(
        n * math.prod(overlaps(d, lo, hi) for d, (lo, hi) in enumerate(box))
        for box, n in Counter(s.box for s in dst).items()
    )


def synthetic_plan(
    shape: tuple[int, ...],
    dtype: np.dtype[Any],
    count: int,
    src: Side,
    dst: Side,
    avoid: tuple[int, ...],
    devices_per_process: Sequence[int],
) -> Plan:
    """Plans ``count`` arrays of ``shape``/``dtype`` from ``src`` to ``dst``.

    The result is a real ``Plan`` (so ``to_dict`` and the statistics are the library's
    own), built without JAX shardings: it describes, it cannot execute.

    Raises:
      UsageError: inconsistent sides, or avoided devices in the destination.
      DataLossError: a box has no copy outside ``avoid``.
    """
    shards = count * (len(src.devices) + len(dst.devices))
    if shards > MAX_DEVICES * 16:
        raise UsageError(
            f"--count {count} arrays over {len(src.devices)} + {len(dst.devices)} devices "
            f"make {shards} shards; at most {MAX_DEVICES * 16} are planned (lower --count)"
        )
    lost_dst = sorted(set(avoid) & set(dst.devices))
    if lost_dst:
        raise UsageError(
            f"--avoid lists device(s) {device_ranges(lost_dst)} that the destination uses; "
            "build the destination on surviving devices only"
        )
    src_specs = shard_specs(src, shape, devices_per_process)
    dst_specs = shard_specs(dst, shape, devices_per_process)
    pieces = count * piece_bound(src_specs, dst_specs)
    if pieces > MAX_PIECES:
        raise UsageError(
            f"this plan would cut up to {pieces:,} pieces (each destination shard from "
            f"every source shard it overlaps); at most {MAX_PIECES:,} are planned (about "
            "2 GB of memory and a minute): use fewer devices or --count, or a destination "
            "cut more like the source"
        )
    names = ["array"] if count == 1 else [f"array[{i}]" for i in range(count)]
    itemsize = dtype.itemsize
    leaves = [LeafSpec(n, shape, itemsize, src_specs, dst_specs) for n in names]
    leaf_plans, stats = plan_leaves(leaves, avoid_devices=avoid)
    # LeafInfo wants JAX shardings, which synthetic devices cannot have; the plan only
    # reads them when it executes, which a synthetic plan never does.
    infos = tuple(LeafInfo(n, ARRAY, shape, dtype, None, cast(Any, None)) for n in names)
    return Plan(None, infos, leaf_plans, stats, "none", frozenset(avoid))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``reshard plan``."""
    p.add_argument(
        "--shape",
        type=shape_arg,
        required=True,
        metavar="SIZES",
        help="array shape, e.g. 8192,8192",
    )
    p.add_argument(
        "--dtype",
        type=dtype_arg,
        default="bfloat16",
        metavar="NAME",
        help="element type (bfloat16)",
    )
    p.add_argument(
        "--count",
        type=positive_int,
        default=1,
        metavar="N",
        help="plan this many such arrays together (1)",
    )
    for side, word in (("src", "source"), ("dst", "destination")):
        p.add_argument(
            f"--{side}-mesh",
            type=mesh_arg,
            required=True,
            metavar="SIZES",
            help=f"{word} mesh shape, e.g. 64x64",
        )
        p.add_argument(
            f"--{side}-axes",
            type=axes_arg,
            metavar="NAMES",
            help=f"{word} mesh axis names, e.g. data,model",
        )
        p.add_argument(
            f"--{side}-spec",
            type=spec_arg,
            metavar="SPEC",
            help=f"{word} partition spec, one entry per dimension: an axis, axes joined by "
            "'+', or None (default: dimension i over axis i)",
        )
        p.add_argument(
            f"--{side}-devices",
            type=devices_arg,
            metavar="IDS",
            help=f"{word} device ids laid out row-major on the mesh, e.g. 0-4095 or 0,2,4-7 "
            "(default: 0..n-1)",
        )
        p.add_argument(
            f"--{side}-memory-kind",
            default="device",
            choices=MEMORY_KINDS,
            metavar="KIND",
            help=f"{word} memory kind: {', '.join(MEMORY_KINDS)} (device)",
        )
    p.add_argument(
        "--avoid",
        type=devices_arg,
        default=(),
        metavar="IDS",
        help="lost devices never to read, e.g. 3,7",
    )
    p.add_argument(
        "--devices-per-process",
        type=process_sizes,
        metavar="N",
        help="multi-controller: process of a device = id // N, or with a count per "
        "process (e.g. 6,2: ids 0-5 and 6-7) the one whose ids hold it (default: one "
        "process)",
    )
    add_output_arguments(p)
    p.add_argument("--pieces", action="store_true", help="with --json: list every piece")


def run(args: argparse.Namespace, console: Any) -> int:
    """Runs ``reshard plan``; returns the exit code."""
    if args.pieces and not args.json:
        raise UsageError("--pieces lists pieces in the JSON output; add --json")
    shape, rank = args.shape, len(args.shape)
    src = make_side(
        "source",
        "--src",
        args.src_mesh,
        args.src_axes,
        args.src_spec,
        args.src_devices,
        args.src_memory_kind,
        rank,
    )
    dst = make_side(
        "destination",
        "--dst",
        args.dst_mesh,
        args.dst_axes,
        args.dst_spec,
        args.dst_devices,
        args.dst_memory_kind,
        rank,
    )
    dpp = args.devices_per_process or (max(src.devices + dst.devices) + 1,)
    try:
        plan = synthetic_plan(shape, args.dtype, args.count, src, dst, args.avoid, dpp)
    except DataLossError as e:
        if args.json:
            json.dump({"error": "DataLossError", "message": str(e)}, sys.stdout)
            print()
        print(f"reshard plan: {e}", file=sys.stderr)
        return 1
    report = plan_report(plan.leaf_plans, plan.stats, max_blocks=args.blocks)
    if args.json:
        out = {
            "shape": list(shape),
            "dtype": str(args.dtype),
            "count": args.count,
            "source": _side_dict(src),
            "destination": _side_dict(dst),
            "avoid": list(args.avoid),
            **report,
        }
        if args.pieces:
            out["leaves"] = plan.to_dict(pieces=True)["leaves"]
        json.dump(out, sys.stdout)
        print()
        return 0
    nbytes = math.prod(shape) * args.dtype.itemsize
    many = f"{args.count} arrays of " if args.count > 1 else ""
    console.print(
        f"[bold]reshard plan[/bold]: {many}{args.dtype}{list(shape)} ({human_bytes(nbytes)} each)"
    )
    # Never wrapped (a terminal wraps them on screen only): the device lists in them
    # are passed back to --src-devices/--dst-devices as they are.
    console.print(f"  source:      {src.describe()}", highlight=False, soft_wrap=True)
    console.print(f"  destination: {dst.describe()}", highlight=False, soft_wrap=True)
    if args.avoid:
        avoiding = f"  avoiding:    devices {device_ranges(args.avoid)} (lost)"
        idle = sorted(set(args.avoid) - set(src.devices))
        if idle:
            # Most likely a typo; harmless either way, so noted rather than refused.
            ids = device_ranges(idle)
            which = f"device {ids} holds" if len(idle) == 1 else f"devices {ids} hold"
            avoiding += f"; {which} no source shard, which changes nothing"
        console.print(avoiding, highlight=False, soft_wrap=True)
    render_report(console, report)
    return 0


def _side_dict(side: Side) -> dict[str, Any]:
    return {
        "mesh": list(side.mesh),
        "axes": list(side.axes),
        "spec": [e if e is None or isinstance(e, str) else list(e) for e in side.spec],
        "devices": device_ranges(side.devices),
        "memory_kind": side.memory_kind,
    }
