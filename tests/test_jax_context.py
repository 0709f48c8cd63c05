"""``reshard`` inside real programs: the caller's JAX context must not change a move.

A context mesh (``jax.set_mesh``), NaN/Inf checking (``jax.debug_nans``/``debug_infs``)
and transfer guards are about computations; a reshard moves bytes, as
``jax.device_put`` does, and must give the same bits under any of them. A reshard
called on tracers (inside ``jax.jit``) must say that it runs eagerly, naming the leaf.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import as_bits, check_result, place
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _collective_executor, _compat

DEVICES = jax.devices()
WORLD = Mesh(np.array(DEVICES).reshape(2, 4), ("data", "model"))
HALF = Mesh(np.array(DEVICES[4:]).reshape(2, 2), ("data", "model"))


def _special_values(dtype: Any) -> np.ndarray:
    """NaN, infinities, -0 and ordinary numbers: the values a NaN check trips on."""
    v = np.arange(16 * 8, dtype=np.float32).reshape(16, 8)
    v[0, :4] = [np.nan, np.inf, -np.inf, -0.0]
    v[9, 5] = np.nan
    return v.astype(dtype)


@contextlib.contextmanager
def _nan_and_inf_checks() -> Iterator[None]:
    with jax.debug_nans(True), jax.debug_infs(True):
        yield


CONTEXTS: dict[str, Callable[[], Any]] = {
    "set_mesh": lambda: jax.set_mesh(WORLD),
    "set_mesh_elsewhere": lambda: jax.set_mesh(Mesh(np.array(DEVICES[:2]), ("x",))),
    "debug_nans_infs": _nan_and_inf_checks,
    "transfer_guard_disallow": lambda: jax.transfer_guard("disallow"),
    "disable_jit": jax.disable_jit,
}

# (executor, pack collective pieces on the host)
EXECUTORS = [("host", True), ("device", True), ("collective", True), ("collective", False)]


@pytest.mark.parametrize("context", sorted(CONTEXTS))
@pytest.mark.parametrize(("executor", "pack_on_host"), EXECUTORS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_move_is_the_same_in_any_context(
    context: str, executor: str, pack_on_host: bool, dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_collective_executor, "PACK_ON_HOST", pack_on_host)
    truth = _special_values(jnp.dtype(dtype))
    moves = [
        (NamedSharding(WORLD, P("data", "model")), NamedSharding(WORLD, P("model", "data"))),
        (NamedSharding(WORLD, P("data")), NamedSharding(HALF, P(None, "model"))),
        # Host memory kinds go through programs that stage the shards in device memory.
        (
            NamedSharding(WORLD, P("model"), memory_kind="pinned_host"),
            NamedSharding(WORLD, P("data", "model")),
        ),
    ]
    for src, dst in moves:
        x = place(truth, src)
        with CONTEXTS[context]():
            expected = jax.device_put(x, dst)
            y = reshard.reshard(x, dst, executor=executor)
            z = reshard.reshard(x, dst, executor=executor, cache_resharding_plans=True)
        check_result(y, truth, dst)
        check_result(z, truth, dst)
        assert y.aval == expected.aval
        np.testing.assert_array_equal(as_bits(x), as_bits(truth))  # the input is intact
        with CONTEXTS[context]():
            d = reshard.reshard(x, dst, executor=executor, donate=True)
        check_result(d, truth, dst)


@pytest.mark.parametrize("context", ["set_mesh", "debug_nans_infs", "disable_jit"])
def test_split_and_concatenate_in_any_context(context: str) -> None:
    truth = _special_values(np.float32)
    x = place(truth, NamedSharding(WORLD, P("data", "model")))
    with CONTEXTS[context]():
        parts = reshard.split_by_mesh_axis([x], "data", donate=True)
        assert x.is_deleted()  # consumed, as documented, in any context
        (back,) = reshard.concatenate_by_mesh_axis(parts, "data")
    assert all(p[0].is_deleted() for p in parts)
    check_result(back, truth, NamedSharding(WORLD, P("data", "model")))


@pytest.mark.parametrize("scope", ["found", "missing"])
def test_reshard_moves_are_explicit_transfers(
    capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, scope: str
) -> None:
    """Under ``transfer_guard("log")``, ``jax.device_put`` logs nothing; nor does reshard
    (its host buffers put on devices are explicit transfers, as device_put's are), also
    where JAX's explicit-transfer scope is not found (a future JAX): the private batched
    put, which it made explicit, then stands down for ``jax.device_put``."""
    if scope == "missing":
        monkeypatch.setattr(_compat, "_explicit_put_scope", None)
    truth = _special_values(np.float32)
    x = place(truth, NamedSharding(WORLD, P("data")))
    dsts = [
        NamedSharding(HALF, P(None, "model")),  # a relayout
        # Only the memory kind changes: PjRt's batched copy of whole shards.
        NamedSharding(WORLD, P("data"), memory_kind="pinned_host"),
        # A relayout into another memory kind: the device executor's batched moves.
        NamedSharding(WORLD, P(None, "data"), memory_kind="pinned_host"),
    ]
    capfd.readouterr()
    for dst in dsts:
        for executor in ("host", "device", "collective"):
            with jax.transfer_guard("log"):
                y = reshard.reshard(x, dst, executor=executor)
            check_result(y, truth, dst)
    err = capfd.readouterr().err
    assert "transfer" not in err, err


def test_disallow_explicit_can_refuse_a_reshard_where_device_put_moves_nothing() -> None:
    # A reshard's moves are explicit transfers: under "disallow_explicit" the host
    # executor's are refused, also where jax.device_put needs none (an unchanged
    # sharding: it hands the input back; a new device order alone: it runs a program,
    # which the guard does not count). Refused before any output exists: x intact.
    truth = _special_values(np.float32)
    x = place(truth, NamedSharding(WORLD, P("data")))
    reordered = Mesh(np.array(DEVICES[::-1]).reshape(2, 4), ("data", "model"))
    for dst in (x.sharding, NamedSharding(reordered, P("data"))):
        with jax.transfer_guard("disallow_explicit"):
            check_result(jax.device_put(x, dst), truth, dst)
            with pytest.raises(Exception, match="Disallowed") as refused:
                reshard.reshard(x, dst, executor="host")
        assert "its moves are explicit transfers" in str(refused.value.__notes__)
        check_result(x, truth, x.sharding)


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("guard", ["full", "host"])
def test_a_guard_refusing_transfers_says_why_they_are_made(
    executor: str, donate: bool, guard: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # On a TPU v5e, programs do not keep every bit of bfloat16, so the device executor
    # cuts and assembles it through host memory (as the collective executor packs it),
    # which "disallow_explicit" refuses where Pathways moves it device to device (as in
    # MaxText's weight sync, which guards device <-> host only). Faked here: bfloat16
    # marked inexact. The full guard also refuses float32: the device executor copies
    # pieces between devices (explicit, where jax.device_put runs a program). Either
    # way the error says why and how to let it; the input is intact, donated or not;
    # "allow" moves it.
    from reshard import _exact

    d = DEVICES[0]
    for only_copies in (False, True):
        key = (d.platform, str(d.device_kind), "bfloat16", only_copies)
        monkeypatch.setitem(_exact._known, key, only_copies)
    src, dst = NamedSharding(HALF, P("data")), NamedSharding(WORLD, P(None, "model"))
    guards = {
        "full": [jax.transfer_guard],
        "host": [jax.transfer_guard_device_to_host, jax.transfer_guard_host_to_device],
    }[guard]
    for dtype in (jnp.bfloat16, np.float32):
        truth = _special_values(dtype)
        x = place(truth, src)
        through_host = executor != "device" or dtype == jnp.bfloat16  # (on "CPU")
        with contextlib.ExitStack() as stack:
            for g in guards:
                stack.enter_context(g("disallow_explicit"))
            if guard == "host" and not through_host:  # device to device: allowed
                y = reshard.reshard(x, dst, executor=executor, cache_resharding_plans=False)
                check_result(y, truth, dst)
                continue
            with pytest.raises(jax.errors.JaxRuntimeError, match="Disallowed") as refused:
                reshard.reshard(
                    x, dst, executor=executor, donate=donate, cache_resharding_plans=False
                )
        notes = str(refused.value.__notes__)
        assert notes.count("reshard: a transfer guard refused") == 1, notes
        if executor == "device" and dtype == jnp.bfloat16:
            assert "arrays of bfloat16 are cut and assembled through host memory" in notes
        else:
            assert "its moves are explicit transfers" in notes, notes
        assert "the inputs are intact" in notes
        check_result(x, truth, src)
        with jax.transfer_guard("allow"):
            check_result(reshard.reshard(x, dst, executor=executor, donate=donate), truth, dst)
        assert x.is_deleted() == donate


@pytest.mark.parametrize("who", ["reshard", "plan"])
def test_tracers_are_refused_with_the_leaf_and_what_to_do(who: str) -> None:
    src = NamedSharding(WORLD, P("data"))
    dst = NamedSharding(HALF, P(None, "model"))
    params = {"w": place(np.ones((8, 16), np.float32), src), "step": 3}
    shardings = {"w": dst, "step": NamedSharding(HALF, P())}
    call = {"reshard": reshard.reshard, "plan": reshard.plan}[who]
    with pytest.raises(
        jax.errors.ConcretizationTypeError,
        match=r"leaf \['step'\] is a tracer: .*Call them outside the traced function",
    ):
        jax.jit(lambda step: call({"w": params["w"], "step": step}, shardings))(3)
    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"leaf \['w'\] is a tracer"):
        jax.vmap(lambda w: call({"w": w}, NamedSharding(HALF, P())), in_axes=1)(params["w"])
    plan = reshard.plan(params, shardings)
    # Every leaf is traced there; the first in tree order is named.
    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"leaf \['step'\] is a tracer"):
        jax.jit(plan.execute)(params)
    with (
        jax.set_mesh(WORLD),
        pytest.raises(jax.errors.ConcretizationTypeError, match=r"leaf \['w'\] is a tracer"),
    ):
        jax.jit(lambda w: plan.execute({"w": w, "step": 3}))(params["w"])
    assert not params["w"].is_deleted()


def test_split_and_concatenate_refuse_tracers_by_name() -> None:
    x = place(np.ones((8, 16), np.float32), NamedSharding(WORLD, P("data")))
    with pytest.raises(
        jax.errors.ConcretizationTypeError, match=r"arrays\['w'\] is a tracer: split_by_mesh"
    ):
        jax.jit(lambda w: reshard.split_by_mesh_axis({"w": w}, "data"))(x)
    parts = reshard.split_by_mesh_axis(x, "data")
    with pytest.raises(jax.errors.ConcretizationTypeError, match=r"is a tracer"):
        jax.jit(lambda a, b: reshard.concatenate_by_mesh_axis([a, b], "data"))(*parts)
    assert not x.is_deleted()
