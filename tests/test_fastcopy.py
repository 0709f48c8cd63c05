"""The optional C copy (``reshard._fastcopy``) moves exactly the bytes numpy would,
refuses what it cannot copy, and reshard gives the same results with it or without."""

from __future__ import annotations

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
