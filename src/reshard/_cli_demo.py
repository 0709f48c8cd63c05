"""``reshard demo``: reshard an LLM-shaped tree on simulated CPU devices, next to jax.device_put.

Four scenarios on ``N`` devices (default 8) -- trainer -> sampler on disjoint device
sets, a same-device relayout, an elastic shrink that reads only surviving replicas,
and the regrow -- each planned, timed against ``jax.device_put`` and verified bit for
bit against numpy (see ``_cli_scenarios`` for their exact shardings).

The parameter tree looks like a decoder-only transformer: bf16 matrices, f32 norms and
an f32 embedding, sized by ``--size-mb``. ``--processes P`` runs the same scenarios in
``P`` local JAX processes (multi-controller) through ``reshard._launch``. The workload
itself lives in ``_cli_scenarios``; this module parses, sets up devices and prints.

JAX must be told how many CPU devices to simulate before it initialises its backends,
so nothing here touches devices until :func:`configure_cpu_devices` has run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from typing import Any

from rich.markup import escape

from ._cli import (
    EXIT_FAILED,
    EXIT_USAGE,
    UsageError,
    add_output_arguments,
    check_env,
    memory_mib,
    positive_float,
    positive_int,
    size_mb,
)
from ._cli_render import render_report
from ._cli_scenarios import model_width, run_demo, shard_unit, tree_bytes
from ._plan import human_bytes

DEFAULT_DEVICES = 8
DEFAULT_SIZE_MB = 200.0
DEFAULT_REPEATS = 3
ENV_TIMEOUT = "RESHARD_DEMO_TIMEOUT_S"  # seconds a --processes run may take
DEFAULT_TIMEOUT_S = 600.0


# ----------------------------------------------------------------------------------
# Devices
# ----------------------------------------------------------------------------------


def configure_cpu_devices(n: int) -> None:
    """Makes JAX simulate ``n`` CPU devices; must run before JAX initialises.

    Sets both the XLA flag (read when the CPU client is created) and the JAX option
    (which wins over the flag where both exist), dropping any inherited device count.

    Raises:
      UsageError: JAX was already initialised with another device count.
    """
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    try:
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", n)
    except Exception:
        # Backends already initialised (e.g. demo called from a program that used
        # JAX): fine if they happen to match.
        if jax.default_backend() != "cpu" or jax.device_count() != n:
            raise UsageError(
                f"JAX is already initialised with {jax.device_count()} "
                f"{jax.default_backend()} device(s); run the demo in a fresh process"
            ) from None


# ----------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``reshard demo``."""
    p.add_argument(
        "--devices",
        type=positive_int,
        default=DEFAULT_DEVICES,
        help=f"simulated CPU devices, an even number ({DEFAULT_DEVICES})",
    )
    p.add_argument(
        "--size-mb",
        type=size_mb,
        default=DEFAULT_SIZE_MB,
        help=f"about how many MiB of parameters ({DEFAULT_SIZE_MB:.0f})",
    )
    p.add_argument(
        "--repeats",
        type=positive_int,
        default=DEFAULT_REPEATS,
        help=f"timed repetitions per method; the median is shown ({DEFAULT_REPEATS})",
    )
    p.add_argument(
        "--processes",
        type=positive_int,
        default=1,
        help="run across this many local JAX processes (multi-controller; default: 1)",
    )
    add_output_arguments(p)


# The most simulated devices the demo takes (far more than it could run).
MAX_DEVICES = 1 << 16


# What a demo process holds at its peak, in MiB, for a tree of ``mib``: JAX itself,
# and ~11 copies of the tree (sources, results, and the baselines' copies and host
# gathers): 191 MB for a 1 MiB tree, 1.27 GB for 100 MiB, 2.26 GB for 197 MiB here.
def needed_mib(mib: float) -> float:
    return 256 + 11 * mib


def _check_args(args: argparse.Namespace) -> None:
    n, procs = args.devices, args.processes
    if n < 2 or n % 2:
        raise UsageError(
            f"--devices must be an even number >= 2 (the scenarios split the devices in "
            f"halves), got {n}; e.g. --devices 8"
        )
    if n % procs:
        raise UsageError(
            f"--devices {n} cannot be split evenly over --processes {procs}; "
            f"use a device count that is a multiple of {procs}"
        )
    if procs > 1:
        timeout_s()  # a bad value is a usage error before anything starts
    if n > MAX_DEVICES:
        raise UsageError(
            f"--devices {n}: at most {MAX_DEVICES} simulated devices, e.g. --devices 8"
        )
    # The model's width is rounded up to a multiple of what every scenario's shard
    # counts divide, which for some device counts is far beyond --size-mb.
    unit = shard_unit(n)
    tree_mib, limit = tree_bytes(model_width(args.size_mb, n)) / 2**20, memory_mib()
    if needed_mib(tree_mib) * procs > limit:  # every process builds the whole tree

        def each(mib: float) -> str:
            if procs == 1:
                return ""
            return f" in each of the {procs} processes ({mib * procs:,.0f} MiB in all)"

        smallest = tree_bytes(unit) / 2**20
        if needed_mib(smallest) * procs > limit:
            why = (
                f"with --devices {n} the model's width must be a multiple of {unit} (so "
                f"that every scenario splits it evenly), which makes the smallest tree "
                f"{smallest:,.0f} MiB and the demo's peak about "
                f"{needed_mib(smallest):,.0f} MiB{each(needed_mib(smallest))}"
            )
            hint = "use a device count with smaller factors, e.g. --devices 8 or 16"
        else:
            why = (
                f"with --devices {n} and --size-mb {args.size_mb:g} the tree is "
                f"{tree_mib:,.0f} MiB (its width rounded up to a multiple of {unit}) and "
                f"the demo's peak about {needed_mib(tree_mib):,.0f} MiB"
                f"{each(needed_mib(tree_mib))}"
            )
            hint = "ask for a smaller --size-mb" + (" or fewer --processes" * (procs > 1))
        raise UsageError(f"{why}, more than this machine's memory ({limit:,.0f} MiB); {hint}")
    if tree_mib > 2 * args.size_mb:
        print(
            f"reshard demo: note: with --devices {n} the model's width must be a multiple "
            f"of {unit}, so the tree is {human_bytes(tree_mib * 2**20)}, not "
            f"~{human_bytes(args.size_mb * 2**20)}; a device count with smaller factors "
            "keeps it near --size-mb",
            file=sys.stderr,
        )


def timeout_s() -> float:
    """The time limit of a ``--processes`` run, from ``RESHARD_DEMO_TIMEOUT_S``.

    Raises:
      UsageError: the variable is set to something other than a number of seconds.
    """
    text = os.environ.get(ENV_TIMEOUT)
    if text is None:
        return DEFAULT_TIMEOUT_S
    try:
        return positive_float(text)
    except argparse.ArgumentTypeError:
        raise UsageError(
            f"{ENV_TIMEOUT}={text!r} is not a number of seconds > 0; "
            f"set it like {ENV_TIMEOUT}=600, or unset it"
        ) from None


def run(args: argparse.Namespace, console: Any) -> int:
    """Runs ``reshard demo``; returns the exit code."""
    _check_args(args)
    if args.processes > 1:
        result = _run_processes(args)
        if result is None:
            return EXIT_USAGE
    else:
        configure_cpu_devices(args.devices)
        result = _run_with_progress(args)
    ok = all(s["verify"]["ok"] for s in result["scenarios"])
    if args.json:
        json.dump(result, sys.stdout)
        print()
    else:
        render(console, result)
    return 0 if ok else EXIT_FAILED


def _run_with_progress(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    # Progress goes to stderr and only to a terminal: piped stdout stays clean.
    err = Console(stderr=True)
    # Steps: the tree, then per scenario place, plan, reshard, verify and the timed runs.
    total = 1 + 4 * (4 + 2 * (args.repeats + 1))
    with Progress(
        TextColumn("{task.description:<48}"),
        BarColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not err.is_terminal,
    ) as progress:
        task = progress.add_task("starting", total=total)

        def step(what: str) -> None:
            progress.update(task, description=what, advance=1)

        return run_demo(args.size_mb, args.repeats, args.blocks, step)


def _run_processes(args: argparse.Namespace) -> dict[str, Any] | None:
    """Runs the demo in ``args.processes`` local processes; ``None`` if unavailable."""
    missing = [
        what
        for module, what in (
            ("reshard._launch", "the local multi-process launcher (reshard._launch)"),
            ("reshard._collective_executor", "the collective executor"),
        )
        if importlib.util.find_spec(module) is None
    ]
    if missing:
        print(
            f"reshard demo: --processes is not available in this build yet: "
            f"{' and '.join(missing)} not found; run without --processes",
            file=sys.stderr,
        )
        return None
    from . import _collective_executor, _launch

    # Read by every child: a bad value is a usage error here, not one traceback each.
    check_env(
        _collective_executor.collective_timeout_s, f"{_collective_executor.ENV_TIMEOUT_S}=600"
    )
    try:
        results = _launch.launch_local(
            "reshard._cli_scenarios:process_main",
            num_processes=args.processes,
            devices_per_process=args.devices // args.processes,
            args=[args.size_mb, args.repeats, args.blocks],
            timeout_s=timeout_s(),
        )
    except _launch.LaunchError as e:
        text = str(e).replace(
            "raise timeout_s if the work needs longer",
            f"raise {ENV_TIMEOUT} (seconds, now {timeout_s():g}) if the work needs longer",
        )
        print(f"reshard demo: the multi-process run failed:\n{text}", file=sys.stderr)
        raise SystemExit(EXIT_FAILED) from None
    values = [r.value for r in results]
    merged: dict[str, Any] = values[0]
    # Every process verified its own shards: the run is good only if all are.
    for i, sc in enumerate(merged["scenarios"]):
        checks = [v["scenarios"][i]["verify"] for v in values]
        sc["verify"] = {
            "ok": all(c["ok"] for c in checks),
            "arrays": checks[0]["arrays"],
            "shards": sum(c["shards"] for c in checks),
            "problems": [p for c in checks for p in c["problems"]][:10],
        }
    return merged


def render(console: Any, result: dict[str, Any]) -> None:
    """Prints the demo's result: per scenario the plan, the times and the check."""
    from rich import box
    from rich.rule import Rule
    from rich.table import Table

    t = result["tree"]
    procs = result["processes"]
    where = f" in {procs} processes" if procs > 1 else ""
    console.print(
        f"[bold]reshard demo[/bold]: {result['devices']} simulated {result['platform']} "
        f"devices{where}\nmodel: a decoder-only transformer, {t['layers']} layers, d_model "
        f"{t['d_model']}: {t['arrays']} arrays, {human_bytes(t['bytes'])}\n"
        "       (bf16 matrices, f32 norms and embedding)"
    )
    scs = result["scenarios"]
    for i, sc in enumerate(scs, 1):
        console.print()
        console.print(Rule(f"{i}/{len(scs)} {sc['title']}", align="left"))
        console.print(sc["story"])
        render_report(console, sc, title=f"plan ({sc['executor']} executor)")
        console.print(_timing(sc["timing"]))
        console.print(_verify_line(sc["verify"]))
    console.print()
    table = Table(
        title="summary",
        box=box.SIMPLE_HEAD,
        title_justify="left",
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,  # seven columns must fit 80 characters when piped
    )
    for name in ("scenario", "moved", "optimal", "reshard", "device_put", "speed-up", "exact"):
        table.add_column(name, justify="left" if name == "scenario" else "right", no_wrap=True)
    for sc in scs:
        s, tm = sc["stats"], sc["timing"]
        dp = tm["device_put_median_ms"]
        table.add_row(
            sc["title"],
            human_bytes(s["bytes_moved"]),
            "yes" if s["bytes_moved"] == s["bytes_lower_bound"] else "[bold red]NO[/bold red]",
            f"{tm['reshard_median_ms']:.1f} ms",
            f"{dp:.1f} ms"
            if dp is not None
            else ("not run" if tm["device_put_skipped"] else "fails"),
            f"{dp / tm['reshard_median_ms']:.2f}x" if dp is not None else "-",
            "[green]yes[/green]" if sc["verify"]["ok"] else "[bold red]NO[/bold red]",
        )
    console.print(table)
    console.print(
        "optimal: bytes moved = the lower bound. speed-up: device_put time / reshard time\n"
        "(medians; one run on this machine: compare ratios, not absolute times)."
    )


def _timing(tm: dict[str, Any]) -> Any:
    from rich.table import Table

    rs, dp = tm["reshard_median_ms"], tm["device_put_median_ms"]
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    grid.add_column(justify="right")
    grid.add_column()
    note = f"median of {tm['repeats']}; planned once in {tm['plan_ms']:.0f} ms, then cached"
    grid.add_row("time", "reshard.reshard", f"{rs:.1f} ms", note)
    if tm["device_put_skipped"]:
        grid.add_row("", "jax.device_put", "-", escape(tm["device_put_skipped"]))
    elif dp is None:
        grid.add_row("", "jax.device_put", "fails", escape(str(tm["device_put_error"])))
    else:
        verdict = f"reshard {dp / rs:.2f}x faster" if dp >= rs else f"reshard {rs / dp:.2f}x slower"
        grid.add_row("", "jax.device_put", f"{dp:.1f} ms", verdict)
    return grid


def _verify_line(v: dict[str, Any]) -> str:
    if v["ok"]:
        return (
            f"[bold]verify[/bold]  [green]ok[/green]: {v['arrays']} arrays, {v['shards']} shards "
            "bit-exact vs numpy, each on its device"
        )
    return "[bold]verify[/bold]  [bold red]FAILED[/bold red]: " + escape("; ".join(v["problems"]))
