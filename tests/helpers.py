"""Shared test helpers: random meshes/specs/values and the numpy ground truth."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DTYPES = [
    "float32",
    "bfloat16",
    "float16",
    "float8_e5m2",
    "float4_e2m1fn",
    "int8",
    "int32",
    "uint8",
    "bool",
    "complex64",
    "int4",
    "key",
]
MEMORY_KINDS = ["device", "pinned_host", "unpinned_host"]


def factorizations(n: int, parts: int) -> list[tuple[int, ...]]:
    """All ordered ways to write ``n`` as a product of ``parts`` factors >= 1."""
    if parts == 1:
        return [(n,)]
    out = []
    for f in range(1, n + 1):
        if n % f == 0:
            out.extend((f, *rest) for rest in factorizations(n // f, parts - 1))
    return out


@st.composite
def meshes(draw: Any, devices: list[Any] | None = None, max_devices: int = 8) -> Mesh:
    """A mesh over a random ordered subset of the devices, with 1-3 axes."""
    pool = devices if devices is not None else jax.devices()[:max_devices]
    n = draw(st.integers(1, len(pool)))
    chosen = draw(st.permutations(pool))[:n]
    rank = draw(st.integers(1, 3))
    shape = draw(st.sampled_from(factorizations(n, rank)))
    names = tuple("xyz"[:rank])
    return Mesh(np.array(chosen).reshape(shape), names)


@st.composite
def specs(draw: Any, mesh: Mesh, ndim: int) -> PartitionSpec:
    """A random spec for a rank-``ndim`` array: entries None, one axis, or several."""
    free = list(mesh.axis_names)
    entries: list[Any] = []
    for _ in range(ndim):
        kind = draw(st.sampled_from(["none", "one", "many"]))
        if kind == "none" or not free:
            entries.append(None)
        elif kind == "one":
            a = draw(st.sampled_from(free))
            free.remove(a)
            entries.append(a)
        else:
            k = draw(st.integers(1, len(free)))
            axes = draw(st.permutations(free))[:k]
            for a in axes:
                free.remove(a)
            entries.append(tuple(axes))
    # Sometimes drop trailing entries (shorter specs are legal).
    cut = draw(st.integers(0, ndim))
    return PartitionSpec(*entries[:cut])


def shard_counts(sharding: NamedSharding, ndim: int) -> list[int]:
    counts = []
    spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
    for e in spec:
        axes = () if e is None else (e,) if isinstance(e, str) else tuple(e)
        counts.append(math.prod(sharding.mesh.shape[a] for a in axes))
    return counts


def random_values(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> Any:
    """Random host values of ``dtype`` (random bits for floats: NaNs included)."""
    if dtype == "key":
        return jax.random.split(
            jax.random.key(int(rng.integers(1 << 30))), math.prod(shape)
        ).reshape(shape)
    if dtype == "bool":
        return rng.integers(0, 2, shape).astype(bool)
    if dtype == "int4":
        return rng.integers(-8, 8, shape).astype(ml_dtypes.int4)
    if dtype == "float4_e2m1fn":  # every code, one per byte (the upper half unused)
        return rng.integers(0, 16, shape).astype(np.uint8).view(ml_dtypes.float4_e2m1fn)
    dt = np.dtype(jnp.dtype(dtype))
    raw = rng.integers(0, 256, math.prod(shape) * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def as_bits(a: Any) -> np.ndarray:
    """A byte-exact, comparable numpy form of any array (keys through their data)."""
    if isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
        a = jax.random.key_data(a)
    a = np.asarray(a)
    if a.dtype in (ml_dtypes.int4, ml_dtypes.int2):
        return a.astype(np.int8)
    if a.dtype == bool:
        return a.view(np.uint8)
    return (
        a.view(np.uint8)
        if a.dtype.itemsize == 1
        else a.view(f"u{a.dtype.itemsize}")
        if a.dtype.itemsize <= 8
        # (Each 16-byte element as two words, on a trailing axis: a 0-d array has no
        # axis for the view to double.)
        else np.ascontiguousarray(a)[..., np.newaxis].view(np.uint64)
    )


def pointers(a: jax.Array) -> dict[Any, int]:
    """Per device, the address of ``a``'s buffer there: equal pointers, same buffer."""
    return {s.device: s.data.unsafe_buffer_pointer() for s in a.addressable_shards}


def place(values: Any, sharding: Any) -> jax.Array:
    """Puts host values (or a key array) on ``sharding`` through a fresh XLA buffer.

    Where this JAX cannot compile a program with outputs in host memory (jax 0.10.0
    on CPU), the buffer is made in device memory and copied there by
    ``jax.device_put``: still fresh, as the library supports jax 0.10 and newer.
    """
    # (One module-level function: a new lambda per call compiled a program per call.)
    try:
        return jax.jit(identity, out_shardings=sharding)(values)
    except jax.errors.JaxRuntimeError:
        if sharding.memory_kind in (None, "device"):
            raise
        on_device = jax.jit(identity, out_shardings=sharding.with_memory_kind("device"))
        return jax.device_put(on_device(values), sharding)


def identity(v: Any) -> Any:
    """``v`` itself: one function for the tests' identity programs, which JAX then
    compiles once per sharding, not once per new lambda."""
    return v


def check_result(y: jax.Array, truth: Any, dst: Any) -> None:
    """Values, sharding and per-device shard placement, bit for bit."""
    assert y.shape == truth.shape
    want = as_bits(truth)
    np.testing.assert_array_equal(as_bits(y), want)
    index = dst.devices_indices_map(y.shape)
    if jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key):
        # JAX spells key arrays' specs inconsistently (jit and device_put disagree on
        # P() vs P(None,)) and indexes rank-0 key shards over their data: require an
        # equivalent sharding and the placement JAX itself gives for these keys.
        ref = place(truth, dst)
        assert y.sharding.is_equivalent_to(dst, y.ndim), f"sharding {y.sharding} !~ {dst}"
        index = {s.device: s.index for s in ref.addressable_shards}
    else:
        assert y.sharding == dst, f"sharding {y.sharding} != {dst}"
    seen = set()
    for shard in y.addressable_shards:
        assert shard.device in index, f"shard on unexpected device {shard.device}"
        assert shard.index == index[shard.device], (shard.index, index[shard.device])
        assert shard.data.sharding.memory_kind == dst.memory_kind
        np.testing.assert_array_equal(as_bits(shard.data), want[shard.index])
        seen.add(shard.device)
    assert seen == set(dst.addressable_devices)


def lower_bound_by_masks(shape: tuple[int, ...], itemsize: int, src: Any, dst: Any) -> int:
    """Independent lower bound with numpy masks: per destination shard, elements not
    held at the same (device, memory kind) by the source."""
    src_index = src.devices_indices_map(shape)
    total = 0
    for dev, idx in dst.devices_indices_map(shape).items():
        need = np.zeros(shape, bool)
        need[idx] = True
        if dev in src_index and src.memory_kind == dst.memory_kind:
            need[src_index[dev]] = False
        total += int(need.sum())
    return total * itemsize


def surviving_mask(shape: tuple[int, ...], sharding: Any, lost: Any) -> np.ndarray:
    """The elements of an array of ``shape`` that some device of ``sharding`` outside
    ``lost`` (device ids) holds: where ``False``, the data is lost."""
    mask = np.zeros(shape, dtype=bool)
    for d, index in sharding.devices_indices_map(shape).items():
        if d.id not in lost:
            mask[index] = True
    return mask


def failing_identity_after(monkeypatch: Any, ran: list[int]) -> Any:
    """Donating identities that run once, then raise (out of memory, as the copy of
    a buffer XLA does not own can); ``ran`` gets each run's array count. Returns the
    real ``prepare_donating_identity``."""
    from reshard import _compat

    real = _compat.prepare_donating_identity

    def prepare(arrays: list[jax.Array]) -> Any:
        run = real(arrays)

        def go() -> Any:
            ran.append(len(arrays))
            if len(ran) > 1:
                raise MemoryError("out of memory (injected)")
            return run()

        return go

    monkeypatch.setattr(_compat, "prepare_donating_identity", prepare)
    return real


def lossy_bf16_to_bits(real: Any) -> Any:
    """``real`` (the executors' ``to_bits``) made lossy for bfloat16, as a TPU's
    programs are for several narrow float types: every NaN becomes the canonical one.
    Installed in its place, it makes the programs and the exactness check that use it
    change bf16 data (see ``reshard._exact``)."""

    def to_bits(x: Any) -> Any:
        if x.dtype == jnp.bfloat16:
            x = jnp.where(jnp.isnan(x), jnp.array(jnp.nan, x.dtype), x)
        return real(x)

    return to_bits


class CompileCounter:
    """A ``jax.monitoring`` duration listener that counts XLA compilations."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, event: str, *args: Any, **kwargs: Any) -> None:
        if "backend_compile" in event:
            self.count += 1
