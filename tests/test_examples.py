"""The documented multi-process example runs and checks its own results."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(args: list[str], timeout: float = 240, **env: str) -> subprocess.CompletedProcess[str]:
    """``python *args`` in a fresh process, the suite's ``XLA_FLAGS`` left out (the
    script picks its own devices) and ``env`` added."""
    clean = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout, env=clean | env
    )


def test_multiprocess_example_runs():
    res = _run([str(ROOT / "examples" / "multiprocess_reshard.py")])
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("process ")]
    assert lines[0] == "process 0: shard sums []"  # process 0 holds no destination shard
    assert lines[1].startswith("process 1: shard sums [") and lines[1].count(",") == 3


def test_multiprocess_benchmark_prints_its_table():
    # The benchmark is run by hand for the numbers; here it runs once, briefly (one
    # rep of the 40 MiB tree), so that it cannot rot unnoticed. It checks the reshards'
    # values itself before it times them.
    res = _run(
        [str(ROOT / "benchmarks" / "bench_multiprocess.py"), "--reps", "1", "--no-single"]
        + ["--timeout", "200"]
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {}
    for line in res.stdout.splitlines():
        parts = line.rsplit(None, 3)
        if len(parts) == 4 and all(x.replace(".", "").isdigit() for x in parts[1:]):
            rows[parts[0].strip()] = float(parts[3])
    floors = [v for k, v in rows.items() if k.startswith("ppermute,")]
    assert len(floors) >= 5 and min(floors) == 1.0, res.stdout
    assert {"reshard (collective executor)", "reshard, same layout (fsdp->fsdp)"} <= set(rows)
    assert "its own chunks, nothing else" in rows, res.stdout
    assert "target: reshard within 1.5x" in res.stdout
    assert "the least a relayout adds: the fastest row's floor" in res.stdout
    # Both processes' CPU per call: each figure a positive count of core-ms.
    cpu = re.search(
        r"CPU per call, both processes \(core-ms\): fastest floor row (\d+), relayout (\d+) "
        r"\(([0-9.]+)x\), same layout (\d+) \(([0-9.]+)x\)",
        res.stdout,
    )
    assert cpu is not None, res.stdout
    assert all(float(g) > 0 for g in cpu.groups()), res.stdout
    # ...and each process's (sender + receiver), own chunks too. With one rep each
    # median is that rep, so the two processes add up to the line above (each figure
    # rounded on its own: within 1 core-ms).
    by_process = re.search(
        r"CPU per call by process \(core-ms, process 0 sends \+ process 1 receives\): "
        r"fastest floor row (\d+) \+ (\d+), relayout (\d+) \+ (\d+) \(its own chunks "
        r"(\d+) \+ (\d+)\), same layout (\d+) \+ (\d+) \(its own chunks (\d+) \+ (\d+)\)",
        res.stdout,
    )
    assert by_process is not None, res.stdout
    split = [int(g) for g in by_process.groups()]
    assert all(x > 0 for x in split), res.stdout
    totals = [int(cpu.group(k)) for k in (1, 2, 4)]
    for total, (a, b) in zip(totals, [split[0:2], split[2:4], split[6:8]], strict=True):
        assert abs(a + b - total) <= 1, res.stdout
    # Both floors give a ratio: the fastest row (strict) and the chunking chosen in
    # rounds of its own (unbiased), which can be no faster than that row.
    ratios = re.findall(r"floor = (?:fastest|the chunking).*?relayout ([0-9.]+)x", res.stdout)
    assert len(ratios) == 2 and float(ratios[1]) <= float(ratios[0]), res.stdout


def _python_blocks(doc: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.DOTALL)


def test_elastic_guide_snippets_run_as_written():
    # docs/elastic.md's snippets follow on from one another; the last one stands for a
    # training loop, so it gets a train_step and batches of its own.
    blocks = _python_blocks(ROOT / "docs" / "elastic.md")
    assert len(blocks) == 4, "update this test with the guide's snippets"
    loop_stand_in = (
        "train_step = lambda state, batch: (state, float(np.asarray(batch).sum()))\n"
        "batches = [np.ones(8), np.arange(8.0)]\n"
        "state = {'w': jax.device_put(np.arange(8.0), NamedSharding(mesh, P('fsdp')))}\n"
    )
    script = "\n".join([*blocks[:3], loop_stand_in, blocks[3], "print('loss', loss)"])
    res = _run(["-c", script], 120, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    assert res.returncode == 0, res.stderr[-3000:]
    # What the comments in the guide say the snippets print.
    assert "[(\"['opt']\", ((8, 12),))]" in res.stdout, res.stdout
    assert "avoiding:    devices [4, 5]" in res.stdout, res.stdout
    assert res.stdout.rstrip().endswith("loss 28.0"), res.stdout


def test_the_accelerator_check_passes_on_cpu():
    # benchmarks/gpu_check.py is what a session with an accelerator runs (none here; it
    # passed on one TPU v5e chip, docs/accelerators.md): it runs on one CPU device too,
    # without its timing table, so that it cannot rot unnoticed.
    res = _run(
        [str(ROOT / "benchmarks" / "gpu_check.py")], GPU_CHECK_NO_TIMING="1", JAX_PLATFORMS="cpu"
    )
    assert res.returncode == 0, (res.stdout[-3000:], res.stderr[-3000:])
    assert res.stdout.rstrip().endswith("RESULT: PASS"), res.stdout[-3000:]
    assert " 0 failed " in res.stdout and "FAIL " not in res.stdout, res.stdout[-3000:]
    # every group ran: the programs at scale too, for every float type (12 on jax 0.10)
    assert res.stdout.count("PASS  at scale: cut + build + copy programs") >= 10, res.stdout
