"""Which live arrays share device buffers because this library made them so.

Some results are made zero-copy on the buffers of an input: the parts of
``split_by_mesh_axis`` and the join of ``concatenate_by_mesh_axis`` (every shard is an
input's buffer), and the outputs of ``reshard`` that are handed unchanged shards
(``may_alias=True``, or when donating). JAX frees a buffer for every array that holds
it, so consuming one such array (donating it to ``reshard``, ``split_by_mesh_axis`` or
``concatenate_by_mesh_axis``) while another lives would free buffers under the other,
which would still read as valid and crash the process when used. So every such result
is recorded here with the input it was made from, and those functions leave an array
that shares buffers with a live, undeleted array outside the call unconsumed: it stays
valid, as an argument whose donation JAX declines. (The same array at two leaves is
one input: its two results share buffers with each other.)

Arrays made from one another form a *group*; two of them are taken to share buffers
when they are in one group and have a device in common. That over-counts where a
result holds only some of an input's shards on a device (an output handed over some
shards of an input that it also holds new buffers beside), which only means an array
is left unconsumed that could have been. Only this library's own results are known:
donating a part to your own ``jax.jit(..., donate_argnums=...)`` still frees it under
its input.

The record is structural (which call made which array, on which devices of its
sharding), not read from buffer addresses, so every process of a multi-process job,
making the same calls, decides alike whichever buffers it holds. (An array dropped on
one process but not yet collected on another, in a reference cycle, could still tell
them apart.)
"""

from __future__ import annotations

import collections
import contextlib
import gc
import threading
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any


class _Group:
    """Arrays made zero-copy from one another: per member id, a weak reference and
    the ids of its sharding's devices; per device id, the members on it."""

    __slots__ = ("members", "on")

    def __init__(self) -> None:
        self.members: dict[int, tuple[weakref.ref[Any], frozenset[int]]] = {}
        self.on: dict[int, set[int]] = {}


# id of a recorded array -> its group. An array's entries go when it does.
_group_of: dict[int, _Group] = {}
_lock = threading.Lock()


def _forget(key: int) -> Callable[[weakref.ref[Any]], None]:
    def forget(_: weakref.ref[Any]) -> None:  # called as the array goes; takes no lock
        group = _group_of.pop(key, None)
        entry = None if group is None else group.members.pop(key, None)
        if group is not None and entry is not None:
            for d in entry[1]:
                group.on.get(d, set()).discard(key)

    return forget


def _group(a: Any) -> _Group | None:
    """``a``'s group, where ``a`` itself (not an earlier array of its id) is recorded."""
    group = _group_of.get(id(a))
    entry = None if group is None else group.members.get(id(a))
    return group if entry is not None and entry[0]() is a else None


def _add(a: Any, group: _Group) -> None:
    key = id(a)
    devices = frozenset(d.id for d in a.sharding.device_set)
    group.members[key] = (weakref.ref(a, _forget(key)), devices)
    for d in devices:
        group.on.setdefault(d, set()).add(key)
    _group_of[key] = group


def _merge(a: _Group, b: _Group) -> _Group:
    """One group of the members of both (the smaller moves)."""
    big, small = (a, b) if len(a.members) >= len(b.members) else (b, a)
    # The keys first, then each entry still there: an array going in a collection
    # leaves its group without the lock (see _forget), and a collection may start at
    # any allocation, such as one of the (key, value) pairs ``items()`` would make
    # while it iterates ("dictionary changed size during iteration").
    for key in tuple(small.members):
        entry = small.members.get(key)
        if entry is None or entry[0]() is None:
            continue
        ref, devices = entry
        big.members[key] = (ref, devices)
        for d in devices:
            big.on.setdefault(d, set()).add(key)
        _group_of[key] = big
    small.members.clear()
    small.on.clear()
    return big


class _Readers:
    """Threads of this process that read their inputs' buffers, and the deleting of
    donated inputs, kept apart.

    jaxlib 0.10 crashes the process (a failed check, or a segmentation fault) when an
    array is deleted while another thread reads its buffers through a numpy view, and
    a program given an array deleted meanwhile fails with an unclear error: so one
    thread donating an input while another reshards it brought the process down. Calls
    read under ``reading`` and delete (and record what their outputs share) under
    ``deleting``, which waits until no other thread reads and holds new readers off.
    ``deletions`` counts the deleting sections, so that a call re-checks its inputs
    for deletion only when one ran meanwhile; ``version`` the records of sharing."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.RLock())
        self._readers: collections.Counter[int] = collections.Counter()
        self._deleters = 0  # waiting to delete: new readers wait for them
        self.deletions = 0

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            # A thread reading already goes on (else it would wait for a deleter that
            # waits for it); others let a waiting deleter go first (or a steady stream
            # of reads would keep it waiting for good).
            while self._deleters and me not in self._readers:
                self._cond.wait()
            self._readers[me] += 1
        try:
            yield
        finally:
            with self._cond:
                self._readers[me] -= 1
                if not self._readers[me]:
                    del self._readers[me]
                self._cond.notify_all()

    @contextlib.contextmanager
    def deleting(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cond:
            self._deleters += 1
            try:
                while any(t != me for t in self._readers):
                    self._cond.wait()
            finally:
                self._deleters -= 1
            self.deletions += 1
            try:
                yield
            finally:
                self._cond.notify_all()


readers = _Readers()
_version = 0  # counts ``note_shared`` calls


def version() -> int:
    """Changes whenever sharing is recorded (``note_shared``)."""
    return _version


def note_shared(origin: Any, derived: Sequence[Any]) -> None:
    """Records that ``derived`` were made zero-copy on buffers of ``origin`` (which may
    have been consumed since: a deleted array shares nothing)."""
    global _version
    with _lock:
        _version += 1
        group = _group(origin)
        if group is None:
            group = _Group()
            _add(origin, group)
        for d in derived:
            if d is origin:
                continue
            other = _group(d)
            if other is None:
                _add(d, group)
            elif other is not group:
                group = _merge(group, other)


def with_handles(spared: set[int], addresses: Mapping[int, Collection[Any]]) -> set[int]:
    """``spared`` and the ids whose buffer ``addresses`` (this process's, per array id)
    meet a spared array's: a handle made by hand on a spared array's buffers is not
    in the record, and consuming it would free them under that array. Read from this
    process's buffers, so decided here only."""
    staying = {k for i in spared for k in addresses[i]}
    return spared | {i for i, ks in addresses.items() if not staying.isdisjoint(ks)}


def shared_elsewhere(arrays: Sequence[Any]) -> set[int]:
    """ids of those ``arrays`` that must not be consumed (``sharing``'s first set)."""
    return sharing(arrays)[0]


def sharing(
    arrays: Sequence[Any], *, once: OneCollection | None = None
) -> tuple[set[int], set[int]]:
    """``(spared, linked)``: ids of those ``arrays`` that must not be consumed, each
    sharing buffers with a live, undeleted array not among them, or with one of
    ``arrays`` that must not be (consuming it would free buffers under that one); and
    ids of the others that share buffers with another of ``arrays`` (which one
    donating call cannot take together). Linear in the members of the groups involved.

    An array no longer reachable but not yet collected (in a reference cycle) would
    count as live, and one process may have collected it while another has not: so
    where any array would be spared, the garbage is collected (a full ``gc.collect()``,
    tens of ms in a large program, only on this path) and the record read again. Every
    process then decides by what is truly live. Calls sharing ``once`` (a donation's,
    one per device set) collect at most once among them: after a collection, only
    garbage made since could count as live."""
    if not _group_of:
        return set(), set()
    spared, linked = _sharing(arrays)
    if spared and not (once is not None and once.done):
        gc.collect()
        if once is not None:
            once.done = True
        spared, linked = _sharing(arrays)
    return spared, linked


class OneCollection:
    """Shared by the ``sharing`` calls of one donation: whether one has collected the
    garbage. (A collection per device set took half of a concatenation of 512 arrays
    in four parts kept alive by their split input.)"""

    def __init__(self) -> None:
        self.done = False


def _sharing(arrays: Sequence[Any]) -> tuple[set[int], set[int]]:
    with _lock:
        ids = {id(a) for a in arrays}
        mine: dict[int, tuple[_Group, frozenset[int]]] = {}
        for a in arrays:
            group = _group(a)
            if group is not None:
                mine[id(a)] = (group, group.members[id(a)][1])
        # Per (group, device): the ids of its live, undeleted members there.
        live: dict[tuple[int, int], list[int]] = {}

        def on(group: _Group, d: int) -> list[int]:
            found = live.get((id(group), d))
            if found is None:
                found = live[(id(group), d)] = []
                # (A snapshot: an array going in another thread leaves its group
                # without the lock, see _forget.)
                for key in tuple(group.on.get(d, ())):
                    entry = group.members.get(key)
                    h = None if entry is None else entry[0]()
                    if h is not None and not h.is_deleted():
                        found.append(key)
            return found

        outside: dict[tuple[int, int], bool] = {}
        spared = set()
        linked = set()
        for i, (group, devices) in mine.items():
            for d in devices:
                members = on(group, d)
                if (id(group), d) not in outside:
                    outside[(id(group), d)] = any(k not in ids for k in members)
                if outside[(id(group), d)]:
                    spared.add(i)
                    break
                if len(members) > 1:
                    linked.add(i)
        # What shares a device of a spared array's group with it is spared too.
        done: set[tuple[int, int]] = set()
        todo = list(spared)
        while todo:
            group, devices = mine[todo.pop()]
            for d in devices:
                if (id(group), d) in done:
                    continue
                done.add((id(group), d))
                for k in on(group, d):
                    if k in mine and k not in spared:
                        spared.add(k)
                        todo.append(k)
        return spared, linked - spared
