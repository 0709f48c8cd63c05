"""Elastic device sets: recover a pytree from surviving replicas, and a training-loop helper.

When devices fail, the state they held may still exist elsewhere: data-parallel
replicas, replicated optimizer state. ``recover`` reshards a pytree onto a mesh of
surviving devices while reading only surviving shards (``reshard(..., avoid_devices=)``);
the plan is built before any byte moves, so when some box has no surviving copy,
``DataLossError`` names every leaf path and box that is gone and the inputs are intact.

``ElasticManager`` wraps a user's step function: it keeps the full mesh and the lost
devices, derives the current mesh with ``shrink_mesh`` (the largest that avoids them),
recovers the state onto it, retries the step, and spreads the state back when devices
return. A device loss is signalled by ``mark_lost`` (tests, simulations, a health
checker), by a ``DeviceLossError`` raised from the step, or by a runtime error whose
message names failed devices (``parse_lost_devices``).

Out of scope: a lost *process* in a multi-controller run; JAX's distributed runtime
does not survive it (see docs/elastic.md for what to do instead).
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from . import _compat
from ._api import _avoid_ids, refuse_unplanned
from ._api import plan as make_plan
from ._collective_common import calls_started
from ._mesh_surgery import (
    _listed,
    carry_shardings,
    check_allowed_sizes,
    check_distinct_devices,
    device_id,
    shrink_mesh,
)
from ._plan import Plan, human_bytes

logger = logging.getLogger("reshard.elastic")


class DeviceLossError(RuntimeError):
    """Devices are gone: raise it from a step function to make ``ElasticManager`` recover.

    Attributes:
      devices: the ids of the lost devices.

    Example:
      >>> from reshard import DeviceLossError
      >>> raise DeviceLossError([4, 5])
      Traceback (most recent call last):
      ...
      reshard._elastic.DeviceLossError: devices [4, 5] lost
    """

    def __init__(self, devices: Iterable[Any], message: str | None = None) -> None:
        self.devices = frozenset(
            device_id(d, "DeviceLossError") for d in _listed(devices, "DeviceLossError")
        )
        super().__init__(message or f"devices {sorted(self.devices)} lost")

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (to another process, a pool's worker) and copied with its devices.
        return (type(self), (sorted(self.devices), str(self)), self.__dict__)


def _recover_with_plan(
    x: Any, sharding: Any, lost_devices: Iterable[Any], *, donate: bool
) -> tuple[Any, Plan]:
    before = calls_started()
    try:
        return _recover(x, sharding, lost_devices, donate=donate)
    except BaseException as e:
        if calls_started() == before:  # failed before Plan.execute counted the call
            refuse_unplanned(x, sharding, e)  # (as reshard does)
        raise


def _recover(
    x: Any, sharding: Any, lost_devices: Iterable[Any], *, donate: bool
) -> tuple[Any, Plan]:
    lost = _avoid_ids(lost_devices, "recover: lost_devices")
    if isinstance(sharding, Mesh):
        _compat.check_shardings_readable(x)
        leaves, treedef = jax.tree_util.tree_flatten(x)
        if not all(isinstance(a, jax.Array) for a in leaves):
            # Only arrays live on a mesh: the rest (a step count as a Python int, say)
            # comes back as it is, and the arrays keep their leaf paths in errors.
            arrays = [a if isinstance(a, jax.Array) else None for a in leaves]
            only = jax.tree_util.tree_unflatten(treedef, arrays)
            out, p = _recover(only, sharding, lost, donate=donate)
            moved = iter(jax.tree_util.tree_leaves(out))
            back = [
                next(moved) if a is not None else b for a, b in zip(arrays, leaves, strict=True)
            ]
            return jax.tree_util.tree_unflatten(treedef, back), p
        mesh = sharding

        def target(a: jax.Array) -> Any:
            s = a.sharding
            if not a.committed:
                # An uncommitted array (a step counter made with jnp.int32(0)) belongs
                # to no device: replicated on the mesh, where jax.jit finds the rest of
                # the state, and the same on every process (committed to each
                # process's own default device, the next step refused the state).
                return NamedSharding(mesh, PartitionSpec())
            lost_here = isinstance(s, SingleDeviceSharding) and (
                device_id(next(iter(s.device_set))) in lost
            )
            if lost_here and a.size:
                # Its only copy is gone, and carry_shardings refuses a device off the
                # mesh: any target on the mesh lets planning raise DataLossError naming it.
                return NamedSharding(mesh, PartitionSpec(), memory_kind=s.memory_kind)
            return a

        sharding = carry_shardings(jax.tree_util.tree_map(target, x), mesh)
    # Elastic events are rare and each has its own avoided set: no point caching.
    p = make_plan(x, sharding, avoid_devices=lost, cache=False)
    return p.execute(x, donate=donate), p


def recover(x: Any, sharding: Any, lost_devices: Iterable[Any], *, donate: bool = False) -> Any:
    """Reshards ``x`` onto ``sharding`` reading only shards on surviving devices.

    Every box of every leaf is copied from a device outside ``lost_devices`` (among
    several surviving replicas the least loaded is chosen), so the result is bit-exact
    whenever each element still has a copy. The check happens while planning, before
    any byte moves.

    Args:
      x: a pytree of ``jax.Array``s. Other leaves go through ``jax.device_put`` when
        ``sharding`` is a ``Sharding`` or a pytree of them, and come back as they are
        when it is a ``Mesh``.
      sharding: a ``Sharding``, a pytree of them that is a tree prefix of ``x``, or a
        ``Mesh`` -- then each array keeps its spec on that mesh (``carry_shardings``),
        and uncommitted arrays (``jnp.int32(0)``) are replicated on it.
        It must not use lost devices (build it with ``shrink_mesh``).
      lost_devices: devices (or ids) that must not be read.
      donate: free the sources once the whole pytree has been recovered; when
        recovery fails nothing is freed.

    Returns:
      A pytree like ``x``, committed to ``sharding``.

    Raises:
      DataLossError: some box has no copy outside ``lost_devices``; ``.missing`` lists
        each ``(leaf path, box)``. Nothing was moved or freed.
      ValueError: the destination uses a lost device, or any error of
        ``reshard.reshard``.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
      >>> w = jax.device_put(np.arange(8.0), NamedSharding(mesh, P("fsdp")))
      >>> small = reshard.shrink_mesh(mesh, [4, 5], "data")
      >>> v = reshard.recover(w, small, lost_devices=[4, 5])
      >>> bool((np.asarray(v) == np.asarray(w)).all()), sorted(d.id for d in v.devices())
      (True, [0, 1, 2, 3])
    """
    return _recover_with_plan(x, sharding, lost_devices, donate=donate)[0]


# Status codes and words that runtimes put into errors about failed hardware. Out of
# memory is a device *error*, not a lost device, so it is excluded explicitly.
_FAILURE = re.compile(
    r"\b(UNAVAILABLE|DATA_LOSS|ABORTED|DEADLINE_EXCEEDED|INTERNAL)\b|heartbeat|unhealthy|"
    r"\blost\b|halted|hardware|uncorrectable|\bECC\b|\bXid\b|device.{0,40}fail|fail.{0,40}device",
    re.IGNORECASE,
)
# Compilation and allocation failures name a device too, but lose none; nor do XLA's
# internal checks (RET_CHECK) and what a device cannot do (UNIMPLEMENTED, unsupported).
# Nor does an error raised by the user's own callback (jax.pure_callback and kin), which
# JAX reports as INTERNAL with the callback's message.
_NOT_LOSS = re.compile(
    r"RESOURCE_EXHAUSTED|out of memory|\bOOM\b|\bcompil(?:e|ing|ation)\b|\ballocat\w*"
    r"|\w*Callback error|\bRET_CHECK\b|\bUNIMPLEMENTED\b|\bunsupported\b|\bnot supported\b",
    re.IGNORECASE,
)
# "devices [4, 5]", "device ids (4, 5)"; without brackets only after "device ids":
# "device ids: 4, 5". A bare "devices 0, 1, 2, 3" more often lists the devices an
# operation ran on than those that failed ("all-reduce over devices 0, 1, 2, 3
# failed: device 2 halted"), so it does not count; nor does a list after "over",
# "across" or "among" ("all-gather over devices [0, 1, 2, 3] aborted").
_ID_LIST = re.compile(
    r"\bdevices?[ _]?(?:ids?)?\s*[:=]?\s*[\[(]\s*(\d+(?:\s*,\s*\d+)*)\s*[\])]"
    r"|\bdevice[ _]ids\s*[:=]?\s*(\d+(?:\s*,\s*\d+)*)\b",
    re.I,
)
_OPERATION_LIST = re.compile(r"\b(?:over|across|among)\s+(?:all\s+)?(?:the\s+)?$", re.I)
# "device 3", "device_id=3", "Device(id=3", "TPU_3", "TpuDevice(id=3", "gpu:3", "cuda:3"
# ("cuda 12" is more often a CUDA version than a device: cuda needs its separator; and
# "GPU 00000000:3B:00.0" is a PCI bus address, which a number followed by ":3B" or ".0"
# starts, not an id)
_ID_ONE = re.compile(
    r"(?:(?:\bdevice[ _]?(?:id|ordinal)?|\bTPU|\bGPU)\s*[:=#_]?\s*(\d+)\b"
    r"|\bcuda\s*[:#_]\s*(\d+)\b)(?![:.][0-9A-Fa-f])"
    r"|\w*Device\(id=(\d+)",
    re.IGNORECASE,
)


def _divisors_hint(n: int) -> tuple[int, ...]:
    """The divisors of ``n``: the sizes to offer where the state divides by ``n``."""
    return tuple(k for k in range(1, n + 1) if n % k == 0)


def parse_lost_devices(error: BaseException) -> frozenset[int]:
    """The device ids an error reports as failed; empty when it is not a device loss.

    ``DeviceLossError`` gives its ``.devices``. Any other ``RuntimeError`` (JAX's
    ``JaxRuntimeError`` is one) counts when its message has a failure status or word
    (``UNAVAILABLE``, ``DATA_LOSS``, ``INTERNAL``, "heartbeat", "unhealthy", "lost",
    "hardware", "ECC", "Xid", "device ... failed", ...) and names devices ("device 3",
    "devices [4, 5]", "TPU_3", "CudaDevice(id=3)", "gpu:3"); out-of-memory, compilation
    and allocation errors never count, nor do errors of your own callbacks
    (``jax.pure_callback``: "CpuCallback error"), nor does a list of the devices an
    operation ran on ("over devices [0, 1, 2, 3]"). Runtimes word these errors
    differently: pass your own parser to ``ElasticManager`` when yours does not match
    (local GPU ordinals equal global ids only in single-process runs).

    Args:
      error: the exception a step raised.

    Returns:
      The ids of the failed devices named in ``error``.

    Example:
      >>> from reshard import parse_lost_devices
      >>> sorted(parse_lost_devices(RuntimeError("UNAVAILABLE: TPU_3 heartbeat timed out")))
      [3]
    """
    if isinstance(error, DeviceLossError):
        return error.devices
    if not isinstance(error, RuntimeError):
        return frozenset()
    text = str(error)
    if _NOT_LOSS.search(text) or not _FAILURE.search(text):
        return frozenset()
    ids: set[int] = set()
    for m in _ID_LIST.finditer(text):
        if not _OPERATION_LIST.search(text, 0, m.start()):
            ids.update(int(i) for i in (m.group(1) or m.group(2)).split(","))
    for m in _ID_ONE.finditer(text):
        ids.add(int(next(g for g in m.groups() if g is not None)))
    return frozenset(ids)


@dataclass(frozen=True)
class ElasticEvent:
    """One change of the device set, as ``ElasticManager`` handled it.

    Attributes:
      kind: ``"shrink"`` (devices lost), ``"grow"`` (devices back) or ``"remesh"``.
      lost: ids of the devices marked lost since the previous event (also those whose
        loss needed no move, e.g. in a slice already dropped).
      returned: ids of the devices that came back since the previous event (a device
        can be in both, when it was lost and came back in between).
      old_shape / new_shape: mesh axis sizes before and after.
      state_bytes: logical bytes of the recovered state (each element once).
      bytes_moved: bytes copied between devices (of the shards on the new mesh, each
        replica counted, so with replicated leaves these two can add up to more than
        ``state_bytes``).
      bytes_kept: bytes of those shards that were already in place (no copy).
      seconds: wall time of the recovery, planning included.
      cause: what triggered it (``"mark_lost"``, or the error text).
    """

    kind: str
    lost: tuple[int, ...]
    returned: tuple[int, ...]
    old_shape: dict[str, int]
    new_shape: dict[str, int]
    state_bytes: int
    bytes_moved: int
    bytes_kept: int
    seconds: float
    cause: str

    def __str__(self) -> str:
        what = []
        if self.lost:
            what.append(f"devices {list(self.lost)} lost")
        if self.returned:
            what.append(f"devices {list(self.returned)} returned")
        return (
            f"{self.kind}: {', '.join(what) or 'no device change'}; mesh {self.old_shape} -> "
            f"{self.new_shape}; recovered {human_bytes(self.state_bytes)} of state in "
            f"{self.seconds * 1e3:.1f} ms (its shards on the new mesh, each replica counted: "
            f"{human_bytes(self.bytes_moved)} copied between devices, "
            f"{human_bytes(self.bytes_kept)} already in place)"
        )


def _placed_on(a: jax.Array, mesh: Mesh) -> bool:
    """Whether ``a`` already lives where ``carry_shardings`` would put it on ``mesh``."""
    if isinstance(a.sharding, NamedSharding):
        return a.sharding.mesh == mesh
    ids = set(mesh.device_ids.ravel().tolist())
    return all(device_id(d) in ids for d in a.sharding.device_set)


StepFn = Callable[..., tuple[Any, Any]]


class ElasticManager:
    """Runs training steps on a mesh that shrinks when devices fail and grows back.

    The manager owns the *full* mesh and the set of lost devices; the current mesh is
    always ``shrink_mesh(full_mesh, lost, axis)``. When the set changes, the next
    ``run_step`` (or ``apply``) moves the state onto the new mesh with ``recover``
    (same specs, reading only surviving shards) and logs an ``ElasticEvent`` to the
    ``reshard.elastic`` logger.

    The step function is called as ``step_fn(state, mesh, *args, **kwargs)`` and must
    return ``(new_state, aux)``. It gets the current mesh so that it can place its
    batch there; it should not donate ``state`` (a failed step is retried with it).

    When ``run_step`` raises after it moved the state (retry limit, data loss on a
    second failure, an unrelated error on the retry), ``recovered_state`` holds the
    state on ``mesh``: continue from it (with ``donate=True`` the caller's old state
    is freed). Without donation the old state also works: ``apply`` recovers it again.

    Args:
      mesh: the full mesh (all devices healthy).
      axis: the mesh axis whose slices may be dropped (the data-parallel axis).
      max_retries: how many device-loss failures one ``run_step`` absorbs before
        giving up with ``RuntimeError``.
      allowed_sizes: sizes the axis may take (see ``shrink_mesh``); the full mesh's
        size is always allowed (the manager starts there and grows back to it).
      error_parser: maps an exception to the ids (or devices) of lost devices (empty
        or ``None``: not a device loss, re-raised); default ``parse_lost_devices``.
      donate: free the old state's buffers after each successful recovery.

    Example:
      >>> import jax, numpy as np, reshard
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
      >>> state = jax.device_put(np.zeros(8), NamedSharding(mesh, P("fsdp")))
      >>> em = reshard.ElasticManager(mesh, "data")
      >>> step = lambda s, mesh: (s + 1, None)
      >>> em.mark_lost([4, 5])
      >>> state, _ = em.run_step(step, state)
      >>> dict(em.mesh.shape), float(state[0])
      ({'data': 1, 'fsdp': 4}, 1.0)
    """

    def __init__(
        self,
        mesh: Mesh,
        axis: str,
        *,
        max_retries: int = 3,
        allowed_sizes: Iterable[int] | None = None,
        error_parser: Callable[[BaseException], Iterable[int]] = parse_lost_devices,
        donate: bool = False,
    ) -> None:
        if axis not in mesh.axis_names:
            raise ValueError(
                f"ElasticManager: axis {axis!r} is not an axis of the mesh (axis names "
                f"{tuple(mesh.axis_names)}); pass the data-parallel axis"
            )
        check_distinct_devices(mesh, "ElasticManager")
        retries: Any = max_retries  # any integral type (numpy's too), not bool
        if isinstance(retries, bool) or not isinstance(retries, Integral) or retries < 0:
            raise ValueError(
                f"ElasticManager: max_retries must be an integer >= 0, got {max_retries!r}"
            )
        self.full_mesh = mesh
        self.axis = axis
        self.max_retries = int(retries)
        sizes = check_allowed_sizes(allowed_sizes, "ElasticManager")
        if sizes is not None:
            # The manager starts on the full mesh, so its size is allowed too: without
            # it, a mesh that shrank would never grow back to where it started.
            sizes = tuple(sorted({*sizes, int(mesh.shape[axis])}))
        self.allowed_sizes = sizes
        self.error_parser = error_parser
        self.donate = donate
        self.events: list[ElasticEvent] = []
        self._mesh = mesh
        self._lost: set[int] = set()
        self._all = {d.id: d for d in mesh.devices.flat}
        # Changes not yet applied to the state: (ids lost, ids returned, cause).
        self._new_lost: set[int] = set()
        self._new_back: set[int] = set()
        self._cause = ""
        # What the next event reports: every device marked lost / returned since the
        # previous event, including changes that needed no move of the state.
        self._event_lost: set[int] = set()
        self._event_back: set[int] = set()
        # The last state ``apply`` produced, until a step on it succeeds: what a caller
        # continues from when ``run_step`` raises after moving a donated state.
        self.recovered_state: Any = None

    # -- what the manager knows ----------------------------------------------------

    @property
    def mesh(self) -> Mesh:
        """The mesh the state lives on (after the last applied change)."""
        return self._mesh

    @property
    def lost_devices(self) -> frozenset[int]:
        """Ids of the devices currently marked lost."""
        return frozenset(self._lost)

    @property
    def active_devices(self) -> tuple[Any, ...]:
        """The devices of the current mesh, in mesh order."""
        return tuple(self._mesh.devices.flat)

    @property
    def inactive_devices(self) -> tuple[Any, ...]:
        """Devices of the full mesh outside the current one: lost, or healthy but idle
        because their slice holds a lost device."""
        active = {d.id for d in self.active_devices}
        return tuple(d for d in self.full_mesh.devices.flat if d.id not in active)

    @property
    def pending(self) -> bool:
        """Whether a device change waits to be applied to the state."""
        return bool(self._new_lost or self._new_back)

    # -- events ----------------------------------------------------------------------

    def mark_lost(self, devices: Iterable[Any], cause: str = "mark_lost") -> None:
        """Records lost devices; the next ``run_step``/``apply`` recovers the state.

        Raises:
          ValueError: a device that is not in the full mesh.
        """
        ids = self._known(devices, "mark_lost")
        new = ids - self._lost
        self._lost |= new
        self._new_lost |= new
        self._new_back -= new
        self._event_lost |= new
        if new:
            self._cause = cause
            logger.warning("devices %s reported lost (%s)", sorted(new), cause)

    def mark_returned(self, devices: Iterable[Any]) -> None:
        """Records devices that are healthy again; the next step spreads the state back.

        Pass later steps the state ``apply`` (or ``run_step``) made after the loss, not
        one made before it: that one may hold shards on these devices, which ``apply``
        takes as they are (it cannot tell that they may be stale).

        Raises:
          ValueError: a device that is not in the full mesh.
        """
        ids = self._known(devices, "mark_returned") & self._lost
        self._lost -= ids
        self._new_back |= ids - self._new_lost
        self._new_lost -= ids
        self._event_back |= ids
        if ids:
            self._cause = "mark_returned"
            logger.info("devices %s reported back", sorted(ids))

    def _known(self, devices: Iterable[Any], where: str) -> set[int]:
        ids = {
            device_id(d, f"ElasticManager.{where}")
            for d in _listed(devices, f"ElasticManager.{where}")
        }
        unknown = sorted(ids - self._all.keys())
        if unknown:
            raise ValueError(
                f"ElasticManager.{where}: devices {unknown} are not in the full mesh (device "
                f"ids {sorted(self._all)}); to add new devices, build a larger mesh with "
                "reshard.grow_mesh and a new ElasticManager"
            )
        return ids

    # -- moving the state ------------------------------------------------------------

    def apply(self, state: Any) -> Any:
        """Puts ``state`` on the mesh that avoids the lost devices, moving it if needed.

        The check is by placement, not by history: a state left on an older mesh (say,
        kept by the caller when ``run_step`` raised) is recovered onto the current one,
        reading only devices that are not lost.

        Args:
          state: a pytree of arrays with ``NamedSharding``s on a mesh of the full mesh's
            devices (normally ``self.mesh``); other leaves come back as they are.

        Returns:
          The state on ``self.mesh`` (the same object when it is already there).

        Raises:
          ValueError: no mesh avoids the lost devices (see ``shrink_mesh``).
          DataLossError: the lost devices held the only copy of some box; the mesh,
            the state and the pending change are left as they were.
        """
        _compat.check_shardings_readable(state)
        target = self._mesh
        if self.pending:
            target = shrink_mesh(
                self.full_mesh, self._lost, self.axis, allowed_sizes=self.allowed_sizes
            )
        arrays = [a for a in jax.tree_util.tree_leaves(state) if isinstance(a, jax.Array)]
        if all(_placed_on(a, target) for a in arrays):
            self._mesh = target
            self._clear()
            return state
        meshes = {getattr(a.sharding, "mesh", None) for a in arrays}
        source = next(iter(meshes)) if len(meshes) == 1 else None
        old_shape = dict(source.shape) if isinstance(source, Mesh) else dict(self._mesh.shape)
        new_shape = dict(target.shape)
        held = {device_id(d) for a in arrays for d in a.sharding.device_set}
        avoid = self._lost & held
        t0 = time.perf_counter()
        try:
            out, p = _recover_with_plan(state, target, avoid, donate=self.donate)
        except Exception as e:
            logger.error(
                "could not move the state from mesh %s to %s avoiding devices %s",
                old_shape,
                new_shape,
                sorted(avoid),
            )
            size, full = new_shape[self.axis], self.full_mesh.shape[self.axis]
            if isinstance(e, ValueError) and "cannot be divided" in str(e) and size != full:
                e.add_note(
                    f"ElasticManager: {self.axis!r} has {size} of its {full} slices now "
                    f"(the largest size{' of allowed_sizes' if self.allowed_sizes else ''} "
                    f"that avoids the lost devices); pass allowed_sizes= with "
                    f"only the sizes of {self.axis!r} that the state divides by, e.g. "
                    f"allowed_sizes={_divisors_hint(full)}"
                )
            raise
        jax.block_until_ready(out)
        seconds = time.perf_counter() - t0
        n_old, n_new = math.prod(old_shape.values()), target.devices.size
        event = ElasticEvent(
            kind="shrink" if n_new < n_old else "grow" if n_new > n_old else "remesh",
            lost=tuple(sorted(self._event_lost)),
            returned=tuple(sorted(self._event_back)),
            old_shape=old_shape,
            new_shape=new_shape,
            state_bytes=p.stats.array_bytes,
            bytes_moved=p.stats.bytes_moved,
            bytes_kept=p.stats.bytes_kept,
            seconds=seconds,
            cause=self._cause or "the state was not on the current mesh",
        )
        self.events.append(event)
        self._event_lost.clear()
        self._event_back.clear()
        logger.warning("%s", event)
        self._mesh = target
        self._clear()
        self.recovered_state = out
        return out

    def _clear(self) -> None:
        self._new_lost.clear()
        self._new_back.clear()
        self._cause = ""

    def _parsed(self, error: Exception) -> set[int]:
        """The device ids ``error_parser`` names (ids or devices) for ``error``: for a
        process's own failure in a reshard across processes, for the error every
        process of it has alike (``failure_on_every_process``), so that all decide
        alike."""
        error = getattr(error, "failure_on_every_process", error)
        found = self.error_parser(error)
        if found is None:  # a parser's "not a device loss", like an empty collection
            return set()
        wrong: Any = None
        try:
            named = set()
            for d in _listed(found):
                wrong = d
                named.add(device_id(d))
            return named
        except (TypeError, ValueError):
            what = found if wrong is None else wrong
            raise TypeError(
                "ElasticManager: error_parser must return a collection of device ids or "
                "devices (empty, or None: not a device loss); it returned "
                f"{'' if wrong is None else 'an item '}{type(what).__name__}: {what!r} for "
                f"{type(error).__name__}: {error}"
            ) from error

    def run_step(self, step_fn: StepFn, state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """Runs ``step_fn(state, mesh, *args, **kwargs)``, recovering from device loss.

        Pending device changes are applied first. When the step raises an error that
        ``error_parser`` maps to active devices, those devices are marked lost, the
        state is recovered onto the smaller mesh and the step is retried, at most
        ``max_retries`` times. Idle devices the error names (in a dropped slice) are
        marked lost too; an error that names no active device is raised unchanged.
        A device lost while the state moves (an error of the move that names devices
        not yet lost) counts the same: it is marked lost and the move tried again.

        Args:
          step_fn: returns ``(new_state, aux)``.
          state: the training state on ``self.mesh``.
          *args: passed on (e.g. the host batch, which ``step_fn`` shards on ``mesh``).
          **kwargs: passed on.

        Returns:
          ``(new_state, aux)`` from the successful attempt.

        Raises:
          RuntimeError: more than ``max_retries`` device losses in this step.
          DataLossError: a loss that destroyed the only copy of some state.
          ValueError: no mesh avoids the lost devices, or the state cannot be laid out
            on the mesh that does (its shape does not divide by the axis's new size:
            see ``allowed_sizes``); the state and the pending change are kept.
            After a device loss in this call, these errors have it as their
            ``__cause__``.
          TypeError: ``error_parser`` returned something other than ids or devices.
          Exception: any error of ``step_fn`` that is not a device loss, unchanged.
        """
        failures = 0
        failed: Exception | None = None  # the last device loss, which a retry follows
        while True:
            try:
                state = self.apply(state)
            except Exception as e:
                # A device lost while the state moves (the move's runtime error names
                # it): avoid it too, and move again. Anything else is the move's own
                # error (no mesh left, data loss), raised with the loss that led to it.
                lost = self._parsed(e) & (self._all.keys() - self._lost)
                if not lost:
                    if failed is not None and e is not failed:
                        raise e from failed
                    raise
                failures += 1
                self.mark_lost(lost, cause=f"{type(e).__name__}: {e}")
                self._give_up_after(failures, lost, e)
                failed = e
                continue
            try:
                out = step_fn(state, self._mesh, *args, **kwargs)
                # Device failures surface asynchronously; wait so they are caught here.
                out = jax.block_until_ready(out)
                self.recovered_state = None
                return out
            except Exception as e:
                active = {d.id for d in self.active_devices}
                named = self._parsed(e)
                lost = named & active
                # Idle devices of the full mesh (in a dropped slice) that the error names
                # are recorded too, so that no later grow puts the state back on them.
                idle = named & self._all.keys() - active
                if idle:
                    self.mark_lost(idle, cause=f"{type(e).__name__}: {e}")
                if not lost:
                    raise
                failures += 1
                # Recorded before giving up, too: the next apply must avoid them.
                self.mark_lost(lost, cause=f"{type(e).__name__}: {e}")
                self._give_up_after(failures, lost, e)
                failed = e

    def _give_up_after(self, failures: int, lost: set[int], error: Exception) -> None:
        """Raises once ``failures`` device losses exceed ``max_retries``."""
        if failures > self.max_retries:
            raise RuntimeError(
                f"ElasticManager: gave up after {self.max_retries} retries; the last "
                f"attempt lost devices {sorted(lost)} (lost so far: "
                f"{sorted(self._lost)}). Raise max_retries, or check the hardware"
            ) from error
