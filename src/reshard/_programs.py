"""Compiled programs shared by every plan, by what they do; bounded.

A plan rebuilt for each call (``cache_resharding_plans=False``, the default) would
otherwise compile its programs again each time (seconds for the device-packed path),
and a cache without a bound would keep every program a workload whose shapes keep
changing ever compiled. Each entry holds one executable (a compiled program, or a
jitted function called with one set of input avals); least recently used out. A
dropped entry frees its executable with it. An entry costs host memory: ~0.3-1.3 MB
for small programs (measured as a loop of changing shapes filled the cache: 1024
entries of ~1.65 MB took ~1.7 GB, so the bound is 256, ~0.4 GB for such programs).

The device executor's programs take at most ``_local_executor.PIECES_PER_PROGRAM``
pieces each (one per device over the whole tree grew with it: 220 MiB for a relayout
of 200 small arrays over 8 CPU devices, 8.5 GiB to compile one of 2000), ~4-5 MiB
each on CPU (a relayout of 512 arrays of 32 pieces: 32 programs held ~170 MiB). A
plan's programs are also held together, in one more entry (a dict of them, keyed by
all of them), put back as the newest whenever one of them compiles: a plan whose
programs outnumber the bound would otherwise push its own out in turn, and compile
each again at every call. The bound is thus one of count, not of memory; a plan in
the plan cache holds its programs itself, and never compiles them again.

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


class _Store(OrderedDict[Hashable, Any]):
    """Entries by key, least recently used out: at most a count of them and, where
    ``weigh`` gives each a weight, at most a budget of weight in all."""

    def __init__(self, weigh: Callable[[Any], int] | None = None) -> None:
        super().__init__()
        self.weigh = weigh
        self.total = 0  # the weight of every entry, where weighed

    def entry(
        self, key: Hashable, build: Callable[[], Any], bound: int, budget: int | None = None
    ) -> Any:
        """The entry for ``key``, else ``build()``'s, kept if it fits."""
        with _lock:
            found = self.get(key)
            if found is not None:
                self.move_to_end(key)
                return found
        made = build()
        weight = self.weigh(made) if self.weigh is not None else 0
        if budget is not None and weight > budget:
            return made  # (it would push everything else out, and not fit either)
        with _lock:
            if key not in self:
                self[key] = made
                self.total += weight
            while len(self) > bound or (budget is not None and self.total > budget):
                _, dropped = self.popitem(last=False)
                self.total -= self.weigh(dropped) if self.weigh is not None else 0
        return made

    def clear(self) -> None:
        super().clear()
        self.total = 0


_lock = threading.Lock()
PROGRAM_CACHE_SIZE = 256
_programs = _Store()


def shared(key: Hashable, build: Callable[[], Any]) -> Any:
    """The entry for ``key`` from the cache, else ``build()``'s (then cached)."""
    return _programs.entry(key, build, PROGRAM_CACHE_SIZE)


# Jobs are host data, ~1 KiB per piece (17 KB for a 16-piece array on 8 devices, by
# tracemalloc): bounded by count and by pieces, so that a few arrays of thousands of
# pieces each (large meshes) cannot hold much memory.
JOB_CACHE_SIZE = 512
JOB_CACHE_PIECES = 1 << 16
_jobs = _Store(lambda job: sum(map(len, job.copies)))


def shared_job(key: Hashable, build: Callable[[], Any]) -> Any:
    """As ``shared``, in the store of the local executors' jobs (``LeafJob``)."""
    return _jobs.entry(key, build, JOB_CACHE_SIZE, JOB_CACHE_PIECES)


def clear() -> None:
    """Empties the cache (and the store of jobs)."""
    with _lock:
        _programs.clear()
        _jobs.clear()


def size() -> int:
    return len(_programs)
