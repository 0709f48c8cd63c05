"""The collective executor: a plan run by compiled SPMD programs on every process.

Multi-controller JAX (one process per host) cannot ``jax.device_put`` an array to a
different device set; what it can do is run one program on many devices at once, every
process calling it with the same arguments. This executor turns a plan into such
programs over the **union mesh**: a 1-D mesh (axis ``"r"``) of every device that holds
a source shard or will hold a destination shard, ordered by device id so every process
builds the same one. Pieces that change device travel in **rounds**
(``_collective_common``), one ``lax.ppermute`` per round and buffer, so the number of
collectives does not grow with the number of arrays or pieces (each costs a fixed
latency: ~1-5 ms over gloo on loopback).

Two ways of packing, chosen per plan:

* **host-packed** (every device a CPU; ``_collective_host``): numpy packs each
  sender's pieces into byte buffers that the programs ``ppermute``, in a pipeline of
  stages, and unpacks them on arrival.
* **device-packed** (accelerators; ``_collective_device``): one program cuts, moves
  and places the pieces itself.

The programs and their schedule are cached in the plan, so a cached plan neither
re-plans nor recompiles. Plans are deterministic (``_planner``), hence so are the
schedule and the order of collectives, which is what lets every process run them in
lock step. Nothing here deletes a source buffer: donation happens in ``_execute`` after
every output exists, so a failure leaves the inputs intact.
"""

from __future__ import annotations

import contextlib
import hashlib
import marshal
import math
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from . import _collective_common, _compat, _exact, _programs
from . import _collective_device as device_packed
from . import _collective_host as host_packed
from ._collective_common import (
    AXIS,
    Copy,
    all_copies,
    calls_started,
    color_edges,
    status_input,
    status_width,
    write_out,
)
from ._plan import HOST_ROUTE
from ._planner import LeafPlan

__all__ = ["PACK_ON_HOST", "CollectiveProgram", "color_edges", "run_collective"]

# None: pack on the host when every device is a CPU. Tests set True/False to force one.
PACK_ON_HOST: bool | None = None
# Host-packed programs off CPU: source shards a destination keeps as they are, on the
# same device, are copied there (``_local_executor.copies_in_place``: by a copy program
# where it keeps the type's bits, else by PjRt), not through host memory as the pieces
# are (there, twice across the bus: 515 ms for 256 MiB of bf16 on a TPU v5e, against
# 38 ms by PjRt). Likewise a destination shard that is a whole source shard of another
# device of the same process is copied device to device by PjRt. On CPU host memory is
# the device's own, and the pooled copies are the faster. None: off CPU; tests set True
# to force it.
KEPT_ON_DEVICE: bool | None = None
# Seconds a collective reshard may wait for its peers before this process exits (unset
# or 0: no limit of ours; on CPU, gloo then raises after 30 minutes, as measured), and
# the exit status it then exits with.
ENV_TIMEOUT_S = "RESHARD_COLLECTIVE_TIMEOUT_S"
TIMEOUT_EXIT_CODE = 75


def collective_timeout_s() -> float:
    """The watchdog's limit from ``RESHARD_COLLECTIVE_TIMEOUT_S`` (0: none)."""
    raw = os.environ.get(ENV_TIMEOUT_S, "").strip()
    try:
        seconds = float(raw) if raw else 0.0
    except ValueError:
        seconds = -1.0
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(
            f"{ENV_TIMEOUT_S} must be a finite number of seconds >= 0 (0: no limit), got {raw!r}"
        )
    return seconds


@contextmanager
def watchdog(seconds: float) -> Iterator[None]:
    """Exits this process if the enclosed collective work takes over ``seconds``.

    A process that skips a reshard call, calls other collectives in between, or is
    stuck leaves its peers waiting inside a collective, which nothing in JAX can
    cancel. Exiting turns that silent hang into errors everywhere: the peers that
    share a collective with this process fail at once (the connection breaks), the
    others when the coordination service notices (its heartbeat). Off by default.
    """
    if seconds <= 0:
        yield
        return

    def give_up() -> None:
        message = (
            f"reshard: process {jax.process_index()} waited {seconds:g} s for its peers in "
            f"a collective reshard ({ENV_TIMEOUT_S}) and exits with status "
            f"{TIMEOUT_EXIT_CODE}, so that they fail too instead of hanging. Likely a "
            "process skipped a reshard call, made its calls in another order, called "
            "other collectives in between, or is stuck.\n"
        )
        # The message, then what the program printed before; but a stream that cannot
        # take them (its lock held, a full pipe nobody reads) must not keep this
        # process from ending: they are written from a thread waited for 1 s at most.
        write = threading.Thread(target=write_out, args=(message,), daemon=True)
        write.start()
        write.join(1.0)
        os._exit(TIMEOUT_EXIT_CODE)

    timer = threading.Timer(seconds, give_up)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class CollectiveProgram:
    """A plan compiled into SPMD programs over the union mesh. Cached per plan.

    Args:
      leaf_plans: the planner's leaf plans (key arrays already as their key data).
      dtypes: the element type of each planned array (``uint32`` for key data).
      alias: per array, whether its destination shards identical to a source shard at
        the same location are handed over instead of copied (``_execute.aliases``).
      pack_on_host: host-packed (True) or device-packed (False); ``None`` picks
        host-packed when every device is a CPU.
      group_bytes: device-packed: the most placeholder bytes per device one program
        takes (``_collective_device.GROUP_BYTES`` if None).
      avoid: ids of devices the plan must not read (``Plan.avoid_devices``): they are
        left out of the union mesh, so no program runs on a lost device and none of
        its buffers is fed to one (no destination is ever on them).
      platform: the platform of the arrays' devices (``None``: JAX's default).
      described: what tells the call's arrays apart beyond the programs' own view
        (which sees key arrays as their ``uint32`` data, and no memory kinds): part
        of the fingerprint, so that two plans whose programs are alike still differ
        when processes call them in different orders.
      kept_on_device: host-packed: whether kept shards not handed over are copied on
        their device, and whole shards moved within a process device to device
        (``KEPT_ON_DEVICE``; ``None``: off CPU).
    """

    def __init__(
        self,
        leaf_plans: Sequence[LeafPlan],
        dtypes: Sequence[Any],
        *,
        alias: Sequence[bool],
        pack_on_host: bool | None = None,
        group_bytes: int | None = None,
        avoid: frozenset[int] = frozenset(),
        platform: str | None = None,
        described: Any = (),
        kept_on_device: bool | None = None,
    ) -> None:
        dst_ids = {s.device for lp in leaf_plans for s in lp.spec.dst}
        assert not dst_ids & avoid, "the API refuses destinations on devices to avoid"
        ids = sorted({s.device for lp in leaf_plans for s in lp.spec.src} - avoid | dst_ids)
        # Ids are per platform: look them up among the devices of the arrays' own.
        by_id = {d.id: d for d in jax.devices(platform)}
        unknown = [i for i in ids if i not in by_id]
        if unknown:
            raise ValueError(
                f"the plan uses device ids {unknown}, which are not among jax.devices(); "
                "plan and execute with the same JAX runtime"
            )
        self.devices = [by_id[i] for i in ids]
        self.avoid = avoid
        self.platform = platform
        self.position = {d: k for k, d in enumerate(ids)}
        self.mesh = Mesh(np.array(self.devices), (AXIS,))
        self.block_sharding = NamedSharding(self.mesh, PartitionSpec(AXIS))
        me = jax.process_index()
        self.local_devices = [d for d in self.devices if d.process_index == me]
        # Whether the union mesh spans processes: only then do they exchange statuses
        # and post failures (a call within one process is not counted, ``count_call``).
        self.crosses_processes = len({d.process_index for d in self.devices}) > 1
        self.leaf_plans = list(leaf_plans)
        self.dtypes = [np.dtype(d) for d in dtypes]
        alias = tuple(alias)
        self.alias = alias
        if group_bytes is None:
            group_bytes = device_packed.GROUP_BYTES
        on_cpu = all(d.platform == "cpu" for d in self.devices)
        if pack_on_host is None:
            pack_on_host = on_cpu
        # Types the device-packed program would not carry exactly (``_exact``), which
        # made the whole program pack on the host, where bytes are bytes.
        self.inexact: list[str] = []
        if not pack_on_host:
            self.inexact = sorted(
                _exact.inexact_types(
                    self.devices, [*self.dtypes, *map(device_packed.carrier, self.dtypes)]
                )
            )
            # (Every process measures the same on the same platform: ``agree`` checks.)
            pack_on_host = bool(self.inexact)
        # Per array, whether its kept shards are copied on their device at the end
        # (``KEPT_ON_DEVICE``) rather than through host memory by the schedule: the
        # program then treats them as handed over (no copy, no destination block), as
        # where ``alias``.
        on_device = (not on_cpu) if kept_on_device is None else kept_on_device
        self.copy_kept = tuple(pack_on_host and on_device and not a for a in alias)
        handed = tuple(a or c for a, c in zip(alias, self.copy_kept, strict=True))
        self.leaves, keep, copies = all_copies(self.leaf_plans, self.position, handed)
        # Per array, destination position -> the position of another device of this
        # process whose source shard is that destination shard whole: copied device to
        # device by PjRt (``KEPT_ON_DEVICE``), not through host memory by the schedule.
        self.moved_whole: list[dict[int, int]] = [{} for _ in self.leaf_plans]
        if pack_on_host and on_device:
            copies = self._moved_whole(copies)
        # What every process must agree on for the programs to match: devices, blocks,
        # pieces and element types, and the settings that shape the schedule (module
        # constants a user may change on one process only) (``agree``; one process has
        # nobody to agree with).
        self.fingerprint = b""
        if jax.process_count() > 1:
            what = (
                ids,
                [(lf.src_block, lf.dst_block, lf.scalar) for lf in self.leaves],
                copies,
                [str(d) for d in self.dtypes],
                alias,
                self.copy_kept,
                pack_on_host,
                host_packed.settings()
                if pack_on_host
                else (group_bytes, device_packed.COPIES_PER_PROGRAM),
                described,
            )
            self.fingerprint = fingerprint(what)
        # Destination position -> source position whose buffer is handed over as it is
        # (or, where ``copy_kept``, copied on its device).
        self.reused: list[dict[int, int]] = [
            {
                self.position[lp.spec.dst[di].device]: self.position[lp.spec.src[si].device]
                for di, si in lp.reused
            }
            if a
            else {}
            for lp, a in zip(self.leaf_plans, handed, strict=True)
        ]
        self.host_packed = pack_on_host
        n = len(ids)
        # The stage that also sums every process's status (host-packed, several
        # processes): the last one.
        self.status_stage: int | None = None
        if pack_on_host:

            def schedule() -> host_packed.HostSchedule:
                return host_packed.HostSchedule(
                    copies,
                    self.leaves,
                    [dt.itemsize for dt in self.dtypes],
                    [d.process_index for d in self.devices],
                    me,
                )

            # A plan built anew for each call (uncached, the default) would build its
            # schedule anew too, and the copy tables with it (~11 ms on the receiving
            # process of the 288 MiB benchmark's relayout, which the others then wait
            # for in ``agree``): equal programs share one, found by the fingerprint,
            # which covers everything it is made from.
            if self.fingerprint:
                key = ("host schedule", self.fingerprint, me)
                self.host = _programs.shared(key, schedule)
            else:
                self.host = schedule()
            if jax.process_count() > 1 and self.host.stages:
                self.status_stage = len(self.host.stages) - 1
        else:
            # Sub-byte types (int4, float4) travel widened to 8 bits: XLA packs them two per
            # byte inside programs but not in buffers made from host data, and an
            # executable refuses arguments whose layout differs from its own.
            self.in_dtypes = [device_packed.carrier(dt) for dt in self.dtypes]
            self.in_shapes = [(n * lf.src_block[0], *lf.src_block[1:]) for lf in self.leaves]
            # Arrays in groups, one program each, so that placeholders (a zero source
            # block where a device of the union holds no source shard) stay bounded.
            placeholder_bytes = [
                math.prod(lf.src_block) * dt.itemsize
                if len({s.device for s in lp.spec.src} & self.position.keys()) < n
                else 0
                for lf, dt, lp in zip(self.leaves, self.in_dtypes, self.leaf_plans, strict=True)
            ]
            # And in groups of at most COPIES_PER_PROGRAM pieces, so that a program's
            # size (and the time and memory compiling it takes) does not grow with
            # the tree; groups of the same arrays (repeated layers) are one program.
            pieces = [0] * len(self.leaves)
            for c in copies:
                pieces[c[0]] += 1
            self.groups = _programs.consecutive_groups(
                placeholder_bytes, group_bytes, pieces, device_packed.COPIES_PER_PROGRAM
            )
            # Per group, its placeholder bytes per device; a group's wait for the
            # previous ones to finish is only needed to keep them under group_bytes.
            self.group_bytes = group_bytes
            self.placeholder_bytes = [sum(placeholder_bytes[li] for li in g) for g in self.groups]
            self.rounds = []  # per group
            for group in self.groups:
                local = {li: k for k, li in enumerate(group)}
                self.rounds.append(
                    device_packed.device_rounds(
                        [(local[c[0]], *c[1:]) for c in copies if c[0] in local],
                        [keep[li] for li in group],
                        [self.in_dtypes[li] for li in group],
                        n,
                    )
                )
        self._compiled: dict[int, Any] = {}
        # Per stage, the filler chunks of a process that sends nothing in it
        # (``_collective_host._filler_stage``).
        self.fillers: dict[int, list[jax.Array]] = {}
        self._status_fn: Any = None
        self._placeholder_fns: dict[tuple[int, tuple[int, ...]], Any] = {}

    def _moved_whole(self, copies: list[Copy]) -> list[Copy]:
        """``copies`` less those that make a destination block, alone and whole, of
        a whole source block of another device of the same process (recorded in
        ``moved_whole``)."""
        per_block: dict[tuple[int, int], list[int]] = {}
        for k, c in enumerate(copies):
            per_block.setdefault((c[0], c[2]), []).append(k)
        taken: set[int] = set()
        for (li, d), ks in per_block.items():
            c = copies[ks[0]]
            lf = self.leaves[li]
            whole = c[3] == lf.src_block == lf.dst_block and not any(c[4]) and not any(c[5])
            src, dst = self.devices[c[1]], self.devices[d]
            if len(ks) == 1 and whole and c[1] != d and src.process_index == dst.process_index:
                self.moved_whole[li][d] = c[1]
                taken.add(ks[0])
        return [c for k, c in enumerate(copies) if k not in taken]

    @property
    def collectives(self) -> int:
        """Number of ``ppermute``s in the program(s)."""
        if self.host_packed:
            return len(self.host.chunks)
        return sum(len(rd.groups) for rounds in self.rounds for rd in rounds if rd.perm)

    def program_key(self, stage: int) -> Any:
        """What the program of ``stage`` does, as a hashable value: equal keys compile
        to the same program (the shared cache's key)."""
        ids = tuple(d.id for d in self.devices)
        if self.host_packed:
            chunks = [self.host.chunks[ci] for ci in self.host.stages[stage]]
            last = stage == self.status_stage
            return ("host", ids, tuple((ch.nbytes, ch.perm) for ch in chunks), last)
        group = self.groups[stage]
        rounds = tuple(
            (
                rd.perm,
                tuple(
                    tuple(
                        (
                            sl.leaf,
                            sl.shape,
                            sl.send_start.tobytes(),
                            sl.recv_start.tobytes(),
                            None if sl.recv_mask is None else sl.recv_mask.tobytes(),
                        )
                        for sl in slots
                    )
                    for slots in rd.groups
                ),
            )
            for rd in self.rounds[stage]
        )
        return (
            "device",
            ids,
            tuple(self.leaves[li] for li in group),
            tuple((self.in_shapes[li], str(self.in_dtypes[li])) for li in group),
            rounds,
        )

    def compiled(self, stage: int = 0) -> Any:
        """The compiled program of one stage (host-packed) or group of arrays
        (device-packed), built once, then reused (across equal programs too)."""
        fn = self._compiled.get(stage)
        if fn is None:
            fn = self._compiled[stage] = _programs.shared(
                self.program_key(stage), lambda: self._compile(stage)
            )
        return fn

    def _compile(self, stage: int) -> Any:
        n = len(self.devices)
        if self.host_packed:
            chunks = [self.host.chunks[ci] for ci in self.host.stages[stage]]
            shapes: list[tuple[int, ...]] = [(n * ch.nbytes,) for ch in chunks]
            dtypes: list[np.dtype[Any]] = [np.dtype(np.uint8)] * len(chunks)
            # The last stage also sums every process's status: per process, whether it
            # failed before that stage and sent filler instead (``run_host_packed``).
            # A psum costs ~1 ms over gloo here, an all_gather ~4 ms.
            last = stage == self.status_stage
            if last:
                shapes.append((n * status_width(),))
                dtypes.append(np.dtype(np.int32))

            def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
                # Nothing but the network: packing and unpacking happen on the host.
                moved = tuple(
                    lax.ppermute(x, AXIS, list(ch.perm))
                    for x, ch in zip(inputs, chunks, strict=False)
                )
                if last:
                    moved += (lax.psum(inputs[-1], AXIS),)
                return moved

            out_count = len(shapes)
        else:
            group = self.groups[stage]
            blocks = [self.leaves[li] for li in group]
            rounds = self.rounds[stage]
            shapes = [self.in_shapes[li] for li in group]
            dtypes = [self.in_dtypes[li] for li in group]

            def body(*inputs: jax.Array) -> tuple[jax.Array, ...]:
                return device_packed.body(blocks, rounds, inputs)

            out_count = len(blocks)
        program = jax.jit(
            jax.shard_map(
                body,
                mesh=self.mesh,
                in_specs=tuple(PartitionSpec(AXIS) for _ in shapes),
                out_specs=tuple(PartitionSpec(AXIS) for _ in range(out_count)),
                check_vma=False,
            )
        )
        avals = [
            jax.ShapeDtypeStruct(s, d, sharding=self.block_sharding)
            for s, d in zip(shapes, dtypes, strict=True)
        ]
        return program.lower(*avals).compile()

    def exchange_status(self, failed: bool) -> jax.Array:
        """Tells every process of the union mesh whether this one failed (and its count
        of calls), and returns every process's (``check_status`` reads it): one small
        ``psum`` over the union mesh.
        Every process with a device in the union mesh must call it (the device-packed
        path does, before its program)."""
        if self._status_fn is None:

            def compile_status() -> Any:
                program = jax.jit(
                    jax.shard_map(
                        lambda x: lax.psum(x, AXIS),
                        mesh=self.mesh,
                        in_specs=PartitionSpec(AXIS),
                        out_specs=PartitionSpec(AXIS),
                    )
                )
                aval = jax.ShapeDtypeStruct(
                    (len(self.devices) * status_width(),),
                    np.dtype(np.int32),
                    sharding=self.block_sharding,
                )
                return program.lower(aval).compile()

            key = ("status", tuple(d.id for d in self.devices))
            self._status_fn = _programs.shared(key, compile_status)
        return self._status_fn(status_input(self, failed))  # type: ignore[no-any-return]

    def placeholders(self, device: Any, leaves: Sequence[int]) -> list[jax.Array]:
        """Zero source blocks for ``leaves`` on ``device`` (one dispatch per device)."""
        cache_key = (device.id, tuple(leaves))
        fn = self._placeholder_fns.get(cache_key)
        if fn is None:
            shapes = tuple((self.leaves[i].src_block, self.in_dtypes[i]) for i in leaves)
            fn = self._placeholder_fns[cache_key] = _programs.shared(
                ("zeros", device.id, tuple((s, str(d)) for s, d in shapes)),
                lambda: jax.jit(
                    lambda: tuple(jnp.zeros(s, d) for s, d in shapes),
                    out_shardings=tuple(SingleDeviceSharding(device) for _ in shapes),
                ),
            )
        return list(fn())


def agree(program: CollectiveProgram) -> None:
    """Checks that every process built the same program (for arrays of the same types
    and memory kinds: its fingerprint), before any of them runs it.

    Processes that were called with different arguments (breaking the
    multi-controller contract, e.g. destination shardings built from
    ``jax.local_devices()``, or different lost devices) would otherwise wait for each
    other in mismatched collectives (for 30 minutes, XLA's default). Each process posts
    a fingerprint of its program to ``jax.distributed``'s key-value store and reads
    every other process's: no device takes part, so neither lost devices nor a choice
    of devices that differs between processes can hang the check. (Without that store,
    one small all-gather over one device per process, none of them avoided.) Once per
    program: a program that has agreed is not checked again, so a process that later
    changes its arguments while the others reuse the program leaves them waiting in its
    collectives; ``RESHARD_COLLECTIVE_TIMEOUT_S`` bounds that wait. A process whose
    call failed before its check posts a refusal instead (``refuse_call``).

    Raises:
      ValueError: on every process, naming the processes that built each plan.
      RuntimeError: a process refused this call, or did not come in time.
    """
    agree_on(program.fingerprint, program.platform, program.avoid)


def agree_on(digest: bytes, platform: str | None, avoid: frozenset[int]) -> None:
    """``agree`` for a fingerprint ``digest`` of what this process was asked to do (for a
    call that builds no program: ``_execute``'s memory-kind changes in place)."""
    if jax.process_count() == 1:
        return
    client = _compat.distributed_client()
    if client is not None:
        everyone = _exchange(client, digest)
    else:
        # One device per process, none avoided (a process with no device left runs
        # none of the plan's programs, and takes no part).
        reps = one_per_process(d for d in jax.devices(platform) if d.id not in avoid)
        if jax.process_index() not in reps:
            return
        mine = np.frombuffer(digest, np.uint32)
        rows = _gather(mine, [reps[p] for p in sorted(reps)]).reshape(len(reps), -1)
        everyone = {p: row.tobytes() for p, row in zip(sorted(reps), rows, strict=True)}
    groups: dict[bytes, list[int]] = {}
    for p, fingerprint in sorted(everyone.items()):
        groups.setdefault(fingerprint, []).append(p)
    if len(groups) > 1:
        raise ValueError(
            f"reshard was called with different arguments on different processes: they "
            f"built {len(groups)} different plans, processes "
            f"{' | '.join(map(str, groups.values()))} each building one. Every process must "
            "pass the same pytree, avals, source and destination shardings (built from "
            "the global jax.devices()), lost or avoided devices and options, in the same "
            "order of calls, with the same reshard settings (such as the sizes in "
            "reshard._collective_host and _collective_device)"
        )


def fingerprint(what: Any) -> bytes:
    """16 bytes that tell apart different values of ``what`` (nested tuples and lists of
    ints, strings, bools and None), the same in every process for equal values.

    ``marshal`` at version 2 writes such values by value alone (later versions refer
    back to objects already written, by identity, which equal values in two processes
    need not share), ~7x faster than ``repr``: ~0.4 against ~2.8 ms on the 288 MiB
    benchmark's relayout, whose uncached calls build it at every call. A value it
    cannot write (a numpy scalar, say) is written by ``repr``, marked apart."""
    try:
        data = b"m" + marshal.dumps(what, 2)
    except ValueError:
        data = b"r" + repr(what).encode()
    return hashlib.sha256(data).digest()[:16]


_AGREE_KEY = "reshard/agree"
# Where the digests of host values put on every process are posted, at every call that
# has such values, before its transfers (read after them: ``values_everywhere``).
_VALUES_KEY = "reshard/values"
_REFUSED = "!"  # marks a refusal posted where the check would be (digests are hex)
# How long a check waits for its peers, as XLA's CPU collectives wait for theirs (the
# all-gather the check once was gave up after 30 minutes).
AGREE_WAIT_S = 1800.0
# It waits in steps of this long, so that an interrupt is seen within one (a signal's
# Python handler runs only once the store's call returns).
WAIT_STEP_MS = 1000


def _key(call: int, process: int, space: str = _AGREE_KEY) -> str:
    """Where ``process`` posts its check (or refusal) of its ``call``-th call: the
    check of a plan's first run, or (``space`` ``_VALUES_KEY``) of its host values."""
    return f"{space}/{call}/{process}"


def _post(client: Any, value: str, space: str = _AGREE_KEY) -> None:
    """Posts ``value`` as this process's part of the current call's check, keyed by the
    count of calls started, the same on every process for the same call. Keyed by call,
    not by check, so a refusal (a call that never reaches its check) pairs with the
    others' check of that very call. Every process's previous post is no longer read
    once this one is made; this process's own are deleted when every process is known
    to have gone on (``_collective_common.forget_earlier_posts``)."""
    _collective_common.post(client, _key(calls_started(), jax.process_index(), space), value)


def refuse_call(error: BaseException) -> None:
    """Tells the other processes that this process's current collective call failed
    before it posted its check (bad input on this process alone, say), so that any of
    them waiting in the check of the same call raises at once, naming this process and
    its error, instead of waiting up to ``AGREE_WAIT_S`` for a check that never comes.
    All of them have then started as many calls, and stay in step.

    Called by ``reshard``, ``recover`` and ``Plan.execute`` for a counted call that
    raised. A call that posted its check already posts nothing: its peers may have
    read the check and gone on into the collectives, where its failure reaches them in
    the status. Peers that run a plan that has run (no check) never read the refusal.
    Never raises: the caller's own error is what matters."""
    if jax.process_count() == 1:
        return
    with contextlib.suppress(Exception):
        client = _compat.distributed_client()
        if client is None:
            return
        what = f"{type(error).__name__}: {error}"
        value = _REFUSED + (what if len(what) <= 2000 else what[:2000] + " ...")
        # Both checks a peer may be waiting in: the plan's, and the host values'.
        for space in (_AGREE_KEY, _VALUES_KEY):
            if not _collective_common.posted_in_this_call(
                _key(calls_started(), jax.process_index(), space)
            ):
                with contextlib.suppress(Exception):  # (the other check still hears)
                    _post(client, value, space)


def _exchange(client: Any, digest: bytes, space: str = _AGREE_KEY) -> dict[int, bytes]:
    """Every process's digest for this check, through the coordination service's
    key-value store, keyed by the count of calls started (every process checks a plan
    that crosses processes the first time it runs, in the same call; and the host
    values put on every process at every call, in ``space`` ``_VALUES_KEY``). Waits
    for each up to ``AGREE_WAIT_S``; ``RESHARD_COLLECTIVE_TIMEOUT_S``'s watchdog bounds
    it sooner, as it does the collectives. A peer that refused this call
    (``refuse_call``) makes this process raise at once."""
    _post(client, digest.hex(), space)
    return _read(client, digest, space)


def _read(client: Any, digest: bytes, space: str) -> dict[int, bytes]:
    """The rest of ``_exchange``, once this process posted ``digest``: every other
    process's, waited for."""
    me, call = jax.process_index(), calls_started()
    everyone = {me: digest}
    deadline = time.monotonic() + AGREE_WAIT_S
    for p in range(jax.process_count()):
        while p not in everyone:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                missing = [q for q in range(jax.process_count()) if q not in everyone]
                what = (
                    "the plan of this call with the others (the first run of a plan that "
                    "crosses processes)"
                    if space == _AGREE_KEY
                    else "the values this call puts on devices of every process"
                )
                raise RuntimeError(
                    f"reshard: waited {AGREE_WAIT_S:g} s for processes {missing} to check "
                    f"{what}: they skipped the call, or are out of step; set "
                    "RESHARD_COLLECTIVE_TIMEOUT_S to bound such waits sooner"
                )
            try:
                got = client.blocking_key_value_get(
                    _key(call, p, space), min(left_ms, WAIT_STEP_MS)
                )
            except Exception as e:  # the store's timeout, or the service's failure
                if "DEADLINE_EXCEEDED" not in str(e):
                    raise
                continue
            if got.startswith(_REFUSED):
                raise RuntimeError(
                    f"reshard: process {p} refused this call before moving any data "
                    f"({got[len(_REFUSED) :]}), so every process raises; no data moved, "
                    "the inputs are intact, and the processes are still in step"
                )
            everyone[p] = bytes.fromhex(got)
    # Every process has posted for this call, so each has left the calls of this
    # process's earlier posts: those keys are no longer read.
    _collective_common.forget_earlier_posts()
    return everyone


def values_everywhere(digest: bytes, devices: Iterable[Any]) -> Callable[[], dict[int, bytes]]:
    """Posts this process's ``digest`` of the host values of this call put on devices
    of every process (``_execute.post_host_values``), and returns the function that
    reads every process's: through the key-value store, where a peer's refusal of the
    call is read too, else (without a store) one small all-gather over one of
    ``devices`` per process, made when read.

    Posted before the call's transfers and read after them: a process that fails after
    its transfers has posted already, so its peers do not wait for it; one that
    refused the call posts its refusal there; and one that is out of step meets its
    peers' earlier call in the transfers, where the status says so, before anyone
    waits here."""
    client = _compat.distributed_client()
    if client is not None:
        _post(client, digest.hex(), _VALUES_KEY)

    def read() -> dict[int, bytes]:
        # (A process that skipped this call leaves the others waiting for it: the
        # watchdog of RESHARD_COLLECTIVE_TIMEOUT_S bounds that, as for the transfers.)
        with watchdog(collective_timeout_s()):
            if client is not None:
                return _read(client, digest, _VALUES_KEY)
            reps = one_per_process(devices)
            on = [reps[p] for p in sorted(reps)]
            # The lengths first: gloo aborts a process whose all-gather differs in size.
            words = _gather(np.array([len(digest) // 4], np.uint32), on)
            if len(set(words.tolist())) > 1:  # (the caller says the counts differ)
                return {p: bytes(4 * int(w)) for p, w in zip(sorted(reps), words, strict=True)}
            rows = _gather(np.frombuffer(digest, np.uint32), on)
        rows = rows.reshape(len(reps), -1)
        return {p: row.tobytes() for p, row in zip(sorted(reps), rows, strict=True)}

    return read


def one_per_process(devices: Iterable[Any]) -> dict[int, Any]:
    """Per process, the device of lowest id among ``devices``: the same choice on every
    process for the same devices (one device per process for ``_gather``)."""
    reps: dict[int, Any] = {}
    for d in sorted(devices, key=lambda d: d.id):
        reps.setdefault(d.process_index, d)
    return reps


def _gather(mine: np.ndarray, devices: Sequence[Any]) -> np.ndarray:
    """Every process's ``mine`` (same shape and type), in the order of ``devices`` (one
    per process, this process's among them): one all-gather over those devices."""
    mesh = Mesh(np.array(devices), ("p",))
    sharding = NamedSharding(mesh, PartitionSpec("p"))
    (local,) = [d for d in devices if d.process_index == jax.process_index()]

    def build() -> Any:
        return jax.jit(
            jax.shard_map(
                # (Each device's block of the output is the whole gather.)
                lambda v: lax.all_gather(v, "p", tiled=True),
                mesh=mesh,
                in_specs=PartitionSpec("p"),
                out_specs=PartitionSpec("p"),
            )
        )

    fn = _programs.shared(
        ("agree", tuple(d.id for d in devices), mine.shape, str(mine.dtype)), build
    )
    with _compat.bookkeeping():
        x = jax.make_array_from_single_device_arrays(
            (len(devices) * mine.size,), sharding, [jax.device_put(mine.ravel(), local)]
        )
        return np.asarray(jax.device_get(fn(x).addressable_shards[0].data))  # (see check_status)


def _platform(shardings: Sequence[jax.sharding.Sharding]) -> str | None:
    """The platform of the destination devices (``None`` for no arrays)."""
    devices: Any = shardings[0].device_set if shardings else ()
    return next((d.platform for d in devices), None)


def run_collective(
    plan: Any,
    sources: Sequence[jax.Array],
    shardings: Sequence[jax.sharding.Sharding],
    *,
    donate: bool,
    alias: Sequence[bool],
    only: Sequence[int] | None = None,
    also: Any = (),
    before: Callable[[], None] | None = None,
) -> list[jax.Array]:
    """Executes ``plan`` with compiled collective programs; every process calls it.

    Multi-controller contract: every process calls this with the same plan (built from
    the same avals and shardings), passing its own addressable shards of the same
    arrays, in the same order of calls -- as for any JAX computation across processes.

    Args:
      plan: a ``Plan`` (its leaf plans are run; the program is cached in it).
      sources: the source arrays (PRNG-key arrays already converted to key data).
      shardings: per array, the destination sharding (of the key data for key arrays).
      donate: unused here: donation is the caller's last step, after every output exists.
      alias: per array, whether destination shards that equal a source shard at the
        same location are handed over unchanged (else copied); see ``_execute.aliases``.
      only: the indices (among the plan's arrays) of the arrays given, where not all
        of them are (the same on every process: decided from the plan alone).
      also: what else of the call the processes compare, with the program (the arrays
        the caller moves without it).
      before: the caller's own copies (of those arrays), called once by every process,
        before the program's status is exchanged where it has one here: a failure of
        theirs then makes every process raise, as one of the program's own does.

    Returns:
      One array per source, committed to its destination sharding.
    """
    del donate  # never delete here: a failure must leave every input intact
    alias = tuple(alias)
    group_bytes = device_packed.GROUP_BYTES
    picked = None if only is None else tuple(only)
    key = (
        "collective_program",
        alias,
        PACK_ON_HOST,
        (group_bytes, device_packed.COPIES_PER_PROGRAM),
        KEPT_ON_DEVICE,
        picked,
    )
    program: CollectiveProgram | None = plan._cache.get(key)
    limit = collective_timeout_s() if jax.process_count() > 1 else 0.0
    with watchdog(limit):
        if program is None:
            leaf_plans, planned = plan.leaf_plans, plan.planned_leaves
            if picked is not None:
                leaf_plans = [leaf_plans[j] for j in picked]
                planned = [planned[j] for j in picked]
            program = CollectiveProgram(
                leaf_plans,
                [s.dtype for s in sources],
                alias=alias,
                pack_on_host=PACK_ON_HOST,
                group_bytes=group_bytes,
                kept_on_device=KEPT_ON_DEVICE,
                avoid=plan.avoid_devices,
                platform=_platform(shardings),
                described=(
                    [(leaf.kind, str(leaf.dtype)) for leaf in planned],
                    [getattr(x.sharding, "memory_kind", None) for x in sources],
                    [getattr(s, "memory_kind", None) for s in shardings],
                    also,
                ),
            )
            if plan.crosses_processes:  # (within one process, others make no such call)
                agree(program)  # before caching: a mismatch raises again next call
            plan._cache[key] = program
            if program.inexact:  # for str(plan): decided here, at the first run
                plan._cache[HOST_ROUTE] = (
                    f"packed on the host, not on the devices (for {', '.join(program.inexact)})"
                )
        if program.host_packed:
            return host_packed.run_host_packed(program, sources, shardings, before=before)
        # With a watchdog, it covers the collectives, not only their dispatch.
        return device_packed.run_device_packed(
            program, sources, shardings, wait=limit > 0, before=before
        )
