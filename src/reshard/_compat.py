"""Every use of a private JAX API, each with a fallback through public API.

A new JAX release that moves an internal must cost speed, never correctness: each
function below tries the fast internal path and falls back to a public equivalent
when the internal is missing or behaves differently. ``tests/test_compat.py`` checks
that both paths give the same result.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec, Sharding, SingleDeviceSharding

from . import _buffers, _programs


def _private(module: str, path: str) -> Any:
    """``module``'s attribute at dotted ``path`` (a private JAX API), or ``None`` where
    this JAX has no such thing: every caller then takes its public fallback."""
    try:  # pragma: no cover - exercised on whichever JAX is installed
        found: Any = importlib.import_module(module)
        for name in path.split("."):
            found = getattr(found, name)
        return found
    except Exception:  # pragma: no cover
        return None


_batched_device_put: Any = _private("jax._src.interpreters.pxla", "batched_device_put")
_ShapedArray: Any = _private("jax._src.core", "ShapedArray")
_update_dp_aval: Any = _private("jax._src.dispatch", "update_dp_aval")
_ArrayImpl: Any = _private("jax._src.array", "ArrayImpl")
_batched_copy: Any = _private(
    "jax._src.lib", "xla_client.batched_copy_array_to_devices_with_sharding"
)
_ALWAYS_COPY: Any = _private("jax._src.lib", "xla_client.ArrayCopySemantics.ALWAYS_COPY")
_backends_are_initialized: Any = _private("jax._src.xla_bridge", "backends_are_initialized")
_explicit_put_scope: Any = _private("jax._src.config", "explicit_device_put_scope")
_is_default_layout: Any = _private("jax._src.interpreters.pxla", "is_default_layout")
# A single-device array's own conversion to numpy (waiting for its data; no copy on
# CPU), where ``np.asarray`` ends up: (array, whether it copied).
_to_numpy: Any = _private("jax._src.array", "ArrayImpl._single_device_array_to_np_array_did_copy")

_distributed_state: Any = _private("jax._src.distributed", "global_state")

# Tests flip this to exercise the public fallbacks.
USE_PRIVATE = True


def array_type() -> Any:
    """The type of a concrete ``jax.Array`` holding data (not a tracer, not a key
    array), or None without the internals."""
    return _ArrayImpl if USE_PRIVATE else None


def distributed_client() -> Any:
    """The client of ``jax.distributed``'s coordination service (its key-value store:
    ``key_value_set``, ``blocking_key_value_get``, ...), or ``None`` where there is
    none (not initialised, or no such API in this JAX)."""
    if not USE_PRIVATE or _distributed_state is None:
        return None
    client = getattr(_distributed_state, "client", None)
    needed = ("key_value_set", "blocking_key_value_get", "key_value_delete")
    return client if all(hasattr(client, m) for m in needed) else None


def backends_initialized() -> bool | None:
    """Whether JAX has made its backends already (then the CPU device count and the
    collectives can no longer be set); ``None`` where JAX does not tell (no public
    API does), and the caller cannot check."""
    if not USE_PRIVATE or _backends_are_initialized is None:
        return None
    return bool(_backends_are_initialized())


@contextlib.contextmanager
def moving_bytes() -> Iterator[None]:
    """The JAX state an executor runs under: that of ``jax.device_put``, whatever the
    caller's context says about computations.

    - The executors' small programs (cut, assemble, copy) run on the devices of their
      own arguments: a mesh set with ``jax.set_mesh`` would make ``jax.jit`` refuse
      every argument on fewer devices, so it is cleared meanwhile.
    - They reinterpret bits (``bitcast_convert_type``): with ``jax.debug_nans`` or
      ``jax.debug_infs`` on, a NaN or Inf in the data would raise, though a move
      never computes with values; both are off meanwhile.
    - Under ``jax.disable_jit`` they would run op by op, and a donating identity
      would donate nothing: jit stays on meanwhile.
    - Host buffers put on devices count as explicit transfers, as ``jax.device_put``'s
      do, for ``jax.transfer_guard``.
    """
    with contextlib.ExitStack() as stack:
        if USE_PRIVATE and _explicit_put_scope is not None:
            stack.enter_context(_explicit_put_scope())
        if getattr(jax.config, "jax_debug_nans", False):
            stack.enter_context(jax.debug_nans(False))
        if getattr(jax.config, "jax_debug_infs", False):
            stack.enter_context(jax.debug_infs(False))
        if getattr(jax.config, "jax_disable_jit", False):
            # Op by op, a donating identity donates nothing (and the programs crawl).
            stack.enter_context(jax.disable_jit(False))
        if not jax.sharding.get_abstract_mesh().empty:
            # (set_mesh refuses inside a trace, where the caller refuses tracers anyway)
            with contextlib.suppress(ValueError):
                stack.enter_context(jax.set_mesh(None))
        yield


def bookkeeping() -> contextlib.AbstractContextManager[Any]:
    """A context for the collective protocol's own few bytes, put on devices or read back
    whatever ``jax.transfer_guard`` the caller set: the status every process sums, the
    filler a process sends where it has no data, and the all-gather of the checks.

    None of them is the caller's data, and each process must be able to send them for
    the others not to wait for it: a guard set on only some processes refuses their
    first transfer of data, and they then report that failure in step, through these
    (``_collective_host.run_host_packed``), instead of leaving their peers in a
    collective until the watchdog."""
    return jax.transfer_guard("allow")


# The types a program traced with jax_enable_x64 off cannot take whole.
_WIDE = frozenset(np.dtype(n) for n in ("int64", "uint64", "float64", "complex128"))


def wide_types(dtypes: Iterable[Any]) -> tuple[np.dtype, ...]:
    """Those of ``dtypes`` that programs traced with ``jax_enable_x64`` off cannot take
    whole (the 64-bit types), once each."""
    return tuple({d for d in dtypes if isinstance(d, np.dtype) and d in _WIDE})


def wide_types_whole(dtypes: Iterable[Any]) -> contextlib.AbstractContextManager[Any]:
    """A context in which programs take arrays of ``dtypes`` whole.

    Arrays of 64-bit types exist while ``jax_enable_x64`` is off: made under
    ``jax.enable_x64``, or before the flag was turned off. A program traced with the
    flag off reads such an argument as its 32-bit counterpart, and every element keeps
    only its low 32 bits (``jax.device_put``'s own relayout does that, jax 0.10);
    ``jax.make_array_from_single_device_arrays`` refuses their shards. PjRt's own
    copies take them whole.

    Args:
      dtypes: the element types of the arrays the programs move.

    Returns:
      ``jax.enable_x64(True)`` where one of ``dtypes`` is a 64-bit type and the flag is
      off, else a context that changes nothing. Host values put meanwhile must be typed
      as the caller's setting says (``jax.enable_x64(x64)`` around them).
    """
    if not jax.enable_x64.value and wide_types(dtypes):
        return jax.enable_x64(True)
    return contextlib.nullcontext()


def ordered_devices(sharding: Sharding) -> tuple[Any, ...]:
    """All devices of ``sharding`` in its own fixed order (the device assignment)."""
    if USE_PRIVATE:
        devs = getattr(sharding, "_device_assignment", None)
        if devs is not None:
            return tuple(devs)
    return tuple(sorted(sharding.device_set, key=lambda d: d.id))


def _assignment_known(sharding: Sharding) -> bool:
    """Whether ``ordered_devices(sharding)`` is JAX's own device assignment, the order
    of an array's ``_arrays`` and of what ``batched_device_put``/``batched_copy``
    (``_skip_checks``) take. Without it (the attribute gone) that order is a guess,
    and the private paths that trust it would put buffers on the wrong positions."""
    return getattr(sharding, "_device_assignment", None) is not None


def addressable_devices(sharding: Sharding) -> tuple[Any, ...]:
    """The devices of ``sharding`` this process can address, in ``ordered_devices`` order."""
    return _addressable_devices(sharding, USE_PRIVATE)


@functools.lru_cache(maxsize=4096)
def _addressable_devices(sharding: Sharding, use_private: bool) -> tuple[Any, ...]:
    # Memoised: shardings are hashable and this runs for every array of every call.
    del use_private  # part of the cache key only
    me = jax.process_index()
    return tuple(d for d in ordered_devices(sharding) if d.process_index == me)


def spec_entries(spec: PartitionSpec) -> tuple[Any, ...]:
    """A ``PartitionSpec``'s per-dimension entries. In jax 0.10 a spec may also carry
    ``reduced``/``unreduced`` axes, and then refuses to be iterated or indexed
    ("Using *pspec is dangerous"); its ``partitions`` are the entries."""
    partitions = getattr(spec, "partitions", None)
    return tuple(spec) if partitions is None else tuple(partitions)


def with_entries(spec: PartitionSpec, entries: Sequence[Any]) -> PartitionSpec:
    """``spec`` with other per-dimension entries, its ``reduced``/``unreduced`` kept."""
    if hasattr(spec, "update") and hasattr(spec, "partitions"):
        return spec.update(partitions=tuple(entries))  # type: ignore[no-any-return]
    return PartitionSpec(*entries)


def unreduced_axes(sharding: Sharding) -> frozenset[Any]:
    """The mesh axes a NamedSharding holds partial sums over (``unreduced``): its
    devices along them hold different addends of one value, not copies of it."""
    spec = getattr(sharding, "spec", None)
    return frozenset(getattr(spec, "unreduced", None) or ())


def reduced_axes(sharding: Sharding) -> frozenset[Any]:
    """The mesh axes a NamedSharding marks ``reduced``: copies of one value along
    them, whose gradients are to be summed."""
    spec = getattr(sharding, "spec", None)
    return frozenset(getattr(spec, "reduced", None) or ())


# jaxlib (0.10.2) makes an array's list of single-device arrays (``_arrays``, which
# ``addressable_shards`` reads) when first asked for, and two threads asking at once
# can leave the array with a wrong list for good: measured with 6 shards, 2 of them or
# all 6 twice (12). The collective executor reads its sources' shards from its copy
# threads, and its user's threads may reshard one array at once: every read here holds
# this lock. (Re-entrant: a finalizer run by the garbage collector inside may read too.)
_shards_lock = threading.RLock()


def device_buffers(x: jax.Array) -> dict[int, jax.Array]:
    """Map from device id to the single-device array ``x`` holds there (this process).
    Safe to call from several threads at once (see ``_shards_lock``)."""
    with _shards_lock:
        if USE_PRIVATE and _assignment_known(x.sharding):
            arrays = getattr(x, "_arrays", None)
            if arrays is not None:
                devs = addressable_devices(x.sharding)
                if len(devs) == len(arrays):
                    return {d.id: a for d, a in zip(devs, arrays, strict=True)}
        return {s.device.id: s.data for s in x.addressable_shards}


def addressable_shards(x: jax.Array) -> list[Any]:
    """``x.addressable_shards`` (with each shard's device and index), read under the
    lock of ``device_buffers``."""
    with _shards_lock:
        return list(x.addressable_shards)


def buffer_keys(x: jax.Array) -> dict[tuple[int, int], jax.Array]:
    """This process's buffers of ``x`` by ``(device id, address)``: what tells two
    arrays that share a buffer (one handed over to the other unchanged). Buffers of
    several devices may have one address (on CPU, zero-copy views of one host array),
    hence the device; two buffers of one device at one address are taken for one
    (the worst that does is leave one of them unfreed)."""
    return {(d, b.unsafe_buffer_pointer()): b for d, b in device_buffers(x).items()}


def empty_as(buf: jax.Array, shape: tuple[int, ...], memory_kind: str | None = None) -> jax.Array:
    """``buf`` as a ``shape``-shaped shard (in ``memory_kind``, if given) where it has
    no elements: XLA may give every device the whole of an empty array ((4, 0) where
    shards are (2, 0)), in jit outputs and the outputs of a donating identity alike,
    and the latter in device memory. There are no bytes to move, only a shape and a
    memory kind to set right."""
    if buf.size != 0:
        return buf
    if buf.shape != shape:
        buf = buf.reshape(shape)  # in device memory, from unpinned host memory
    if memory_kind is not None and buf.sharding.memory_kind != memory_kind:
        (device,) = buf.sharding.device_set
        buf = jax.device_put(buf, SingleDeviceSharding(device, memory_kind=memory_kind))
    return buf


def assemble(
    shape: tuple[int, ...],
    dtype: Any,
    sharding: Sharding,
    buffers: Sequence[Any],
    devices: Sequence[Any],
) -> jax.Array:
    """Builds a sharded array from one buffer per addressable device.

    ``buffers`` may be numpy arrays (placed zero-copy on CPU when 64-byte aligned) or
    single-device ``jax.Array``s already on their device (used as they are).
    """
    aval = (
        device_put_aval(shape, dtype, sharding)
        if USE_PRIVATE
        and _batched_device_put is not None
        # (Without the explicit scope its host buffers would be implicit transfers,
        # logged or refused by jax.transfer_guard: jax.device_put's are explicit.)
        and _explicit_put_scope is not None
        and not jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)
        and _assignment_known(sharding)
        else None
    )
    # (Without device_put's aval, the public path's is better than a bare ShapedArray:
    # make_array_from_single_device_arrays gives it the sharding's mesh and memory.)
    if aval is not None:
        try:
            return _batched_device_put(aval, sharding, list(buffers), list(devices))
        except Exception:  # pragma: no cover - fall through to the public path
            pass
    out = place_host_buffers(buffers, devices, sharding.memory_kind)
    return jax.make_array_from_single_device_arrays(shape, sharding, out, dtype=dtype)


def device_put_aval(
    shape: tuple[int, ...], dtype: Any, sharding: Sharding, weak_type: bool = False
) -> Any:
    """The abstract value ``jax.device_put`` gives an array of ``shape``/``dtype`` put on
    ``sharding`` (its mesh and spec, its memory space; ``None`` without the internals).

    JAX reads it back as ``x.aval`` and, for shardings other than ``NamedSharding``,
    as ``jax.typeof(x)``: that decides, for one, where ``jax.jit`` puts results made
    from the array (host memory stays host memory). Memoised: it costs ~8 us.
    """
    if not USE_PRIVATE or _update_dp_aval is None or _ShapedArray is None:
        return None
    return _device_put_aval(shape, dtype, sharding, weak_type)


@functools.lru_cache(maxsize=4096)
def _device_put_aval(
    shape: tuple[int, ...], dtype: Any, sharding: Sharding, weak_type: bool
) -> Any:
    try:
        return _update_dp_aval(_ShapedArray(shape, dtype, weak_type=weak_type), sharding)
    except Exception:  # pragma: no cover - no aval to set
        return None


def finish(x: jax.Array, aval: Any, fresh: bool) -> jax.Array:
    """``x`` committed and with abstract value ``aval`` (from ``device_put_aval``) over
    the same buffers, as ``jax.device_put`` returns it: arrays made by the executors
    carry their source's mesh, no memory space, or no weak type (``jnp.full(shape,
    2.0)``, which must not promote a bfloat16 it meets), and PjRt's copy of an
    uncommitted input is uncommitted (a later ``jax.jit`` would move it to device 0).

    ``fresh``: ``x`` was made for this call alone, so its ``aval`` may be set in place
    (~0.05 us, against ~4 us for a new array object).

    Without the internals ``x`` comes back over the same buffers, committed, with the
    abstract value it has: JAX has no public way to mark an array weakly typed (nor,
    for a ``SingleDeviceSharding`` in a host memory kind, to give it a host memory
    space), the fallbacks that change a result.
    """
    if aval is None or _ArrayImpl is None:
        # Without the internals: committed through jax.device_put to the array's own
        # sharding (zero-copy: the new array holds the same buffers), else a later
        # jax.jit would move an uncommitted copy (PjRt's batched copy makes those) to
        # the default device; the aval set in place where there is one to set.
        if not x.committed:
            x, fresh = jax.device_put(x, x.sharding), True
        if aval is not None and x.aval != aval and fresh:
            with contextlib.suppress(Exception):
                x.aval = aval  # type: ignore[misc]
        return x
    if x.committed and x.aval == aval:
        return x
    if fresh and x.committed:
        try:
            x.aval = aval  # type: ignore[misc]
            return x
        except Exception:  # pragma: no cover - make a new array object instead
            pass
    try:
        return _ArrayImpl(  # type: ignore[no-any-return]
            aval,
            x.sharding,
            x._arrays,  # type: ignore[attr-defined]
            committed=True,
            _skip_checks=True,
        )
    except Exception:  # pragma: no cover - keep the array as it is
        return x


def in_default_layout(x: jax.Array) -> jax.Array:
    """``x``, or a copy of it in its devices' default layout where its buffers have
    another one (``jax.jit(..., out_shardings=Format(Layout(...), s))`` makes such
    arrays).

    The executors copy and cut shards and put arrays together from buffers of several
    origins; with a custom layout that goes wrong: jax 0.10 on CPU copies such a buffer
    to another device (``jax.device_put``, PjRt's batched copy) into one that compiled
    programs then misread, and an array put together from buffers of two layouts is
    read by ``jax.jit`` in the layout of its first. A default-layout copy first, made by
    a program (on the array's own devices, device memory only: no program runs on host
    memory kinds, left as they are), keeps every value exact. Without the internals
    every array whose layout is not plainly row-major is copied: slower, never wrong.
    """
    sharding = x.sharding
    if sharding.memory_kind not in (None, "device") or x.size == 0:
        return x
    if not sharding.is_fully_addressable and not sharding.addressable_devices:
        return x  # another process's array: its program is theirs to run
    try:
        # (The buffers' own layout is read first: ~0.2 us, against ~1.2 us for
        # ``x.format``, and this runs for every array of every call.)
        pjrt = getattr(x, "_pjrt_layout", None) if USE_PRIVATE else None
        if pjrt is not None and _pjrt_layout_is_default(pjrt, sharding, x.aval):
            return x
    except Exception:  # pragma: no cover - the public path below
        pass
    try:
        layout = x.format.layout  # type: ignore[attr-defined]
    except Exception:  # pragma: no cover - no layout to read: nothing to do
        return x
    if layout is None or _layout_is_default(layout, sharding, jax.typeof(x)):
        return x
    key = ("in_default_layout", jax.typeof(x), x.sharding, layout)

    def build() -> Any:
        from ._local_executor import from_bits, to_bits  # (that module imports this one)

        # As bits (see ``bits_dtype``), so that no NaN is changed on the way.
        return jax.jit(lambda a: from_bits(jnp.copy(to_bits(a)), a.dtype), out_shardings=x.sharding)

    return _programs.shared(key, build)(x)  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=4096)
def _pjrt_layout_is_default(pjrt: Any, sharding: Sharding, aval: Any) -> bool:
    from jax._src.layout import Layout

    return _layout_is_default(Layout.from_pjrt_layout(pjrt), sharding, aval)


def _layout_is_default(layout: Any, sharding: Sharding, aval: Any) -> bool:
    if USE_PRIVATE and _is_default_layout is not None:
        try:
            return bool(_is_default_layout(layout, sharding, aval))
        except Exception:  # pragma: no cover - the public test below
            pass
    order = getattr(layout, "major_to_minor", None)
    return order == tuple(range(len(aval.shape))) and not getattr(layout, "tiling", ())


def sharding_of(v: Any, what: str) -> Any:
    """``v.sharding``. JAX cannot read it for a key array made on key data whose spec
    has reduced axes (jax 0.10: "Using pspec[...] is dangerous"): a ``ValueError``
    naming ``what`` (the leaf) and the way round instead."""
    try:
        return v.sharding
    except ValueError as e:
        if not jax.dtypes.issubdtype(getattr(v, "dtype", None), jax.dtypes.prng_key):
            raise
        raise ValueError(
            f"{what}: JAX cannot read this key array's sharding (its key data's spec has "
            "reduced axes), nor can jax.device_put or jax.random.key_data take it; move "
            "the key data it was made from (the array given to jax.random.wrap_key_data) "
            "and wrap the result"
        ) from e


def check_shardings_readable(tree: Any) -> None:
    """``sharding_of`` for every key array of ``tree``, by its leaf path: for callers
    that read leaves' shardings where no path is at hand."""
    for path, v in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if isinstance(v, jax.Array) and jax.dtypes.issubdtype(v.dtype, jax.dtypes.prng_key):
            sharding_of(v, f"leaf {jax.tree_util.keystr(path) or '<root>'}")


def may_donate(a: jax.Array) -> bool:
    """Whether a program may take ``a`` and donate it (``donating_identity``).

    Yes in device memory. Never in ``unpinned_host``, where XLA runs nothing. In
    ``pinned_host`` only where the abstract value says host memory too: jax 0.10 gives
    the outputs of ``jax.jit`` on a ``SingleDeviceSharding`` in ``pinned_host`` a
    device memory space, and a program donating such an array aborts the process.
    """
    kind = a.sharding.memory_kind
    if kind in (None, "device"):
        return True
    space = getattr(getattr(a, "aval", None), "memory_space", None)
    return kind == "pinned_host" and getattr(space, "name", None) == "Host"


def donating_identity(arrays: list[jax.Array]) -> list[jax.Array]:
    """``arrays`` on new handles over the same buffers: a jitted identity that donates
    its arguments, so XLA aliases every output to its input buffer. The arguments must
    share one device assignment, order included (one jit call), and no buffer."""
    return prepare_donating_identity(arrays)()


def prepare_donating_identity(arrays: list[jax.Array]) -> Callable[[], list[jax.Array]]:
    """``donating_identity(arrays)`` in two steps: compiles its program now (nothing is
    donated) and returns the call that runs it. A caller donating on several device
    sets (one call each) compiles every program first, so that a failure to build one
    comes before any input is consumed; what can still fail after the first donation
    is running an identity, which allocates nothing where XLA takes the donation, but
    copies a buffer XLA does not own (a CPU buffer adopted from numpy), and may run
    out of memory there. Callers copy such buffers of the CPU executors' outputs
    beforehand (``_buffers.lease_test``); a user's own zero-copy arrays stay at risk.

    One jitted function per signature (avals and shardings), in the bounded cache of
    compiled programs (``_programs``): one jitted function for everything would keep
    an executable for every signature it ever saw."""
    key = ("donating_identity", tuple((jax.typeof(a), a.sharding) for a in arrays))
    fn = _programs.shared(key, lambda: jax.jit(lambda xs: xs, donate_argnums=0))
    # Compiled here; the call below finds the executable in jit's own cache. (Not
    # through the compiled object, whose stricter check refuses arguments in a layout
    # jit's call accepts: 4-bit arrays on CPU, jax 0.10.)
    fn.lower(arrays).compile()
    return lambda: fn(arrays)  # type: ignore[no-any-return]


def with_buffers(x: jax.Array, buffers: Sequence[jax.Array]) -> jax.Array:
    """``x`` (its abstract value, sharding, committed) over other single-device
    ``buffers``, given in the order of ``device_buffers(x)``."""
    if USE_PRIVATE and _ArrayImpl is not None:
        try:
            return _ArrayImpl(  # type: ignore[no-any-return]
                x.aval, x.sharding, list(buffers), committed=True, _skip_checks=True
            )
        except Exception:  # pragma: no cover - the public path below
            pass
    y = jax.make_array_from_single_device_arrays(x.shape, x.sharding, list(buffers))
    return finish(y, x.aval, fresh=True)


def copy_shards(xs: Sequence[jax.Array], shardings: Sequence[Sharding]) -> list[jax.Array]:
    """Copies every array to its sharding shard by shard, in one batched call: the
    shard at position ``k`` of an array's device list goes to the device at position
    ``k`` of its new sharding's (device to device; PjRt's own copy).

    Only for arrays whose new sharding gives every position the same index as the old
    one, on other devices or in another memory kind: the caller checks that. The
    public fallback, ``jax.device_put``, takes the same path where it sees the
    shardings as equal, and is otherwise still correct (slower).
    """
    if not xs:
        return []
    # Each distinct sharding object once: a tree's arrays share a few of them.
    targets = {id(s): s for s in shardings}
    if (
        USE_PRIVATE
        and _batched_copy is not None
        # (Without the explicit scope its copies would be implicit transfers, logged or
        # refused by jax.transfer_guard: jax.device_put's are explicit.)
        and _explicit_put_scope is not None
        and all(_assignment_known(s) for s in targets.values())
        and all(_assignment_known(s) for s in {id(x.sharding): x.sharding for x in xs}.values())
    ):
        try:
            lists = {k: s._internal_device_list.addressable_device_list for k, s in targets.items()}
            devices = [lists[id(s)] for s in shardings]
            return list(_batched_copy(list(xs), devices, list(shardings), [_ALWAYS_COPY] * len(xs)))
        except Exception:  # pragma: no cover - fall through to the public path
            pass
    return list(jax.device_put(list(xs), list(shardings), may_alias=False))


def fresh_copies(xs: Sequence[jax.Array]) -> list[jax.Array]:
    """Copies of ``xs`` in new buffers, each on its own sharding (one batched call)."""
    if not xs:
        return []
    return list(jax.device_put(list(xs), [x.sharding for x in xs], may_alias=False))


def new_handles(bufs: Sequence[jax.Array]) -> list[jax.Array]:
    """New single-device arrays with the data of ``bufs``, whose arrays are about to be
    deleted: over the same memory where it is host memory a CPU executor filled and
    still holds on lease (an earlier reshard's output: the new array keeps the lease,
    nothing is copied or allocated), else copies: also where the memory is part of a
    block carved for several small shards, which the new array would keep whole,
    shards that moved away included. (A donated output of an earlier reshard kept in
    place was copied whole.)"""
    spans = [
        (b.unsafe_buffer_pointer(), b.size * np.dtype(b.dtype).itemsize)
        if platform_of(b) == "cpu" and whole_bytes(b.dtype)
        else (0, 1 << 62)  # (no lease holds that)
        for b in bufs
    ]
    views = _buffers.POOL.views_of(spans)
    over = [i for i, v in enumerate(views) if v is not None]
    out: list[Any] = list(bufs)
    if over:  # (no bytes move: nothing for a transfer guard to refuse)
        with jax.transfer_guard_host_to_device("allow"):
            placed = jax.device_put(
                [views[i].view(np.dtype(bufs[i].dtype)).reshape(bufs[i].shape) for i in over],  # type: ignore[union-attr]
                [bufs[i].sharding for i in over],
                may_alias=True,
            )
        for i, p in zip(over, placed, strict=True):
            out[i] = p
    rest = [i for i, v in enumerate(views) if v is None]
    if rest:
        for i, c in zip(rest, fresh_copies([bufs[i] for i in rest]), strict=True):
            out[i] = c
    return out


def whole_bytes(dtype: Any) -> bool:
    """Whether elements of ``dtype`` take whole bytes (not int4, float4, ...)."""
    dt = np.dtype(dtype)
    if jax.numpy.issubdtype(dt, jax.numpy.integer):
        return bool(jax.numpy.iinfo(dt).bits >= 8)
    if jax.numpy.issubdtype(dt, jax.numpy.floating):
        return bool(jax.numpy.finfo(dt).bits >= 8)
    return True


def platform_of(x: jax.Array) -> str:
    """The platform of the devices ``x`` is on (one per array)."""
    device: Any = next(iter(x.sharding.device_set))
    return str(device.platform)


def host_view(x: jax.Array) -> np.ndarray:
    """A single-device array's data in host memory: on CPU a view of the buffer itself
    (no copy); elsewhere a copy made by an explicit transfer (``jax.device_get``, which
    ``jax.transfer_guard`` allows where it refuses implicit ones).

    On CPU, numpy's own types come through the buffer protocol (~4 us); for the types
    it does not know (bfloat16, the float8s, int4: ``ml_dtypes``, kind ``V``), which the
    buffer protocol cannot describe, ``np.asarray`` takes JAX's ``__array__``, whose
    Python layers took 13-130 us per bfloat16 shard here, so this calls the conversion
    they end in directly (~8 us; read-only, as there). A relayout of a model across
    processes takes hundreds of such views per call."""
    if platform_of(x) == "cpu":
        return cpu_view(x)
    return np.asarray(jax.device_get(x))


def cpu_view(x: jax.Array) -> np.ndarray:
    """``host_view`` of a single-device array known to be on a CPU device. (A deleted
    array goes to ``np.asarray``, which raises JAX's error.)"""
    if (
        x.dtype.kind == "V"
        and USE_PRIVATE
        and _to_numpy is not None
        and type(x) is _ArrayImpl
        and not x.is_deleted()
    ):
        view: np.ndarray = _to_numpy(x)[0]
        view.flags.writeable = False
        return view
    return np.asarray(x)


def place_host_buffers(
    buffers: Sequence[Any], devices: Sequence[Any], memory_kind: str | None
) -> list[Any]:
    """Puts the numpy buffers among ``buffers`` on their devices in one batched call
    (zero-copy on CPU when aligned); ``jax.Array``s are kept as they are."""
    out: list[Any] = list(buffers)
    pending = [i for i, b in enumerate(out) if not isinstance(b, jax.Array)]
    if pending:
        placed = jax.device_put(
            [out[i] for i in pending],
            [
                jax.sharding.SingleDeviceSharding(devices[i], memory_kind=memory_kind)
                for i in pending
            ],
            may_alias=True,
        )
        for i, arr in zip(pending, placed, strict=True):
            out[i] = arr
    return out


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised numpy array whose data starts on an ``align``-byte boundary.

    XLA's CPU client adopts such a buffer without copying (``may_alias``), so a
    destination shard written here reaches JAX with one copy per byte in total.
    """
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = (-raw.ctypes.data) % align
    return raw[offset : offset + nbytes].view(dtype).reshape(shape)
