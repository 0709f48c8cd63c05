"""The optional C copy (``reshard._fastcopy``) moves exactly the bytes numpy would,
refuses what it cannot copy, and reshard gives the same results with it or without."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_reshard import cases, run_case

from reshard import _buffers
from reshard._buffers import copy_into, native_copy

fastcopy = _buffers._fastcopy
needs_ext = pytest.mark.skipif(fastcopy is None, reason="reshard._fastcopy is not built")


def test_extension_is_built_where_a_compiler_is():
    # It is optional so that an install without a C compiler still works; where there
    # is one (CI), a build that silently failed would lose the fast path unnoticed.
    if not (shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler here: the extension is allowed to be missing")
    assert fastcopy is not None
    x86 = os.uname().machine in ("x86_64", "AMD64")
    assert bool(fastcopy.HAVE_STREAM) is x86


def _block(rng, shape, itemsize):
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * itemsize, dtype=np.uint8)
    return raw.view(f"V{itemsize}").reshape(shape)  # any bits, any item size


@st.composite
def strided_pairs(draw):
    """A random box of one block and the same-shaped box of another, each possibly
    reversed along outer axes, the destination block possibly at an odd address."""
    rank = draw(st.integers(1, 4))
    itemsize = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    # Short rows take the C code's fixed-size copies (1-64 bytes), long ones its
    # memcpy or streamed path (whole 64-byte lines between plain head and tail).
    last = draw(st.one_of(st.integers(1, 7), st.integers(8, 300)))
    piece = tuple(draw(st.integers(1, 7)) for _ in range(rank - 1)) + (last,)

    def box():
        full = tuple(p + draw(st.integers(0, 3)) for p in piece)
        start = tuple(draw(st.integers(0, f - p)) for f, p in zip(full, piece, strict=True))
        return full, tuple(slice(a, a + p) for a, p in zip(start, piece, strict=True))

    flips = tuple(draw(st.booleans()) for _ in range(rank - 1)) + (False,)
    flip = tuple(slice(None, None, -1) if f else slice(None) for f in flips)
    return itemsize, box(), box(), flip, draw(st.integers(0, 63))


@needs_ext
@settings(max_examples=300, deadline=None)
@given(case=strided_pairs(), stream=st.booleans())
def test_copy_is_numpys_copy_bit_for_bit(case, stream):
    itemsize, (src_full, src_box), (dst_full, dst_box), flip, shift = case
    rng = np.random.default_rng(len(src_full) * 16 + itemsize)
    src = _block(rng, src_full, itemsize)[src_box][flip]
    size = int(np.prod(dst_full)) * itemsize

    def dst_in(storage):
        # ``shift`` bytes into the allocation: the C code streams whole 64-byte
        # lines only, so it must copy an unaligned head (and the tail) plainly.
        block = storage[shift : shift + size].view(f"V{itemsize}").reshape(dst_full)
        return block[dst_box][flip]

    ours = np.random.default_rng(shift).integers(0, 256, size + 64, dtype=np.uint8)
    numpys = ours.copy()
    dst_in(numpys)[...] = src
    fastcopy.copy(dst_in(ours).view(np.uint8), src.view(np.uint8), stream)
    assert ours.tobytes() == numpys.tobytes()  # the box, and nothing outside it


@needs_ext
def test_copy_refuses_what_it_cannot_copy_and_leaves_dst_alone():
    a = np.arange(4096, dtype=np.uint8).reshape(64, 64)
    b = np.zeros((64, 64), np.uint8)
    cases = [
        (b[:, :32], a[:, :31], ValueError, "same shape"),
        (b, a.reshape(64, 8, 8), ValueError, "same rank"),
        (b[:, ::2], a[:, :32], ValueError, "last axis"),
        (b.view(np.uint16), a.view(np.uint8)[:, :32], ValueError, "item size"),
        (a[1:], a[:-1], ValueError, "overlap"),  # rows 1.. written from rows ..62
        (np.frombuffer(bytes(4096), np.uint8).reshape(64, 64), a, ValueError, "read-only"),
    ]
    for dst, src, error, words in cases:
        kept = a.tobytes() + b.tobytes()
        with pytest.raises(error, match=words):
            fastcopy.copy(dst, src, True)
        assert a.tobytes() + b.tobytes() == kept
    fastcopy.copy(b[:0], a[:0], True)  # empty: nothing to do, no error
    with pytest.raises(TypeError):
        fastcopy.copy(b, [1, 2, 3], True)


def test_native_copy_declines_rather_than_copying_wrong(monkeypatch):
    # Where the C copy does not apply, native_copy copies nothing and says so, and
    # copy_into's numpy path makes the copy: small pieces, overlapping bytes (numpy
    # copies those right), strided last axes, a missing extension.
    monkeypatch.setattr(_buffers, "NATIVE_COPY_BYTES", 1024)
    a = np.arange(1 << 16, dtype=np.float32)
    small = np.zeros(16, np.float32)
    assert not native_copy(small, a[:16])
    want = a.copy()
    want[8:] = a[:-8].copy()
    assert not native_copy(a[8:], a[:-8]) or fastcopy is None
    copy_into(a, a[:-8], (slice(8, None),))
    assert a.tobytes() == want.tobytes()
    b = np.zeros((512, 256), np.float32)
    src = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    assert not native_copy(b, src[:, ::2])
    copy_into(b, src[:, ::2])
    assert b.tobytes() == np.ascontiguousarray(src[:, ::2]).tobytes()
    monkeypatch.setattr(_buffers, "NATIVE_COPY", False)
    assert not native_copy(b, src[:, :256])


@st.composite
def copy_cases(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 40)) for _ in range(rank))
    box = []
    for d in shape:
        a = draw(st.integers(0, d - 1))
        box.append(slice(a, draw(st.integers(a + 1, d))))
    return shape, tuple(box), draw(st.sampled_from(["float32", "bfloat16", "bool", "int8"]))


@settings(max_examples=150, deadline=None)
@given(case=copy_cases(), native=st.booleans(), stream=st.booleans())
def test_copy_into_is_the_same_with_and_without_the_extension(case, native, stream):
    import ml_dtypes

    shape, box, name = case
    dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
    rng = np.random.default_rng(len(shape))
    src = _block(rng, shape, np.dtype(dtype).itemsize).view(dtype)
    size = tuple(s.stop - s.start for s in box)
    dst = np.zeros(tuple(d + 2 for d in size), dtype)
    at = tuple(slice(1, 1 + d) for d in size)
    want = dst.copy()
    want[at] = src[box]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_buffers, "NATIVE_COPY", native and fastcopy is not None)
        mp.setattr(_buffers, "NATIVE_COPY_BYTES", 1)  # every piece, however small
        mp.setattr(_buffers, "STREAM_COPY_BYTES", 1 if stream else 1 << 40)
        copy_into(dst, src[box], at)
    assert dst.tobytes() == want.tobytes()


@needs_ext
@settings(max_examples=30, deadline=None)
@given(
    case=cases(),
    executor=st.sampled_from(["host", "collective"]),
    stream=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_reshard_with_every_copy_native_is_exact(case, executor, stream, seed):
    # The local host executor (its copy loop chosen per plan) and the collective
    # executor's host packing, with the C copy taking every piece.
    from reshard import _collective_executor

    src, dst, shape, dtype = case
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_buffers, "NATIVE_COPY_BYTES", 1)
        mp.setattr(_buffers, "STREAM_COPY_BYTES", 1 if stream else 1 << 40)
        mp.setattr(_collective_executor, "PACK_ON_HOST", True)
        run_case(src, dst, shape, dtype, executor=executor, seed=seed)


def test_host_executor_marks_large_pieces_native(monkeypatch):
    from reshard._local_executor import copy_mode

    monkeypatch.setattr(_buffers, "NATIVE_COPY", True)
    big = (1024, 64)  # 256 KiB of float32
    assert copy_mode(big, (1024, 256), (1024, 64), 4) == _buffers.NATIVE
    assert copy_mode((), (), (), 4) is None  # a scalar is never native
    monkeypatch.setattr(_buffers, "NATIVE_COPY", False)
    assert copy_mode(big, (1024, 256), (1024, 64), 4) is None  # 256 B rows: numpy


def test_reshard_works_when_the_extension_cannot_be_imported(tmp_path):
    # A machine without a compiler installs reshard without _fastcopy: every copy is
    # numpy's then, and results are the same.
    script = textwrap.dedent(
        """
        import sys
        sys.modules["reshard._fastcopy"] = None  # import fails as if never built
        import jax
        import numpy as np
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        import reshard
        from reshard import _buffers
        assert _buffers._fastcopy is None and not _buffers.NATIVE_COPY
        devs = np.array(jax.devices()[:4])
        x_np = np.arange(512 * 1024, dtype=np.float32).reshape(512, 1024)
        x = jax.device_put(x_np, NamedSharding(Mesh(devs, ("a",)), P("a", None)))
        for executor in ("host", "collective"):
            y = reshard.reshard(
                x, NamedSharding(Mesh(devs, ("a",)), P(None, "a")), executor=executor
            )
            assert np.asarray(y).tobytes() == x_np.tobytes(), executor
        print("ok")
        """
    )
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4")
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "ok"


def test_environment_switch_turns_the_extension_off():
    env = dict(os.environ, RESHARD_NATIVE_COPY="0", JAX_PLATFORMS="cpu")
    code = "from reshard import _buffers; print(_buffers.NATIVE_COPY)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"


def _c_contiguous_block(rng, shape, itemsize):
    return np.ascontiguousarray(_block(rng, shape, itemsize))


@st.composite
def piece_sets(draw):
    """Source shards of one rank and item size, destination shards, and boxes copied
    out of the former into the latter (some overlapping: later rows write last)."""
    rank = draw(st.integers(0, 4))
    itemsize = draw(st.sampled_from([1, 2, 3, 4, 8, 16]))
    dim = st.integers(1, 6)
    srcs = [tuple(draw(dim) for _ in range(rank)) for _ in range(draw(st.integers(1, 3)))]
    dsts = [tuple(draw(dim) for _ in range(rank)) for _ in range(draw(st.integers(1, 2)))]
    work = []
    for d in dsts:
        pieces = []
        for _ in range(draw(st.integers(0, 4))):
            si = draw(st.integers(0, len(srcs) - 1))
            ssl, dsl = [], []
            for a, b in zip(srcs[si], d, strict=True):
                n = draw(st.integers(0, min(a, b)))  # empty boxes too
                i, j = draw(st.integers(0, a - n)), draw(st.integers(0, b - n))
                ssl.append(slice(i, i + n))
                dsl.append(slice(j, j + n))
            pieces.append((si, tuple(ssl), tuple(dsl)))
        work.append(pieces)
    unused = draw(st.booleans())  # a source no piece reads may be passed as None
    return itemsize, srcs, dsts, work, unused


def _pieces_and_truth(case, work):
    """Random blocks for a ``piece_sets`` case copying ``work``: our destinations,
    numpy's copy into the same bits, the sources to pass (``None`` where unused, if
    the case says so) and the tables."""
    from reshard._buffers import piece_table

    itemsize, src_shapes, dst_shapes, _, unused = case
    rng = np.random.default_rng(len(src_shapes) * 31 + itemsize)
    srcs = [_c_contiguous_block(rng, s, itemsize) for s in src_shapes]
    ours = [_c_contiguous_block(rng, d, itemsize) for d in dst_shapes]
    numpys = [d.copy() for d in ours]
    for d, pieces in zip(numpys, work, strict=True):
        for si, ssl, dsl in pieces:
            d[dsl] = srcs[si][ssl]
    tables = [
        piece_table(p, src_shapes, d, itemsize) for p, d in zip(work, dst_shapes, strict=True)
    ]
    read = {si for pieces in work for si, _, _ in pieces}
    passed = [None if unused and si not in read else s for si, s in enumerate(srcs)]
    return ours, numpys, passed, tables


@needs_ext
@settings(max_examples=300, deadline=None)
@given(case=piece_sets(), stream=st.booleans())
def test_copy_pieces_is_numpys_copy_bit_for_bit(case, stream):

    ours, numpys, passed, tables = _pieces_and_truth(case, case[3])
    assert all(t is not None for t in tables)  # rank 4 at most: 3 outer axes at most
    fastcopy.copy_pieces(passed, list(zip(ours, tables, strict=True)), 0 if stream else 1 << 40)
    for a, b in zip(ours, numpys, strict=True):
        assert a.tobytes() == b.tobytes()  # the boxes, and nothing outside them


def _disjoint(box, taken):
    """Whether ``box`` (slices) shares no element with any box of ``taken``."""
    return all(
        any(a.stop <= b.start or b.stop <= a.start for a, b in zip(box, t, strict=True))
        for t in taken
    )


@contextlib.contextmanager
def streaming_width(width):
    """Streaming stores of at most ``width`` bytes (the widest the CPU has) inside."""
    got = fastcopy.stream_width(width)
    assert got in ((0,) if not fastcopy.HAVE_STREAM else (16, 32, 64)) and got <= width
    try:
        yield
    finally:
        fastcopy.stream_width(64)


@needs_ext
@settings(max_examples=300, deadline=None)
@given(
    case=piece_sets(),
    stream=st.booleans(),
    band=st.sampled_from([1, 7, 64, 100, 1 << 20]),
    parts=st.integers(1, 4),
    width=st.sampled_from([16, 32, 64]),
    data=st.data(),
)
def test_copy_pieces_in_bands_and_parts_is_numpys_copy_bit_for_bit(
    case, stream, band, parts, width, data
):
    # Band mode copies the boxes a band of each in turn, and a part only its share of
    # every box's bands: the parts together, in any order, make numpy's copy. (The
    # executors never write a byte twice, so boxes overlapping in a destination,
    # whose order would matter, are left out here.) Each streaming width the CPU has.

    kept = []
    for pieces in case[3]:
        mine: list = []
        for p in pieces:
            if _disjoint(p[2], [q[2] for q in mine]):
                mine.append(p)
        kept.append(mine)
    ours, numpys, passed, tables = _pieces_and_truth(case, kept)
    order = data.draw(st.permutations(range(parts)))
    with streaming_width(width):
        for part in order:
            fastcopy.copy_pieces(
                passed,
                list(zip(ours, tables, strict=True)),
                0 if stream else 1 << 40,
                band,
                part,
                parts,
            )
    for a, b in zip(ours, numpys, strict=True):
        assert a.tobytes() == b.tobytes()  # the boxes, and nothing outside them


@needs_ext
def test_copy_pieces_in_bands_covers_long_runs_and_big_boxes():
    # A contiguous run of 1 MiB + 3 bytes (no outer axis: cut into 64-byte units) and
    # a column block of a 3-D block (cut along its outermost axis), streamed, in
    # bands of 4 KiB, 3 parts, from an odd destination offset.
    from reshard._buffers import piece_table

    rng = np.random.default_rng(5)
    n = (1 << 20) + 3
    src = rng.integers(0, 256, n + 5, dtype=np.uint8)
    dst = np.zeros(n + 9, np.uint8)
    run = piece_table([(0, (slice(5, 5 + n),), (slice(9, 9 + n),))], [src.shape], dst.shape, 1)
    cube = rng.integers(0, 256, (64, 48, 256), dtype=np.uint8)
    out = np.zeros((64, 48, 100), np.uint8)
    box = (slice(0, 64), slice(0, 48), slice(7, 107))
    cut = piece_table(
        [(1, box, (slice(0, 64), slice(0, 48), slice(0, 100)))],
        [src.shape, cube.shape],
        out.shape,
        1,
    )
    for width in (16, 32, 64):
        dst[:] = 0
        out[:] = 0
        with streaming_width(width):
            for part in (2, 0, 1):
                fastcopy.copy_pieces([src, cube], [(dst, run), (out, cut)], 0, 4096, part, 3)
        assert dst[9:].tobytes() == src[5:].tobytes() and not dst[:9].any()
        assert out.tobytes() == cube[box].tobytes()


@needs_ext
def test_copy_pieces_refuses_bad_bands_and_parts():
    from reshard._buffers import piece_table

    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, np.uint8)
    table = piece_table([(0, (slice(0, 64),), (slice(0, 64),))], [(64,)], (64,), 1)
    for band, part, parts in [
        (-1, 0, 1),
        (64, 2, 2),
        (64, -1, 2),
        (64, 0, 0),
        (0, 0, 2),
        (64, 0, 5000),
    ]:
        with pytest.raises(ValueError, match="part"):
            fastcopy.copy_pieces([src], [(dst, table)], 0, band, part, parts)
        assert not dst.any()


def test_piece_table_merges_runs_and_gives_up_past_its_axes():
    from reshard._buffers import piece_table

    if fastcopy is None:
        assert piece_table([(0, (slice(0, 2),), (slice(0, 2),))], [(4,)], (2,), 4) is None
        return
    # Whole rows of a row block are one run of bytes; a column block is rows.
    rows = piece_table(
        [(0, (slice(2, 4), slice(0, 8)), (slice(0, 2), slice(0, 8)))], [(4, 8)], (2, 8), 4
    )
    assert rows.shape == (1, fastcopy.TABLE_WIDTH)
    assert list(rows[0, :5]) == [0, 0, 2 * 8 * 4, 2 * 8 * 4, 0]
    cols = piece_table(
        [(1, (slice(0, 4), slice(4, 8)), (slice(0, 4), slice(0, 4)))], [(1, 1), (4, 8)], (4, 4), 4
    )
    assert list(cols[0, :8]) == [1, 0, 16, 16, 1, 4, 16, 32]
    empty = piece_table(
        [(0, (slice(1, 1), slice(0, 8)), (slice(0, 0), slice(0, 8)))], [(4, 8)], (2, 8), 4
    )
    assert empty.shape == (0, fastcopy.TABLE_WIDTH)
    # Four outer axes that no layout merges: more than the C loop walks.
    box = (slice(0, 2), slice(0, 2), slice(0, 2), slice(0, 2), slice(0, 2))
    assert piece_table([(0, box, box)], [(2, 4, 2, 4, 4)], (4, 2, 4, 2, 4), 1) is None


@needs_ext
def test_copy_pieces_refuses_bad_rows_and_writes_nothing():
    from reshard._buffers import piece_table

    src = np.arange(256, dtype=np.uint8).reshape(16, 16)
    good = piece_table(
        [(0, (slice(0, 4), slice(0, 4)), (slice(0, 4), slice(0, 4)))], [(16, 16)], (8, 8), 1
    )

    def bad(**fields):
        t = good.copy()
        for name, value in fields.items():
            t[
                0,
                ["src", "doff", "soff", "run", "outer"].index(name)
                if not name.startswith("a")
                else 5 + int(name[1:]),
            ] = value
        return t

    dst = np.zeros((8, 8), np.uint8)
    other = np.zeros((8, 8), np.uint8)
    cases = [
        ([src], [(dst, bad(src=1))], ValueError, "missing source"),
        ([None], [(dst, good)], ValueError, "missing source"),
        ([src], [(dst, bad(src=-1))], ValueError, "missing source"),
        ([src], [(dst, bad(doff=61))], ValueError, "bounds"),  # 4 rows of 4 from 61
        ([src], [(dst, bad(soff=256))], ValueError, "bounds"),
        ([src], [(dst, bad(doff=-1))], ValueError, "bounds"),
        ([src], [(dst, bad(run=65))], ValueError, "bounds"),
        ([src], [(dst, bad(a0=1 << 62))], ValueError, "bounds"),  # a count that overflows
        ([src], [(dst, bad(a1=-8))], ValueError, "bounds"),  # a negative step
        ([src], [(dst, bad(a1=0))], ValueError, "bounds"),  # rows written on each other
        ([src], [(dst, bad(a0=0))], ValueError, "bounds"),
        ([src], [(dst, bad(outer=fastcopy.MAX_OUTER + 1))], ValueError, "bounds"),
        ([src], [(dst, good[:, :-1].copy())], ValueError, "TABLE_WIDTH"),
        ([src], [(src[4:12, 4:12].copy(), good), (src, good)], ValueError, "overlap"),
        (
            [src],
            [(np.frombuffer(bytes(64), np.uint8), good)],
            (BufferError, ValueError),
            "read-only|writable",
        ),
        ([src[:, ::2]], [(dst, good)], (BufferError, ValueError), "contiguous"),
        ([src], [(dst,)], TypeError, "dst, table"),
    ]
    for srcs, work, error, words in cases:
        # Nothing is written, even into a destination whose own rows were all good.
        with pytest.raises(error, match=words):
            fastcopy.copy_pieces(srcs, [(other, good)] + work, 0)
        assert not dst.any() and not other.any()
    for band in (0, 64):  # rows of no bytes: nothing to copy, in bands too
        fastcopy.copy_pieces([src], [(dst, bad(run=0))], 0, band)
        assert not dst.any()
    fastcopy.copy_pieces([src], [(dst, good)], 0)
    assert dst[:4, :4].tobytes() == src[:4, :4].tobytes() and not dst[4:].any()
    fastcopy.copy_pieces([], [], 0)  # nothing to do


def _counting(monkeypatch, raises: bool = False) -> list[int]:
    """Counts calls of ``copy_pieces`` (and makes them fail before copying, as the
    C code refuses a buffer it cannot take, when ``raises``)."""
    import types

    calls = [0]

    def copy_pieces(*args):
        calls[0] += 1
        if raises:
            raise BufferError("a buffer that is not C-contiguous")
        fastcopy.copy_pieces(*args)

    stub = types.SimpleNamespace(
        **{k: getattr(fastcopy, k) for k in dir(fastcopy) if not k.startswith("_")}
    )
    stub.copy_pieces = copy_pieces
    monkeypatch.setattr(_buffers, "_fastcopy", stub)
    return calls


@needs_ext
@settings(max_examples=40, deadline=None)
@given(
    case=cases(), mode=st.sampled_from(["tables", "numpy", "refused"]), seed=st.integers(0, 2**16)
)
def test_host_executor_is_exact_with_tables_without_and_when_refused(case, mode, seed):
    # The host executor copies each array's small shards in one C call (its pieces as
    # table rows), its large shards in one call split by bands between the copy
    # threads; with the extension off, piece by piece; and piece by piece again where
    # the C code refuses a buffer.
    src, dst, shape, dtype = case
    with pytest.MonkeyPatch.context() as mp:
        calls = _counting(mp, raises=mode == "refused")
        mp.setattr(_buffers, "NATIVE_COPY", mode != "numpy")
        run_case(src, dst, shape, dtype, executor="host", seed=seed)
    if mode == "numpy":
        assert calls[0] == 0


@needs_ext
@settings(max_examples=40, deadline=None)
@given(case=cases(), seed=st.integers(0, 2**16), refused=st.booleans())
def test_host_executor_splits_large_shards_by_bands_exactly(case, seed, refused):
    # Every shard "large" (own buffer, banded copy split between threads), bands of
    # ~100 bytes, up to 3 parts from 64 bytes on: the parts, run on the copy threads,
    # make numpy's copy; refused, part 0 alone copies piece by piece.
    from reshard import _local_executor

    src, dst, shape, dtype = case
    with pytest.MonkeyPatch.context() as mp:
        _counting(mp, raises=refused)
        mp.setattr(_local_executor, "SMALL_SHARD_BYTES", 0)
        mp.setattr(_local_executor, "THREADED_COPY_BYTES", 32)
        mp.setattr(_local_executor, "COPY_THREADS", 3)
        mp.setattr(_buffers, "BAND_BYTES", 100)
        run_case(src, dst, shape, dtype, executor="host", seed=seed)


def _rows_and_blocks():
    """Row shards on the 8 devices and (2 x 4) blocks on them, where the extension is
    on (the test is skipped otherwise)."""
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    if fastcopy is None or not _buffers.NATIVE_COPY:
        pytest.skip("reshard._fastcopy is not built or is switched off")
    devs = np.array(jax.devices()[:8])
    rows = NamedSharding(Mesh(devs, ("a",)), P("a", None))
    return rows, NamedSharding(Mesh(devs.reshape(2, 4), ("b", "c")), P("b", "c"))


def test_host_executor_copies_an_arrays_large_shards_in_parts(monkeypatch):
    # One array of 4 MiB from row shards to (2 x 4) blocks: its 8 shards of 512 KiB
    # (made "large") are one copy in 3 parts, each part one C call on a copy thread.
    import jax

    import reshard
    from reshard import _local_executor

    src, dst = _rows_and_blocks()
    truth = np.random.default_rng(3).random((1024, 1024), np.float32)
    x = jax.device_put(truth, src)
    seen = []
    real = fastcopy.copy_pieces

    def recording(srcs, work, stream, band, part, parts):
        seen.append((len(work), part, parts))
        real(srcs, work, stream, band, part, parts)

    import types

    stub = types.SimpleNamespace(
        **{k: getattr(fastcopy, k) for k in dir(fastcopy) if not k.startswith("_")}
    )
    stub.copy_pieces = recording
    monkeypatch.setattr(_buffers, "_fastcopy", stub)
    monkeypatch.setattr(_local_executor, "SMALL_SHARD_BYTES", 0)
    monkeypatch.setattr(_local_executor, "COPY_THREADS", 3)
    y = reshard.reshard(x, dst, executor="host")
    assert sorted(seen) == [(8, 0, 3), (8, 1, 3), (8, 2, 3)]
    assert np.asarray(y).tobytes() == truth.tobytes() and y.sharding == dst
    for s in y.addressable_shards:
        assert np.asarray(s.data).tobytes() == truth[s.index].tobytes()


def test_host_executor_fills_an_arrays_small_shards_in_one_call(monkeypatch):
    # 16 arrays, each cut from row shards into (2 x 4) blocks on the same 8 devices:
    # 4 pieces per destination shard, 32 per array, one C call per array.
    import jax

    import reshard
    from reshard import _local_executor

    src, dst = _rows_and_blocks()
    truth = [np.random.default_rng(i).random((64, 32), np.float32) for i in range(16)]
    xs = [jax.device_put(t, src) for t in truth]
    calls = _counting(monkeypatch)
    filled = []
    monkeypatch.setattr(_local_executor, "_fill", lambda *a: filled.append(a))
    ys = reshard.reshard(xs, [dst] * 16, executor="host")
    assert calls[0] == 16 and not filled
    for y, t in zip(ys, truth, strict=True):
        assert np.asarray(y).tobytes() == t.tobytes() and y.sharding == dst
        for s in y.addressable_shards:
            assert np.asarray(s.data).tobytes() == t[s.index].tobytes()


def test_host_executor_copies_pieces_past_the_tables_axes_one_by_one():
    # A 7-D array cut from shards split along axes 0, 2, 4 into shards split along
    # 1, 3, 5: each piece keeps four outer axes apart, more than the C loop walks, so
    # piece_table gives up and the executor copies those pieces one by one, exactly.
    import jax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import reshard
    from reshard import _execute

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("a", "b", "c"))
    truth = np.arange(4**6 * 2, dtype=np.int16).reshape(4, 4, 4, 4, 4, 4, 2)
    x = jax.device_put(truth, NamedSharding(mesh, P("a", None, "b", None, "c")))
    dst = NamedSharding(mesh, P(None, "a", None, "b", None, "c"))
    plan = reshard.plan(x, dst, executor="host")
    y = plan.execute(x)
    (job,) = _execute._jobs(plan)
    assert all(t is None for t in job.tables)
    assert np.asarray(y).tobytes() == truth.tobytes() and y.sharding == dst
    for s in y.addressable_shards:
        assert np.asarray(s.data).tobytes() == truth[s.index].tobytes()
