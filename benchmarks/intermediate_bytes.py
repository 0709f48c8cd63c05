"""Bytes moved: our direct plan against the seed's intermediate-sharding route.

The route (``reshard_with_intermediate_sharding``) reshards to the intermediate
sharding, keeps the first replica (no bytes move) and reshards that to the output. Its
cost is the sum of two plans' ``bytes_moved``. Everything here is planned from
``jax.ShapeDtypeStruct``s, so no array is allocated and any shape can be used.

Run: ``python benchmarks/intermediate_bytes.py`` (simulates 8 CPU devices).
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import reshard  # noqa: E402
from reshard import plan  # noqa: E402


def named(shape, names, spec, ids):
    devices = np.array([jax.devices()[i] for i in ids]).reshape(shape)
    return NamedSharding(Mesh(devices, names), spec)


def route_bytes(struct, out):
    """Bytes the intermediate route moves, or None when it reshards directly."""
    try:
        inter, replica_axes = reshard.find_intermediate_sharding(struct.sharding, out)
    except reshard.NoIntermediateShardingError:
        return None
    to_inter = plan(struct, inter, cache=False).stats.bytes_moved
    kept = jax.ShapeDtypeStruct(struct.shape, struct.dtype, sharding=inter)
    for axis in replica_axes:
        kept = reshard.split_by_mesh_axis(kept, axis)[0]
    return to_inter + plan(kept, out, cache=False).stats.bytes_moved


CASES = [
    # (name, shape, in sharding, out sharding)
    (
        "[fsdp:8] rows -> [tp:4] cols, devs 4-7",
        (4096, 4096),
        named((8,), ("fsdp",), P("fsdp", None), range(8)),
        named((4,), ("tp",), P(None, "tp"), range(4, 8)),
    ),
    (
        "[fsdp:8] rows -> [tp:4] cols, devs 0-3",
        (4096, 4096),
        named((8,), ("fsdp",), P("fsdp", None), range(8)),
        named((4,), ("tp",), P(None, "tp"), range(4)),
    ),
    (
        "[fsdp:8] rows -> [dp:2,tp:4] cols",
        (4096, 4096),
        named((8,), ("fsdp",), P("fsdp", None), range(8)),
        named((2, 4), ("dp", "tp"), P(None, "tp"), range(8)),
    ),
    (
        "[x:2,fsdp:4] rows -> [tp:2] cols, devs 6-7",
        (4096, 4096),
        named((2, 4), ("x", "fsdp"), P("fsdp", None), range(8)),
        named((2,), ("tp",), P(None, "tp"), [6, 7]),
    ),
    (
        "[a:2,b:4] (b,a) -> 1 device",
        (4096, 4096),
        named((2, 4), ("a", "b"), P("b", "a"), range(8)),
        named((1,), ("t",), P(None, None), [7]),
    ),
    (
        "[fsdp:8] rows -> [tp:4] rows (none needed)",
        (4096, 4096),
        named((8,), ("fsdp",), P("fsdp", None), range(8)),
        named((4,), ("tp",), P("tp", None), range(4, 8)),
    ),
    (
        "[fsdp:8] dim 1 -> [tp:4] dim 0 (3-D)",
        (64, 4096, 16),
        named((8,), ("fsdp",), P(None, "fsdp", None), range(8)),
        named((4,), ("tp",), P("tp", None, None), range(4)),
    ),
]


def main() -> None:
    mib = 1 << 20
    header = (
        f"{'case (float32)':<44} {'array':>9} {'direct':>10} {'via intermediate':>17} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, shape, src, dst in CASES:
        struct = jax.ShapeDtypeStruct(shape, np.float32, sharding=src)
        direct = plan(struct, dst, cache=False).stats.bytes_moved
        via = route_bytes(struct, dst)
        total = struct.size * 4
        via_text = "direct" if via is None else f"{via / mib:.1f} MiB"
        ratio = "" if via is None or not direct else f"{via / direct:.1f}x"
        print(
            f"{name:<44} {total / mib:>5.0f} MiB {direct / mib:>6.1f} MiB {via_text:>17} {ratio:>6}"
        )


if __name__ == "__main__":
    main()
