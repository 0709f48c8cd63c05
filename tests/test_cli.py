"""The ``reshard`` command line, run as a user runs it: subprocesses, small sizes.
(``plan``'s reports and most usage errors run in this process, through the same entry
point: a subprocess costs ~2 s to start Python and JAX; what depends on the process
itself, such as start-up, pipes, terminals and the environment, still runs as one.)

What the CLI prints must be the library's own numbers: ``--json`` outputs are compared
with plans built here, in this process (8 simulated devices from ``conftest``), from the
same shardings; and every plan must move exactly the lower bound. Command-line mistakes
must be one line on stderr with exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any
from unittest import mock

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import reshard
from reshard import _cli, _cli_scenarios

SIZE_MB = "4"


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    # The CLI chooses its own device count; colour must depend on the terminal only.
    for k in ("XLA_FLAGS", "FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE", "JAX_NUM_CPU_DEVICES"):
        env.pop(k, None)
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess[str]:
    """``python -m reshard ARGS`` with stdout/stderr captured (piped: no terminal)."""
    return subprocess.run(
        [sys.executable, "-m", "reshard", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=_env(**env),
    )


def run_json(*args: str, timeout: float = 120, **env: str) -> Any:
    res = run_cli(*args, "--json", timeout=timeout, **env)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def run_here(*args: str) -> subprocess.CompletedProcess[str]:
    """``reshard ARGS`` run in this process, piped as ``run_cli``'s are and in the same
    environment as its subprocess (without the variables that choose colour): for
    ``plan``, which needs no devices, saving ~2 s per run (starting Python and JAX)."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, _env(), clear=True),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
    ):
        code = _cli.main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def run_here_json(*args: str) -> Any:
    res = run_here(*args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def roundtrip(x: Any) -> Any:
    """What a value looks like after JSON (int keys become strings, tuples lists)."""
    return json.loads(json.dumps(x))


def check_report(report: dict[str, Any]) -> None:
    """Internal consistency of a report: optimal, and the matrix adds up to the stats."""
    s = report["stats"]
    assert s["bytes_moved"] == s["bytes_lower_bound"]
    m = np.array(report["matrix"]["bytes"], dtype=np.int64)
    src_blocks, dst_blocks = report["matrix"]["src_blocks"], report["matrix"]["dst_blocks"]
    assert m.shape == (len(src_blocks), len(dst_blocks))
    assert m.sum() == s["bytes_moved"]
    assert sum(s["send_bytes"].values()) == s["bytes_moved"]
    assert sum(s["recv_bytes"].values()) == s["bytes_moved"]
    for row, ids in zip(m, src_blocks, strict=True):
        assert row.sum() == sum(s["send_bytes"].get(str(i), 0) for i in ids)
    for col, ids in zip(m.T, dst_blocks, strict=True):
        assert col.sum() == sum(s["recv_bytes"].get(str(i), 0) for i in ids)


def check_matrix_equals_library(report: dict[str, Any], plan: reshard.Plan) -> None:
    """With one device per block, the report's matrix is ``Plan.transfer_matrix()``."""
    srcs, dsts, m = plan.transfer_matrix()
    assert [b for (b,) in report["matrix"]["src_blocks"]] == srcs
    assert [b for (b,) in report["matrix"]["dst_blocks"]] == dsts
    np.testing.assert_array_equal(np.array(report["matrix"]["bytes"]), m)


def one_line_usage_error(res: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("reshard") and "error:" in lines[0], lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


# ----------------------------------------------------------------------------------
# demo
# ----------------------------------------------------------------------------------


def _library_plans(size_mb: float) -> dict[str, reshard.Plan]:
    """The demo's scenarios planned here, from avals and shardings only."""
    tree, _ = _cli_scenarios.model_tree(size_mb, 8)
    plans = {}
    for sc in _cli_scenarios.scenarios(jax.devices()[:8]):
        src = _cli_scenarios._shardings(tree, sc.src_mesh, sc.src_style)
        dst = _cli_scenarios._shardings(tree, sc.dst_mesh, sc.dst_style)
        avals = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, np.dtype(p.dtype), sharding=s),
            tree,
            src,
            is_leaf=_cli_scenarios._is_param,
        )
        plans[sc.key] = reshard.plan(avals, dst, avoid_devices=[d.id for d in sc.lost], cache=False)
    return plans


@pytest.mark.timeout(180)
def test_demo_json_matches_library_plans_and_verifies() -> None:
    out = run_json("demo", "--size-mb", SIZE_MB, "--repeats", "1", timeout=150)
    assert out["devices"] == 8 and out["processes"] == 1 and out["platform"] == "cpu"
    assert out["tree"]["arrays"] == 74
    assert [s["key"] for s in out["scenarios"]] == ["disjoint", "relayout", "shrink", "regrow"]
    plans = _library_plans(float(SIZE_MB))
    for sc in out["scenarios"]:
        assert sc["verify"]["ok"], sc["verify"]["problems"]
        assert sc["verify"]["arrays"] == 74 and sc["verify"]["shards"] > 74
        check_report(sc)
        plan = plans[sc["key"]]
        assert sc["stats"] == roundtrip(plan.stats.as_dict())
        check_matrix_equals_library(sc, plan)
        tm = sc["timing"]
        assert len(tm["reshard_ms"]) == 1 and tm["reshard_median_ms"] > 0
        assert tm["device_put_median_ms"] > 0 and tm["device_put_error"] is None
    shrink = out["scenarios"][2]
    assert shrink["lost_devices"] == [6, 7]
    assert all(shrink["stats"]["send_bytes"].get(str(d), 0) == 0 for d in (6, 7))
    # The relayout keeps what is already in place; the disjoint one cannot.
    assert out["scenarios"][1]["stats"]["bytes_kept"] > 0
    assert out["scenarios"][0]["stats"]["bytes_kept"] == 0


@pytest.mark.timeout(120)
def test_demo_human_output_is_plain_when_piped() -> None:
    res = run_cli("demo", "--devices", "4", "--size-mb", "2", "--repeats", "1", timeout=100)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "\x1b[" not in out  # no colour codes in a pipe
    assert "4 simulated cpu devices" in out
    assert out.count("verify  ok:") == 4
    assert out.count("= the lower bound: optimal") == 4
    assert "transfer matrix" in out and "summary" in out
    for title in ("trainer -> sampler", "relayout", "shrink 4 -> 3", "regrow 3 -> 4"):
        assert title in out
    # The heatmap of the disjoint scenario: source rows 0, 1 and columns 2, 3.
    assert "src\\dst  2 3" in out


@pytest.mark.timeout(240)
def test_demo_processes() -> None:
    available = all(
        importlib.util.find_spec(m) is not None
        for m in ("reshard._launch", "reshard._collective_executor")
    )
    args = ("demo", "--processes", "2", "--size-mb", "2", "--repeats", "1")
    if not available:
        res = run_cli(*args)
        assert res.returncode == 2 and "not available" in res.stderr
        return
    out = run_json(*args, timeout=220, RESHARD_DEMO_TIMEOUT_S="180")
    assert out["processes"] == 2 and out["devices"] == 8
    for sc in out["scenarios"]:
        assert sc["executor"] == "collective"
        assert sc["verify"]["ok"], sc["verify"]["problems"]
        check_report(sc)
        assert sc["timing"]["device_put_skipped"]


def test_demo_processes_unavailable_is_a_clean_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *a: Any) -> Any:
        return None if name == "reshard._collective_executor" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert _cli.main(["demo", "--processes", "2"]) == 2
    err = capsys.readouterr().err
    assert "--processes is not available in this build yet" in err
    assert "the collective executor" in err


def test_demo_device_counts_that_inflate_the_tree_are_named(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The model's width is a multiple of what every scenario's shard counts divide:
    # for 94 devices 6674, a 9.3 GiB tree however small --size-mb is.
    from reshard import _cli_demo

    monkeypatch.setattr(_cli_demo, "memory_mib", lambda: 4096.0)
    assert _cli.main(["demo", "--devices", "94", "--size-mb", "1"]) == 2
    err = capsys.readouterr().err
    assert "multiple of 6674" in err and "smallest tree 9,516 MiB and the demo's peak" in err
    assert "about 104,929 MiB, more than this machine's memory" in err  # ~11x, + JAX
    # Where the size asked for, not the device count, is too large, the message says so.
    with pytest.raises(
        _cli.UsageError, match=r"--size-mb 4300 the tree is 4,984 MiB.*smaller --size-mb"
    ):
        _cli_demo._check_args(argparse.Namespace(devices=30, processes=1, size_mb=4300.0))
    _cli_demo._check_args(argparse.Namespace(devices=30, processes=1, size_mb=1.0))
    assert "the tree is 101.8 MiB, not ~1.0 MiB" in capsys.readouterr().err
    # (Below a MiB in KiB and bytes: it read "0.0 MiB, not ~0.0001 MiB".)
    _cli_demo._check_args(argparse.Namespace(devices=2, processes=1, size_mb=0.0001))
    assert "the tree is 1.0 KiB, not ~105 B" in capsys.readouterr().err
    # Every process builds the whole tree: a size that one process fits, four do not.
    _cli_demo._check_args(argparse.Namespace(devices=8, processes=1, size_mb=200.0))
    with pytest.raises(
        _cli.UsageError,
        match=r"the tree is 197 MiB .* peak about 2,422 MiB in each of the 4 processes "
        r"\(9,689 MiB in all\), more than this machine's memory \(4,096 MiB\); ask for a "
        r"smaller --size-mb or fewer --processes",
    ):
        _cli_demo._check_args(argparse.Namespace(devices=8, processes=4, size_mb=200.0))
    with pytest.raises(_cli.UsageError, match=r"peak about 104,929 MiB in each of the 2 "):
        _cli_demo._check_args(argparse.Namespace(devices=94, processes=2, size_mb=1.0))
    _cli_demo._check_args(argparse.Namespace(devices=8, processes=1, size_mb=16.0))
    assert capsys.readouterr().err == ""


# ----------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------


def test_plan_json_matches_real_shardings() -> None:
    """Synthetic ids give exactly the plan of the same shardings on real devices."""
    ids = [7, 6, 5, 4, 3, 2, 1, 0]
    out = run_here_json(
        "plan", "--shape", "64,96", "--dtype", "float32",
        "--src-mesh", "2x4", "--src-axes", "data,model", "--src-spec", "data,model",
        "--dst-mesh", "2x2x2", "--dst-axes", "a,b,c", "--dst-spec", "a+b,c",
        "--dst-devices", ",".join(map(str, ids)), "--pieces",
    )  # fmt: skip
    devs = jax.devices()[:8]
    src = NamedSharding(Mesh(np.array(devs).reshape(2, 4), ("data", "model")), P("data", "model"))
    dst_mesh = Mesh(np.array([devs[i] for i in ids]).reshape(2, 2, 2), ("a", "b", "c"))
    dst = NamedSharding(dst_mesh, P(("a", "b"), "c"))
    plan = reshard.plan(jax.ShapeDtypeStruct((64, 96), np.float32, sharding=src), dst, cache=False)
    assert out["stats"] == roundtrip(plan.stats.as_dict())
    check_report(out)
    check_matrix_equals_library(out, plan)
    want = sorted(map(json.dumps, plan.to_dict()["leaves"][0]["pieces"]))
    got = sorted(map(json.dumps, out["leaves"][0]["pieces"]))
    assert got == want
    assert sum(p["bytes"] for p in out["leaves"][0]["pieces"]) == out["stats"]["bytes_moved"]
    assert out["destination"]["spec"] == [["a", "b"], "c"]


@pytest.mark.parametrize(
    "ids",
    [
        [7, 6, 5, 4, 3, 2, 1, 0],
        [3, 2, 0, 1],
        [0, 1, 2, 3, 8, 10, 11],
        [4096, 4097, 0, 1, 5],
        [9],
        list(np.random.default_rng(0).permutation(64)),
    ],
)
def test_device_ranges_keep_the_order_and_read_back(ids: list[int]) -> None:
    from reshard._cli_plan import devices_arg
    from reshard._cli_render import device_ranges

    text = device_ranges(int(i) for i in ids)
    assert devices_arg(text) == tuple(ids)
    assert len(text) <= len(",".join(map(str, ids)))


def test_plan_prints_devices_in_mesh_order() -> None:
    """A reversed destination is not the source: the printed lists say so, and the
    JSON's lists give the same plan when passed back. Piped (80 columns), a long list
    stays on its line, as it can only be passed back whole."""
    args = ("plan", "--shape", "64", "--src-mesh", "64", "--dst-mesh", "64")
    backwards = ",".join(str(i) for i in range(63, -1, -1))
    reverse = ("--dst-devices", backwards)
    res = run_here(*args, *reverse)
    assert res.returncode == 0, res.stderr
    assert "source:      mesh 64 (a0), spec (a0), devices 0-63\n" in res.stdout
    assert f"destination: mesh 64 (a0), spec (a0), devices {backwards}\n" in res.stdout
    out = run_here_json(*args, *reverse)
    assert out["source"]["devices"] == "0-63"
    assert out["destination"]["devices"] == backwards
    again = run_here_json(
        *args,
        "--src-devices", out["source"]["devices"],
        "--dst-devices", out["destination"]["devices"],
    )  # fmt: skip
    assert again["stats"] == out["stats"] and again["stats"]["bytes_kept"] == 0
    assert again["destination"] == out["destination"]


def test_plan_heatmap_keeps_one_line_per_row_when_piped_and_labels_blocks_exactly() -> None:
    # Piped, rich assumes 80 columns; 32 destination columns of 3 characters once
    # wrapped every row, so the cells no longer stood under their device ids.
    res = run_here(
        "plan", "--shape", "1024", "--src-mesh", "32", "--dst-mesh", "32", "--dst-spec", ""
    )
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("src\\dst"))
    assert lines[header].split()[1:] == [str(i) for i in range(32)]
    rows = lines[header + 1 : header + 33]
    assert [row.split()[0] for row in rows] == [str(i) for i in range(32)]
    assert all(len(row.split()) == 33 for row in rows), rows
    # Blocks whose ids are not one range are labelled as device lists are written.
    res = run_here(
        "plan", "--shape", "64", "--src-mesh", "8", "--src-devices", "0-3,100-103",
        "--dst-mesh", "8", "--dst-devices", "200-203,300-303", "--blocks", "3",
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "columns: destination devices 200-203,300-303 in 3 block(s)" in res.stdout
    labels = [line.split()[0] for line in res.stdout.splitlines()[-4:-1]]
    assert labels == ["0-2", "3,100-101", "102-103"], res.stdout


def test_plan_avoid_reads_surviving_replicas_only() -> None:
    out = run_here_json(
        "plan", "--shape", "1024,1024", "--src-mesh", "2x4", "--src-spec", "None,model",
        "--dst-mesh", "4", "--dst-axes", "x", "--dst-devices", "4-7", "--avoid", "0-3",
    )  # fmt: skip
    check_report(out)
    assert out["avoid"] == [0, 1, 2, 3]
    assert all(out["stats"]["send_bytes"].get(str(d), 0) == 0 for d in range(4))
    devs = jax.devices()[:8]
    src = NamedSharding(Mesh(np.array(devs).reshape(2, 4), ("data", "model")), P(None, "model"))
    dst = NamedSharding(Mesh(np.array(devs[4:]), ("x",)), P("x"))
    sds = jax.ShapeDtypeStruct((1024, 1024), jax.numpy.bfloat16, sharding=src)
    plan = reshard.plan(sds, dst, avoid_devices=range(4), cache=False)
    assert out["stats"] == roundtrip(plan.stats.as_dict())


def test_plan_devices_per_process_picks_senders_in_the_receivers_process() -> None:
    # A source replicated on devices 0 and 6, destination rows on 5 and 7: each
    # receiver reads the replica in its own process where there is one.
    def senders(per_process: str) -> dict[str, int]:
        out = run_here_json(
            "plan", "--shape", "8,8", "--dtype", "float32", "--src-mesh", "2",
            "--src-devices", "0,6", "--src-spec", "None,None", "--dst-mesh", "2",
            "--dst-devices", "5,7", "--devices-per-process", per_process,
        )  # fmt: skip
        check_report(out)
        return dict(out["stats"]["send_bytes"])

    assert senders("4") == {"6": 256}  # processes 0-3 | 4-7: 5, 6 and 7 in one
    assert senders("6,2") == {"0": 128, "6": 128}  # 0-5 | 6-7: 5 reads 0, 7 reads 6
    assert senders("8") == {"0": 128, "6": 128}  # one process: either replica
    res = run_here(
        "plan", "--shape", "8,8", "--src-mesh", "2", "--src-devices", "0,6",
        "--dst-mesh", "2", "--dst-devices", "5,7", "--devices-per-process", "4,2",
    )  # fmt: skip
    assert res.returncode == 2
    assert "device 6 is beyond the 6 devices that --devices-per-process 4,2" in res.stderr
    res = run_here("plan", "--shape", "8", "--src-mesh", "2", "--dst-mesh", "2",
                   "--devices-per-process", "4,0")  # fmt: skip
    assert res.returncode == 2 and "'0' is not a whole number >= 1" in res.stderr


def test_plan_notes_avoided_devices_that_hold_no_source_shard() -> None:
    args = ("plan", "--shape", "48,64", "--src-mesh", "2x4", "--src-axes", "r,f", "--src-spec",
            "f", "--dst-mesh", "6", "--dst-axes", "f", "--dst-spec", "f")  # fmt: skip
    res = run_here(*args, "--avoid", "6,7,100")
    assert res.returncode == 0, res.stderr
    line = next(s for s in res.stdout.splitlines() if "avoiding:" in s)
    assert line.endswith(
        "devices 6-7,100 (lost); device 100 holds no source shard, which changes nothing"
    )
    res = run_here(*args, "--avoid", "6-7,100-101")
    assert "devices 100-101 hold no source shard" in res.stdout
    res = run_here(*args, "--avoid", "6,7")
    line = next(s for s in res.stdout.splitlines() if "avoiding:" in s)
    assert line.endswith("devices 6-7 (lost)")


def test_plan_data_loss_is_exit_1_with_one_clean_line() -> None:
    args = ("plan", "--shape", "1024,1024", "--src-mesh", "2x4", "--dst-mesh", "4")
    res = run_here(*args, "--dst-axes", "x", "--avoid", "4-7")
    assert res.returncode == 1 and res.stdout == ""
    assert "Traceback" not in res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "data lost" in lines[0] and "[512:1024, 0:1024]" in lines[0]
    out = json.loads(run_here(*args, "--dst-axes", "x", "--avoid", "4-7", "--json").stdout)
    assert out["error"] == "DataLossError"


@pytest.mark.timeout(120)
def test_plan_4096_to_3072_synthetic_devices() -> None:
    args = (
        "plan", "--shape", "12288,8192", "--dtype", "bfloat16",
        "--src-mesh", "64x64", "--src-axes", "data,model", "--src-spec", "data,model",
        "--src-devices", "0-4095",
        "--dst-mesh", "48x64", "--dst-axes", "data,model", "--dst-spec", "data,model",
        "--dst-devices", "4096-7167",
    )  # fmt: skip
    out = run_here_json(*args)
    s = out["stats"]
    # Disjoint device sets: every byte moves, and that is the lower bound.
    assert s["bytes_moved"] == s["bytes_lower_bound"] == 12288 * 8192 * 2
    assert len(s["send_bytes"]) == 4096 and len(s["recv_bytes"]) == 3072
    assert set(s["send_bytes"].values()) == {12288 * 8192 * 2 // 4096}
    assert len(out["matrix"]["src_blocks"]) == 32 and len(out["matrix"]["dst_blocks"]) == 32
    check_report(out)
    res = run_here(*args)
    assert res.returncode == 0, res.stderr
    assert "per device (7,168 devices)" in res.stdout
    assert "destination devices 4096-7167 in 32 block(s) of up to 96" in res.stdout
    assert "= the lower bound: optimal" in res.stdout


def test_plan_colours_only_on_a_terminal() -> None:
    args = ("plan", "--shape", "64", "--src-mesh", "4", "--dst-mesh", "2")
    assert "\x1b[" not in run_cli(*args).stdout
    assert "\x1b[" in run_cli(*args, FORCE_COLOR="1").stdout


def test_piped_output_has_no_trailing_spaces() -> None:
    # rich pads tables and panels to the console's width; saved output must diff cleanly.
    for shape, per_device in (
        ("64,64", " device     sends   receives   new buffers\n"),
        # Zero-size: one line instead of a table of headers alone.
        ("0,4", "per device: no device sends, receives or allocates anything\n"),
    ):
        res = run_cli("plan", "--shape", shape, "--src-mesh", "2x4", "--dst-mesh", "4x2")
        assert res.returncode == 0, res.stderr
        assert per_device in res.stdout
        assert [line for line in res.stdout.splitlines() if line.endswith(" ")] == []


def test_trailing_spaces_are_dropped_only_at_the_end_of_a_line() -> None:
    import io

    buf = io.StringIO()
    out = _cli._NoTrailingSpaces(buf)
    for chunk in ("a  ", "b  ", "\nc ", " \n  d", "  "):
        out.write(chunk)
    # Spaces held back at the end of a write are written once the line goes on.
    assert buf.getvalue() == "a  b\nc\n  d"


@pytest.mark.parametrize(
    "name",
    [
        "bfloat16",
        "float8_e5m2",
        "float8_e4m3fn",
        "float8_e8m0fnu",
        "float4_e2m1fn",
        "int4",
        "uint2",
        "bool",
        "int8",
        "uint64",
        "float16",
        "complex64",
        "complex128",
    ],
)
def test_plan_dtype_takes_every_type_jax_arrays_have(name: str) -> None:
    from reshard._cli_plan import dtype_arg

    # (numpy 2.4 reads ml_dtypes' float8_e5m2 as kind "f", the other extra types as "V")
    assert dtype_arg(name) == np.dtype(getattr(jax.numpy, name))


def test_plan_refuses_replicated_words_as_axis_names_and_numbers_too_long_to_read() -> None:
    from reshard._cli import positive_int
    from reshard._cli_plan import axes_arg, devices_arg

    for word in ("None", "none", "_"):
        with pytest.raises(argparse.ArgumentTypeError, match="means a replicated dimension"):
            axes_arg(f"data,{word}")
    res = run_here("plan", "--shape", "8", "--src-mesh", "2", "--dst-mesh", "2", "--dev", "1")
    assert res.returncode == 2 and "unrecognized arguments: --dev 1" in res.stderr
    huge = "9" * 5000  # past Python's limit on the digits int() reads
    with pytest.raises(argparse.ArgumentTypeError, match=r"device ids are below 10\*\*18"):
        devices_arg(f"{huge},1")
    with pytest.raises(argparse.ArgumentTypeError, match=r"\(5,000 digits\) is too large"):
        positive_int(huge)
    assert devices_arg("0-3,999999999999999999") == (0, 1, 2, 3, 10**18 - 1)
    assert devices_arg("0" * 30 + "5") == (5,)  # (digits past leading zeros count)
    assert positive_int("0" * 4999 + "7") == 7
    for text in ("²", "8²", "①", "0" * 5000):
        with pytest.raises(argparse.ArgumentTypeError, match="is not a whole number >= 1"):
            positive_int(text)


@pytest.mark.parametrize("name", ["complex32", "bcomplex32", "finfo", "iinfo"])
def test_plan_dtype_refuses_ml_dtypes_names_jax_has_no_arrays_of(name: str) -> None:
    import argparse

    from reshard._cli_plan import dtype_arg

    with pytest.raises(argparse.ArgumentTypeError, match="not a dtype of JAX arrays"):
        dtype_arg(name)


@pytest.mark.parametrize(
    "args, needles",
    [
        (["plan", "--shape", "10x", "--src-mesh", "2", "--dst-mesh", "2"], ["--shape", "e.g."]),
        (["plan", "--src-mesh", "2", "--dst-mesh", "2"], ["required", "--shape"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--src-devices", "0-3", "--dst-mesh", "2"],
         ["--src-devices lists 4", "0-1"]),
        (["plan", "--shape", "10", "--src-mesh", "3", "--dst-mesh", "2"], ["not divisible by 3"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", "--dtype", "floaty"],
         ["not a dtype", "bfloat16"]),
        # numpy reads these as records, objects, strings, dates, or a syntax error
        *[(["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", f"--dtype={d}"],
           ["not a dtype", "bfloat16"])
          for d in (",8", "f4,f4", "object", "finfo", "S3", "M8[ns]", "V8", "float128", ">f4")],
        (["--bogus"], ["unrecognized arguments: --bogus; name a command first"]),
        (["--devices", "4", "demo"],
         ["unrecognized arguments: --devices; name a command first, then its flags"]),
        (["--size-mb", "4", "--devices", "4", "demo"],
         ["unrecognized arguments: --size-mb --devices; name a command first, then its flags"]),
        (["--size-mb", "4", "--devices", "4"],
         ["unrecognized arguments: --size-mb --devices; name a command first, then its flags"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", "--src-memory-kind",
          "bogus"], ["--src-memory-kind", "invalid choice: 'bogus'", "pinned_host"]),
        (["plan", "--shape", "16", "--src-mesh", "100000x100000", "--dst-mesh", "2"],
         ["10000000000 devices", "at most"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", "--avoid", "0-99999999999"],
         ["--avoid", "more than"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", "--count", "1000000000"],
         ["--count", "lower --count"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--src-spec", "foo", "--dst-mesh", "2"],
         ["['foo']", "does not define"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", "--avoid", "1"],
         ["destination uses"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--src-devices", "3-1", "--dst-mesh", "2"],
         ["inclusive ranges"]),
        (["plan", "--shape", "16", "--src-mesh", "2x2", "--src-axes", "a", "--dst-mesh", "2"],
         ["one name per mesh dimension"]),
        (["plan", "--shape", "16", "--src-mesh", "2", "--dst-mesh", "2", "--pieces"], ["--json"]),
        (["demo", "--devices", "7"], ["even number"]),
        # Sizes past any float: one line, not an OverflowError.
        (["demo", "--devices", "1" + "0" * 200], ["at most 65536 simulated devices"]),
        (["plan", "--shape", ",".join(["1" + "0" * 160] * 2), "--src-mesh", "2", "--dst-mesh",
          "2"], ["an array of more than 2**100 elements", "(323 characters)"]),
        (["plan", "--shape", "9" * 5000, "--src-mesh", "2", "--dst-mesh", "2"],
         ["is not a shape", "(5,000 characters)"]),
        # Pieces, not shards, bound planning's time and memory: 16,384 sources to as
        # many replicas of the whole array would need ~130 GB.
        (["plan", "--shape", "16384", "--src-mesh", "16384", "--dst-mesh", "16384",
          "--dst-devices", "16384-32767", "--dst-spec", "None"],
         ["up to 268,435,456 pieces", "at most 4,194,304"]),
        (["demo", "--size-mb", "-1"], ["--size-mb", "> 0"]),
        (["demo", "--devices", "6", "--processes", "4"], ["evenly"]),
        (["bench", "--cases", "nope"], ["unknown case", "disjoint"]),
        # An empty list is a mistake, not "every case" (the whole suite takes minutes).
        (["bench", "--cases", ""], ["--cases names no case ('')", "e.g. --cases disjoint"]),
        (["bench", "--cases", " , "], ["--cases names no case (' , ')"]),
        (["dmeo"], ["invalid choice", "demo"]),
        # Not a finite size, or more than any machine's memory: refused before any work.
        (["demo", "--size-mb", "inf"], ["--size-mb", "finite"]),
        (["demo", "--size-mb", "nan"], ["--size-mb", "finite"]),
        (["bench", "--size-mb", "inf"], ["--size-mb", "finite"]),
        (["bench", "--size-mb", "1e15"], ["--size-mb", "memory"]),
        # A command's unknown flags are its own, with its own --help.
        *[([cmd, *rest, "--bogus"],
           [f"reshard {cmd}: error: unrecognized arguments: --bogus", f"'reshard {cmd} --help'"])
          for cmd, rest in (("plan", ["--shape", "8", "--src-mesh", "2", "--dst-mesh", "2"]),
                            ("bench", []), ("demo", ["--devices", "4"]))],
        (["--bogus", "bench"], ["reshard: error: unrecognized arguments: --bogus"]),
        # argparse takes "-5,64" for a flag: what is wrong with it, not how to pass it
        # (with '=') only to be told then.
        (["plan", "--shape", "-5,64", "--src-mesh", "2", "--dst-mesh", "2"],
         ["argument --shape: '-5,64'", ">= 0"]),
        (["plan", "--shape", "8", "--src-mesh", "2", "--src-devices", "-1,0", "--dst-mesh", "2"],
         ["argument --src-devices: '-1,0'", "inclusive ranges"]),
        (["plan", "--shape=-5,64", "--src-mesh", "2", "--dst-mesh", "2"], ["--shape", ">= 0"]),
    ],
)  # fmt: skip
def test_bad_arguments_are_one_line_exit_2(
    args: list[str], needles: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if args in _BAD_ARGUMENTS_IN_A_SUBPROCESS:
        res = run_cli(*args, timeout=60)
    else:
        # In this process: a subprocess per case (~2 s to start Python and import JAX)
        # cost over a minute of the suite. demo and bench check some arguments only
        # once they run; each step that would start work (choosing the simulated
        # devices, launching processes, running the demo or the suite) fails the test
        # here, so every mistake must be reported before any of them.
        _fail_on_work(monkeypatch)
        res = run_here(*args)
    one_line_usage_error(res, *needles)


# Run as a user runs them too: the first parse error, the overflow guards, and a
# mistake of each command that checks its arguments as it runs.
_BAD_ARGUMENTS_IN_A_SUBPROCESS = [
    ["plan", "--shape", "10x", "--src-mesh", "2", "--dst-mesh", "2"],
    ["--bogus"],
    ["plan", "--shape", "9" * 5000, "--src-mesh", "2", "--dst-mesh", "2"],
    ["demo", "--devices", "7"],
    ["bench", "--cases", "nope"],
]


@pytest.mark.parametrize(
    "args",
    [["demo", "--devices", "4"], ["demo", "--processes", "2"], ["bench", "--cases", "disjoint"]],
)
def test_the_guard_of_in_process_mistakes_stops_commands_that_are_right(
    args: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Otherwise the in-process cases above could pass with the guard doing nothing.
    _fail_on_work(monkeypatch)
    with pytest.raises(AssertionError, match="work started"):
        _cli.main(args)


def _fail_on_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes every step of ``demo`` and ``bench`` that starts work raise
    ``AssertionError`` (which ``main`` does not catch), so that a command-line
    mistake not reported before them fails the test."""
    from reshard import _cli_bench, _cli_demo

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("work started before the mistake was reported")

    for name in ("configure_cpu_devices", "_run_processes", "_run_with_progress"):
        monkeypatch.setattr(_cli_demo, name, started)
    find_suite = _cli_bench.find_suite

    def suite_without_work() -> tuple[Any, str, Any]:
        _, where, module = find_suite()
        known = getattr(module, "SCENARIOS", None)
        return started, where, argparse.Namespace(SCENARIOS=known, setup_devices=started)

    monkeypatch.setattr(_cli_bench, "find_suite", suite_without_work)


def test_a_value_starting_with_a_dash_that_is_valid_is_shown_how_to_pass() -> None:
    parser = _cli._Parser(prog="reshard x")
    parser.add_argument("--offsets")
    with pytest.raises(_cli.UsageError) as e:
        parser.parse_args(["--offsets", "-5,64"])
    assert str(e.value) == (
        "argument --offsets: expected one argument; a value that starts with '-' needs "
        "'=', e.g. --offsets=-5,64 (see 'reshard x --help')"
    )
    assert parser.parse_args(["--offsets=-5,64"]).offsets == "-5,64"


def test_bad_environment_is_one_line_exit_2() -> None:
    res = run_cli("demo", "--processes", "2", RESHARD_DEMO_TIMEOUT_S="abc")
    one_line_usage_error(res, "RESHARD_DEMO_TIMEOUT_S='abc'", "seconds")
    # Read by every child process: checked before they start (it was two tracebacks).
    res = run_cli("demo", "--processes", "2", RESHARD_COLLECTIVE_TIMEOUT_S="abc")
    one_line_usage_error(res, "RESHARD_COLLECTIVE_TIMEOUT_S must be", "got 'abc'", "or unset it")


def test_demo_timeout_names_the_variable_to_raise() -> None:
    """The CLI's only knob is the environment variable, not launch_local's argument."""
    res = run_cli("demo", "--processes", "2", "--size-mb", "1", RESHARD_DEMO_TIMEOUT_S="0.5")
    assert res.returncode == 1, res.stderr
    assert "raise RESHARD_DEMO_TIMEOUT_S (seconds, now 0.5) if the work needs longer" in res.stderr
    assert "timeout_s" not in res.stderr.replace("RESHARD_DEMO_TIMEOUT_S", "")


@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_closed_stdout_pipe_exits_0_quietly(json_flag: list[str]) -> None:
    """``reshard plan ... | head -1``: the reader leaves early, which is no failure."""
    args = ["plan", "--shape", "64,64", "--src-mesh", "2x4", "--dst-mesh", "4x2", *json_flag]
    env = _env()
    # Buffered, as for a user: the JSON then reaches the pipe only when flushed.
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the command, still importing, writes anything
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 0, err
    assert err == ""


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("json_flag", [[], ["--json"]])
def test_a_closed_stdout_pipe_keeps_the_runs_own_exit_code(
    json_flag: list[str], unbuffered: bool
) -> None:
    """Data loss piped into a reader that left is still exit 1, with its stderr line.

    Unbuffered, the first write meets the closed pipe in the middle of the run: the
    run must still go to its end instead of ending there with exit 0.
    """
    args = ["plan", "--shape", "48,64", "--src-mesh", "8", "--dst-mesh", "6", "--avoid", "6,7"]
    env = _env()
    env.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reshard", *args, *json_flag],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 1, err
    assert err.startswith("reshard plan: ") and "Traceback" not in err, err


@pytest.mark.parametrize("lost", ["full disk", "closed"])
def test_a_lost_stdout_is_a_failure_with_a_message(lost: str) -> None:
    """A full disk (stdout is /dev/full) or a stdout closed at start (`reshard plan ...
    >&-`) loses the output: exit 1 with one line on stderr, no traceback (for a closed
    stdout, not an AttributeError)."""
    args = ["plan", "--shape", "48,64", "--src-mesh", "8", "--dst-mesh", "6"]
    run = functools.partial(
        subprocess.run, stderr=subprocess.PIPE, text=True, env=_env(), timeout=60
    )
    if lost == "closed":
        res = run(["sh", "-c", 'exec "$0" -m reshard "$@" >&-', sys.executable, *args])
    else:
        if not os.path.exists("/dev/full"):
            pytest.skip("needs /dev/full")
        with open("/dev/full", "w") as full:
            res = run([sys.executable, "-m", "reshard", *args], stdout=full)
    assert res.returncode == 1, res.stderr
    assert res.stderr.startswith("reshard plan: error: cannot write standard output: ")
    assert "Traceback" not in res.stderr, res.stderr


def test_plan_of_exabytes_counts_past_int64() -> None:
    """An array of 2**67 bytes: the matrix cell does not fit int64, the report is exact."""
    args = ("plan", "--shape", "4294967296,4294967296", "--dtype", "float64",
            "--src-mesh", "1", "--dst-mesh", "1", "--dst-devices", "1")  # fmt: skip
    out = run_here_json(*args)
    assert out["stats"]["bytes_moved"] == 2**67
    assert out["matrix"]["bytes"] == [[2**67]]
    res = run_here(*args)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "147,573,952,589,676,412,928 B" in res.stdout and "src\\dst  1" in res.stdout


def test_help_and_version() -> None:
    res = run_cli("--help")
    assert res.returncode == 0 and "demo" in res.stdout and "plan" in res.stdout
    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"reshard {reshard.__version__}"


# ----------------------------------------------------------------------------------
# bench
# ----------------------------------------------------------------------------------


FOOTER_LINE = "alpha and beta are made up"
FAKE_SUITE = """
import dataclasses

SCENARIOS = ("alpha", "beta")
SETUP = []
FOOTER = "alpha and beta are made up"

def setup_devices(n):
    SETUP.append(n)

@dataclasses.dataclass
class Row:
    scenario: str
    reshard_s: float
    device_put_s: float
    bytes_moved: int
    options: str

    def as_dict(self):
        d = dataclasses.asdict(self)
        d["vs_device_put"] = self.device_put_s / self.reshard_s
        return d

def run(scenarios=SCENARIOS, size_mb=300, reps=5, progress=None):
    return [Row(s, 0.002, 0.005, 1 << 20, f"{size_mb},{reps},{SETUP}") for s in scenarios]
"""


def test_bench_runs_a_suite_and_prints_its_ratios(tmp_path: Path) -> None:
    suite = tmp_path / "fake_suite.py"
    suite.write_text(textwrap.dedent(FAKE_SUITE))
    args = ("bench", "--size-mb", "7", "--repeats", "2", "--cases", "beta")
    out = run_json(*args, RESHARD_BENCH_MODULE=str(suite))
    assert out["suite"].endswith("fake_suite.py:run")
    # Options reach the suite under its own names; devices were set up first.
    assert out["rows"] == [
        {
            "scenario": "beta",
            "reshard_s": 0.002,
            "device_put_s": 0.005,
            "bytes_moved": 1 << 20,
            "options": "7.0,2,[8]",
            "vs_device_put": 2.5,
        }
    ]
    res = run_cli(*args, RESHARD_BENCH_MODULE=str(suite))
    assert res.returncode == 0, res.stderr
    assert "2.50x" in res.stdout and "2.0 ms" in res.stdout and "1.0 MiB" in res.stdout
    # The footer is the suite's own: not the built-in suite's explanation of its columns.
    assert res.stdout.rstrip().endswith(FOOTER_LINE) and "memcpy" not in res.stdout
    no_footer = tmp_path / "no_footer.py"
    no_footer.write_text(textwrap.dedent(FAKE_SUITE).replace(f'FOOTER = "{FOOTER_LINE}"', ""))
    res = run_cli(*args, RESHARD_BENCH_MODULE=str(no_footer))
    assert res.returncode == 0, res.stderr
    assert res.stdout.rstrip().endswith("2.50x") and FOOTER_LINE not in res.stdout


@pytest.mark.parametrize(
    "args", [("--reps", "0"), ("--size-mb", "-4"), ("--size-mb", "nan"), ("--scenarios", ",")]
)
def test_benchmarks_bench_py_rejects_bad_values_without_a_traceback(args: tuple[str, ...]) -> None:
    """``python benchmarks/bench.py`` (the suite's own entry point) has the limits of
    ``reshard bench``: exit 2 and one message, not a StatisticsError or TypeError."""
    root = Path(__file__).resolve().parent.parent
    res = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "bench.py"), "--no-rss", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and "error:" in res.stderr, res.stderr


@pytest.mark.parametrize("module", ["no_such_bench_module_xyz", "no_such_package_xyz.bench"])
def test_bench_without_a_suite_exits_2(module: str) -> None:
    res = run_cli("bench", RESHARD_BENCH_MODULE=module)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert module in res.stderr and "no such module" in res.stderr
    assert "reshard bench: error:" in res.stderr  # as every other usage error says


@pytest.mark.parametrize(
    "body,why",
    [("def run(:\n", "SyntaxError at"), ("import no_such_package_xyz\n", "ModuleNotFoundError")],
)
def test_bench_suite_that_fails_to_import_exits_2(tmp_path: Path, body: str, why: str) -> None:
    suite = tmp_path / "broken_suite.py"
    suite.write_text(body)
    res = run_cli("bench", RESHARD_BENCH_MODULE=str(suite))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "reshard bench: error:" in res.stderr and "cannot import it" in res.stderr
    assert why in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_bench_suite_without_rows_says_so(tmp_path: Path) -> None:
    suite = tmp_path / "empty_suite.py"
    suite.write_text("def run(size_mb=1, reps=1, progress=None):\n    return []\n")
    for json_flag in ((), ("--json",)):
        res = run_cli("bench", *json_flag, RESHARD_BENCH_MODULE=str(suite))
        assert res.returncode == 1 and "the suite returned no rows" in res.stderr, res.stderr


@pytest.mark.timeout(180)
@pytest.mark.skipif(
    importlib.util.find_spec("reshard._bench") is None, reason="no packaged benchmark suite"
)
def test_bench_real_suite_small() -> None:
    # The suite is defined on simulated CPU devices whatever platform the user's
    # environment asks for (here one this machine does not have).
    out = run_json(
        "bench", "--size-mb", SIZE_MB, "--repeats", "1", "--cases", "relayout", "--no-rss",
        timeout=160, JAX_PLATFORMS="cuda",
    )  # fmt: skip
    assert out["suite"] == "reshard._bench:run"
    (row,) = out["rows"]
    assert row["scenario"] == "relayout"
    assert 0 < row["bytes_moved"] <= row["dst_bytes"]
    assert row["reshard_s"] > 0 and row["vs_device_put"] > 0
    assert row["rss_rise_x"] is None  # --no-rss reached the suite


def test_fresh_arrays_are_new_objects_over_the_same_buffers() -> None:
    """What the demo and the benchmarks time each call on: no host copy cached by an
    earlier ``device_put`` (which would let it skip its gather), nothing copied."""
    from reshard._timing import fresh_arrays

    devs = np.array(jax.devices())
    mesh = Mesh(devs.reshape(2, 4), ("a", "b"))
    host = np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
    tree = {
        "w": jax.device_put(host, NamedSharding(mesh, P("b", "a"))),
        "pinned": jax.device_put(host, NamedSharding(mesh, P("a"), memory_kind="pinned_host")),
        "key": jax.device_put(jax.random.split(jax.random.key(1), 8), NamedSharding(mesh, P())),
        "scalar": 3,
    }
    for name in ("w", "pinned"):
        np.asarray(tree[name])  # caches a host copy on the array, as device_put's gather does
        assert tree[name]._npy_value is not None
    out = fresh_arrays(tree)
    assert out["scalar"] == 3
    for name in ("w", "pinned", "key"):
        old, new = tree[name], out[name]
        assert new is not old
        if name != "key":
            assert new._npy_value is None
        assert new.sharding == old.sharding and new.dtype == old.dtype
        for a, b in zip(old.addressable_shards, new.addressable_shards, strict=True):
            assert a.device == b.device and a.index == b.index
            if name != "key":
                assert np.asarray(a.data).ctypes.data == np.asarray(b.data).ctypes.data
    np.testing.assert_array_equal(np.asarray(out["w"]), host)
    np.testing.assert_array_equal(np.asarray(out["pinned"]), host)
    np.testing.assert_array_equal(
        np.asarray(jax.random.key_data(out["key"])), np.asarray(jax.random.key_data(tree["key"]))
    )


def test_bench_runs_a_case_named_twice_once(tmp_path: Path) -> None:
    suite = tmp_path / "fake_suite.py"
    suite.write_text(textwrap.dedent(FAKE_SUITE))
    out = run_json("bench", "--cases", "beta,beta", RESHARD_BENCH_MODULE=str(suite))
    assert [r["scenario"] for r in out["rows"]] == ["beta"]


@pytest.mark.parametrize("value", ["abc", "1GiB"])
def test_a_bad_host_pool_size_is_a_usage_error_not_a_traceback(
    value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``RESHARD_HOST_POOL_BYTES`` is read on first use, not at import: a bad value
    leaves ``import reshard`` and ``--help`` working, and a command says it in one line."""
    res = run_cli("--help", RESHARD_HOST_POOL_BYTES=value)
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    # The command, in this process (the value is read when the command starts).
    plan = ["plan", "--shape", "8", "--src-mesh", "2", "--dst-mesh", "2"]
    monkeypatch.setenv("RESHARD_HOST_POOL_BYTES", value)
    res = run_here(*plan)
    assert res.returncode == 2 and "Traceback" not in res.stderr and res.stdout == "", res
    assert res.stderr.startswith("reshard plan: error: RESHARD_HOST_POOL_BYTES"), res.stderr
    assert value in res.stderr
    monkeypatch.setenv("RESHARD_HOST_POOL_BYTES", "")  # empty: unset
    res = run_here(*plan)
    assert res.returncode == 0 and res.stderr == "", res
    assert res.stdout.startswith("reshard plan: bfloat16[8]"), res.stdout
