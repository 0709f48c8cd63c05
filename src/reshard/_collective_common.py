"""What both collective paths share: the union mesh's copies and their rounds.

A plan's pieces become **copies** in union-mesh coordinates (positions ``0..n-1`` of
the devices sorted by id). Copies between two positions travel in **rounds**: the
pairs of positions that exchange data are edge-coloured (a bipartite colouring), so
in a round every position sends to at most one other and receives from at most one:
exactly what one ``lax.ppermute`` can do. The number of rounds is the largest number
of partners any position has, the fewest possible.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from . import _compat
from ._geometry import box_shape, relative_offsets, volume
from ._planner import LeafPlan

AXIS = "r"  # the union mesh's only axis

# One copy in union-mesh coordinates: (leaf, source position, destination position,
# piece shape, start in the source block, start in the destination block).
Copy = tuple[int, int, int, tuple[int, ...], tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class LeafBlocks:
    """Block shapes of one array in the program: every source (destination) shard of
    an array has the same shape, so each is one block of the union mesh."""

    src_block: tuple[int, ...]
    dst_block: tuple[int, ...]
    scalar: bool  # rank-0 array, carried as shape (1,)


def color_edges(edges: Sequence[tuple[int, int]]) -> list[int]:
    """Colours the edges of a bipartite multigraph so no two edges at a node share one.

    Senders and receivers are the two sides, so each colour is a valid ``ppermute``
    round. Uses the classic alternating-path recolouring (König's theorem): the number
    of colours equals the largest degree, the fewest rounds possible.

    Args:
      edges: ``(sender, receiver)`` pairs; repeated pairs are separate edges.

    Returns:
      The colour (round index) of each edge, in input order.
    """
    at_send: dict[tuple[int, int], int] = {}  # (sender, colour) -> edge index
    at_recv: dict[tuple[int, int], int] = {}  # (receiver, colour) -> edge index
    colour = [-1] * len(edges)

    def free(table: dict[tuple[int, int], int], node: int) -> int:
        c = 0
        while (node, c) in table:
            c += 1
        return c

    for e, (u, v) in enumerate(edges):
        a, b = free(at_send, u), free(at_recv, v)
        if (v, a) in at_recv:
            # `a` is taken at v. Walk the path from v along colours a, b, a, ... and swap
            # a <-> b on it; in a bipartite graph it never reaches u, so afterwards `a`
            # is free at both ends of e.
            path: list[int] = []
            node, on_recv_side, c = v, True, a
            while True:
                nxt = (at_recv if on_recv_side else at_send).get((node, c))
                if nxt is None:
                    break
                path.append(nxt)
                su, sv = edges[nxt]
                node, on_recv_side = (su, False) if on_recv_side else (sv, True)
                c = b if c == a else a
            for p in path:
                su, sv = edges[p]
                del at_send[(su, colour[p])]
                del at_recv[(sv, colour[p])]
            for p in path:
                su, sv = edges[p]
                colour[p] = b if colour[p] == a else a
                at_send[(su, colour[p])] = p
                at_recv[(sv, colour[p])] = p
        colour[e] = a
        at_send[(u, a)] = e
        at_recv[(v, a)] = e
    return colour


def rounds_of(pairs: Sequence[tuple[int, int]]) -> list[tuple[tuple[int, int], ...]]:
    """Groups device pairs into permutations (rounds), fewest possible."""
    pairs = sorted(pairs)
    colour = color_edges(pairs)
    return [
        tuple(pr for pr, col in zip(pairs, colour, strict=True) if col == c)
        for c in sorted(set(colour))
    ]


def _uniform_shape(lp: LeafPlan, side: str) -> tuple[int, ...]:
    shards = lp.spec.src if side == "source" else lp.spec.dst
    shapes = {box_shape(s.box) for s in shards}
    if len(shapes) != 1:
        raise ValueError(
            f"leaf {lp.spec.name}: the collective executor needs equally shaped {side} "
            f"shards, got shapes {sorted(shapes)}; use executor='host' or 'device' in one "
            "process, or a sharding with even shards"
        )
    return shapes.pop()


def _leaf_copies(
    li: int, lp: LeafPlan, position: dict[int, int], alias: bool
) -> tuple[LeafBlocks, list[Copy], set[int]]:
    """One array's copies, its block shapes, and the positions whose output is kept."""
    spec = lp.spec
    src_block, dst_block = _uniform_shape(lp, "source"), _uniform_shape(lp, "destination")
    copies: list[Copy] = []
    for p in lp.kept + lp.moved:
        s, d = spec.src[p.src], spec.dst[p.dst]
        copies.append(
            (
                li,
                position[s.device],
                position[d.device],
                box_shape(p.box),
                relative_offsets(p.box, s.box),
                relative_offsets(p.box, d.box),
            )
        )
    if not alias and volume(spec.dst[0].box) > 0:  # not handed over: copied too
        # (An array with no elements has nothing to copy: empty pieces in a
        # device-packed program beside a handed-over array fail to compile, jax 0.10.)
        for di, si in lp.reused:
            s, d = spec.src[si], spec.dst[di]
            zero = (0,) * len(spec.shape)
            copies.append(
                (li, position[s.device], position[d.device], box_shape(d.box), zero, zero)
            )
    reused_pos = {position[spec.dst[di].device] for di, _ in lp.reused} if alias else set()
    keep = {position[d.device] for d in spec.dst} - reused_pos
    scalar = len(spec.shape) == 0
    if scalar:
        src_block = dst_block = (1,)
        copies = [(li, s, d, (1,), (0,), (0,)) for li, s, d, _, _, _ in copies]
    return LeafBlocks(src_block, dst_block, scalar), copies, keep


def all_copies(
    leaf_plans: Sequence[LeafPlan], position: dict[int, int], alias: bool | Sequence[bool]
) -> tuple[list[LeafBlocks], list[set[int]], list[Copy]]:
    """Block shapes, kept output positions and copies of every array of the plan.

    The kept positions of an array are those of its destination shards that are not
    handed over from a source shard unchanged (``alias``, per array or for all).
    """
    aliases = [alias] * len(leaf_plans) if isinstance(alias, bool) else list(alias)
    blocks: list[LeafBlocks] = []
    keep: list[set[int]] = []
    copies: list[Copy] = []
    # Arrays of one geometry share their pieces and shards (``plan_leaves``): their
    # copies differ only in the array's index, so they are worked out once. (Identities
    # are safe: every object named is held by ``leaf_plans``.)
    seen: dict[tuple[Any, ...], tuple[LeafBlocks, list[Copy], set[int]]] = {}
    for li, lp in enumerate(leaf_plans):
        spec = lp.spec
        ids = (id(lp.kept), id(lp.moved), id(lp.reused), id(spec.src), id(spec.dst))
        key: tuple[Any, ...] = (*ids, len(spec.shape), aliases[li])
        done = seen.get(key)
        if done is None:
            done = seen[key] = _leaf_copies(li, lp, position, aliases[li])
            cs = done[1]
        else:
            cs = [(li, *c[1:]) for c in done[1]]
        blocks.append(done[0])
        keep.append(set(done[2]))
        copies.extend(cs)
    return blocks, keep, copies


def finish(
    lp: LeafPlan, dtype: np.dtype, sharding: Any, parts: list[Any], devs: list[Any]
) -> jax.Array:
    """Puts this process's destination shards (numpy or on-device) together."""
    shape = tuple(lp.spec.shape)
    if not any(isinstance(p, jax.Array) for p in parts):
        # Zero-copy on CPU; with no parts (no destination device in this process),
        # ~5 us against ~25 through jax.make_array_from_single_device_arrays.
        return _compat.assemble(shape, dtype, sharding, parts, devs)
    parts = _compat.place_host_buffers(parts, devs, sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(shape, sharding, parts, dtype=dtype)


# Calls of ``reshard.reshard`` and ``Plan.execute`` this process has made, counted as
# each starts. Every process makes the same calls (the multi-controller contract), so
# the counts agree whenever processes meet in a reshard's collectives: a call that one
# process skipped, or that failed on it alone before its collectives, shows as counts
# that differ, where the collectives alone would pair one process's call with
# another's next one and return wrong data.
_calls_started = 0
_CALL_MODULUS = 1 << 28  # the count travels in an int32 status (see status_input)


def write_out(message: str) -> None:
    """Writes ``message`` to stderr, then flushes stdout; each may fail (not raised) or
    block (a full pipe nobody reads): call it from a thread not waited on for long."""
    with contextlib.suppress(Exception):
        sys.stderr.write(message)
        sys.stderr.flush()
    with contextlib.suppress(Exception):
        sys.stdout.flush()


# Messages for stderr from a signal handler: put in a queue (SimpleQueue.put may be
# called from one), written by one daemon thread started beforehand (starting a thread
# inside a handler can deadlock on threading's own locks).
_messages: queue.SimpleQueue[str] = queue.SimpleQueue()
_writer: threading.Thread | None = None


def _write_messages() -> None:
    while True:
        write_out(_messages.get())


def _held_interrupt(also_failed: bool) -> KeyboardInterrupt:
    interrupt = KeyboardInterrupt()
    interrupt.add_note(
        "reshard: this interrupt came during a collective reshard and was held until "
        "this process's part of it was done: the call returns no results, the inputs "
        "are intact, and every process is still in step"
        + ("; the call failed too (the error above)" if also_failed else "")
    )
    return interrupt


@contextlib.contextmanager
def interrupts_held(active: bool) -> Iterator[None]:
    """Holds back an interrupt (SIGINT, Ctrl-C) that comes while this process takes
    part in a reshard across processes, and raises it once its part is done.

    Interrupted between two of a reshard's programs, a process that went on (a
    notebook, a loop that catches ``KeyboardInterrupt``) met its peers' unfinished
    call with its next one, and every process hung. Held, the interrupt ends the call
    after its last collective (``execute_plan``: before any input is donated), with no
    results and the inputs intact, all processes still in step; if the call raised,
    the interrupt is raised from that error. A second interrupt stops at once, as
    without this (for a peer that never comes). Only in the main thread, and only
    where SIGINT has Python's own handler: one the program installed is left alone.
    """
    global _writer
    if (
        not active
        or threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    if _writer is None or not _writer.is_alive():  # (a forked child has none)
        _writer = threading.Thread(target=_write_messages, daemon=True, name="reshard-stderr")
        _writer.start()
    held: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if held:
            raise KeyboardInterrupt
        held.append(signum)
        _messages.put(
            "reshard: interrupt held until this process's part of the collective reshard "
            "is done, so that the other processes do not wait for it in vain; interrupt "
            "again to stop now\n"
        )

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    except BaseException as e:
        if held and not isinstance(e, KeyboardInterrupt):
            raise _held_interrupt(also_failed=True) from e
        raise
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if held:
        raise _held_interrupt(also_failed=False)


def count_call() -> None:
    """Counts a call of the public API that may run collectives (as it starts)."""
    global _calls_started
    _calls_started += 1


def refused(error: BaseException) -> None:
    """Tells the other processes that this process's current counted call raised
    ``error`` (``_collective_executor.refuse_call``)."""
    from ._collective_executor import refuse_call  # (that module imports this one)

    refuse_call(error)


@contextlib.contextmanager
def counted_call() -> Iterator[None]:
    """Counts a call that runs collectives as it starts, and tells the other processes
    if it raises (``refused``)."""
    count_call()
    try:
        yield
    except BaseException as e:
        refused(e)
        raise


def calls_started() -> int:
    """The count of calls ``count_call`` has counted: the current call's number while
    one runs."""
    return _calls_started


def status_width() -> int:
    """Entries of the status per device: two per process (see ``status_input``)."""
    return 2 * jax.process_count()


def status_input(program: Any, failed: bool) -> jax.Array:
    """This process's status, to be summed over the union mesh (``psum``): per process,
    two entries that only it writes (on its first device of the union; the rest write
    zeros): its count of calls and whether it failed, and a word of the fingerprint of
    the program it runs. Processes without a device in the union leave theirs 0.

    The fingerprint tells apart calls that meet in the same collectives but run
    different plans, each checked before (``agree`` runs once per plan): calls made in
    another order on some processes, say, whose collectives happen to match."""
    me, count = jax.process_index(), jax.process_count()
    rows = [np.zeros((status_width(),), np.int32) for _ in program.local_devices]
    rows[0][me] = 4 * (_calls_started % _CALL_MODULUS) + 2 + int(failed)
    rows[0][count + me] = int.from_bytes(
        program.fingerprint[:4].ljust(4, b"\0"), "little", signed=True
    )
    with _compat.bookkeeping():
        return _compat.assemble(
            (len(program.devices) * status_width(),),
            np.dtype(np.int32),
            program.block_sharding,
            rows,
            program.local_devices,
        )


def check_status(status: jax.Array | None, when: str) -> None:
    """Raises, on every process alike, if a summed status shows processes out of step
    (their counts of calls differ) or processes that failed ``when``."""
    if status is None:
        return
    entries, words = _status_rows(status)
    calls = {p: int(v) >> 2 for p, v in enumerate(entries) if v}
    if len(set(calls.values())) > 1:
        raise RuntimeError(
            "reshard calls are out of step across processes: in this collective reshard "
            f"the processes had started these numbers of calls: {calls}. A call skipped "
            "by some processes, or failing on some before they joined its collectives, "
            "paired one process's call with another's next one. No results were made, "
            "and the inputs are intact. Every process must make the same calls of "
            "reshard / Plan.execute in the same order; the counts cannot come back in "
            "step within this job, so later collective reshards fail the same way: "
            "restart the processes"
        )
    plans: dict[int, list[int]] = {}
    for p in calls:
        plans.setdefault(int(words[p]), []).append(p)
    if len(plans) > 1:
        raise RuntimeError(
            "reshard calls differ across processes: in this collective reshard processes "
            f"{' | '.join(map(str, plans.values()))} each ran a different plan, every one "
            "checked before (a plan is compared across processes only the first time it "
            "runs). The calls were made in another order, or with other arguments, on "
            "some processes. No results were made, and the inputs are intact. Every "
            "process must make the same calls of reshard / Plan.execute, with the same "
            "arguments, in the same order"
        )
    failed = _failed(entries)
    if failed:
        raise peers_failed(failed, when)
    if len(calls) == jax.process_count():
        # Every process reached this call, so each has left its earlier ones.
        forget_earlier_posts()


def _status_rows(status: jax.Array) -> tuple[np.ndarray, np.ndarray]:
    """A summed status's two rows: per process, its entry (count of calls and whether
    it failed) and its word of the program's fingerprint (``status_input``)."""
    # jax.device_get, not np.asarray: on an accelerator reading a device buffer is a
    # device-to-host transfer, implicit for np.asarray (refused under
    # jax.transfer_guard('disallow')), explicit for device_get. (On CPU np.asarray is a
    # zero-copy view, which no guard sees.)
    with _compat.bookkeeping():
        everyone = np.asarray(jax.device_get(status.addressable_shards[0].data))
    count = len(everyone) // 2
    return everyone[:count], everyone[count:]


def _failed(entries: np.ndarray) -> list[int]:
    return [p for p, v in enumerate(entries) if int(v) & 1]


def failed_processes(status: jax.Array) -> list[int]:
    """The processes whose summed ``status`` says they failed."""
    return _failed(_status_rows(status)[0])


def shared_failure(error: BaseException, status: jax.Array, when: str) -> None:
    """Gives ``error``, this process's own failure that ``status`` reported to the
    others, the error they raise (``peers_failed``: every process that failed, and why)
    as ``failure_on_every_process``: the same text on every process, for a decision
    every process must take alike (``ElasticManager``'s, which devices are lost)."""
    with contextlib.suppress(Exception):  # (the process's own error is what it raises)
        error.failure_on_every_process = peers_failed(  # type: ignore[attr-defined]
            failed_processes(status), when
        )


def peers_failed(failed: Sequence[int], when: str) -> RuntimeError:
    """The error of a process whose peers ``failed`` ``when``: it made no results. It
    says why they failed, where they posted it (``post_failure``)."""
    reasons = _failure_reasons(failed)
    why = "; ".join(f"process {p}: {reasons.get(p, 'its own error says why')}" for p in failed)
    return RuntimeError(
        f"reshard failed on process(es) {list(failed)} {when} ({why}), so this "
        "process's results would be incomplete: none were made. Every process of the "
        "reshard raises, all still in step; the inputs are intact"
    )


# Where a process that fails its part of a collective reshard posts why, in
# jax.distributed's key-value store: per call (the same count on every process in step)
# and process. Posted before the status that reports the failure, so it is there when
# the peers read the status.
_FAILURE_KEY = "reshard/failure/{call}/{process}"
_REASON_CHARS = 2000


# The keys this process posted in the store, with the call each was posted in, oldest
# first: deleted once no process can read them any more (``forget_earlier_posts``).
# (Threads of one process may post: a call within one process fails too.)
_posts: list[tuple[int, str]] = []
_posts_lock = threading.Lock()


def post(client: Any, key: str, value: str) -> None:
    """Sets ``key`` to ``value`` in jax.distributed's key-value store, recorded as
    posted by this process in its current call, for ``forget_earlier_posts``."""
    client.key_value_set(key, value, allow_overwrite=True)
    with _posts_lock:
        _posts.append((_calls_started, key))


def posted_in_this_call(key: str) -> bool:
    """Whether this process posted ``key`` in its current call."""
    with _posts_lock:
        return (_calls_started, key) in _posts


def forget_earlier_posts() -> None:
    """Deletes what this process posted in its earlier calls. Called where every
    process is known to have reached the current call, so to have left every earlier
    one, where such posts are read: a check all of them posted (``_exchange``), or a
    status all of them summed (``check_status``). Else each failed call would leave its
    keys in the store for the life of the job. Best effort: never raises."""
    with _posts_lock:
        old = [key for call, key in _posts if call < _calls_started]
        if not old:
            return
        _posts[:] = [(call, key) for call, key in _posts if call >= _calls_started]
    with contextlib.suppress(Exception):
        client = _compat.distributed_client()
        if client is not None:
            for key in old:
                with contextlib.suppress(Exception):
                    client.key_value_delete(key)


def post_failure(error: BaseException) -> None:
    """Posts ``error`` as why this process failed its part of the current collective
    reshard, for its peers' errors (``peers_failed``): an error that names a failed
    device (``parse_lost_devices``) must name it on every process, so that an elastic
    loop on each of them marks it lost alike. Best effort: never raises."""
    if jax.process_count() == 1:
        return
    with contextlib.suppress(Exception):
        client = _compat.distributed_client()
        if client is not None:
            what = f"{type(error).__name__}: {error}"
            if len(what) > _REASON_CHARS:  # its start and its end
                cut = _REASON_CHARS // 4
                what = f"{what[: _REASON_CHARS - cut]} ... {what[-cut:]}"
            post(
                client, _FAILURE_KEY.format(call=_calls_started, process=jax.process_index()), what
            )


def _failure_reasons(failed: Sequence[int]) -> dict[int, str]:
    """What the processes that ``failed`` posted (``post_failure``), where found."""
    reasons: dict[int, str] = {}
    client = _compat.distributed_client()
    if client is None:
        return reasons
    for p in failed:
        with contextlib.suppress(Exception):
            key = _FAILURE_KEY.format(call=_calls_started, process=p)
            reasons[p] = client.blocking_key_value_get(key, 2000)
    return reasons
