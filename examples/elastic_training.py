"""Elastic training on 8 simulated CPU devices: lose a replica, keep training, grow back.

A small MLP (plain jax.numpy + jax.grad, SGD with momentum) trains on a mesh
``data=2 x fsdp=4``: parameters and momentum are sharded over ``fsdp`` and replicated
over ``data``, so each ``data`` row holds a full copy of the state.

1. Mid-run, devices 4 and 5 (both in replica 1) fail: the step raises
   ``reshard.DeviceLossError``. ``reshard.ElasticManager`` shrinks the mesh to
   ``data=1 x fsdp=4`` on devices 0-3, recovers the state from replica 0 without
   reading devices 4-5, and retries the step. The recovered state is compared with a
   host copy saved before the loss (bit-exact), and training goes on with the loss
   still falling.
2. The devices come back: the state is spread onto all 8 devices again (bit-exact).
3. The data-loss case: a ZeRO-style state whose momentum is sharded over *all* 8
   devices has no second copy, so losing devices 4-5 raises ``reshard.DataLossError``
   naming the missing leaves and boxes, before anything moves.

Run: ``python examples/elastic_training.py`` (``--small`` for a quick run). Exits
non-zero if any check fails.
"""

from __future__ import annotations

import os

# Simulated devices must be configured before JAX initialises its backend.
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import reshard  # noqa: E402

log = logging.getLogger("elastic_training")

# Where each leaf lives: parameters and momentum sharded over fsdp, replicated over data.
SPECS = {
    "w1": P(None, "fsdp"),
    "b1": P("fsdp"),
    "w2": P("fsdp", None),
    "b2": P(),
}
BATCH = P(("data", "fsdp"))


def init_state(key: jax.Array, d_in: int, hidden: int) -> dict[str, Any]:
    k1, k2 = jax.random.split(key)
    params = {
        "w1": jax.random.normal(k1, (d_in, hidden), jnp.float32) / np.sqrt(d_in),
        "b1": jnp.zeros((hidden,), jnp.float32),
        "w2": jax.random.normal(k2, (hidden, 1), jnp.float32) / np.sqrt(hidden),
        "b2": jnp.zeros((1,), jnp.float32),
    }
    momentum = jax.tree.map(jnp.zeros_like, params)
    return {"params": params, "momentum": momentum, "step": jnp.zeros((), jnp.int32)}


def state_shardings(mesh: Mesh, specs: dict[str, P] = SPECS) -> dict[str, Any]:
    per_leaf = {k: NamedSharding(mesh, s) for k, s in specs.items()}
    return {"params": per_leaf, "momentum": per_leaf, "step": NamedSharding(mesh, P())}


def mlp(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return (h @ params["w2"] + params["b2"])[:, 0]


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((mlp(params, x) - y) ** 2)


def update(state: dict[str, Any], x: jax.Array, y: jax.Array, lr: float = 0.1, beta: float = 0.5):
    loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
    momentum = jax.tree.map(lambda m, g: beta * m + g, state["momentum"], grads)
    params = jax.tree.map(lambda p, m: p - lr * m, state["params"], momentum)
    return {"params": params, "momentum": momentum, "step": state["step"] + 1}, loss


_compiled: dict[tuple[int, ...], Any] = {}


def compiled_step(mesh: Mesh) -> Any:
    """One jitted step per mesh; shardings pinned so the state stays on its specs."""
    key = tuple(mesh.device_ids.ravel().tolist()) + tuple(mesh.devices.shape)
    if key not in _compiled:
        sh, batch = state_shardings(mesh), NamedSharding(mesh, BATCH)
        _compiled[key] = jax.jit(
            update,
            in_shardings=(sh, batch, batch),
            out_shardings=(sh, NamedSharding(mesh, P())),
        )
    return _compiled[key]


def to_host(tree: Any) -> Any:
    # np.array copies: the device buffers may be freed (donated) later.
    return jax.tree.map(lambda a: np.array(a), tree)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def same_bits(tree: Any, host: Any) -> bool:
    pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(host), strict=True)
    return all(np.array(a).tobytes() == b.tobytes() for a, b in pairs)


def device_ids(tree: Any) -> list[int]:
    return sorted({d.id for a in jax.tree.leaves(tree) for d in a.devices()})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny model and few steps (tests)")
    ap.add_argument("--steps", type=int, default=None, help="steps per phase (>= 1)")
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    d_in, hidden, n, steps = (16, 32, 64, 6) if args.small else (64, 512, 1024, 30)
    steps = args.steps if args.steps is not None else steps
    logging.basicConfig(
        level=logging.INFO, format="%(levelname)-7s %(name)s: %(message)s", stream=sys.stdout
    )
    failures: list[str] = []

    def check(ok: bool, what: str) -> None:
        log.info("check %s: %s", "passed" if ok else "FAILED", what)
        if not ok:
            failures.append(what)

    devices = np.array(jax.devices()[:8]).reshape(2, 4)
    full = Mesh(devices, ("data", "fsdp"))
    log.info("mesh %s, device ids %s", dict(full.shape), full.device_ids.tolist())

    # A fixed regression task: the targets come from a random "teacher" MLP.
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, d_in)).astype(np.float32)
    teacher = init_state(jax.random.key(1), d_in, hidden)["params"]
    y = np.asarray(mlp(teacher, jnp.asarray(x))).astype(np.float32)

    state = reshard.reshard(init_state(jax.random.key(0), d_in, hidden), state_shardings(full))
    nbytes = sum(a.nbytes for a in jax.tree.leaves(state))
    log.info("state: %s in %d leaves", fmt_bytes(nbytes), len(jax.tree.leaves(state)))

    manager = reshard.ElasticManager(full, "data", donate=True)
    # The first state each mesh receives: lets us compare recovered states with copies.
    arrivals: list[tuple[dict[str, int], Any]] = []
    fail_at = {"step": steps, "fired": False}

    def step_fn(state: Any, mesh: Mesh, xb: np.ndarray, yb: np.ndarray) -> tuple[Any, Any]:
        if not arrivals or arrivals[-1][0] != dict(mesh.shape):
            arrivals.append((dict(mesh.shape), state))
        if int(state["step"]) == fail_at["step"] and not fail_at["fired"]:
            fail_at["fired"] = True
            # On hardware this is a runtime error naming the devices.
            raise reshard.DeviceLossError([4, 5], "simulated: devices 4 and 5 stopped responding")
        return compiled_step(mesh)(state, xb, yb)

    losses: list[float] = []

    def train(k: int) -> None:
        nonlocal state
        for _ in range(k):
            state, loss = manager.run_step(step_fn, state, x, y)
            losses.append(float(loss))
            s = int(state["step"])
            if s % max(1, steps // 3) == 0 or s <= 1:
                log.info("step %3d  loss %.6f  on mesh %s", s, losses[-1], dict(manager.mesh.shape))

    # Phase 1: eight devices; the loss happens during step `steps`.
    log.info("--- phase 1: training on 8 devices (data=2 x fsdp=4)")
    train(steps)
    loss_before = losses[-1]
    log.info("--- phase 2: devices 4 and 5 fail during step %d", steps)
    saved = to_host(state)  # to check the recovery against; not used to recover
    # What the recovery will do, planned from shardings alone (nothing moves here).
    small = reshard.shrink_mesh(full, [4, 5], "data")
    preview = reshard.plan(state, reshard.carry_shardings(state, small), avoid_devices=[4, 5])
    log.info("recovery plan:\n%s", preview)
    log.info(
        "replica 0 (devices 0-3) already holds the new layout: %s to copy, %s kept",
        fmt_bytes(preview.stats.bytes_moved),
        fmt_bytes(preview.stats.bytes_kept),
    )
    t0 = time.perf_counter()
    train(1)  # the step raises DeviceLossError, the manager recovers and retries
    log.info(
        "step with failure, recovery, retry (and compiling for the new mesh) took %.1f ms",
        (time.perf_counter() - t0) * 1e3,
    )
    shrink = manager.events[-1]
    recovered = arrivals[-1][1]
    check(dict(manager.mesh.shape) == {"data": 1, "fsdp": 4}, "mesh shrank to data=1 x fsdp=4")
    check(device_ids(recovered) == [0, 1, 2, 3], "state recovered onto devices 0-3")
    check(
        same_bits(recovered, saved),
        "recovered state is bit-exact with the copy saved before the loss",
    )
    loss_at_loss = losses[-1]
    train(steps)
    check(
        losses[-1] < loss_at_loss < loss_before,
        f"loss still falling on 4 devices ({loss_before:.6f} -> {loss_at_loss:.6f} -> {losses[-1]:.6f})",
    )

    log.info("--- phase 3: devices 4 and 5 are back")
    before_grow = to_host(state)
    manager.mark_returned([4, 5])
    train(1)
    grow = manager.events[-1]
    check(dict(manager.mesh.shape) == {"data": 2, "fsdp": 4}, "mesh grew back to data=2 x fsdp=4")
    check(device_ids(arrivals[-1][1]) == list(range(8)), "state spread onto devices 0-7")
    check(same_bits(arrivals[-1][1], before_grow), "spread state is bit-exact")
    loss_at_grow = losses[-1]
    train(steps)
    check(
        losses[-1] < loss_at_grow,
        f"loss still falling on 8 devices ({loss_at_grow:.6f} -> {losses[-1]:.6f})",
    )

    log.info("--- phase 4: the data-loss case (momentum sharded over all 8 devices, one copy)")
    zero_specs = {k: P(("data", "fsdp")) if k == "w1" else s for k, s in SPECS.items()}
    zero_sh = state_shardings(full)
    zero_sh["momentum"] = state_shardings(full, zero_specs)["momentum"]
    zero_state = reshard.reshard(state, zero_sh)
    kept = to_host(zero_state)
    try:
        reshard.recover(zero_state, small, lost_devices=[4, 5], donate=True)
        check(False, "DataLossError raised")
    except reshard.DataLossError as e:
        log.info("DataLossError: %s", e)
        for path, box in e.missing:
            shape = "x".join(str(b - a) for a, b in box)
            log.info("  missing: %s box %s (%s elements)", path, list(box), shape)
        # Devices 4 and 5 held rows [4/8, 6/8) of w1's momentum, and nothing else had them.
        expected = [("['momentum']['w1']", ((d_in // 2, 3 * d_in // 4), (0, hidden)))]
        check(e.missing == expected, f"DataLossError names exactly {expected}")
        check(
            not any(a.is_deleted() for a in jax.tree.leaves(zero_state))
            and same_bits(zero_state, kept),
            "inputs untouched after DataLossError (even with donate=True)",
        )

    log.info(
        "summary: shrink recovered %s (%s moved) in %.1f ms; grow recovered %s (%s moved) in %.1f ms; loss %.6f -> %.6f",
        fmt_bytes(shrink.state_bytes),
        fmt_bytes(shrink.bytes_moved),
        shrink.seconds * 1e3,
        fmt_bytes(grow.state_bytes),
        fmt_bytes(grow.bytes_moved),
        grow.seconds * 1e3,
        losses[0],
        losses[-1],
    )
    if failures:
        log.error("%d check(s) failed: %s", len(failures), failures)
        return 1
    log.info("all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
