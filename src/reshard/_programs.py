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
    return _entry(_programs, PROGRAM_CACHE_SIZE, key, build)


# Jobs are host data: a few KiB for a model's arrays on 8 devices, ~64 B per piece.
JOB_CACHE_SIZE = 512
_jobs: OrderedDict[Hashable, Any] = OrderedDict()


def shared_job(key: Hashable, build: Callable[[], Any]) -> Any:
    """As ``shared``, in the store of the local executors' jobs."""
    return _entry(_jobs, JOB_CACHE_SIZE, key, build)


def _entry(
    store: OrderedDict[Hashable, Any], bound: int, key: Hashable, build: Callable[[], Any]
) -> Any:
    """``store``'s entry for ``key``, else ``build()``'s, kept among the last ``bound``."""
    with _lock:
        found = store.get(key)
        if found is not None:
            store.move_to_end(key)
            return found
    made = build()
    with _lock:
        store[key] = made
        while len(store) > bound:
            store.popitem(last=False)
    return made


def clear() -> None:
    """Empties the cache (and the store of jobs)."""
    with _lock:
        _programs.clear()
        _jobs.clear()


def size() -> int:
    return len(_programs)
