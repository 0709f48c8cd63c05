"""Compiled programs shared by every plan, by what they do; bounded.

A plan rebuilt for each call (``cache_resharding_plans=False``, the default) would
otherwise compile its programs again each time (seconds for the device-packed path),
and a cache without a bound would keep every program a workload whose shapes keep
changing ever compiled. Each entry holds one executable (a compiled program, or a
jitted function called with one set of input avals), or the device executor's of one
plan (below), and weighs as many; least recently used out, to at most
``PROGRAM_CACHE_SIZE`` in all. A dropped entry frees its executables with it (but
for those that another entry or a plan still holds). An executable costs host
memory: ~0.3-1.3 MB for small programs (measured as a loop of changing shapes filled
the cache: 1024 entries of ~1.65 MB took ~1.7 GB, so the bound is 256, ~0.4 GB for
such programs).

The device executor's programs take at most ``_local_executor.PIECES_PER_PROGRAM``
pieces each (one per device over the whole tree grew with it: 220 MiB for a relayout
of 200 small arrays over 8 CPU devices, 8.5 GiB to compile one of 2000), ~4-5 MiB
each on CPU (a relayout of 512 arrays of 32 pieces: 32 programs held ~170 MiB). A
plan's are held together, in one entry (``Programs``) found by every equal plan. The
plan whose programs compiled last is pinned, until another plan compiles: never
dropped, and held on top of the bound (up to that plan's programs more), or a plan
rebuilt for each call whose programs outnumber the bound would push its own out (or
its call's other entries would) and compile them all again at every call. Plans in
turn that need more than the bound together do compile again at each call: keep them
in the plan cache, where a plan holds its programs itself and never compiles them
again. A program equal to one of another plan (the same layers in another tree) is
that one while anything holds it (``_local_executor._live_programs``); shared, it
weighs in both entries.

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
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax


class _Store(OrderedDict[Hashable, Any]):
    """Entries by key, least recently used out: at most a count of them and, where
    ``weigh`` gives each a weight, at most a budget of weight in all."""

    def __init__(self, weigh: Callable[[Any], int] | None = None) -> None:
        super().__init__()
        self.weigh = weigh
        self.total = 0  # the weight of every entry, where weighed
        self.weights: dict[Hashable, int] = {}  # each entry's, as last weighed
        self.pinned: Hashable | None = None  # never dropped to make room (``reweigh``)

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
            if key in self:  # (built by another thread meanwhile: one for both)
                made = self[key]
            else:
                self[key] = made
                self.weights[key] = weight
                self.total += weight
            self._drop_oldest(bound, budget)
        return made

    def reweigh(self, key: Hashable, value: Any, bound: int, budget: int) -> None:
        """``value``, the entry for ``key`` (put back where it was dropped), has grown:
        weighed again, made the newest, and pinned, however heavy, until another is:
        the others make room."""
        assert self.weigh is not None
        with _lock:
            if self.setdefault(key, value) is not value:
                return  # (another equal plan's, in its place: that one is weighed)
            self.move_to_end(key)
            weight = self.weigh(value)
            self.total += weight - self.weights.get(key, 0)
            self.weights[key] = weight
            self.pinned = key
            self._drop_oldest(bound, budget)

    def _drop_oldest(self, bound: int, budget: int | None) -> None:
        """Drops the oldest entries until the others than the pinned one fit (the
        pinned entry comes on top of the bound, not out of it)."""
        pinned = self.pinned if self.pinned in self else None
        count, weight = len(self), self.total
        if pinned is not None:
            count, weight = count - 1, weight - self.weights[pinned]
        while count > bound or (budget is not None and weight > budget):
            oldest = iter(self)
            key = next(oldest)
            if key == pinned:
                key = next(oldest)
            del self[key]
            dropped = self.weights.pop(key)
            self.total -= dropped
            count, weight = count - 1, weight - dropped

    def clear(self) -> None:
        super().clear()
        self.weights.clear()
        self.total = 0
        self.pinned = None


_lock = threading.Lock()
PROGRAM_CACHE_SIZE = 256
# Each entry weighs the executables it holds: one, or a plan's programs (``Programs``).
_programs = _Store(lambda v: len(v) if isinstance(v, Programs) else 1)


class Programs(dict[Hashable, Any]):
    """One entry holding several jitted programs (the device executor's of one plan,
    by what each does), weighed as many; ``grown`` after adding to it."""


class OneExecutable:
    """``jax.jit(fn)``, compiled at its first call for the types and shardings of that
    call's arguments, weak types made strong, and then called with any arguments of
    those types and shardings, weak or not: one executable, as the cache weighs it.

    ``jax.jit`` compiles anew for an argument that differs only by being weakly typed
    (an array made from a Python scalar, such as a training step count), so a weak
    and a strong array of one geometry took two executables of one key: twice the
    compilations (16 more for a 64x64 relayout over 8 devices), one counted.

    Programs of sub-byte types (int4, float4) stay with ``jax.jit``'s own call: the
    compiled object's stricter check refuses their buffers' layout on CPU (jax
    0.10), which jit's call accepts (as ``_compat.donating_identity`` found)."""

    __slots__ = ("__weakref__", "_compiled", "_jitted")

    def __init__(self, fn: Callable[..., Any]) -> None:
        self._jitted = jax.jit(fn)
        self._compiled: Any = None

    def __call__(self, *args: Any) -> Any:
        compiled = self._compiled
        if compiled is None:
            if any(jax.dtypes.itemsize_bits(a.dtype) < 8 for a in args):
                compiled = self._compiled = self._jitted
            else:
                avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in args]
                compiled = self._compiled = self._jitted.lower(*avals).compile()
        return compiled(*args)


def shared(key: Hashable, build: Callable[[], Any]) -> Any:
    """The entry for ``key`` from the cache, else ``build()``'s (then cached)."""
    return _programs.entry(key, build, PROGRAM_CACHE_SIZE, PROGRAM_CACHE_SIZE)


def grown(key: Hashable, programs: Programs) -> None:
    """``programs``, the entry for ``key``, has more programs than when it was last
    weighed: weighed again, made the newest (back in, where it was dropped) and
    pinned, and older entries dropped for the others to stay within
    ``PROGRAM_CACHE_SIZE`` programs."""
    _programs.reweigh(key, programs, PROGRAM_CACHE_SIZE, PROGRAM_CACHE_SIZE)


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
    """The weight of what the cache holds: its executables (the jitted programs of the
    device executor's entries, compiled or about to be, and the host-packed schedules
    too, one each)."""
    return _programs.total


def consecutive_groups(
    weights: Sequence[int],
    limit: int,
    pieces: Sequence[int] | None = None,
    piece_limit: int | None = None,
) -> list[list[int]]:
    """Indices of consecutive items (arrays, pieces) in groups whose ``weights`` add up
    to at most ``limit``, and their ``pieces`` to at most ``piece_limit`` (an item over
    either alone): one program runs each group (``_collective_executor.CollectiveProgram``,
    ``_local_executor._chunked``)."""
    groups: list[list[int]] = []
    used = count = 0
    for li, w in enumerate(weights):
        p = 0 if pieces is None else pieces[li]
        full = used + w > limit or (piece_limit is not None and count + p > piece_limit)
        if not groups or (groups[-1] and full):
            groups.append([])
            used = count = 0
        groups[-1].append(li)
        used += w
        count += p
    return groups
