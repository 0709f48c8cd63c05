# Types of the optional C extension built from _fastcopy.c. Its arguments are objects
# with the buffer protocol (numpy arrays); collections.abc.Buffer needs Python 3.12.
from typing import Any

HAVE_STREAM: int

def copy(dst: Any, src: Any, stream: bool, /) -> None: ...

TABLE_WIDTH: int
MAX_OUTER: int

def copy_pieces(
    srcs: Any,
    work: Any,
    stream_bytes: int,
    band_bytes: int = 0,
    part: int = 0,
    parts: int = 1,
    /,
) -> None: ...
def stream_width(max_width: int = 64, /) -> int: ...
