"""The ``reshard`` command line: ``demo``, ``plan`` and ``bench``.

``reshard demo`` shows, on simulated CPU devices, what the library does and how it
compares with ``jax.device_put``; ``reshard plan`` explains a reshard of any number of
synthetic devices without data; ``reshard bench`` runs the benchmark suite packaged with it.

Conventions every command follows:

* Human output goes through ``rich``: tables and colours on a terminal, plain text when
  piped (rich decides from ``isatty``). ``--json`` prints one JSON document instead.
* A mistake on the command line is one line on stderr that says what is wrong and how
  to write it, and exit code 2 -- never a traceback. Data loss (``--avoid``) is exit
  code 1. Anything else that fails is a bug and keeps its traceback.
* A reader that stops early (``reshard plan ... | head``) is no failure: the output
  ends quietly, with the run's exit code.
* Heavy imports happen inside the commands: ``reshard demo`` must choose the number of
  simulated devices before JAX initialises its backends.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NoReturn, TextIO, cast

EXIT_USAGE = 2
EXIT_FAILED = 1

_EPILOG = """examples:
  reshard demo                              # 8 simulated CPU devices, ~200 MB of weights
  reshard demo --devices 4 --size-mb 16
  reshard plan --shape 12288,8192 --src-mesh 64x64 --src-devices 0-4095 \\
               --dst-mesh 48x64 --dst-devices 4096-7167
  reshard bench --json
"""


class UsageError(Exception):
    """A mistake on the command line: printed as one line, exit code 2.

    Args:
      message: what is wrong and how to write it.
      prog: the command it belongs to (``"reshard plan"``); filled in by ``main``
        when not given.
    """

    def __init__(self, message: str, prog: str | None = None) -> None:
        super().__init__(message)
        self.prog = prog


class _Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (no usage block), exit code 2."""

    _args: Sequence[str] = ()

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        # Kept for `error`, which argparse gives only the message.
        self._args = tuple(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._args, namespace)

    def error(self, message: str) -> NoReturn:
        flags = [a for a in self._args if a.startswith("-")]
        if message.endswith("required: command") and flags:
            # Flags before any command (`reshard --bogus`): say so, not only that the
            # command is missing.
            message = f"unrecognized arguments: {' '.join(flags)}; name a command first"
        elif (
            re.match(r"argument command: invalid choice: '.*' \(", message)
            and self._args[:1] != ("--",)
            and self._args[:1] == tuple(flags[:1])
        ):
            # A command's flag and its value before the command (`reshard --devices 4
            # demo`): argparse takes the value for the command; name every flag before
            # the command (or all of them, with no command).
            commands = {
                name
                for action in self._actions
                if isinstance(action, argparse._SubParsersAction)
                for name in action.choices
            }
            end = next((i for i, a in enumerate(self._args) if a in commands), None)
            named = " ".join(a for a in self._args[:end] if a.startswith("-"))
            message = f"unrecognized arguments: {named}; name a command first, then its flags"
        message = self._dash_value(message)
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)

    def _dash_value(self, message: str) -> str:
        """``message``, for a value such as ``-5,64`` that argparse takes for a flag: what
        is wrong with the value, or else how to pass it (``--flag=-5,64``)."""
        m = re.fullmatch(r"argument (\S+): expected one argument", message)
        if m is None:
            return message
        flags = m.group(1).split("/")
        for flag, value in zip(self._args, self._args[1:], strict=False):
            if flag in flags and value.startswith("-") and not re.match(r"--?[A-Za-z]", value):
                convert = next((a.type for a in self._actions if flag in a.option_strings), None)
                try:
                    if callable(convert):
                        convert(value)
                except (argparse.ArgumentTypeError, TypeError, ValueError) as e:
                    # Not worth a hint that leads to this error: say it now.
                    return f"argument {m.group(1)}: {e}"
                return f"{message}; a value that starts with '-' needs '=', e.g. {flag}={value}"
        return message


class _CommandParser(_Parser):
    """The parser of one command: reports the flags it does not know itself.

    argparse leaves a command's unknown flags to the top-level parser, whose message
    would send the user to ``reshard --help`` instead of ``reshard plan --help``.
    """

    def parse_known_args(self, args: Iterable[str] | None = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse type)."""
    try:
        v = int(text)
    except ValueError:
        digits = text.strip()
        if digits.isascii() and digits.isdigit():  # past the digits int() reads
            significant = digits.lstrip("0")
            if len(significant) > 4000:
                raise argparse.ArgumentTypeError(
                    f"{text[:20]!r}... ({len(significant):,} digits) is too large, e.g. 8"
                ) from None
            v = int(significant or "0")
        else:
            v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1, e.g. 8")
    return v


def positive_float(text: str) -> float:
    """A finite number > 0 (argparse type)."""
    try:
        v = float(text)
    except ValueError:
        v = 0.0
    if not (v > 0 and math.isfinite(v)):  # also rejects nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number > 0, e.g. 200 or 4.5")
    return v


def memory_mib() -> float:
    """This machine's physical memory in MiB (1 TiB where the platform cannot say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (AttributeError, ValueError, OSError):
        return float(2**20)


def size_mb(text: str) -> float:
    """``--size-mb``: a finite number > 0 of MiB that fits this machine's memory.

    The demo and the benchmarks build their trees in host memory: a size beyond it
    could only fail later, with an out-of-memory error (argparse type).
    """
    v = positive_float(text)
    limit = memory_mib()
    if v > limit:
        raise argparse.ArgumentTypeError(
            f"{text!r} MiB is more than this machine's memory ({limit:,.0f} MiB); "
            "the trees live in host memory, e.g. 200"
        )
    return v


def add_output_arguments(p: argparse.ArgumentParser, *, blocks: bool = True) -> None:
    """``--blocks`` (heatmap size) and ``--json``, shared by the commands that plan."""
    if blocks:
        p.add_argument(
            "--blocks", type=positive_int, default=32, help="heatmap blocks per side, at most (32)"
        )
    p.add_argument("--json", action="store_true", help="print JSON for machines")


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``reshard`` and its three commands."""
    from . import __version__, _cli_bench, _cli_demo, _cli_plan

    parser = _Parser(
        prog="reshard",
        description="Move sharded JAX arrays between shardings and device sets: "
        "see it work (demo), explain a plan (plan), measure (bench).",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"reshard {__version__}")
    sub = parser.add_subparsers(
        dest="command", metavar="command", required=True, parser_class=_CommandParser
    )
    commands = (
        ("demo", _cli_demo, "reshard an LLM-shaped tree on simulated CPU devices"),
        ("plan", _cli_plan, "explain a reshard of synthetic devices (thousands), without data"),
        ("bench", _cli_bench, "run the benchmark suite and print the table of ratios"),
    )
    for name, module, summary in commands:
        # The first paragraph of the command module's docstring describes the command.
        doc = (module.__doc__ or "").split("\n\n")[0].replace("``", "")
        # No abbreviations: "--dev 1" silently meant --devices-per-process in plan.
        cmd = sub.add_parser(name, help=summary, description=doc, allow_abbrev=False)
        module.add_arguments(cmd)
        cmd.set_defaults(run=module.run)
    return parser


def console() -> Any:
    """The stdout console: colours only on a terminal; no guessing of highlights.

    Piped, lines end without the spaces rich pads tables and panels with (to the
    console's width), so that saved output diffs and greps cleanly.
    """
    from rich.console import Console

    try:
        piped = not sys.stdout.isatty()
    except (AttributeError, ValueError):  # stdout closed at start (`>&-`): rich reports it
        piped = False
    if piped:
        return Console(highlight=False, file=cast(TextIO, _NoTrailingSpaces(sys.stdout)))
    return Console(highlight=False)


class _NoTrailingSpaces:
    """A text stream that drops the spaces at the end of each line written through it.

    Spaces at the end of one ``write`` are held back until the next shows whether
    the line goes on (they are written) or ends there (they are dropped).
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._held = ""

    def write(self, text: str) -> int:
        *lines, last = (self._held + text).split("\n")
        kept = last.rstrip(" ")
        self._held = last[len(kept) :]
        done = "".join(line.rstrip(" ") + "\n" for line in lines)
        self._stream.write(done + kept)
        return len(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def check_env(read: Callable[[], object], example: str) -> None:
    """Calls ``read`` (which reads an environment variable, raising ``ValueError`` for
    a bad value); a bad value becomes a ``UsageError`` that shows how to set it
    (``example``)."""
    try:
        read()
    except ValueError as e:
        raise UsageError(f"{e}; set it like {example}, or unset it") from None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reshard`` console script and of ``python -m reshard``.

    Args:
      argv: the arguments after the program name (default: ``sys.argv[1:]``).

    Returns:
      The exit code: 0 success, 1 failure (e.g. data loss), 2 a command-line mistake.
    """
    prog = "reshard"
    stdout = sys.stdout
    out = _ReaderMayLeave(stdout)
    sys.stdout = cast(TextIO, out)
    try:
        args = build_parser().parse_args(argv)
        prog = f"reshard {args.command}"
        from ._buffers import limit_from_env

        # Read by the CPU executor: a bad value is a usage error, not a traceback.
        check_env(limit_from_env, "RESHARD_HOST_POOL_BYTES=1073741824")
        code = int(args.run(args, console()))
        out.flush()  # a closed pipe shows here at the latest, not at the interpreter's exit
        return code
    except UsageError as e:
        print(f"{e.prog or prog}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OutputLost as e:
        print(f"{prog}: error: cannot write standard output: {e}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print("reshard: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.stdout = stdout


class OutputLost(Exception):
    """Standard output could not be written (not a reader that left: that is fine)."""


class _ReaderMayLeave:
    """``sys.stdout`` for a command whose reader may stop early (``reshard plan | head``).

    Once a write or flush meets a closed pipe, stdout is pointed at ``/dev/null`` and
    the rest of the output is dropped, so the command still runs to its end: its exit
    code (1 for data loss, say) and its messages on stderr are the same as when its
    output is read in full. Everything else is the wrapped stream's.
    """

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = False

    def write(self, text: str) -> int:
        if self._stream is None and text:  # started with stdout closed (`>&-`)
            raise OutputLost("standard output is closed")
        if not self._gone:
            try:
                self._stream.write(text)
            except BrokenPipeError:
                self._reader_left()
            except OSError as e:  # a full disk, say: the output is lost, so the run fails
                self._reader_left()
                raise OutputLost(e) from None
        return len(text)

    def flush(self) -> None:
        if not self._gone and self._stream is not None:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._reader_left()
            except OSError as e:
                self._reader_left()
                raise OutputLost(e) from None

    def _reader_left(self) -> None:
        self._gone = True
        # What the stream still buffers then goes to /dev/null, at the latest when the
        # interpreter flushes it on exit, without raising again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)
