"""Reshard across two local processes: process 0's devices -> process 1's devices.

Run: ``python examples/multiprocess_reshard.py``. The launcher starts 2 JAX processes
with 4 simulated CPU devices each (gloo collectives on 127.0.0.1); every process runs
``main`` with the same arguments, as the multi-controller contract requires.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def main() -> list[float]:
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard

    devs = np.array(jax.devices())  # 8 global devices, 4 per process
    truth = np.arange(1024 * 1024, dtype=np.float32).reshape(1024, 1024)
    src = NamedSharding(Mesh(devs[:4], ("fsdp",)), P("fsdp"))
    dst = NamedSharding(Mesh(devs[4:], ("tp",)), P(None, "tp"))
    # dtype= is needed: process 1 holds none of the source shards.
    x = jax.make_array_from_callback(truth.shape, src, lambda idx: truth[idx], dtype=truth.dtype)
    y = reshard.reshard(x, dst)  # every process makes this same call
    for s in y.addressable_shards:  # this process's destination shards, checked exactly
        np.testing.assert_array_equal(np.asarray(s.data), truth[s.index])
    return [float(np.asarray(s.data).sum()) for s in y.addressable_shards]


if __name__ == "__main__":
    from reshard import launch_local

    results = launch_local(
        f"{Path(__file__).resolve()}:main", num_processes=2, devices_per_process=4, timeout_s=120
    )
    for r in results:
        print(f"process {r.process_id}: shard sums {r.value}")
