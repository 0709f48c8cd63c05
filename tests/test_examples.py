"""The documented multi-process example runs and checks its own results."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_multiprocess_example_runs():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    res = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multiprocess_reshard.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = [line for line in res.stdout.splitlines() if line.startswith("process ")]
    assert lines[0] == "process 0: shard sums []"  # process 0 holds no destination shard
    assert lines[1].startswith("process 1: shard sums [") and lines[1].count(",") == 3
