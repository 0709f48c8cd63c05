"""Which element types compiled programs carry bit for bit, per platform.

A move must deliver every bit it was given: NaN payloads and signs, signed zeros,
subnormals. The executors' compiled programs (cut, assemble, copy, the device-packed
collective program) hold floats as unsigned integers of their width inside
(``_local_executor.to_bits``) and take and give them in their own type at the
program's edges. That is exact on CPU, but not everywhere: on a TPU v5e (jax 0.10.2)
a program whose input or output is ``float16``, ``float8_e4m3fn``, ``float8_e4m3`` or
``float8_e3m4`` changes some of their values on the way in or out, even a plain
``jax.jit(lambda a: a)`` (NaNs made canonical, for example); ``bfloat16`` and
``float8_e5m2`` survive a plain copy there, but not the bitcasts and updates of the
cut and assemble programs; PjRt's own transfers (``jax.device_put`` between devices
and memory kinds, ``jax.device_get``) keep every type (``docs/accelerators.md``).
Which types are affected depends on the chip and the compiler, so it is not written
down here but measured: the first time a type is to enter a program on a platform,
``programs_keep_bits`` runs the executors' programs in small on every bit pattern of
the type (random ones for wider types) and compares the bits. Types
that fail are moved without programs: whole shards by PjRt, device to device; shards
cut or assembled from pieces through host memory (exact, slower).

Integers and booleans are not checked: programs move them as they are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import _compat

# (platform, device kind, dtype name, only copies) -> whether programs keep every bit.
_known: dict[tuple[str, str, str, bool], bool] = {}
_lock = threading.Lock()


def _probe_values(dtype: np.dtype) -> np.ndarray:
    """Every bit pattern of ``dtype`` (types narrower than a byte: each of their codes;
    4 and 8 bytes: a fixed random sample led by the special patterns), as a 2-d
    array."""
    if dtype.itemsize == 1:
        bits = jnp.finfo(dtype).bits if jnp.issubdtype(dtype, jnp.floating) else 8
        codes = np.arange(1 << bits, dtype=np.uint8)
        return np.tile(codes, 4096 >> bits).reshape(16, -1).view(dtype)
    if dtype.itemsize == 2:
        return np.arange(1 << 16, dtype=np.uint16).reshape(256, 256).view(dtype)
    width = dtype.itemsize // 2 if dtype.kind == "c" else dtype.itemsize
    unsigned = np.dtype(f"u{width}")
    n, mant = 8 * width, {4: 23, 8: 52}[width]
    sign, exp = 1 << (n - 1), ((1 << (n - 1 - mant)) - 1) << mant
    # zeros, subnormals, infinities and NaNs (quiet or not, with payloads) of either sign
    special = [0, 1, 2, mant, exp, exp | 1, exp | (1 << (mant - 1)), exp | 12345, (1 << n) - 1]
    special += [v | sign for v in special]
    rng = np.random.default_rng(0)
    raw = rng.integers(0, (1 << n) - 1, size=1 << 14, dtype=unsigned, endpoint=True)
    raw[: len(special)] = np.array(special, dtype=unsigned)
    return raw.reshape(128, -1).view(dtype)


def _raw(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return (
        a.view(np.dtype(f"u{a.dtype.itemsize}"))
        if a.dtype.itemsize in (1, 2, 4, 8)
        else a.view(np.uint8)
    )


def _programs_in_small(
    host: np.ndarray, only_copies: bool = False
) -> list[tuple[Callable[..., jax.Array], list[np.ndarray], np.ndarray]]:
    """The executors' programs in small, as ``(program, inputs, expected output)``:
    the local executor's cut, assemble and copy programs (``_local_executor``), each
    compiled on its own with its own inputs, as the executor runs them, and what the
    device-packed collective program does with offsets only known when it runs (see
    ``_collective_device``). Compilers treat bitcasts next to slicing and updating
    differently in each, and fuse what one program holds, so each is checked as it
    runs (on a TPU v5e, ``float8_e5m2`` came back changed from an assemble program
    fed a separate cut, but not from a cut and an assemble in one program). With
    ``only_copies``, the copy program alone."""
    from . import _local_executor as local  # (that module imports this one)

    shape, dtype = host.shape, host.dtype
    rows, width = shape
    half = width // 2
    left = ((0, rows), (0, half))
    right = ((0, rows), (half, width))
    cuts = local._Static(((left, shape, str(dtype)),))
    outputs = local._Static(
        ((shape, dtype, (("recv", left, None), ("local", right + right, shape))),)
    )

    def moved(x: jax.Array, at: jax.Array) -> jax.Array:
        bits = local.to_bits(x)
        # (Constant starts as 32-bit integers, as there: a Python int is a 64-bit one
        # with jax_enable_x64 on, and dynamic_slice refuses starts of mixed types.)
        zero = np.int32(0)
        pieces = [jax.lax.dynamic_slice(bits, (zero, at[k]), (rows, half)) for k in (1, 0)]
        both = jnp.concatenate(pieces, axis=1)
        out = jax.lax.full(bits.shape, 0, bits.dtype)
        out = jax.lax.dynamic_update_slice(out, both[:, half:], (zero, at[0]))
        out = jax.lax.dynamic_update_slice(out, both[:, :half], (zero, at[1]))
        return local.from_bits(out, x.dtype)

    piece = np.ascontiguousarray(host[:, :half])
    copy = (lambda x: local._copies(x)[0], [host], host)
    if only_copies:
        return [copy]
    return [
        (lambda x: local._cut(cuts, x)[0], [host], piece),
        (lambda p, x: local._build(outputs, p, x)[0], [piece, host], host),
        copy,
        (moved, [host, np.array([0, half], np.int32)], host),
    ]


def _check(device: Any, dtype: np.dtype, only_copies: bool = False) -> bool:
    on = jax.sharding.SingleDeviceSharding(device)
    # (A measurement of the platform, not a move of the caller's: a transfer guard set
    # by the caller would refuse its puts, and the answer would stay "inexact".)
    with _compat.moving_bytes(), jax.transfer_guard("allow"):
        for program, inputs, expected in _programs_in_small(_probe_values(dtype), only_copies):
            got = jax.jit(program)(*(jax.device_put(v, on) for v in inputs))
            if not np.array_equal(_raw(np.asarray(jax.device_get(got))), _raw(expected)):
                return False
    return True


def needs_check(dtype: Any) -> bool:
    """Whether ``dtype`` is one that programs might change (floating and complex)."""
    dtype = np.dtype(dtype)
    return bool(jnp.issubdtype(dtype, jnp.inexact))


def programs_keep_bits(device: Any, dtype: Any, *, only_copies: bool = False) -> bool:
    """Whether compiled programs on ``device``'s platform carry every bit pattern of
    ``dtype`` exactly (measured once per platform, device kind and type; see the
    module's docstring): all the executors' programs, or with ``only_copies`` the
    program that copies shards in place (on a TPU v5e it keeps ``bfloat16``, which
    the others do not). Where the check itself fails to run, the answer is no: the
    exact path is the safe one."""
    dtype = np.dtype(dtype)
    if not needs_check(dtype):
        return True
    key = (device.platform, str(getattr(device, "device_kind", "")), dtype.name, only_copies)
    found = _known.get(key)
    if found is not None:
        return found
    with _lock:
        found = _known.get(key)
        if found is None:
            try:
                found = _check(device, dtype, only_copies)
            except Exception:  # noqa: BLE001 - a type the platform cannot compile with
                found = False
            _known[key] = found
    return found


def inexact_types(devices: Any, dtypes: Any) -> set[str]:
    """The names of those ``dtypes`` that programs on the platform of ``devices`` (one
    plan is on one platform) do not carry exactly. Measured on a device of this
    process: across processes, each measures its own, and all agree where their
    devices are of one kind (the collective executor checks that they do)."""
    devices = list(devices)
    if not devices:
        return set()
    me = jax.process_index()
    local = [d for d in devices if d.process_index == me]
    device = local[0] if local else jax.local_devices(backend=devices[0].platform)[0]
    kinds = {np.dtype(dt) for dt in dtypes}
    return {dt.name for dt in kinds if not programs_keep_bits(device, dt)}
