"""Types that compiled programs do not carry bit for bit are moved without them.

On a TPU v5e some float types change inside any program (see ``reshard._exact``). CPU
programs keep every bit, so these tests make them lossy for ``bfloat16`` (NaNs made
canonical, as the TPU does) by wrapping ``to_bits``, which every executor program and
the exactness check itself use: the check must notice, and the executors must then
deliver every bit anyway. Controls show that the lossy programs do change the data
when the check is overruled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from helpers import as_bits, check_result, lossy_bf16_to_bits, place, random_values
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import (
    _collective_device,
    _collective_executor,
    _compat,
    _exact,
    _local_executor,
    _programs,
)

FLOATS = [
    "float32",
    "bfloat16",
    "float16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
    "float8_e4m3b11fnuz",
    "float4_e2m1fn",
    "complex64",
]


def _mesh(ids: list[int]) -> Mesh:
    return Mesh(np.array([jax.devices()[i] for i in ids]), ("a",))


def _uint(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.dtype(f"u{a.dtype.itemsize}"))


@pytest.mark.parametrize("name", ["bfloat16", "float16", "float8_e4m3fn", "float8_e5m2"])
def test_the_check_sees_every_bit_pattern_of_narrow_types(name):
    dt = np.dtype(getattr(ml_dtypes, name, None) or name)
    values = _exact._probe_values(dt)
    assert len(np.unique(_uint(values))) == 1 << (8 * dt.itemsize)


def test_the_check_sees_every_code_of_float4():
    values = _exact._probe_values(np.dtype(ml_dtypes.float4_e2m1fn))
    assert sorted(set(_uint(values).ravel().tolist())) == list(range(16))


@pytest.mark.parametrize("name", ["float32", "complex64"])
def test_the_check_sees_the_special_patterns_of_wide_types(name):
    values = _exact._probe_values(np.dtype(name)).ravel()
    parts = values.view(np.float32)
    raw = set(parts.view(np.uint32).tolist())
    assert {0, 0x80000000, 1, 0x7F800000, 0xFF800000} <= raw  # zeros, subnormal, infs
    nans = parts[np.isnan(parts)].view(np.uint32)
    assert len(set(nans.tolist())) > 8  # payloads and signs, quiet and signalling
    assert {0x7F800001, 0x7FC00000} <= set(nans.tolist())


@pytest.mark.parametrize("name", FLOATS)
def test_cpu_programs_keep_every_bit(name, monkeypatch):
    monkeypatch.setattr(_exact, "_known", {})
    assert _exact.programs_keep_bits(jax.devices()[0], np.dtype(jnp.dtype(name)))


def test_integers_and_booleans_are_not_checked(monkeypatch):
    monkeypatch.setattr(_exact, "_check", lambda *a: pytest.fail("checked"))
    for name in ["int8", "uint32", "int4", "bool"]:
        assert _exact.programs_keep_bits(jax.devices()[0], np.dtype(jnp.dtype(name)))


@pytest.fixture
def lossy_bf16(monkeypatch):
    """Programs that make every bfloat16 NaN the canonical one, as a TPU does to
    float16; fresh caches, so that no plan or program made before is reused."""
    to_bits = lossy_bf16_to_bits(_local_executor.to_bits)
    for mod in (_local_executor, _collective_device):
        monkeypatch.setattr(mod, "to_bits", to_bits)
    monkeypatch.setattr(_exact, "_known", {})
    for clear in (reshard.clear_plan_cache, _programs.clear, jax.clear_caches):
        clear()
    yield
    for clear in (reshard.clear_plan_cache, _programs.clear, jax.clear_caches):
        clear()


def test_the_check_catches_programs_that_change_bits(lossy_bf16):
    cpu = jax.devices()[0]
    assert not _exact.programs_keep_bits(cpu, np.dtype(jnp.bfloat16))
    assert _exact.programs_keep_bits(cpu, np.dtype(np.float32))
    assert _exact.inexact_types([cpu], [jnp.bfloat16, np.float32, np.int8]) == {"bfloat16"}


def test_a_check_that_fails_to_run_says_no_once(monkeypatch):
    calls = []

    def broken(device, dtype, only_copies=False):
        calls.append(dtype)
        raise RuntimeError("cannot compile")

    monkeypatch.setattr(_exact, "_known", {})
    monkeypatch.setattr(_exact, "_check", broken)
    cpu = jax.devices()[0]
    assert not _exact.programs_keep_bits(cpu, np.dtype(np.float16))
    assert not _exact.programs_keep_bits(cpu, np.dtype(np.float16))
    assert len(calls) == 1


def test_a_transfer_guard_of_the_caller_does_not_decide_the_check(monkeypatch):
    # Under jax.transfer_guard("disallow_explicit") the first call's check could not
    # put its probe values, and float32 went through host memory for good after.
    monkeypatch.setattr(_exact, "_known", {})
    cpu = jax.devices()[0]
    with jax.transfer_guard("disallow_explicit"):
        assert _exact.programs_keep_bits(cpu, np.dtype(np.float32))
    assert _exact._known == {("cpu", cpu.device_kind, "float32", False): True}


def test_the_copy_program_is_judged_on_its_own(monkeypatch):
    # (On a TPU v5e a copy program keeps bf16, which the other programs do not.)
    monkeypatch.setattr(_exact, "_known", {})
    monkeypatch.setattr(_exact, "_check", lambda device, dtype, only_copies: only_copies)
    cpu = jax.devices()[0]
    assert _exact.programs_keep_bits(cpu, np.dtype(jnp.bfloat16), only_copies=True)
    assert not _exact.programs_keep_bits(cpu, np.dtype(jnp.bfloat16))
    assert _exact.inexact_types([cpu], [jnp.bfloat16]) == {"bfloat16"}


def _tree(rng):
    """bf16 and f32 arrays (random bits: NaN payloads included) over devices 0-3."""
    src = NamedSharding(_mesh([0, 1, 2, 3]), P("a"))
    truth = {
        "w": random_values(rng, (64, 96), "bfloat16"),
        "b": random_values(rng, (32, 8), "bfloat16"),
        "f": random_values(rng, (64, 96), "float32"),
    }
    assert np.isnan(truth["w"].astype(np.float32)).any()
    return truth, {k: place(v, src) for k, v in truth.items()}


# Relayout on the same devices (kept pieces), to other devices, into another memory
# kind (whole shards), and to the same sharding (every shard copied in place).
DESTINATIONS = [
    NamedSharding(_mesh([0, 1, 2, 3]), P(None, "a")),
    NamedSharding(_mesh([4, 5, 6, 7]), P(None, "a")),
    NamedSharding(_mesh([0, 1, 2, 3]), P("a"), memory_kind="pinned_host"),
    NamedSharding(_mesh([0, 1, 2, 3]), P("a")),
]


@pytest.mark.parametrize("pjrt", [None, True], ids=["cpu-default", "whole-shards-by-pjrt"])
@pytest.mark.parametrize(
    "dst", DESTINATIONS, ids=["relayout", "other-devices", "pinned", "in-place"]
)
def test_device_executor_moves_inexact_types_through_host_memory(
    lossy_bf16, monkeypatch, dst, pjrt
):
    # (Off CPU, the host route copies whole shards by PjRt: forced here on CPU.)
    monkeypatch.setattr(_local_executor, "PJRT_WHOLE_SHARDS", pjrt)
    real_put = jax.device_put
    by_pjrt = []

    def put(x, *args, **kw):
        if kw.get("may_alias") is False and isinstance(x, list):
            by_pjrt.extend(str(a.dtype) for a in x if isinstance(a, jax.Array))
        return real_put(x, *args, **kw)

    monkeypatch.setattr(jax, "device_put", put)
    real_copy = _compat.copy_shards

    def copy(xs, shardings):  # (PjRt's batched copy, called directly)
        by_pjrt.extend(str(a.dtype) for a in xs)
        return real_copy(xs, shardings)

    monkeypatch.setattr(_compat, "copy_shards", copy)
    truth, x = _tree(np.random.default_rng(0))
    routed = {}
    for name in ("run_host", "run_device"):
        real = getattr(_local_executor, name)

        def spy(*args, _real=real, _name=name, **kw):
            routed[_name] = sorted(str(s.dtype) for s in args[1])  # (the sources)
            return _real(*args, **kw)

        monkeypatch.setattr(f"reshard._execute.{name}", spy)
    p = reshard.plan(x, dst, executor="device")
    y = p.execute(x)
    for k in truth:
        check_result(y[k], truth[k], dst)
        check_result(x[k], truth[k], x[k].sharding)  # inputs intact
    if dst.memory_kind == "pinned_host":
        # Only the memory kind changes: PjRt copies every array whole (a transfer,
        # which keeps every bit), with neither executor nor the host route.
        assert routed == {} and "host route" not in str(p), (routed, str(p))
        return
    assert routed["run_host"] == ["bfloat16", "bfloat16"]
    assert routed["run_device"] == ["float32"]
    # str(plan) says so, once the first run has decided it
    assert "host route:  2 array(s) of bfloat16 through host memory: this" in str(p), str(p)
    # The copy in place keeps every box: its 2 x 4 bf16 shards are whole copies, which
    # go by PjRt where asked (the lossy copy program is refused).
    expect = 8 if pjrt and dst.spec == P("a") else 0
    assert by_pjrt.count("bfloat16") == expect


def test_device_executor_control_lossy_programs_do_change_bf16(lossy_bf16, monkeypatch):
    truth, x = _tree(np.random.default_rng(0))
    monkeypatch.setattr(_exact, "programs_keep_bits", lambda device, dtype: True)
    p = reshard.plan(x, DESTINATIONS[0], executor="device")
    y = p.execute(x)
    assert "host route" not in str(p)
    assert not np.array_equal(as_bits(y["w"]), as_bits(truth["w"]))
    np.testing.assert_array_equal(as_bits(y["f"]), as_bits(truth["f"]))


@pytest.mark.parametrize("keep_bits", [False, True], ids=["checked", "control-overruled"])
def test_collective_program_packs_on_host_for_inexact_types(lossy_bf16, monkeypatch, keep_bits):
    truth, x = _tree(np.random.default_rng(1))
    if keep_bits:
        monkeypatch.setattr(_exact, "programs_keep_bits", lambda device, dtype: True)
    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", False)
    dst = DESTINATIONS[0]
    p = reshard.plan(x, dst, executor="collective")
    assert "host route" not in str(p)  # (decided at the first run)
    y = p.execute(x)
    route = "host route:  packed on the host, not on the devices (for bfloat16): this platform"
    assert (route in str(p)) is not keep_bits, str(p)
    (program,) = [
        v for v in p._cache.values() if isinstance(v, _collective_executor.CollectiveProgram)
    ]
    assert program.host_packed is not keep_bits
    if keep_bits:
        assert not np.array_equal(as_bits(y["w"]), as_bits(truth["w"]))
    else:
        for k in truth:
            check_result(y[k], truth[k], dst)


def test_copies_in_place_are_fresh_and_exact(monkeypatch):
    rng = np.random.default_rng(2)
    dev = jax.devices()[3]
    keys = []
    real_shared = _programs.shared

    def shared(key, build):
        keys.append(key)
        return real_shared(key, build)

    monkeypatch.setattr(_programs, "shared", shared)
    cases = [
        ("bfloat16", "device"),
        ("float32", "device"),
        ("int4", "device"),
        ("float16", "pinned_host"),
        ("float32", "unpinned_host"),
    ]
    truths = [random_values(rng, (16, 24), dt) for dt, _ in cases]
    xs = [
        jax.device_put(t, jax.sharding.SingleDeviceSharding(dev, memory_kind=mk))
        for t, (_, mk) in zip(truths, cases, strict=True)
    ]
    out = _local_executor.copies_in_place(xs)
    for x, y, t in zip(xs, out, truths, strict=True):
        assert y.sharding == x.sharding
        assert y.unsafe_buffer_pointer() != x.unsafe_buffer_pointer()
        np.testing.assert_array_equal(as_bits(y), as_bits(t))
    # One program for the three in device memory; PjRt copies the two in host memory.
    (key,) = [k for k in keys if k[0] == "copies"]
    assert [str(dt) for _, dt in key[2]] == ["bfloat16", "float32", "int4"]


def test_inexact_types_kept_in_place_are_copied_by_a_copy_program_that_keeps_them(monkeypatch):
    # bf16 as on a TPU v5e: refused by the executors' programs as a whole, kept by the
    # copy program. Its arrays take the host route, whose copies in place still run
    # as a program (PjRt's copy to the same device is slow on accelerators).
    monkeypatch.setattr(_exact, "_known", {})
    monkeypatch.setattr(
        _exact, "_check", lambda device, dtype, only_copies: only_copies or dtype != jnp.bfloat16
    )
    monkeypatch.setattr(_local_executor, "PJRT_WHOLE_SHARDS", True)
    for clear in (reshard.clear_plan_cache, _programs.clear):
        clear()
    keys = []
    real_shared = _programs.shared
    monkeypatch.setattr(_programs, "shared", lambda k, b: keys.append(k) or real_shared(k, b))
    truth, x = _tree(np.random.default_rng(3))
    dst = NamedSharding(_mesh([0, 1, 2, 3]), P("a"))
    y = reshard.plan(x, dst, executor="device").execute(x)
    for k in truth:
        check_result(y[k], truth[k], dst)
        for a, b in zip(y[k].addressable_shards, x[k].addressable_shards, strict=True):
            assert a.data.unsafe_buffer_pointer() != b.data.unsafe_buffer_pointer()
    copied = sorted(str(dt) for k in keys if k[0] == "copies" for _, dt in k[2])
    assert copied == ["bfloat16"] * 8 + ["float32"] * 4
    reshard.clear_plan_cache()


@pytest.mark.parametrize(
    "context",
    [
        lambda: jax.transfer_guard("disallow"),
        lambda: jax.debug_nans(True),
        lambda: jax.set_mesh(jax.make_mesh((2,), ("m",), devices=jax.devices()[4:6])),
    ],
    ids=["transfer-guard", "debug-nans", "set-mesh"],
)
def test_the_check_runs_in_any_context_a_reshard_runs_in(monkeypatch, context):
    # (The check's values hold NaNs; its transfers are explicit; its programs run on
    # the device asked about, whatever mesh is set.)
    monkeypatch.setattr(_exact, "_known", {})
    with context():
        assert _exact.programs_keep_bits(jax.devices()[0], np.dtype(jnp.bfloat16))
        assert _exact.programs_keep_bits(jax.devices()[0], np.dtype(np.float16), only_copies=True)
