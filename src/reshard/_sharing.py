"""Which live arrays share device buffers because this library made them so.

Some results are made zero-copy on the buffers of an input that stays valid: the
parts of ``split_by_mesh_axis`` without donation, a join of such parts that could not
be consumed, and outputs handed unchanged shards with ``may_alias=True``. JAX frees a
buffer for every array that holds it, so consuming one of them (donating it to
``reshard``, ``split_by_mesh_axis`` or ``concatenate_by_mesh_axis``) would free
buffers under the other, which would still read as valid and crash the process when
used. So each such pair is recorded here, and those functions leave an array that
shares buffers with a live array outside the call unconsumed: it stays valid, as JAX
leaves an argument whose donation it declines.

Only this library's own zero-copy results are known here. Donating a part to your
own ``jax.jit(..., donate_argnums=...)`` still frees it under its input.

The record is structural (which call made which array), not read from buffer
addresses: every process of a multi-process job makes the same calls, so every one
decides alike, whichever of the devices' buffers it holds.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

# id of an array -> (a weak reference to it, weak references to the arrays it shares
# buffers with). An entry goes when its array does.
_links: dict[int, tuple[weakref.ref[Any], list[weakref.ref[Any]]]] = {}
_lock = threading.Lock()


def _entry(a: Any) -> tuple[weakref.ref[Any], list[weakref.ref[Any]]] | None:
    e = _links.get(id(a))
    return e if e is not None and e[0]() is a else None


def _live(refs: Iterable[weakref.ref[Any]]) -> list[Any]:
    return [h for r in refs if (h := r()) is not None]


def _forget(key: int) -> Callable[[weakref.ref[Any]], None]:
    def forget(_: weakref.ref[Any]) -> None:  # called as the array goes
        _links.pop(key, None)

    return forget


def _link(a: Any, b: Any) -> None:
    e = _entry(a)
    if e is None:
        key = id(a)
        e = _links[key] = (weakref.ref(a, _forget(key)), [])
    others = [h for h in _live(e[1]) if h is not b]
    e[1][:] = [weakref.ref(h) for h in others] + [weakref.ref(b)]


def shares_with(a: Any) -> list[Any]:
    """The live arrays ``a`` shares buffers with (as recorded)."""
    with _lock:
        e = _entry(a)
        return [] if e is None else _live(e[1])


def note_shared(origin: Any, derived: Sequence[Any]) -> None:
    """Records that ``derived`` hold buffers of ``origin``, which stays valid: each then
    shares buffers with ``origin`` and with whatever ``origin`` shares them with (a
    part of a part shares with the whole). Over-counts where only some buffers are
    common (two splits of one array along different axes), which only means an array
    is left unconsumed that could have been."""
    with _lock:
        e = _entry(origin)
        related = [origin, *([] if e is None else _live(e[1]))]
        for d in derived:
            for r in related:
                if r is not d:
                    _link(d, r)
                    _link(r, d)


def shared_elsewhere(arrays: Sequence[Any]) -> set[int]:
    """ids of those ``arrays`` that share buffers with a live, undeleted array not
    among them: consuming one would free buffers under that array."""
    if not _links:
        return set()
    ids = {id(a) for a in arrays}
    return {
        id(a)
        for a in arrays
        if any(id(h) not in ids and not h.is_deleted() for h in shares_with(a))
    }
