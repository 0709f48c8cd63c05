"""Compiled programs shared by every plan, by what they do; bounded.

A plan rebuilt for each call (``cache_resharding_plans=False``, the default) would
otherwise compile its programs again each time (seconds for the device-packed path),
and a cache without a bound would keep every program a workload whose shapes keep
changing ever compiled. Each entry holds one executable (a compiled program, or a
jitted function called with one set of input avals); least recently used out. A
dropped entry frees its executable with it. An entry costs host memory: ~0.3-1.3 MB
for small programs, ~1.65 MB on average for the device executor's programs of a
50-array tree on CPU (measured as a loop of changing shapes filled the cache: 1024
entries took ~1.7 GB, so the bound is 256, ~0.4 GB at most). The device executor
takes two entries per device per plan (its cut and build programs), so 256 entries
hold the programs of 16 plans over 8 devices; a plan in the plan cache also holds
its own, and never compiles them again.

The host-packed collective executor keeps its schedules here too (one entry each,
keyed by the program's fingerprint): what it packs, sends and unpacks per stage, with
its copy tables, which an uncached plan would otherwise build again at every call.

The local executors' per-array jobs (``_local_executor.LeafJob``: the copies and copy
tables of one geometry) are shared the same way, in a store of their own
(``shared_job``), so that a model of many shapes cannot push compiled programs out.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

PROGRAM_CACHE_SIZE = 256
_programs: OrderedDict[Hashable, Any] = OrderedDict()
_lock = threading.Lock()


def shared(key: Hashable, build: Callable[[], Any]) -> Any:
    """The entry for ``key`` from the cache, else ``build()``'s (then cached)."""
    with _lock:
        fn = _programs.get(key)
        if fn is not None:
            _programs.move_to_end(key)
            return fn
    fn = build()
    with _lock:
        _programs[key] = fn
        while len(_programs) > PROGRAM_CACHE_SIZE:
            _programs.popitem(last=False)
    return fn


# Jobs are host data: a few KiB for a model's arrays on 8 devices, ~64 B per piece.
JOB_CACHE_SIZE = 512
_jobs: OrderedDict[Hashable, Any] = OrderedDict()


def shared_job(key: Hashable, build: Callable[[], Any]) -> Any:
    """As ``shared``, in the store of the local executors' jobs."""
    with _lock:
        job = _jobs.get(key)
        if job is not None:
            _jobs.move_to_end(key)
            return job
    job = build()
    with _lock:
        _jobs[key] = job
        while len(_jobs) > JOB_CACHE_SIZE:
            _jobs.popitem(last=False)
    return job


def clear() -> None:
    """Empties the cache (and the store of jobs)."""
    with _lock:
        _programs.clear()
        _jobs.clear()


def size() -> int:
    return len(_programs)
