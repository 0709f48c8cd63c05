"""``reshard bench``: run the benchmark suite (packaged with the library) and print its table of ratios.

The suite itself lives in ``reshard._bench`` (``benchmarks/bench.py`` runs the same
code); this module only finds it, runs it and prints its rows. What it relies on:

* a module-level function ``run`` (or ``run_benchmarks``) returning rows: objects with
  an ``as_dict()`` method (which may add the ratio columns), mappings, dataclasses or
  ``NamedTuple``s, each from column name to value in display order;
* of its keyword arguments, those it declares among ``size_mb``, ``repeats``/``reps``,
  ``cases``/``scenarios``, ``rss`` and ``progress`` (a callable taking a message);
* optionally ``SCENARIOS`` (the valid case names), ``setup_devices(n)`` (which
  simulates the CPU devices before JAX starts) and ``FOOTER`` (a line printed under
  the table: how to read the suite's columns).

The environment variable ``RESHARD_BENCH_MODULE`` (a module name or a ``.py`` path)
points ``reshard bench`` at another suite with the same contract.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import importlib.util
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ._plan import human_bytes

ENV_MODULE = "RESHARD_BENCH_MODULE"
DEVICES = 8  # the suite's scenarios are written for 8 simulated CPU devices
_FUNCTIONS = ("run", "run_benchmarks")


class SuiteNotAvailable(Exception):
    """No benchmark suite could be found: exit code 2 with a message."""


def _load_path(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(f"_reshard_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SuiteNotAvailable(f"cannot load the benchmark suite {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _import_suite(custom: str, load: Callable[[], Any]) -> Any:
    """Imports the user's suite; one that fails to import is named in one line."""
    try:
        return load()
    except SyntaxError as e:
        raise SuiteNotAvailable(
            f"{ENV_MODULE}={custom}: cannot import it: SyntaxError at {e.filename}, "
            f"line {e.lineno}: {e.msg}"
        ) from None
    except Exception as e:
        raise SuiteNotAvailable(
            f"{ENV_MODULE}={custom}: cannot import it: {type(e).__name__}: {e}"
        ) from None


def find_suite() -> tuple[Callable[..., Iterable[Any]], str, Any]:
    """The suite's row function, where it came from, and its module.

    Raises:
      SuiteNotAvailable: no suite found, or one without a row function.
    """
    module: Any = None
    where = ""
    custom = os.environ.get(ENV_MODULE)
    if custom:
        where = custom
        if custom.endswith(".py"):
            if not Path(custom).is_file():
                raise SuiteNotAvailable(f"{ENV_MODULE}={custom}: no such file")
            module = _import_suite(custom, lambda: _load_path(Path(custom)))
        else:
            try:
                # Raises, rather than returns None, when a parent package is missing.
                found = importlib.util.find_spec(custom)
            except (ImportError, ValueError):
                found = None
            if found is None:
                raise SuiteNotAvailable(f"{ENV_MODULE}={custom}: no such module")
            module = _import_suite(custom, lambda: importlib.import_module(custom))
    elif importlib.util.find_spec("reshard._bench") is not None:
        where = "reshard._bench"
        module = importlib.import_module("reshard._bench")
    if module is None:
        raise SuiteNotAvailable(
            "the benchmark suite is not available in this build yet (no module "
            f"reshard._bench); set {ENV_MODULE} to a module that defines run()"
        )
    for name in _FUNCTIONS:
        fn = getattr(module, name, None)
        if callable(fn):
            return fn, f"{where}:{name}", module
    raise SuiteNotAvailable(
        f"the benchmark suite {where} defines none of {list(_FUNCTIONS)}; "
        "it needs a function that returns rows"
    )


def _as_dict(row: Any) -> dict[str, Any]:
    # A row's own `as_dict` may add derived columns (the ratios).
    if callable(getattr(row, "as_dict", None)):
        return dict(row.as_dict())
    if isinstance(row, Mapping):
        return dict(row)
    if dataclasses.is_dataclass(row) and not isinstance(row, type):
        return dataclasses.asdict(row)
    if hasattr(row, "_asdict"):
        return dict(row._asdict())
    raise TypeError(f"a benchmark row must be a mapping, dataclass or NamedTuple, got {row!r}")


def _options(fn: Callable[..., Any], wanted: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """Keyword arguments for ``fn``: per option, the first of its names ``fn`` declares.

    ``wanted`` maps alternative names of one option (``("repeats", "reps")``) to its
    value; options left at ``None`` are not passed, so the suite's defaults apply.
    """
    params = inspect.signature(fn).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out: dict[str, Any] = {}
    for names, value in wanted.items():
        if value is None:
            continue
        name = next((n for n in names if n in params), names[0] if var_kw else None)
        if name is not None:
            out[name] = value
    return out


def format_cell(column: str, value: Any) -> str:
    """Seconds (``*_s``) as ms, ratios (``vs_*``, ``*_x``) as ``1.73x``, bytes readable."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        lowered = column.lower()
        if lowered.endswith("_s"):
            return f"{value * 1e3:.1f} ms"
        if lowered.startswith("vs_") or lowered.endswith("_x") or "ratio" in lowered:
            return f"{value:.2f}x"
        if "bytes" in lowered:
            return human_bytes(value)
        return f"{value:,}" if isinstance(value, int) else f"{value:.3g}"
    return str(value)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``reshard bench``."""
    from ._cli import positive_int, size_mb

    p.add_argument(
        "--size-mb",
        type=size_mb,
        help="size of the LLM-shaped trees in MiB (suite default; the built-in suite's "
        "leaves, narrow, offload and blocks cases keep their fixed sizes)",
    )
    p.add_argument("--repeats", type=positive_int, help="timed repetitions (suite default)")
    p.add_argument("--cases", help="comma-separated cases to run, e.g. disjoint,relayout")
    p.add_argument("--no-rss", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--json", action="store_true", help="print JSON for machines")


def run(args: argparse.Namespace, console: Any) -> int:
    """Runs ``reshard bench``; returns the exit code."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from ._cli import UsageError

    try:
        fn, where, module = find_suite()
    except SuiteNotAvailable as e:
        print(f"reshard bench: error: {e}", file=sys.stderr)
        return 2
    known = getattr(module, "SCENARIOS", None)
    cases = None
    if args.cases is not None:
        # Each case once, in the order given (a repeated name would run it again).
        cases = tuple(dict.fromkeys(c.strip() for c in args.cases.split(",") if c.strip()))
        if not cases:
            examples = f", e.g. --cases {known[0]}" if known else ""
            raise UsageError(f"--cases names no case ({args.cases!r}){examples}")
    if cases is not None and known is not None:
        bad = [c for c in cases if c not in known]
        if bad:
            raise UsageError(
                f"--cases: unknown case(s) {bad}; choose from {','.join(known)}, "
                f"e.g. --cases {known[0]}"
            )
    # The suite runs on simulated CPU devices, which must exist before JAX starts.
    setup = getattr(module, "setup_devices", None)
    if callable(setup):
        setup(DEVICES)
    else:
        from ._cli_demo import configure_cpu_devices

        configure_cpu_devices(DEVICES)
    err = Console(stderr=True)
    with err.status("benchmarking", spinner="dots") if err.is_terminal else _nothing() as status:

        def progress(what: str) -> None:
            if status is not None:
                status.update(what)

        options = _options(
            fn,
            {
                ("size_mb",): args.size_mb,
                ("repeats", "reps"): args.repeats,
                ("cases", "scenarios"): cases,
                ("rss",): False if args.no_rss else None,
                ("progress",): progress,
            },
        )
        rows = [_as_dict(r) for r in fn(**options)]
    if not rows:  # (with --json too: nothing was measured)
        print(f"reshard bench ({where}): the suite returned no rows", file=sys.stderr)
        return 1
    if args.json:
        json.dump({"suite": where, "rows": rows}, sys.stdout, default=str)
        print()
        return 0
    columns: list[str] = []
    for r in rows:
        columns.extend(k for k in r if k not in columns)
    # A column with no value in any row (e.g. peak memory with --no-rss) says nothing.
    columns = [c for c in columns if any(r.get(c) is not None for r in rows)]
    table = Table(title=f"reshard bench ({where})", box=box.SIMPLE_HEAD, title_justify="left")
    for c in columns:
        header = c[:-2] if c.endswith("_s") else c  # the cell says "ms"
        table.add_column(
            header.replace("_", " "), justify="left" if c == columns[0] else "right", no_wrap=True
        )
    for r in rows:
        table.add_row(*(format_cell(c, r.get(c)) for c in columns))
    # Piped output has no terminal width to respect: keep each row on one line.
    if not console.is_terminal:
        console.width = 200
    console.print(table)
    # The suite says how to read its columns; another suite's are not ours to explain.
    footer = getattr(module, "FOOTER", None)
    if isinstance(footer, str) and footer:
        console.print(footer)
    return 0


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield None
