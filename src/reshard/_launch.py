"""Local multi-process launcher: N JAX processes x M simulated CPU devices on one machine.

Multi-controller JAX runs one process per host; every process calls the same program
with the same arguments and JAX's distributed runtime (``jax.distributed``) connects
them. This module reproduces that on one machine so tests, demos and users can try
``reshard`` across processes without a cluster:

- :func:`launch_local` starts ``num_processes`` Python processes, each with
  ``devices_per_process`` simulated CPU devices (one count for all, or one per
  process, as hosts of different sizes have), gloo CPU collectives and a coordinator
  on a free port of 127.0.0.1; it collects every process's stdout, stderr, exit code
  and (for function targets) return value, and always ends every process it started.
- :func:`initialize_from_env` is called inside a child (the launcher calls it for you
  by default) and initialises JAX from the environment variables the launcher sets.

Failure behaviour (why the knobs below exist), as measured with jax 0.10.2 on CPU:

- a peer dies while the others are in a collective with it: they fail at once with a
  gloo error ("Connection reset by peer");
- a peer dies while the others do something else: the coordination service declares it
  dead after ``heartbeat_timeout_s`` and aborts the others ("Terminating process
  because the JAX distributed service detected fatal errors ... tasks are unhealthy";
  ~12.5 s after the death with 10 s, ~4 s with 3 s); if the dead peer is process 0,
  which hosts the service, they abort at once;
- a peer never arrives: the others abort in ``jax.distributed.initialize``
  (DEADLINE_EXCEEDED in RegisterTask) after ``init_timeout_s`` (~9-11 s with 3 or 5 s);
- processes that call different collectives (a broken multi-controller contract) wait
  for each other until gloo gives up: the waiting process raised ("Timed out waiting
  1800000ms for send operation to complete") after 30 minutes; only a timeout of ours
  ends that sooner.

So the launcher does not rely on the children alone: once one process has failed, the
rest get ``peer_failure_grace_s`` to report their own error and are then killed, and
``timeout_s`` bounds the whole run. Every child runs in its own process group (killed as
a group) and dies with the launcher (Linux parent-death signal plus a watchdog thread),
so no process outlives a launch, except one that leaves its process group
(``start_new_session``) or, after a SIGKILL of the launcher, a child blocked in native
code that holds the GIL (the handler and the watchdog both need it).

Example:
    >>> from reshard._launch import launch_local
    >>> results = launch_local("mypkg.worker:main", num_processes=2,
    ...                        devices_per_process=4, timeout_s=60)  # doctest: +SKIP
    >>> [r.value for r in results]  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import runpy
import signal
import site
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from numbers import Integral, Real
from pathlib import Path
from typing import Any

# Environment variables the launcher sets in each child; `initialize_from_env` reads them.
ENV_COORDINATOR_ADDRESS = "RESHARD_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "RESHARD_NUM_PROCESSES"
ENV_PROCESS_ID = "RESHARD_PROCESS_ID"
ENV_DEVICES_PER_PROCESS = "RESHARD_DEVICES_PER_PROCESS"
ENV_INIT_TIMEOUT_S = "RESHARD_INIT_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT_S = "RESHARD_HEARTBEAT_TIMEOUT_S"
ENV_SHUTDOWN_TIMEOUT_S = "RESHARD_SHUTDOWN_TIMEOUT_S"
# Private: how the child finds its target/arguments, and its launcher's pid.
_ENV_SPEC = "RESHARD_LAUNCH_SPEC"
_ENV_PARENT_PID = "RESHARD_LAUNCH_PARENT_PID"

# The child is started with `python -c` rather than `python -m reshard._launch`, so
# this module is imported once under its real name (no duplicate `__main__` copy).
_CHILD_BOOTSTRAP = "import reshard._launch as _l; _l._child_main()"

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
_POLL_S = 0.02
_ENDING = "ending"  # in a launch's directory: the launcher is ending its children
_MAX_JAX_SECONDS = 2**31 - 1  # (jax.distributed's timeouts are C ints)
_TERM_GRACE_S = 2.0  # SIGTERM -> SIGKILL escalation when the launcher ends a process
# Process 0's exit status when its coordinator's port was taken before it could bind it
# (EX_TEMPFAIL), and how many ports a launch tries.
_PORT_TAKEN_EXIT = 75
# What process 0 writes to stderr then: gRPC's log line, and jax.distributed's error.
_PORT_TAKEN = ("Failed to add port to server", "Failed to start RPC server")
_PORT_ATTEMPTS = 3


class LaunchError(RuntimeError):
    """A local multi-process launch failed: a process exited non-zero, or time ran out.

    Attributes:
        results: one :class:`ProcessResult` per process, in process-id order.
    """

    def __init__(self, message: str, results: list[ProcessResult]) -> None:
        super().__init__(message)
        self.results = results

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (out of a pool's worker, say) and copied with its results.
        return (type(self), (str(self), self.results), self.__dict__)


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """What one launched process did.

    Attributes:
        process_id: the JAX process index (``jax.process_index()`` in the child).
        returncode: exit status; negative means killed by that signal number.
        stdout: everything the process wrote to stdout.
        stderr: everything the process wrote to stderr (tracebacks land here).
        value: the JSON-decoded return value of a ``module:function`` target, else None.
        duration_s: seconds from start until the process ended (for one that failed on
            its own, until its failure was caught: its traceback may take longer).
        terminated: the launcher killed it (timeout, a failed peer, or an interrupt).
        timed_out: the launcher killed it because ``timeout_s`` ran out.
        returned_s: for a ``module:function`` target that returned, seconds from start
            until it did (the process may have ended long after, in JAX's shutdown,
            waiting for its peers), else None.
    """

    process_id: int
    returncode: int
    stdout: str
    stderr: str
    value: Any
    duration_s: float
    terminated: bool
    timed_out: bool
    returned_s: float | None = None

    @property
    def ok(self) -> bool:
        """True when the process exited with status 0 on its own."""
        return self.returncode == 0 and not self.terminated

    def describe(self) -> str:
        """One line: which process, how it ended, and when."""
        if self.returncode < 0:
            try:
                how = f"killed by {signal.Signals(-self.returncode).name}"
            except ValueError:
                how = f"killed by signal {-self.returncode}"
        else:
            how = f"exit code {self.returncode}"
        why = ""
        if self.timed_out:
            why = " (launcher timeout)"
        elif self.terminated:
            why = " (terminated by the launcher after a peer failed)"
        return f"process {self.process_id}: {how}{why} after {self.duration_s:.1f} s"


def free_port(host: str = "127.0.0.1") -> int:
    """Returns a TCP port on ``host`` that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _claim_port(host: str = "127.0.0.1") -> tuple[int, socket.socket | None]:
    """A free port for the coordinator, held from the moment it is chosen: the OS picks
    it for a socket bound as ``_hold_port`` binds (ports it hands out for ``bind`` to
    port 0 are never shared, ``SO_REUSEPORT`` or not), so no other program can take it
    between the choice and the hold. Where the platform lacks ``SO_REUSEPORT``:
    ``free_port``'s port, not held."""
    holder = _hold_port(0, host)
    if holder is None:
        return free_port(host), None
    return int(holder.getsockname()[1]), holder


def _hold_port(port: int, host: str = "127.0.0.1") -> socket.socket | None:
    """A socket bound to ``port`` with ``SO_REUSEPORT``, never listening, or ``None``
    where the port is taken already (or the platform lacks ``SO_REUSEPORT``).

    While it is open, no other program's ``bind`` to port 0 gets this port, and a plain
    ``bind`` to it fails; the coordinator's gRPC server, which binds with
    ``SO_REUSEPORT``, still can. Without it, another launch (whose coordinator binds the
    same way) could be handed the same port by ``free_port`` and bind it beside ours:
    the kernel would then spread the processes of both launches over the two
    coordinators, which abort both ("a different incarnation").
    """
    reuse = getattr(socket, "SO_REUSEPORT", None)
    if reuse is None:
        return None
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, reuse, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        return None
    return sock


class _Terminated(BaseException):
    """A SIGTERM, raised in the launcher's main thread while it waits (see below)."""


class _SigtermUnwinds:
    """While ``launch_local`` runs: a SIGTERM to the launcher unwinds it (the children
    are ended and its temporary directory removed, as on Ctrl-C), then ends the
    process as the SIGTERM would have. Only where Python's default action stands and in
    the main thread (the only one that may set handlers); elsewhere the children still
    die with the launcher (their parent-death signal), but the directory stays."""

    def __enter__(self) -> None:
        self.active = (
            threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        )
        if self.active:
            signal.signal(signal.SIGTERM, self._raise)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise _Terminated

    def __exit__(self, kind: Any, value: Any, tb: Any) -> None:
        if self.active:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if kind is _Terminated:
                os.kill(os.getpid(), signal.SIGTERM)  # now the default action: the end


def launch_local(
    target: str,
    num_processes: int = 2,
    devices_per_process: int | Sequence[int] = 4,
    *,
    timeout_s: float = 120.0,
    args: Sequence[Any] = (),
    env: Mapping[str, str | bytes | os.PathLike[str]] | None = None,
    initialize: bool = True,
    check: bool = True,
    init_timeout_s: int = 30,
    heartbeat_timeout_s: int = 10,
    shutdown_timeout_s: int | None = None,
    peer_failure_grace_s: float = 5.0,
    cwd: str | os.PathLike[str] | None = None,
) -> list[ProcessResult]:
    """Runs ``target`` in ``num_processes`` local JAX processes and waits for all of them.

    Each process gets ``devices_per_process`` simulated CPU devices (or, given one count
    per process, process ``i`` gets ``devices_per_process[i]``), gloo collectives and
    the coordinator address of a free port on 127.0.0.1, so the processes together see
    the sum of their counts as global devices (``jax.devices()``). The
    launcher holds that port for the launch (``_claim_port``). Should another program
    take it before process 0 binds it, the launch starts again on another port (up to
    3 ports, within ``timeout_s``; with ``initialize=True`` only: the launcher must see
    the bind fail); the target has not run then.

    Args:
        target: what every process runs, one of: ``"pkg.module:function"`` or
            ``"path/to/file.py:function"`` (called as ``function(*args)``; its return
            value must be JSON-serialisable and comes back as ``ProcessResult.value``,
            through JSON: tuples as lists, dict keys as text);
            ``"path/to/script.py"`` or ``"pkg.module"`` (run as ``__main__`` with
            ``sys.argv[1:] == [str(a) for a in args]``).
        num_processes: how many processes (>= 1).
        devices_per_process: simulated CPU devices per process (>= 1): one count for
            every process, or a list or tuple of ``num_processes`` counts, one per
            process in process-id order (e.g. ``[4, 2]``: a trainer's host of 4 devices
            and a sampler's of 2).
        timeout_s: hard limit for the whole launch; then every process is killed.
        args: positional arguments for the target, a list or tuple (JSON-serialisable
            for function targets).
        env: extra environment variables for the children (override the defaults,
            e.g. ``{"JAX_PLATFORMS": "cuda"}``; a ``PYTHONPATH`` comes after the
            directory this package is imported from, unless that is a site-packages
            directory).
        initialize: call :func:`initialize_from_env` before the target. Pass False when
            the target calls it itself (e.g. to test a process that arrives late).
        check: raise :class:`LaunchError` unless every process exited with status 0.
        init_timeout_s: ``jax.distributed`` initialisation timeout: how long processes
            wait for a peer that never arrives.
        heartbeat_timeout_s: ``jax.distributed`` heartbeat timeout: how long until a
            dead peer is declared dead.
        shutdown_timeout_s: ``jax.distributed`` shutdown-barrier timeout at exit: how
            long a process that has finished waits for the others to finish (longer,
            and the coordinator aborts them all). Default: ``timeout_s`` (rounded up),
            so that processes of a run may finish any time apart within it.
        peer_failure_grace_s: after a process fails, how long the others may keep
            running (to report their own error) before the launcher kills them.
        cwd: working directory of the children (default: the current one); a
            relative file target is found there.

    Returns:
        One :class:`ProcessResult` per process, in process-id order.

    Raises:
        RuntimeError: called at the top level of a function target's module while a
            launched process imports it (the launch belongs under ``if __name__ ==
            "__main__":``; the module is imported in every process).
        TypeError: ``target`` is not text.
        ValueError: a count or timeout is out of range or not a number, ``target`` is
            empty, ``env`` holds a name that is not text or a value that is
            not text, bytes or a path, or ``args`` is not JSON-serialisable.
        FileNotFoundError: ``cwd`` is not a directory, or a file target does not
            exist; nothing was started.
        LaunchError: with ``check=True``, when any process failed or timed out; the
            message names the process that failed first and shows its stderr tail.
    """
    importing = _importing
    if importing is not None and importing[1] == threading.get_ident():
        raise RuntimeError(
            f"launch_local called while this launched process imports its target "
            f"{importing[0]!r}: every process would launch again. A function target's "
            f"module is imported in each process, not run as __main__; put the launch "
            f'under `if __name__ == "__main__":`'
        )
    if not isinstance(target, str):
        raise TypeError(
            "launch_local target names what to run, as text: 'pkg.module:function', "
            "'path/to/file.py:function', 'path/to/script.py' or 'pkg.module'; got "
            f"{type(target).__name__}: {target!r}"
        )
    per_process = _device_counts(num_processes, devices_per_process)
    limits = {"timeout_s": timeout_s, "peer_failure_grace_s": peer_failure_grace_s}
    if any(isinstance(v, bool) or not isinstance(v, Real) for v in limits.values()):
        raise ValueError(
            f"launch_local needs timeout_s and peer_failure_grace_s as numbers; got {limits}."
        )
    if not timeout_s > 0 or not peer_failure_grace_s >= 0:  # NaN fails both
        raise ValueError(
            "launch_local needs timeout_s > 0 and peer_failure_grace_s >= 0; got "
            f"timeout_s={timeout_s}, peer_failure_grace_s={peer_failure_grace_s}."
        )
    if shutdown_timeout_s is None:
        shutdown_timeout_s = max(1, math.ceil(min(timeout_s, 1e9)))
    seconds = {
        "init_timeout_s": init_timeout_s,
        "heartbeat_timeout_s": heartbeat_timeout_s,
        "shutdown_timeout_s": shutdown_timeout_s,
    }
    bad = [v for v in seconds.values() if isinstance(v, bool) or not isinstance(v, Integral)]
    if bad or any(not 1 <= v <= _MAX_JAX_SECONDS for v in seconds.values()):
        raise ValueError(
            "launch_local needs init_timeout_s, heartbeat_timeout_s and shutdown_timeout_s "
            f"as whole seconds from 1 to {_MAX_JAX_SECONDS} (jax.distributed takes 32-bit "
            f"ints); got {seconds}."
        )
    if not target.strip():
        raise ValueError(
            "launch_local target is empty; name what to run: 'pkg.module:function', "
            "'path/to/file.py:function', 'path/to/script.py' or 'pkg.module'."
        )
    if env is not None:
        if not isinstance(env, Mapping):
            raise ValueError(
                f"launch_local env maps variable names to values; got {type(env).__name__}."
            )
        # What subprocess takes: text, bytes or paths. Only names and types are shown:
        # an environment may hold secrets.
        bad_env = {
            k: type(v).__name__
            for k, v in env.items()
            if not isinstance(k, str) or not isinstance(v, str | bytes | os.PathLike)
        }
        if bad_env:
            raise ValueError(
                "launch_local env maps variable names (text) to values (text, bytes or "
                f"paths); these do not (name: type of value): {bad_env}."
            )
    _check_files(target, cwd)
    if isinstance(args, str | bytes | Mapping) or not isinstance(args, Iterable):
        raise ValueError(
            "launch_local args are the target's positional arguments, as a list or tuple; "
            f"got {type(args).__name__}: {args!r} (for one argument, pass [value])"
        )
    try:
        args_json = json.dumps(list(args))
    except TypeError as e:
        raise ValueError(
            f"launch_local args must be JSON-serialisable (they cross a process "
            f"boundary); got args={args!r}: {e}"
        ) from e

    # A port free when chosen may be taken (by any program) before process 0 binds
    # it; process 0 then fails before any process has run the target, and the launch
    # starts again on another port, within the same timeout.
    deadline = time.monotonic() + timeout_s
    for attempt in range(_PORT_ATTEMPTS):
        port, holder = _claim_port()
        try:
            results, port_taken = _launch_once(
                target,
                per_process,
                port=port,
                deadline=deadline,
                args_json=args_json,
                env=env,
                initialize=initialize,
                seconds=seconds,
                peer_failure_grace_s=peer_failure_grace_s,
                cwd=cwd,
            )
        finally:
            if holder is not None:
                holder.close()
        if not port_taken or attempt + 1 == _PORT_ATTEMPTS or time.monotonic() >= deadline:
            break
    if check and not all(r.ok for r in results):
        message = _failure_message(target, results, timeout_s)
        if port_taken:
            message += (
                f"\nThe coordinator's port was taken before process 0 could bind it, on "
                f"each of the {attempt + 1} ports tried; the target did not run."
            )
        raise LaunchError(message, results)
    return results


def _device_counts(num_processes: Any, devices_per_process: Any) -> list[int]:
    """Each process's simulated device count, in process-id order, from the arguments
    of :func:`launch_local` (checked)."""

    def whole(v: Any) -> bool:
        return not isinstance(v, bool) and isinstance(v, Integral) and int(v) >= 1

    if not whole(num_processes):
        raise ValueError(
            f"launch_local needs num_processes >= 1, as an integer; got num_processes="
            f"{num_processes!r}."
        )
    if isinstance(devices_per_process, list | tuple):
        if len(devices_per_process) != num_processes or not all(
            whole(v) for v in devices_per_process
        ):
            raise ValueError(
                f"launch_local needs devices_per_process as one integer >= 1, or as "
                f"{num_processes} of them (one per process, for num_processes="
                f"{num_processes}); got devices_per_process={devices_per_process!r}."
            )
        return [int(v) for v in devices_per_process]
    if not whole(devices_per_process):
        raise ValueError(
            "launch_local needs devices_per_process >= 1, as an integer or a list of "
            f"one integer per process; got devices_per_process={devices_per_process!r}."
        )
    return [int(devices_per_process)] * int(num_processes)


def _check_files(target: str, cwd: str | os.PathLike[str] | None) -> None:
    """Up front, not in every child after JAX starts: ``cwd`` is a directory and a
    file target exists (a relative one in ``cwd``, where the children look for it)."""
    given = None if cwd is None else os.fsdecode(cwd)
    base = Path.cwd() if given is None else Path(given)
    if given is not None and (not given or not base.is_dir()):
        raise FileNotFoundError(
            f"launch_local cwd {str(cwd)!r} is not a directory (the children's working "
            f"directory, relative to {str(Path.cwd())!r})"
        )
    where = target if target.endswith(".py") else target.rpartition(":")[0]
    if where.endswith(".py") and not (base / target).exists() and not (base / where).is_file():
        raise FileNotFoundError(
            f"launch_local target file {where!r} does not exist in {str(base)!r} (a "
            f"relative path is taken from cwd, the children's working directory)"
        )


def _launch_once(
    target: str,
    per_process: Sequence[int],
    *,
    port: int,
    deadline: float,
    args_json: str,
    env: Mapping[str, str | bytes | os.PathLike[str]] | None,
    initialize: bool,
    seconds: Mapping[str, int],
    peer_failure_grace_s: float,
    cwd: str | os.PathLike[str] | None,
) -> tuple[list[ProcessResult], bool]:
    """One launch of every process, with the coordinator on ``port``.

    Returns:
      The results, and whether process 0 found the port taken (the target never ran).
    """
    num_processes = len(per_process)
    # (Entered in order, left in reverse: the directory is gone before a SIGTERM
    # ends this process.)
    with _SigtermUnwinds(), tempfile.TemporaryDirectory(prefix="reshard-launch-") as tmp:
        workdir = Path(tmp)
        procs: list[subprocess.Popen[bytes]] = []
        files: list[tuple[Path, Path, Path]] = []
        start, start_wall = time.monotonic(), time.time()
        ended_at: dict[int, float] = {}
        # When each child exited, taken by a thread blocked in its wait (the poll below
        # sees an exit up to _POLL_S late), and, read from its file, when a child that
        # failed on its own caught the failure: a process failing because a peer died
        # (gloo's "connection closed") often exits within the same poll, and then
        # looked first as often as the process that caused it.
        exited_at: dict[int, float] = {}
        terminated: set[int] = set()
        timed_out = False
        try:
            for pid in range(num_processes):
                out_p, err_p, res_p = (workdir / f"{pid}.{k}" for k in ("out", "err", "json"))
                spec_p = workdir / f"{pid}.spec.json"
                spec_p.write_text(
                    json.dumps(
                        {
                            "target": target,
                            "args": json.loads(args_json),
                            "initialize": initialize,
                            "result_path": str(res_p),
                            "started_path": str(workdir / f"{pid}.started"),
                            "failed_path": str(workdir / f"{pid}.failed"),
                        }
                    )
                )
                child_env = _child_environment(
                    env,
                    coordinator=f"127.0.0.1:{port}",
                    num_processes=num_processes,
                    process_id=pid,
                    devices_per_process=per_process[pid],
                    **seconds,
                    spec_path=spec_p,
                )
                files.append((out_p, err_p, res_p))
                with open(out_p, "wb") as out_f, open(err_p, "wb") as err_f:
                    procs.append(
                        subprocess.Popen(
                            [sys.executable, "-c", _CHILD_BOOTSTRAP],
                            stdin=subprocess.DEVNULL,
                            stdout=out_f,
                            stderr=err_f,
                            env=child_env,
                            cwd=cwd,
                            # Own process group: we can kill the child together with
                            # anything it spawned, and a Ctrl-C in the terminal reaches
                            # only us (we then end the children ourselves).
                            start_new_session=True,
                        )
                    )
                _clock_exit(procs[-1], pid, exited_at)
            first_failure_at: float | None = None
            while len(ended_at) < num_processes:
                now = time.monotonic()
                for pid, proc in enumerate(procs):
                    if pid not in ended_at and proc.poll() is not None:
                        ended_at[pid] = exited_at.get(pid, now)
                        if proc.returncode != 0 and first_failure_at is None:
                            first_failure_at = now
                            if pid == 0 and _port_was_taken(workdir, initialize):
                                # Nobody can start without process 0's coordinator:
                                # the others are ended at once, for a new attempt.
                                first_failure_at -= peer_failure_grace_s
                if len(ended_at) == num_processes:
                    break
                peer_deadline = (
                    first_failure_at + peer_failure_grace_s
                    if first_failure_at is not None
                    else float("inf")
                )
                if now >= deadline or now >= peer_deadline:
                    timed_out = now >= deadline and now < peer_deadline
                    for pid in range(num_processes):
                        if pid not in ended_at:
                            terminated.add(pid)
                    _end_all(procs, ended_at, workdir)
                    break
                time.sleep(_POLL_S)
        finally:
            # Reached on success, on timeout, and on any exception including
            # KeyboardInterrupt: nothing we started may survive us.
            for pid in range(num_processes):
                if pid < len(procs) and pid not in ended_at and procs[pid].poll() is None:
                    terminated.add(pid)
            _end_all(procs, ended_at, workdir)

        results = []
        for pid, proc in enumerate(procs):
            out_p, err_p, res_p = files[pid]
            value, returned_s = None, None
            if res_p.exists():
                with contextlib.suppress(ValueError):
                    value = json.loads(res_p.read_text())
                with contextlib.suppress(OSError):
                    returned_s = max(0.0, res_p.stat().st_mtime - start_wall)
            ended = ended_at.get(pid, time.monotonic())
            if proc.returncode != 0:
                with contextlib.suppress(OSError, ValueError):
                    # (time.monotonic is one clock for every process of the machine.)
                    ended = min(ended, float((workdir / f"{pid}.failed").read_text()))
            results.append(
                ProcessResult(
                    process_id=pid,
                    returncode=int(proc.returncode),
                    stdout=out_p.read_text(errors="replace"),
                    stderr=err_p.read_text(errors="replace"),
                    value=value,
                    duration_s=ended - start,
                    terminated=pid in terminated,
                    timed_out=timed_out and pid in terminated,
                    returned_s=returned_s,
                )
            )
        port_taken = _port_was_taken(workdir, initialize)
    return results, port_taken


def _port_was_taken(workdir: Path, initialize: bool) -> bool:
    """Whether process 0 of a launch in ``workdir`` failed to bind the coordinator's
    port before any process ran the target. (jax.distributed.initialize then raises,
    or with jax 0.10.2 at times crashes with SIGSEGV after gRPC has said so.)"""
    if not initialize or any(workdir.glob("*.started")):
        return False
    err = (workdir / "0.err").read_text(errors="replace") if (workdir / "0.err").exists() else ""
    return any(m in err for m in _PORT_TAKEN)


def _clock_exit(proc: subprocess.Popen[bytes], pid: int, exited_at: dict[int, float]) -> None:
    """Records in ``exited_at[pid]`` the moment ``proc`` exits (a daemon thread waits).

    (While the thread waits it holds the Popen's wait lock, so ``poll()`` reports the
    exit only once the thread has reaped it.)
    """

    def wait() -> None:
        proc.wait()
        exited_at[pid] = time.monotonic()

    threading.Thread(target=wait, name=f"reshard-launch-wait-{pid}", daemon=True).start()


def _end_all(
    procs: Sequence[subprocess.Popen[bytes]], ended_at: dict[int, float], workdir: Path
) -> None:
    """Ends every process group we started: SIGTERM, then SIGKILL after a short grace.

    First it leaves a file ``_ENDING`` in ``workdir``, so that the children take the
    SIGTERM for the launcher's (``_die_with_parent``).

    SIGTERM first so a child may flush its output; SIGKILL because a process blocked in
    a native collective (gloo) may never act on SIGTERM. Groups whose leader already
    exited still get the signals, which reaps anything the child left behind: a
    grandchild that outlives the SIGTERM's grace (it ignores or handles SIGTERM) gets
    the SIGKILL too, even when every child has exited.
    """
    groups = [p.pid for p in procs]
    with contextlib.suppress(OSError):
        (workdir / _ENDING).touch()
    # A Ctrl-C or SIGTERM (raised here by `_SigtermUnwinds`) that arrives meanwhile ends
    # the wait it interrupts, not the ending: the SIGKILL still goes to every group,
    # and the interruption is raised once it has.
    interrupted: BaseException | None = None
    for sig, wait_s in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            _signal_groups(groups, sig)
            t_end = time.monotonic() + wait_s
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.0, t_end - time.monotonic()))
            # Grandchildren are not ours to wait for: poll their groups until the grace
            # ends.
            alive = _groups_alive(groups)
            while alive and time.monotonic() < t_end:
                time.sleep(_POLL_S)
                alive = _groups_alive(groups)
            if not alive and all(p.poll() is not None for p in procs):
                break
        except (KeyboardInterrupt, _Terminated) as e:
            interrupted = interrupted or e
            if sig == signal.SIGKILL:  # (perhaps cut short while sending it)
                _signal_groups(groups, signal.SIGKILL)
    now = time.monotonic()
    for pid, p in enumerate(procs):
        if p.poll() is not None:
            ended_at.setdefault(pid, now)
    if interrupted is not None:
        raise interrupted


def _signal_groups(pgids: Sequence[int], sig: int) -> None:
    for pgid in pgids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def _groups_alive(pgids: Sequence[int]) -> bool:
    """Whether a process that is not a zombie is left in any of the groups ``pgids``.

    On Linux read from ``/proc`` (a zombie waiting for its reaper is no process left to
    end); elsewhere ``killpg(pgid, 0)``, which also counts zombies.
    """
    wanted = set(pgids)
    if not wanted:
        return False
    proc = Path("/proc")
    if proc.is_dir() and Path("/proc/self/stat").exists():
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue  # gone meanwhile
            # After the command: state, ppid, pgrp, ...
            if fields[0] != "Z" and int(fields[2]) in wanted:
                return True
        return False
    for pgid in wanted:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        return True
    return False


def _failure_message(target: str, results: list[ProcessResult], timeout_s: float) -> str:
    """Names the process that failed first, how the others ended, and its stderr tail."""
    failed = [r for r in results if not r.ok]
    own_failures = [r for r in failed if not r.terminated]
    if own_failures:
        first = min(own_failures, key=lambda r: r.duration_s)
        head = (
            f"launch_local({target!r}) failed: process {first.process_id} failed first "
            f"({first.describe()})."
        )
    else:
        first = failed[0]
        head = (
            f"launch_local({target!r}) timed out after {timeout_s:g} s and every "
            "still-running process was killed; raise timeout_s if the work needs longer."
        )
        done = [r for r in results if r.returned_s is not None or r.ok]
        if len(done) < len(results) and done:
            # Processes whose target returned while the others ran on (they then wait
            # in JAX's shutdown for the others, and are killed with them): the others
            # may have waited for them in a collective they never joined.
            ids = [r.process_id for r in done]
            one = len(ids) == 1
            when = min(r.duration_s if r.returned_s is None else r.returned_s for r in done)
            head += (
                f" But {f'process {ids[0]}' if one else f'processes {ids}'} had returned "
                f"from the target (the first after {when:.1f} s): the others may have been "
                f"waiting for {'it' if one else 'them'} in a collective "
                f"{'it' if one else 'they'} never joined (a skipped reshard call; "
                "RESHARD_COLLECTIVE_TIMEOUT_S ends such waits sooner)."
            )
    lines = [head, *("  " + r.describe() for r in results)]
    tail = first.stderr.strip().splitlines()[-25:]
    if tail:
        lines.append(f"stderr of process {first.process_id} (last lines):")
        # (Each line cut short: one huge line would make the message unreadable; the
        # whole stderr is in the error's results.)
        lines.extend(
            "  | " + (line if len(line) <= 500 else f"{line[:500]}... ({len(line):,} characters)")
            for line in tail
        )
    return "\n".join(lines)


def _child_environment(
    extra: Mapping[str, str | bytes | os.PathLike[str]] | None,
    *,
    coordinator: str,
    num_processes: int,
    process_id: int,
    devices_per_process: int,
    init_timeout_s: int,
    heartbeat_timeout_s: int,
    shutdown_timeout_s: int,
    spec_path: Path,
) -> dict[str, str]:
    """The environment of one child: ours, plus what JAX needs before it initialises."""
    env = dict(os.environ)
    # An inherited --xla_force_host_platform_device_count (e.g. from a test conftest
    # that simulates 8 devices) would fight with our per-process device count.
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    env["XLA_FLAGS"] = " ".join(flags)
    # JAX reads JAX_* config from the environment at import, so these hold even for a
    # script that imports jax before calling `initialize_from_env`.
    env["JAX_PLATFORMS"] = "cpu"
    env["JAX_NUM_CPU_DEVICES"] = str(devices_per_process)
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env["PYTHONUNBUFFERED"] = "1"  # output survives a kill
    env.update(
        {
            ENV_COORDINATOR_ADDRESS: coordinator,
            ENV_NUM_PROCESSES: str(num_processes),
            ENV_PROCESS_ID: str(process_id),
            ENV_DEVICES_PER_PROCESS: str(devices_per_process),
            ENV_INIT_TIMEOUT_S: str(init_timeout_s),
            ENV_HEARTBEAT_TIMEOUT_S: str(heartbeat_timeout_s),
            ENV_SHUTDOWN_TIMEOUT_S: str(shutdown_timeout_s),
            _ENV_SPEC: str(spec_path),
            _ENV_PARENT_PID: str(os.getpid()),
        }
    )
    env.update({k: os.fsdecode(v) for k, v in (extra or {}).items()})  # (as Popen would)
    # The child must import this very package, installed or not: first on its path,
    # also when `extra` gives a PYTHONPATH of its own. Not when it is installed in a
    # site directory, which the child (the same interpreter) has on its path anyway:
    # first on the path, it would come before the standard library, whose modules a
    # package installed there may shadow (old backports of argparse, enum, ...).
    pkg_root = _package_root()
    if pkg_root not in _site_dirs():
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_root, env.get("PYTHONPATH", "")) if p)
    return env


def _package_root() -> str:
    """The directory this package is imported from."""
    return str(Path(__file__).resolve().parent.parent)


def _site_dirs() -> set[str]:
    """This interpreter's site-packages directories (resolved)."""
    dirs = [*getattr(site, "getsitepackages", list)(), site.getusersitepackages()]
    dirs += [sysconfig.get_path("purelib"), sysconfig.get_path("platlib")]
    return {str(Path(d).resolve()) for d in dirs if d}


def initialize_from_env() -> None:
    """Initialises JAX in a launched process from the launcher's environment variables.

    Sets the simulated CPU device count and gloo collectives, then calls
    ``jax.distributed.initialize`` with the coordinator, process count/id and the
    timeouts chosen by :func:`launch_local`. Idempotent: a second call does nothing.
    Must run before anything initialises JAX's backends (e.g. ``jax.devices()``).

    Raises:
        RuntimeError: the launcher's environment variables are missing (not started by
            :func:`launch_local`), or JAX's backends were initialised too early.
    """
    import jax

    from . import _compat

    if jax.distributed.is_initialized():
        return
    missing = [
        k
        for k in (ENV_COORDINATOR_ADDRESS, ENV_NUM_PROCESSES, ENV_PROCESS_ID)
        if k not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"initialize_from_env: environment variables {missing} are not set; this "
            "process was not started by reshard's launch_local. Start it with "
            "launch_local(...), or call jax.distributed.initialize(...) yourself."
        )
    if _compat.backends_initialized():
        raise RuntimeError(
            "initialize_from_env: JAX's backends are already initialised (something "
            "called jax.devices() or ran a computation first), so the device count and "
            "collectives can no longer be set. Call initialize_from_env() before any "
            "other JAX call."
        )
    coordinator = os.environ[ENV_COORDINATOR_ADDRESS]
    jax.config.update("jax_platforms", os.environ.get("JAX_PLATFORMS", "cpu"))
    jax.config.update("jax_num_cpu_devices", int(os.environ.get(ENV_DEVICES_PER_PROCESS, "1")))
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # The preemption service installs a native SIGTERM handler that only logs, which
    # would disarm our own (the launcher's SIGTERM and the parent-death signal must end
    # the process group). Preemption notices mean nothing for local runs anyway.
    jax.config.update("jax_enable_preemption_service", False)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=int(os.environ[ENV_NUM_PROCESSES]),
        process_id=int(os.environ[ENV_PROCESS_ID]),
        # Loopback only: the default binds the coordinator on every interface.
        coordinator_bind_address=coordinator,
        cluster_detection_method="deactivate",
        initialization_timeout=int(os.environ.get(ENV_INIT_TIMEOUT_S, "30")),
        heartbeat_timeout_seconds=int(os.environ.get(ENV_HEARTBEAT_TIMEOUT_S, "10")),
        shutdown_timeout_seconds=int(os.environ.get(ENV_SHUTDOWN_TIMEOUT_S, "10")),
    )


def set_parent_death_signal(sig: int) -> None:
    """Asks Linux to send this process ``sig`` when its parent dies (else does nothing).

    The signal comes when the thread that started this process ends, so start children
    from a thread that lives as long as they should.
    """
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def _die_with_parent() -> None:
    """Makes this child, and everything it spawned, end when the launcher dies.

    The kernel sends us SIGTERM when the launcher dies (Linux parent-death signal); our
    handler then kills our whole process group, grandchildren included (a plain SIGKILL
    as parent-death signal would orphan them). A handler only runs when the main thread
    reaches Python code, and a main thread blocked in a collective may not for a long
    time, so a watchdog thread polling our parent pid does the same; it also covers a
    parent that died before `prctl` ran, and platforms without a parent-death signal.
    The launcher's own SIGTERM (when it ends a run) takes the same path.
    """
    parent = int(os.environ.get(_ENV_PARENT_PID, "0"))
    me = os.getpid()

    ending = Path(os.environ.get(_ENV_SPEC, "")).parent / _ENDING

    def end_group(*signum: object) -> None:
        if os.getpid() != me:
            # A child forked without exec (multiprocessing's "fork") inherits this
            # handler: its SIGTERM (a Pool's terminate(), say) must end it alone, as
            # the default action would, not the whole group with the worker in it.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        with contextlib.suppress(Exception):
            # A SIGTERM from neither the launcher nor the parent's death: the status
            # (-9, the SIGKILL below) would hide it. Only into a file: a write to a
            # full pipe would block, and the SIGKILL never come.
            outside = signum and not ending.exists() and os.getppid() == parent
            if outside and stat.S_ISREG(os.fstat(2).st_mode):
                os.write(
                    2,
                    f"reshard launch: process {os.environ.get(ENV_PROCESS_ID, '?')} got "
                    "SIGTERM from outside the launcher; ending it and all it started "
                    "(SIGKILL to its process group)\n".encode(),
                )
            sys.stdout.flush()
            sys.stderr.flush()
        os.killpg(0, signal.SIGKILL)

    signal.signal(signal.SIGTERM, end_group)
    # A child forked without exec gets SIGTERM's default action back at once: with this
    # Python-level handler, one stuck in native code (a lock some other thread held at
    # the fork, say) would never run it, and a Pool's terminate() would wait for it
    # forever. (end_group's own check stays, for a fork that skips the hook.)
    os.register_at_fork(after_in_child=lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL))
    set_parent_death_signal(signal.SIGTERM)
    if parent and os.getppid() != parent:
        end_group()

    def watch() -> None:
        while True:
            time.sleep(0.25)
            if parent and os.getppid() != parent:
                end_group()

    threading.Thread(target=watch, name="reshard-launch-watchdog", daemon=True).start()


# The function target a launched child is importing, and the thread importing it,
# while it does: a launch_local at the top level of that module (no ``if __name__ ==
# "__main__":`` guard) would launch again from every child, and so on. (Other threads
# may launch meanwhile.)
_importing: tuple[str, int] | None = None


def _resolve_function(target: str) -> Any:
    """``"pkg.mod:fn"`` or ``"path/file.py:fn"`` -> the function object."""
    global _importing
    _importing = (target, threading.get_ident())
    try:
        return _import_function(target)
    finally:
        _importing = None


def _import_function(target: str) -> Any:
    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        path = Path(where).resolve()
        # The file may import modules beside it, as it could run as a script.
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location(f"_reshard_launch_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise ImportError(f"launch target file {str(path)!r} cannot be loaded")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(where)
    try:
        return getattr(module, name)
    except AttributeError:
        raise AttributeError(
            f"launch target {target!r}: module {where!r} has no attribute {name!r}"
        ) from None


def _child_main() -> None:
    """Entry point of a launched child: initialise JAX, run the target, report back."""
    _die_with_parent()
    global _failed_at
    spec = json.loads(Path(os.environ[_ENV_SPEC]).read_text())
    _failed_at = (os.getpid(), spec["failed_path"])
    target: str = spec["target"]
    args: list[Any] = spec["args"]
    try:
        if spec["initialize"]:
            try:
                initialize_from_env()
            except Exception as e:
                if os.environ.get(ENV_PROCESS_ID) == "0" and _PORT_TAKEN[1] in str(e):
                    print(
                        f"reshard launch: the coordinator's port "
                        f"({os.environ.get(ENV_COORDINATOR_ADDRESS)}) was taken before "
                        f"process 0 could bind it ({e}); the target did not run",
                        file=sys.stderr,
                    )
                    _fail_fast(_PORT_TAKEN_EXIT)
                raise
        Path(spec["started_path"]).touch()  # (no new port after this)
        # A Windows drive letter ("C:\\x.py") is a path, not a function target.
        is_function = ":" in target and not Path(target).exists()
        if is_function:
            value = _resolve_function(target)(*args)
            Path(spec["result_path"]).write_text(json.dumps(value))
        elif target.endswith(".py"):
            sys.argv = [target, *map(str, args)]
            # As `python script.py` does: the script's directory first on the path, in
            # place of the bootstrap's (`-c`) current directory, where it has one.
            if sys.path[:1] == [""]:
                del sys.path[0]
            sys.path.insert(0, str(Path(target).resolve().parent))
            runpy.run_path(target, run_name="__main__")
        else:
            sys.argv = [target, *map(str, args)]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if code != 0:
            when = time.monotonic()
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            _fail_fast(code, when)
        raise
    except BaseException:
        when = time.monotonic()  # (before the traceback, which may take a while)
        traceback.print_exc()
        _fail_fast(1, when)


# A launched child's pid, and where _fail_fast tells the launcher when it failed.
_failed_at: tuple[int, str] | None = None


def _fail_fast(code: int, when: float | None = None) -> None:
    """Exits now, skipping atexit handlers.

    JAX's atexit handler runs a distributed shutdown barrier that waits for every peer
    (up to ``shutdown_timeout_s``); a failed process must not wait for peers that may be
    blocked on it. Its peers learn of the failure through the heartbeat instead.

    The moment of the failure (``when``, default now) is left for the launcher first:
    a peer that fails because this process exits (its connections close) does so
    later, however the two exits are scheduled, so the launcher names the right process
    as the first to fail. (Not from a child forked without exec, whose failure is not
    the launched process's.)
    """
    if _failed_at is not None and _failed_at[0] == os.getpid():
        with contextlib.suppress(OSError):
            Path(_failed_at[1]).write_text(repr(time.monotonic() if when is None else when))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
