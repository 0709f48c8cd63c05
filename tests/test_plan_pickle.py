"""Plans are serialisable: ``pickle`` keeps everything but compiled programs, with
devices by platform and id, so a plan loads wherever the same devices exist."""

from __future__ import annotations

import copy
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import check_result, place, random_values
from jax.sharding import Mesh, NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import reshard

DEVS = np.array(jax.devices())
SRC_MESH = Mesh(DEVS[:4].reshape(2, 2), ("a", "b"))
DST_MESH = Mesh(DEVS[[7, 5, 6, 4]].reshape(2, 2), ("a", "b"))


def _case() -> tuple[dict, dict, dict]:
    rng = np.random.default_rng(0)
    truth = {
        "w": random_values(rng, (8, 12), "bfloat16"),
        "pinned": random_values(rng, (4, 6), "float32"),
        "key": random_values(rng, (4,), "key"),
        "scalar": 3,
    }
    x = {
        "w": place(truth["w"], NamedSharding(SRC_MESH, P(None, "b"))),  # 2 replicas
        "pinned": place(truth["pinned"], NamedSharding(SRC_MESH, P(None, "b"))),
        "key": place(truth["key"], NamedSharding(SRC_MESH, P("a"))),
        "scalar": 3,
    }
    dst = {
        "w": NamedSharding(DST_MESH, P("b", "a")),
        "pinned": NamedSharding(DST_MESH, P("a"), memory_kind="pinned_host"),
        "key": SingleDeviceSharding(DEVS[6]),
        "scalar": NamedSharding(DST_MESH, P()),
    }
    return x, dst, truth


@pytest.mark.parametrize("executor", ["host", "device", "collective"])
def test_a_pickled_plan_is_the_same_plan(executor: str) -> None:
    x, dst, truth = _case()
    plan = reshard.plan(x, dst, executor=executor, avoid_devices=[3])
    for loaded in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan)):
        assert loaded is not plan
        assert loaded.leaves == plan.leaves and loaded.leaf_plans == plan.leaf_plans
        assert loaded.stats == plan.stats and loaded.treedef == plan.treedef
        assert (loaded.executor, loaded.avoid_devices) == (executor, frozenset({3}))
        assert loaded.to_dict() == plan.to_dict() and str(loaded) == str(plan)
        # The devices are this process's own objects, not copies.
        (w_leaf,) = [leaf for leaf in loaded.leaves if leaf.path == "['w']"]
        mesh = w_leaf.dst_sharding.mesh
        assert all(a is b for a, b in zip(mesh.devices.flat, DST_MESH.devices.flat, strict=True))
        out = loaded.execute(x)
        for name in ("w", "pinned", "key"):
            check_result(out[name], truth[name], dst[name])
        assert int(out["scalar"]) == 3 and out["scalar"].sharding == dst["scalar"]


def test_a_plan_loads_in_another_process_with_the_same_devices(tmp_path: Path) -> None:
    x, dst, truth = _case()
    plan = reshard.plan(x, dst)
    (tmp_path / "plan.pkl").write_bytes(pickle.dumps(plan))
    np.save(tmp_path / "w.npy", np.asarray(truth["w"]).view(np.uint16))
    np.save(tmp_path / "pinned.npy", np.asarray(truth["pinned"]))
    np.save(tmp_path / "key.npy", np.asarray(jax.random.key_data(truth["key"])))
    # The loaded plan runs there too, on arrays made there, checked against the truth.
    script = textwrap.dedent(
        f"""
        import pickle, sys
        import jax
        jax.config.update("jax_num_cpu_devices", {{n}})
        import ml_dtypes
        import numpy as np
        from helpers import check_result, place
        try:
            plan = pickle.loads(open({str(tmp_path / "plan.pkl")!r}, "rb").read())
        except ValueError as e:
            print("ERROR", e)
            sys.exit(0)
        print(plan.stats.bytes_moved, plan.executor)
        load = lambda name: np.load({str(tmp_path)!r} + "/" + name + ".npy")
        truth = {{
            "w": load("w").view(ml_dtypes.bfloat16),
            "pinned": load("pinned"),
            "key": jax.random.wrap_key_data(load("key")),
        }}
        leaves = {{leaf.path: leaf for leaf in plan.leaves}}
        x = {{k: place(v, leaves[f"['{{k}}']"].src_sharding) for k, v in truth.items()}}
        out = plan.execute({{**x, "scalar": 3}})
        for k, v in truth.items():
            check_result(out[k], v, leaves[f"['{{k}}']"].dst_sharding)
        assert int(out["scalar"]) == 3
        print("ran")
        """
    )
    for n, expect in (
        (8, f"{plan.stats.bytes_moved} host"),
        (4, "ERROR this plan uses cpu device"),
    ):
        res = subprocess.run(
            [sys.executable, "-c", script.replace("{n}", str(n))],
            capture_output=True,
            text=True,
            timeout=120,
            env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)},
        )
        assert res.returncode == 0, res.stderr
        assert res.stdout.startswith(expect), res.stdout
        assert res.stdout.rstrip().endswith("ran") == (n == 8), res.stdout
    assert "plan again here with reshard.plan" in res.stdout


def test_a_plan_copies_without_pickling_its_tree() -> None:
    # A plan is immutable: copy.deepcopy needs no pickle, so a pytree class defined
    # in a function (which pickle refuses) copies too.
    import dataclasses

    def local_class() -> type:
        @jax.tree_util.register_dataclass
        @dataclasses.dataclass
        class Params:
            w: object

        return Params

    params = local_class()
    x, dst, truth = _case()
    tree = params(x["w"])
    plan = reshard.plan(tree, dst["w"])
    with pytest.raises(AttributeError):  # pickle itself refuses the class
        pickle.dumps(plan)
    for copied in (copy.deepcopy(plan), copy.copy(plan)):
        assert copied is not plan and not copied._cache
        assert copied.leaves == plan.leaves and copied.stats == plan.stats
        assert copied.stats.send_bytes is not plan.stats.send_bytes
        check_result(copied.execute(tree).w, truth["w"], dst["w"])
