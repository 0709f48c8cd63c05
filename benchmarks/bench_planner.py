"""Planner scaling on synthetic devices: a 100-leaf tree from 4096 to 3072 devices.

``python benchmarks/bench_planner.py [--leaves 100] [--src 4096] [--dst 3072]``

No JAX devices are involved: shard boxes come from ``named_shard_boxes`` with
synthetic device ids, so this runs anywhere. Prints planning time and plan statistics.
"""

from __future__ import annotations

import argparse
import time

from reshard._geometry import named_shard_boxes
from reshard._planner import LeafSpec, ShardSpec, plan_leaves


def synthetic_leaf(
    name: str,
    shape: tuple[int, ...],
    itemsize: int,
    src: tuple[tuple[int, ...], tuple[str, ...], tuple, list[int]],
    dst: tuple[tuple[int, ...], tuple[str, ...], tuple, list[int]],
    devices_per_process: int = 8,
) -> LeafSpec:
    """A ``LeafSpec`` for NamedSharding-like layouts on synthetic device ids.

    ``src``/``dst`` are ``(mesh shape, axis names, spec, device ids in mesh order)``.
    """

    def shards(
        side: tuple[tuple[int, ...], tuple[str, ...], tuple, list[int]],
    ) -> tuple[ShardSpec, ...]:
        mesh_shape, names, spec, ids = side
        boxes = named_shard_boxes(shape, mesh_shape, names, spec)
        return tuple(
            ShardSpec(dev, "device", dev // devices_per_process, box)
            for dev, box in zip(ids, boxes.values(), strict=True)
        )

    return LeafSpec(name, shape, itemsize, shards(src), shards(dst))


def llm_leaves(n_leaves: int, n_src: int, n_dst: int) -> list[LeafSpec]:
    """``n_leaves`` matrices: src mesh (data, fsdp) -> dst mesh (data, tp), disjoint ids."""
    src_mesh = (n_src // 64, 64)
    dst_mesh = (n_dst // 64, 64)
    src = (src_mesh, ("data", "fsdp"), ("fsdp", None), list(range(n_src)))
    dst = (dst_mesh, ("data", "tp"), (None, "tp"), list(range(n_src, n_src + n_dst)))
    shapes = [(8192, 8192), (8192, 28672), (28672, 8192), (8192,)]
    out = []
    for i in range(n_leaves):
        shape = shapes[i % len(shapes)]
        s = src if len(shape) == 2 else (src_mesh, ("data", "fsdp"), (), src[3])
        d = dst if len(shape) == 2 else (dst_mesh, ("data", "tp"), (), dst[3])
        out.append(synthetic_leaf(f"layer{i}", shape, 2, s, d))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--leaves", type=int, default=100)
    ap.add_argument("--src", type=int, default=4096)
    ap.add_argument("--dst", type=int, default=3072)
    a = ap.parse_args()
    t0 = time.perf_counter()
    leaves = llm_leaves(a.leaves, a.src, a.dst)
    t1 = time.perf_counter()
    _, stats = plan_leaves(leaves)
    t2 = time.perf_counter()
    print(f"{a.leaves} leaves, {a.src} -> {a.dst} devices")
    print(f"  building shard lists: {t1 - t0:.2f} s; planning: {t2 - t1:.2f} s")
    print(
        f"  transfers: {stats.transfers}, moved {stats.bytes_moved / 2**30:.1f} GiB "
        f"(lower bound {stats.bytes_lower_bound / 2**30:.1f} GiB), "
        f"max/mean send {stats.max_send_bytes / max(stats.mean_send_bytes, 1):.2f}"
    )


if __name__ == "__main__":
    main()
