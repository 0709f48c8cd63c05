"""Exceptions raised by reshard. Each subclasses the builtin a caller would expect."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ._geometry import Box


def format_box(box: Box) -> str:
    """``[0:4, 8:16]`` -- a box written as numpy-style slices."""
    return "[" + ", ".join(f"{a}:{b}" for a, b in box) + "]"


class DataLossError(ValueError):
    """Some part of some array has no copy on any device that may be read.

    Raised before any byte moves, so the inputs are untouched.

    Attributes:
      missing: ``(leaf path, box)`` pairs, one per lost box (adjacent boxes merged).
    """

    def __init__(self, missing: Sequence[tuple[str, Box]]) -> None:
        self.missing = list(missing)
        shown = "; ".join(f"{path}{format_box(box)}" for path, box in self.missing[:8])
        more = f" (and {len(self.missing) - 8} more)" if len(self.missing) > 8 else ""
        super().__init__(
            f"data lost: {len(self.missing)} box(es) have no copy on a surviving device: "
            f"{shown}{more}. Restore these leaves from a checkpoint, or keep more replicas."
        )

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled (to another process) and copied with what is missing.
        return (type(self), (self.missing,), self.__dict__)
