"""reshard on an accelerator: one self-contained check of the accelerator paths.

Run on a machine with a GPU or TPU, one process, from the repository root:

    PYTHONPATH=src:$PYTHONPATH python benchmarks/gpu_check.py   # ~4 minutes on one TPU v5e chip

Its results on a TPU v5e (one chip, 2026-12-05) are in docs/accelerators.md.

It also runs on CPU (set XLA_FLAGS=--xla_force_host_platform_device_count=8 for 8
devices, or leave it unset for 1). It checks, bit for bit against numpy:

- memory kinds device <-> pinned_host (and unpinned_host where the device has it),
- the local *device* executor (``executor="device"``; ``auto`` picks it off CPU),
- the *collective* executor in one process, as it chooses and forced device-packed or
  host-packed (``PACK_ON_HOST``),
- every bit pattern of each narrow float type (bf16, f16, fp8s) through each of them,
  and which types this platform's programs carry exactly (``reshard._exact``),
- the device executor's programs at 256 MiB for the types judged so (group ``scale``:
  whether a program keeps bits can depend on sizes),
- donation (inputs deleted; >= 1 MiB kept in device memory handed over in place),
  ``may_alias=True``, PRNG key arrays, int4/uint4/float4, bf16, fp8 (NaN payloads
  included), bool, complex, zero-size arrays, scalars, pytrees with non-array leaves,
- reshards under ``jax.transfer_guard("disallow")`` (every move must be explicit),
- 64-bit types with ``jax_enable_x64`` on (on a TPU, ``float64`` values it holds:
  see ``truth64``),
- where there are 2+ devices: layout and device-set changes too,

then prints a timing table against ``jax.device_put`` and ``jax.jit`` identity.
Prints ``PASS``/``FAIL`` per check and exits 1 if any check failed (or none ran).
``GPU_CHECK_ONLY=scale,every_bit_pattern`` runs those groups alone (also
``single_device``, ``multi_device``), without the timing.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import traceback

T_START = time.monotonic()
BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "270"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import reshard  # noqa: E402
from reshard import _collective_executor  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def report(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'}  {name}{'  -- ' + detail if detail else ''}", flush=True)


def check(name: str):
    """Decorator-free runner: ``with check(name): ...`` records PASS unless it raises."""

    class _Ctx:
        def __enter__(self):
            return self

        def __exit__(self, et, ev, tb):
            if et is None:
                report(name, True)
            else:
                detail = f"{et.__name__}: {str(ev).splitlines()[0] if str(ev) else ''}"
                report(name, False, detail[:300])
                traceback.print_exception(et, ev, tb, limit=6)
            return True  # keep going

    return _Ctx()


# ------------------------------------------------------------------------------------
# Ground truth and exact comparison
# ------------------------------------------------------------------------------------


def bits_of(a: np.ndarray) -> np.ndarray:
    """The raw bits of a host array, as unsigned integers (sub-byte types: one per
    element, as numpy holds them)."""
    a = np.ascontiguousarray(a)  # (a view to another item size needs contiguous data)
    if a.dtype.itemsize == 0 or a.dtype == np.bool_:
        return a.astype(np.uint8)
    if a.dtype.kind == "c":
        return a.view(np.dtype(f"u{a.dtype.itemsize // 2}"))
    return a.view(np.dtype(f"u{a.dtype.itemsize}"))


def truth(shape, dtype, seed) -> np.ndarray:
    """Random bits of ``dtype`` (NaN payloads, signed zeros and subnormals included)."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    name = dt.name
    if "int4" in name or "int2" in name:
        lo, hi = (-8, 8) if name == "int4" else (0, 16)
        return rng.integers(lo, hi, n).astype(dt).reshape(shape)
    raw = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8)
    return raw.view(dt).reshape(shape)


def truth64(shape, dtype, seed) -> np.ndarray:
    """``truth`` for the 64-bit types (with ``jax_enable_x64`` on). A TPU has no float64:
    XLA emulates it there, and holds no float64 (nor complex128) bit pattern as given:
    ``jax.device_put`` of random bits changed 3,014 of 3,072 values, and of the values
    read back from the chip, putting them back turned each -0.0 into +0.0 and a
    program's bitcast to uint64 changed 2,401 of them (2026-12-07, TPU v5e). No move
    through host memory or a bitcast can then keep every bit, so on a TPU these are
    values it does hold: float32 values, none of them zero."""
    if PLATFORM == "tpu" and np.dtype(dtype).kind in "fc":
        rng = np.random.default_rng(seed)
        v = rng.standard_normal(shape).astype(np.float32)
        v[v == 0] = 1.0
        return v.astype(dtype)
    return truth(shape, dtype, seed)


def put(host: np.ndarray, sharding) -> jax.Array:
    return jax.make_array_from_callback(
        host.shape, sharding, lambda idx: host[idx], dtype=host.dtype
    )


def verify(y: jax.Array, host: np.ndarray, sharding, what: str = "") -> None:
    """Every shard of ``y`` is on its device and memory kind and bit-exact."""
    assert isinstance(y, jax.Array), f"{what}: not a jax.Array: {type(y)}"
    assert not y.is_deleted(), f"{what}: output deleted"
    assert y.shape == host.shape and y.dtype == host.dtype, (what, y.shape, y.dtype)
    assert y.sharding.is_equivalent_to(sharding, y.ndim), f"{what}: {y.sharding} != {sharding}"
    want_mk = sharding.memory_kind or y.sharding.memory_kind
    assert y.sharding.memory_kind == want_mk, (what, y.sharding.memory_kind, want_mk)
    idx_map = sharding.devices_indices_map(host.shape)
    for s in y.addressable_shards:
        got = np.asarray(jax.device_get(s.data))
        assert s.data.sharding.memory_kind == want_mk, (what, s.device, s.data.sharding)
        want = host[idx_map[s.device]]
        assert got.shape == want.shape, (what, s.device, got.shape, want.shape)
        if not np.array_equal(bits_of(got), bits_of(want)):
            bad = int(np.sum(bits_of(got) != bits_of(want)))
            raise AssertionError(f"{what}: shard on {s.device} differs in {bad} elements")


def key_truth(n: int, seed: int) -> np.ndarray:
    return np.asarray(jax.random.key_data(jax.random.split(jax.random.key(seed), n)))


# ------------------------------------------------------------------------------------
# Setup
# ------------------------------------------------------------------------------------

DEVS = jax.devices()
D0 = DEVS[0]
PLATFORM = D0.platform
KINDS = [m.kind for m in D0.addressable_memories()]
DEFAULT_KIND = D0.default_memory().kind
HOST_KINDS = [k for k in ("pinned_host", "unpinned_host") if k in KINDS]
N = len(DEVS)

print(
    f"gpu_check: jax {jax.__version__}, platform {PLATFORM} ({D0.device_kind}), {N} device(s), "
    f"memory kinds {KINDS} (default {DEFAULT_KIND}), reshard {reshard.__version__}",
    flush=True,
)
if PLATFORM == "cpu":
    print("NOTE: CPU run: the accelerator-only behaviour is not exercised here", flush=True)

MESH1 = Mesh(np.array(DEVS[:1]), ("x",))


def ns(mesh, spec, mk=None):
    return NamedSharding(mesh, spec, memory_kind=mk)


EXECUTORS = [
    "auto",
    "device",
    "collective",
    "collective-device-packed",
    "collective-host-packed",
] + (["host"] if PLATFORM == "cpu" else [])


def run(x, dst, executor: str, **kw):
    """One reshard with ``executor`` ('collective-device-packed' and
    'collective-host-packed' force a packing; 'collective' lets it choose)."""
    if executor.startswith("collective-"):
        saved = _collective_executor.PACK_ON_HOST
        _collective_executor.PACK_ON_HOST = executor == "collective-host-packed"
        try:
            return reshard.plan(x, dst, executor="collective").execute(x, **kw)
        finally:
            _collective_executor.PACK_ON_HOST = saved
    if executor == "auto":
        return reshard.reshard(x, dst, **kw)
    return reshard.plan(x, dst, executor=executor).execute(x, **kw)


def mk_pairs():
    kinds = [DEFAULT_KIND] + HOST_KINDS
    return [(a, b) for a in kinds for b in kinds]


DTYPES = [
    np.float32,
    jnp.bfloat16,
    np.float16,
    np.int8,
    np.uint8,
    np.int32,
    np.uint16,
    np.bool_,
    np.complex64,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.int4,
    jnp.uint4,
]
if hasattr(jnp, "float4_e2m1fn"):
    DTYPES.append(jnp.float4_e2m1fn)


def truth_any(shape, dtype, seed):
    dt = np.dtype(dtype)
    if dt.name == "float4_e2m1fn":
        rng = np.random.default_rng(seed)
        # every one of the 16 codes, through float32 values (exact in float4_e2m1fn)
        vals = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
        v = vals[rng.integers(0, 8, int(np.prod(shape)))] * rng.choice([-1, 1], int(np.prod(shape)))
        v[::7] = -0.0
        return v.astype(dt).reshape(shape)
    return truth(shape, dtype, seed)


# ------------------------------------------------------------------------------------
# 1. Correctness on one device (and more, where there are)
# ------------------------------------------------------------------------------------


def checks_single_device() -> None:
    # Memory kinds x executors x dtypes: one (64, 48) array each.
    for ex in EXECUTORS:
        for a, b in mk_pairs():
            if ex == "host" and PLATFORM != "cpu":
                continue
            with check(f"[{ex}] memory {a} -> {b}, all dtypes"):
                src, dst = ns(MESH1, P("x"), a), ns(MESH1, P(None, "x"), b)
                # every dtype where device memory is on one side; a few between host kinds
                dts = DTYPES if DEFAULT_KIND in (a, b) else [np.float32, jnp.bfloat16, jnp.int4]
                bad = []  # every dtype is tried; the check fails naming all that failed
                for i, dt in enumerate(dts):
                    h = truth_any((64, 48), dt, i)
                    x = put(h, src)
                    try:
                        y = run(x, dst, ex)
                        verify(y, h, dst, f"{np.dtype(dt).name}")
                        verify(x, h, src, f"{np.dtype(dt).name} input intact")
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"{np.dtype(dt).name} ({type(e).__name__}: {str(e)[:80]})")
                assert not bad, "; ".join(bad)
    # Donation, handover in device memory (>= 1 MiB kept), copies otherwise.
    for ex in EXECUTORS:
        with check(f"[{ex}] donate=True: inputs deleted, outputs exact (4 MiB f32 + small bf16)"):
            src = ns(MESH1, P("x"), DEFAULT_KIND)
            hb, hs = truth((1024, 1024), np.float32, 1), truth((8, 8), jnp.bfloat16, 2)
            x = {"big": put(hb, src), "small": put(hs, src)}
            ptr = x["big"].addressable_shards[0].data.unsafe_buffer_pointer()
            dst = ns(MESH1, P(None, "x"), DEFAULT_KIND)
            y = run(x, dst, ex, donate=True)
            assert x["big"].is_deleted() and x["small"].is_deleted(), "inputs not consumed"
            verify(y["big"], hb, dst, "big")
            verify(y["small"], hs, dst, "small")
            got = y["big"].addressable_shards[0].data.unsafe_buffer_pointer()
            if got != ptr:
                print(f"WARN  [{ex}] donated 4 MiB shard kept in place was copied, not handed over")
        for hk in HOST_KINDS:
            with check(f"[{ex}] donate=True device -> {hk} and back"):
                h = truth((512, 1024), jnp.bfloat16, 3)
                s_dev, s_host = ns(MESH1, P("x"), DEFAULT_KIND), ns(MESH1, P("x"), hk)
                x = put(h, s_dev)
                y = run(x, s_host, ex, donate=True)
                assert x.is_deleted()
                verify(y, h, s_host)
                z = run(y, s_dev, ex, donate=True)
                assert y.is_deleted()
                verify(z, h, s_dev)
    for ex in EXECUTORS:
        with check(f"[{ex}] may_alias=True keeps input valid and exact"):
            s = ns(MESH1, P("x"), DEFAULT_KIND)
            h = truth((512, 512), np.float32, 4)
            x = put(h, s)
            y = run(x, ns(MESH1, P(None, "x"), DEFAULT_KIND), ex, may_alias=True)
            verify(x, h, s)
            verify(y, h, s)
        with check(f"[{ex}] default call returns a copy (no shared buffer)"):
            s = ns(MESH1, P("x"), DEFAULT_KIND)
            h = truth((256, 256), np.float32, 5)
            x = put(h, s)
            y = run(x, s, ex)
            p_in = x.addressable_shards[0].data.unsafe_buffer_pointer()
            p_out = y.addressable_shards[0].data.unsafe_buffer_pointer()
            assert p_in != p_out, "output shares the input's buffer"
            x.delete()
            verify(y, h, s)
    # Key arrays.
    for ex in EXECUTORS:
        for b in [DEFAULT_KIND] + HOST_KINDS:
            with check(f"[{ex}] PRNG key array device -> {b} (and donated)"):
                keys = jax.random.split(jax.random.key(7), 64)
                s = ns(MESH1, P("x"), DEFAULT_KIND)
                kx = jax.device_put(keys, s)
                want = np.asarray(jax.random.key_data(keys))
                dst = ns(MESH1, P(None), b)
                ky = run(kx, dst, ex)
                assert jax.dtypes.issubdtype(ky.dtype, jax.dtypes.prng_key), ky.dtype
                got = np.asarray(jax.device_get(jax.random.key_data(ky)))
                assert np.array_equal(got, want)
                kz = run(kx, dst, ex, donate=True)
                assert kx.is_deleted()
                assert np.array_equal(np.asarray(jax.device_get(jax.random.key_data(kz))), want)
    # Zero-size arrays and scalars, every memory-kind pair.
    for ex in EXECUTORS:
        with check(f"[{ex}] zero-size (0, 8)/(8, 0) and scalars, every memory-kind pair"):
            for a, b in [p for p in mk_pairs() if DEFAULT_KIND in p]:
                for shape in [(0, 8), (8, 0), ()]:
                    for dt in (np.float32, jnp.int4):
                        h = truth_any(shape, dt, 9)
                        src = ns(MESH1, P("x") if shape else P(), a)
                        dst = ns(MESH1, P(None, "x") if shape else P(), b)
                        x = put(h, src)
                        verify(run(x, dst, ex), h, dst, f"{shape} {np.dtype(dt).name} {a}->{b}")
                        verify(run(x, dst, ex, donate=True), h, dst, f"{shape} donated")
                        assert x.is_deleted()
    # A pytree with mixed leaves, planned once and executed twice (cached programs).
    for ex in EXECUTORS:
        with check(f"[{ex}] pytree (arrays, keys, numpy, python scalars), plan reused"):
            s_dev = ns(MESH1, P("x"), DEFAULT_KIND)
            hk = HOST_KINDS[0] if HOST_KINDS else DEFAULT_KIND
            hs = {
                "w": truth((256, 128), jnp.bfloat16, 11),
                "b": truth((128,), np.float32, 12),
                "q": truth_any((64, 32), jnp.int4, 13),
                "e": truth((0, 4), np.float32, 14),
            }
            tree = {k: put(v, s_dev) for k, v in hs.items()}
            tree["key"] = jax.device_put(jax.random.split(jax.random.key(3), 8), s_dev)
            tree["np"] = np.arange(6, dtype=np.int32)
            tree["py"] = 3.5
            dst = {
                "w": ns(MESH1, P(None, "x"), hk),
                "b": ns(MESH1, P(), DEFAULT_KIND),
                "q": ns(MESH1, P(None, "x"), hk),
                "e": ns(MESH1, P(), hk),
                "key": ns(MESH1, P(), DEFAULT_KIND),
                "np": SingleDeviceSharding(D0),
                "py": SingleDeviceSharding(D0),
            }
            if ex.startswith("collective-"):
                _collective_executor.PACK_ON_HOST = ex == "collective-host-packed"
            try:
                plan = reshard.plan(
                    tree, dst, executor="collective" if ex.startswith("collective") else ex
                )
                for rep in range(2):
                    out = plan.execute(tree)
                    for k, v in hs.items():
                        verify(out[k], v, dst[k], f"{k} (call {rep})")
                    assert np.array_equal(
                        np.asarray(jax.random.key_data(out["key"])),
                        np.asarray(jax.random.key_data(tree["key"])),
                    )
                    assert np.array_equal(np.asarray(out["np"]), tree["np"])
                    assert float(out["py"]) == 3.5
            finally:
                _collective_executor.PACK_ON_HOST = None
    # Under a transfer guard that refuses implicit transfers (every move is explicit).
    for ex in EXECUTORS:
        with check(f"[{ex}] under jax.transfer_guard('disallow')"):
            pairs = mk_pairs()
            hs = [truth((128, 64), np.float32, 20 + i) for i in range(len(pairs))]
            xs = [put(h, ns(MESH1, P("x"), a)) for h, (a, _) in zip(hs, pairs, strict=True)]
            dsts = [ns(MESH1, P(None, "x"), b) for _, b in pairs]
            jax.block_until_ready(xs)
            with jax.transfer_guard("disallow"):
                ys = run(xs, dsts, ex)
                jax.block_until_ready(ys)
            for y, h, d in zip(ys, hs, dsts, strict=True):
                verify(y, h, d)
    # With jax_enable_x64 on: 64-bit types, host values (a Python int is then a weakly
    # typed int64), and the check of which types programs carry exactly, whose own
    # program must run there too (before, it failed to, and every float went through
    # host memory).
    for ex in EXECUTORS:
        with check(f"[{ex}] 64-bit types with jax_enable_x64 on"), jax.enable_x64(True):
            from reshard import _exact

            src, dst = ns(MESH1, P("x")), ns(MESH1, P(None, "x"))
            for i, dt in enumerate((np.int64, np.uint64, np.float64, np.complex128)):
                h = truth64((64, 48), dt, 40 + i)
                verify(run(put(h, src), dst, ex), h, dst, np.dtype(dt).name)
            if PLATFORM == "tpu" and ex in ("auto", "device"):
                # Whatever the chip holds of random float64 bits, the local executors
                # move as it is (on the device: no host, no bitcast).
                x = put(truth((64, 48), np.float64, 49), src)
                held = np.asarray(jax.device_get(x))
                verify(run(x, dst, ex), held, dst, "float64 random bits, as held")
            rep = ns(MESH1, P())
            out = run({"i": 3, "f": np.arange(3.0) / 3}, {"i": rep, "f": rep}, ex)
            assert (out["i"].dtype, out["i"].weak_type, out["f"].dtype) == (
                np.int64, True, np.float64
            ), (out["i"].dtype, out["i"].weak_type, out["f"].dtype)  # fmt: skip
            assert _exact._check(D0, np.dtype(np.float32)), "the bit check did not run"
    # Made with it on, moved with it off (the default): a program traced with it off
    # reads such an array as its 32-bit type, so the library's programs run with it on.
    for ex in EXECUTORS:
        with check(f"[{ex}] 64-bit types made with jax_enable_x64 on, moved with it off"):
            src = ns(MESH1, P("x"))
            dsts = [src, ns(MESH1, P(None, "x"))] + [ns(MESH1, P("x"), k) for k in HOST_KINDS]
            for i, dt in enumerate((np.int64, np.uint64, np.float64, np.complex128)):
                h = truth64((64, 48), dt, 50 + i)
                with jax.enable_x64(True):
                    x = put(h, src)
                for dst in dsts:
                    verify(run(x, dst, ex), h, dst, f"{np.dtype(dt).name} -> {dst}")
    # Async dispatch: a reshard of a result still being computed, then deletion of the
    # source right after the call (the runtime must keep it until its reads are done).
    for ex in EXECUTORS:
        with check(f"[{ex}] source still computing; source deleted right after the call"):
            s = ns(MESH1, P("x"), DEFAULT_KIND)
            h = truth((2048, 2048), np.float32, 30)
            x0 = put(h, s)
            f = jax.jit(
                lambda a: jax.lax.bitcast_convert_type(
                    (jax.lax.bitcast_convert_type(a, jnp.uint32) ^ jnp.uint32(0x5A5A5A5A))
                    ^ jnp.uint32(0x5A5A5A5A),
                    jnp.float32,
                ),
                out_shardings=s,
            )
            x = f(x0)  # not waited for
            dst = ns(MESH1, P(None, "x"), HOST_KINDS[0] if HOST_KINDS else DEFAULT_KIND)
            y = run(x, dst, ex)
            x.delete()
            verify(y, h, dst)


EXHAUSTIVE = [
    jnp.bfloat16,
    np.float16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.float8_e4m3fnuz,
    jnp.float8_e5m2fnuz,
    jnp.float8_e4m3b11fnuz,
] + [getattr(jnp, n) for n in ("float8_e3m4", "float8_e4m3", "float8_e8m0fnu") if hasattr(jnp, n)]


def every_pattern(dtype) -> np.ndarray:
    """Every bit pattern of a 1- or 2-byte type, as a (256, 256) array."""
    dt = np.dtype(dtype)
    raw = (
        np.arange(1 << 16, dtype=np.uint16)
        if dt.itemsize == 2
        else np.tile(np.arange(256, dtype=np.uint8), 256)
    )
    return raw.view(dt).reshape(256, 256)


def checks_every_bit_pattern() -> None:
    """Every bit pattern of each narrow float type through every executor: kept in
    device memory (a copy), into a host memory kind and back; plus whether this
    platform's programs carry each type exactly (``reshard._exact``: those that do not
    are moved without programs)."""
    from reshard import _exact, _local_executor

    verdicts = []
    for dt in EXHAUSTIVE + [np.float32, np.complex64]:
        keep = _exact.programs_keep_bits(D0, np.dtype(dt))
        verdicts.append(f"{np.dtype(dt).name}={'yes' if keep else 'NO'}")
    print("INFO  programs keep every bit: " + ", ".join(verdicts), flush=True)
    # The device executor's own cut and assemble programs, with a real cut (a plan on
    # one device has none): for the types this platform's programs carry exactly.
    with check("device executor cut + assemble programs, every bit pattern (exact types)"):
        bad = []
        for dt in EXHAUSTIVE:
            if not _exact.programs_keep_bits(D0, np.dtype(dt)):
                continue
            h = every_pattern(dt)
            x = jax.device_put(h, SingleDeviceSharding(D0))
            cuts = _local_executor._Static(((((0, 256), (0, 100)), h.shape, str(h.dtype)),))
            (left,) = jax.jit(lambda a, c=cuts: _local_executor._cut(c, a))(x)
            outs = _local_executor._Static(
                (
                    (
                        h.shape,
                        h.dtype,
                        (
                            ("recv", ((0, 256), (0, 100)), None),
                            ("local", ((0, 256), (100, 256), (0, 256), (100, 256)), h.shape),
                        ),
                    ),
                )
            )
            (y,) = jax.jit(lambda r, loc, o=outs: _local_executor._build(o, r, loc))(left, x)
            if not np.array_equal(bits_of(np.asarray(y)), bits_of(h)):
                bad.append(np.dtype(dt).name)
        assert not bad, f"changed: {bad}"
    pairs = [(DEFAULT_KIND, DEFAULT_KIND)] + [
        p for hk in HOST_KINDS[:1] for p in ((DEFAULT_KIND, hk), (hk, DEFAULT_KIND))
    ]
    for ex in EXECUTORS:
        for a, b in pairs:
            with check(
                f"[{ex}] every bit pattern of {len(EXHAUSTIVE)} narrow float types, {a} -> {b}"
            ):
                bad = []
                for dt in EXHAUSTIVE:
                    h = every_pattern(dt)
                    src, dst = ns(MESH1, P("x"), a), ns(MESH1, P(None, "x"), b)
                    x = put(h, src)
                    try:
                        verify(run(x, dst, ex), h, dst, np.dtype(dt).name)
                        verify(x, h, src, f"{np.dtype(dt).name} input intact")
                    except Exception as e:  # noqa: BLE001
                        bad.append(f"{np.dtype(dt).name} ({type(e).__name__}: {str(e)[:80]})")
                assert not bad, "; ".join(bad)


def stress_values(shape, dtype) -> np.ndarray:
    """Values of ``dtype`` that programs are most likely to change: for 1- and 2-byte
    types every bit pattern, scattered and repeated; for wider ones random bits with
    every third row subnormals and zeros and every third row infinities and NaNs with
    payloads, of either sign."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.itemsize <= 2:
        width = 8 * dt.itemsize
        codes = (np.arange(n, dtype=np.uint64) * 40503 + 7) % (1 << width)
        return codes.astype(np.dtype(f"u{dt.itemsize}")).view(dt).reshape(shape)
    width = dt.itemsize // 2 if dt.kind == "c" else dt.itemsize
    unsigned = np.dtype(f"u{width}")
    exp = np.array(np.inf, np.dtype(f"f{width}")).view(unsigned)  # the exponent's bits
    per_row = shape[-1] * (2 if dt.kind == "c" else 1)
    raw = (
        np.random.default_rng(7)
        .integers(
            0,
            np.iinfo(unsigned).max,
            size=(n * (2 if dt.kind == "c" else 1)),
            dtype=unsigned,
            endpoint=True,
        )
        .reshape(-1, per_row)
    )
    raw[::3] &= ~exp  # subnormals, zeros
    raw[1::3] |= exp  # infinities, NaNs with payloads
    return raw.view(dt).reshape(shape)


def checks_at_scale() -> None:
    """The device executor's programs at a model's sizes, for the types this platform's
    programs are judged to carry exactly (``reshard._exact`` judges them in small, on
    blocks of 256 x 256 at most): an fsdp -> tp relayout of one array in four row
    shards, cut into four column blocks each (the cut program, as the executor runs it)
    and put back together (the build program), and a copy in place (the copy program,
    also for the types only it is judged to carry). On a TPU v5e, a program that
    concatenated ``bfloat16`` pieces in their own type kept every bit putting together
    a 2048 x 2048 array from pieces of 512 x 512, and lost its NaNs and subnormals
    putting together 16384 x 8192 from pieces of 4096 x 2048: whether a program keeps
    bits can depend on sizes, so they are checked here at 256 MiB (1 MiB on CPU)."""
    from reshard import _exact
    from reshard import _local_executor as L

    side = 8192 if PLATFORM != "cpu" else 512
    k = 4
    types = [np.dtype(t) for t in EXHAUSTIVE + [np.float32, np.complex64]]
    for dt in types:
        cut_build = _exact.programs_keep_bits(D0, dt)
        copies = _exact.programs_keep_bits(D0, dt, only_copies=True)
        if not (cut_build or copies):
            continue
        R, C = side * 4 // dt.itemsize, side  # 256 MiB on an accelerator
        what = ("cut + build + copy" if cut_build else "copy") + f" programs, {R} x {C}"
        with check(f"at scale: {what} keep every bit of {dt.name}"):
            full = stress_values((R, C), dt)
            r, c = R // k, C // k
            on = SingleDeviceSharding(D0)
            srcs = [jax.device_put(full[i * r : (i + 1) * r], on) for i in range(k)]
            bad = 0
            if cut_build:
                cuts = L._Static(
                    tuple((((0, r), (j * c, (j + 1) * c)), (r, C), dt.name) for j in range(k))
                )
                cut = jax.jit(lambda x, d=cuts: L._cut(d, *([x] * k)))
                outs = L._Static(
                    (
                        (
                            (R, c),
                            dt,
                            tuple(("recv", ((i * r, (i + 1) * r), (0, c)), None) for i in range(k)),
                        ),
                    )
                )
                build = jax.jit(lambda *recv, d=outs: L._build(d, *recv))
                pieces = [cut(x) for x in srcs]
                for j in range(k):
                    (y,) = build(*(pieces[i][j] for i in range(k)))
                    want = full[:, j * c : (j + 1) * c]
                    bad += int((bits_of(np.asarray(y)) != bits_of(want)).sum())
                del pieces
            for i, x in enumerate(srcs):
                (y,) = jax.jit(L._copies)(x)
                bad += int((bits_of(np.asarray(y)) != bits_of(full[i * r : (i + 1) * r])).sum())
            assert bad == 0, f"{bad} elements changed"


def checks_multi_device() -> None:
    if N < 2:
        print("SKIP  multi-device layout / device-set checks (1 device)", flush=True)
        return
    half = N // 2
    devs = np.array(DEVS)
    cases = [
        (
            "fsdp -> tp, disjoint halves",
            ns(Mesh(devs[:half], ("f",)), P("f")),
            ns(Mesh(devs[half : 2 * half], ("t",)), P(None, "t")),
        ),
        (
            "relayout, same devices",
            ns(Mesh(devs, ("a",)), P("a")),
            ns(Mesh(devs, ("a",)), P(None, "a")),
        ),
        ("shrink to N-1", ns(Mesh(devs, ("a",)), P("a")), ns(Mesh(devs[: N - 1], ("b",)), P())),
    ]
    for hk in HOST_KINDS[:1]:
        cases.append(
            (
                "device -> host kind, other devices",
                ns(Mesh(devs[:half], ("f",)), P("f")),
                ns(Mesh(devs[half : 2 * half], ("t",)), P(None, "t"), hk),
            )
        )
    for ex in EXECUTORS:
        for name, src, dst in cases:
            with check(f"[{ex}] {name}: dtypes, donation"):
                for i, dt in enumerate(
                    [np.float32, jnp.bfloat16, jnp.int4, jnp.float8_e5m2, np.bool_]
                ):
                    h = truth_any((8 * N, 16 * N), dt, 40 + i)
                    x = put(h, src)
                    verify(run(x, dst, ex), h, dst, np.dtype(dt).name)
                    verify(run(x, dst, ex, donate=True), h, dst, f"{np.dtype(dt).name} donated")
                    assert x.is_deleted()
            with check(f"[{ex}] {name}: 64-bit types with jax_enable_x64 on"), jax.enable_x64(True):
                for i, dt in enumerate((np.int64, np.uint64, np.float64, np.complex128)):
                    h = truth64((8 * N, 16 * N), dt, 50 + i)
                    verify(run(put(h, src), dst, ex), h, dst, np.dtype(dt).name)


# ------------------------------------------------------------------------------------
# 2. Timing (information only: ratios, one run)
# ------------------------------------------------------------------------------------


def fresh(tree):
    def f(a):
        if not isinstance(a, jax.Array):
            return a
        return jax.make_array_from_single_device_arrays(
            a.shape, a.sharding, [s.data for s in a.addressable_shards], dtype=a.dtype
        )

    return jax.tree.map(f, tree)


def median_ms(fn, x, reps=5):
    jax.block_until_ready(fn(fresh(x)))  # warm (plans, compilation)
    ts = []
    for _ in range(reps):
        arg = fresh(x)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(arg))
        ts.append(time.perf_counter() - t0)
        del out
    return statistics.median(ts) * 1e3


def timing() -> None:
    mib = int(os.environ.get("GPU_CHECK_MIB", "256" if PLATFORM != "cpu" else "32"))
    rows = []
    kinds = [DEFAULT_KIND] + HOST_KINDS[:1]
    one = (mib << 20) // 2  # bf16 elements
    cols = 4096
    big_shape = (one // cols, cols)
    leaves = 64
    small_shape = ((one // leaves) // 1024, 1024)
    for label, shape, count, dtype, pairs in [
        (f"1 x {mib} MiB bf16", big_shape, 1, jnp.bfloat16, None),
        (f"{leaves} leaves bf16", small_shape, leaves, jnp.bfloat16, None),
        # (f32: a type every platform's programs carry exactly, see reshard._exact)
        (f"1 x {mib} MiB f32", (big_shape[0] // 2, cols), 1, jnp.float32, [kinds[0]]),
    ]:
        for a in kinds if pairs is None else pairs:
            for b in kinds if pairs is None else pairs:
                if time.monotonic() - T_START > BUDGET_S:
                    print("SKIP  remaining timings (time budget)", flush=True)
                    break
                src, dst = ns(MESH1, P("x"), a), ns(MESH1, P(None, "x"), b)
                xs = [jax.device_put(jnp.zeros(shape, dtype) + i, src) for i in range(count)]
                jax.block_until_ready(xs)
                dsts = [dst] * count
                row = {"case": f"{label} {a}->{b}"}
                try:
                    row["reshard"] = median_ms(
                        lambda t, d=dsts: reshard.reshard(t, d, cache_resharding_plans=True), xs
                    )
                    saved = _collective_executor.PACK_ON_HOST
                    _collective_executor.PACK_ON_HOST = False
                    try:
                        pl = reshard.plan(xs, dsts, executor="collective")
                        row["collective"] = median_ms(pl.execute, xs)
                    finally:
                        _collective_executor.PACK_ON_HOST = saved
                    row["device_put"] = median_ms(
                        lambda t, d=dsts: jax.device_put(t, d, may_alias=False), xs
                    )
                    try:
                        ident = jax.jit(lambda t: t, out_shardings=dsts)
                        row["jit"] = median_ms(ident, xs)
                    except Exception as e:  # noqa: BLE001
                        row["jit"] = None
                        row["jit_err"] = type(e).__name__
                except Exception as e:  # noqa: BLE001
                    report(f"timing {row['case']}", False, f"{type(e).__name__}: {str(e)[:200]}")
                    continue
                rows.append(row)
                del xs
    if not rows:
        return
    print()
    print(
        f"{'case':44s} {'reshard':>9s} {'coll.dev':>9s} {'dev_put':>9s} {'jit id':>9s} {'dp/ours':>8s}"
    )
    print("-" * 92)
    for r in rows:
        jit = "n/a" if r.get("jit") is None else f"{r['jit']:.2f}"
        print(
            f"{r['case']:44s} {r['reshard']:9.2f} {r['collective']:9.2f} {r['device_put']:9.2f} "
            f"{jit:>9s} {r['device_put'] / r['reshard']:7.2f}x"
        )
    print(
        "milliseconds, medians of 5 after a warm-up call; dp/ours > 1: reshard faster; "
        "coll.dev: the collective executor asked to pack on the devices (it packs on the "
        "host where programs do not carry a type exactly: reshard._exact)\n"
    )
    if PLATFORM != "cpu":
        try:
            stats = D0.memory_stats() or {}
            print(
                f"device memory: peak {stats.get('peak_bytes_in_use', 0) / 2**30:.2f} GiB, "
                f"in use {stats.get('bytes_in_use', 0) / 2**30:.2f} GiB"
            )
        except Exception:  # noqa: BLE001
            pass


def main() -> int:
    # GPU_CHECK_ONLY=scale,every_bit_pattern,... runs those groups alone.
    only = [g for g in os.environ.get("GPU_CHECK_ONLY", "").split(",") if g]
    groups = {
        "single_device": checks_single_device,
        "every_bit_pattern": checks_every_bit_pattern,
        "scale": checks_at_scale,
        "multi_device": checks_multi_device,
    }
    unknown = sorted(set(only) - set(groups))
    if unknown:
        print(f"GPU_CHECK_ONLY: no such group(s) {unknown}; the groups are {sorted(groups)}")
        return 2
    for name, run_group in groups.items():
        if not only or name in only:
            run_group()
    if os.environ.get("GPU_CHECK_NO_TIMING") != "1" and not only:
        timing()
    failed = [n for n, ok, _ in RESULTS if not ok]
    took = time.monotonic() - T_START
    print(
        f"\n{len(RESULTS) - len(failed)} passed, {len(failed)} failed in {took:.0f} s "
        f"({PLATFORM}, {N} device(s))"
    )
    for n in failed:
        print(f"FAILED: {n}")
    if not RESULTS:  # (a group can skip all its checks: nothing ran is no pass)
        print("RESULT: FAIL (no check ran)", flush=True)
        return 1
    print("RESULT:", "FAIL" if failed else "PASS", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
