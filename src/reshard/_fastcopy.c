/*
 * reshard._fastcopy: copy one strided array into another of the same shape, bit for
 * bit, without the GIL. Optional: reshard falls back to numpy where it is not built.
 *
 * Why: cutting a piece out of a shard (or writing one into a shard) is a 2-D copy of
 * many rows of a few KiB each. numpy runs it as one inner loop per row, and every row
 * passes through the cache on its way to memory it will not be read from for a while
 * (a send buffer, an output shard). Here each row is one memcpy, and rows of big
 * copies are written with non-temporal (streaming) stores on x86-64, which skip the
 * cache: on a 2-core EPYC, a 288 MiB 4-way column cut went from 3.9 GB/s (numpy) to
 * 4.3 (memcpy per row) and 5.8 (streaming), against 6.0 for one contiguous memcpy.
 * copy_pieces copies many pieces in one call from tables of byte offsets, optionally
 * in bands (copy_banded) so that the pieces of one source row bound for different
 * destinations are cut while that row is in cache.
 *
 * The module takes any objects exporting a strided buffer (numpy arrays) and only
 * needs the Python headers to build: no numpy headers, so a build never depends on
 * the numpy it will run with.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#if defined(__GNUC__) /* GCC and Clang: per-function targets, run-time CPU checks */
#include <immintrin.h>
#define WIDE_STREAM 1
#else
#define WIDE_STREAM 0
#endif
#else
#define HAVE_STREAM 0
#endif

#define MAX_DIMS 64

#if HAVE_STREAM
/* Whole 64-byte lines streamed, n a multiple of 64 and d 64-byte aligned. The widest
 * stores the CPU has are chosen at import (``stream_width``): on a Xeon (Sapphire
 * Rapids) a 4-way column cut streamed with 16-byte stores ran at 3.5-4.8 GB/s, with
 * 32-byte ones at 5.2-6.0 and with 64-byte ones at 6.4-6.9 (one thread, memory not in
 * cache), and a plain 256 MiB copy at 5.8-7.0, 6.8-8.9 and 7.8-8.8 (glibc's memcpy
 * 8.4-9.7). */
static void stream_lines_16(char *d, const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
}

#if WIDE_STREAM
__attribute__((target("avx"))) static void stream_lines_32(char *d, const char *s, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i += 64) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(s + i));
        __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + 32));
        _mm256_stream_si256((__m256i *)(d + i), a);
        _mm256_stream_si256((__m256i *)(d + i + 32), b);
    }
}

__attribute__((target("avx512f"))) static void stream_lines_64(char *d, const char *s,
                                                               Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i += 64) {
        _mm512_stream_si512((void *)(d + i), _mm512_loadu_si512((const void *)(s + i)));
    }
}
#endif

static void (*stream_lines)(char *, const char *, Py_ssize_t) = stream_lines_16;

/* Chooses the stores stream_lines uses: the widest the CPU has, at most max_width
 * bytes (16, 32 or 64). Returns the width chosen. */
static int choose_stream(int max_width) {
    stream_lines = stream_lines_16;
#if WIDE_STREAM
    __builtin_cpu_init();
    if (max_width >= 64 && __builtin_cpu_supports("avx512f")) {
        stream_lines = stream_lines_64;
        return 64;
    }
    if (max_width >= 32 && __builtin_cpu_supports("avx")) {
        stream_lines = stream_lines_32;
        return 32;
    }
#else
    (void)max_width;
#endif
    return 16;
}

/* One row with streaming stores of whole cache lines; plain copies up to the first
 * 64-byte aligned destination byte and after the last whole line. (Streaming part of a
 * line while plain stores write the rest of it is very slow: 96-byte rows aligned to
 * 16 bytes took 15x the time of plain copies.) */
static void stream_row(char *d, const char *s, Py_ssize_t n) {
    Py_ssize_t i = (Py_ssize_t)((64 - ((uintptr_t)d & 63)) & 63);
    if (i > n) i = n;
    if (i) memcpy(d, s, (size_t)i);
    Py_ssize_t lines = (n - i) & ~(Py_ssize_t)63;
    if (lines) stream_lines(d + i, s + i, lines);
    i += lines;
    if (i < n) memcpy(d + i, s + i, (size_t)(n - i));
}
#endif

/* count rows of row bytes each, the next one ds (ss) bytes further on. Short rows are
 * copied by fixed-size copies the compiler inlines: a call to memcpy per row of a few
 * bytes would cost several times the copy (4-byte rows: ~7x, measured). */
#define FIXED_ROWS(N)                                              \
    case N:                                                        \
        for (Py_ssize_t r = 0; r < count; r++, d += ds, s += ss) { \
            memcpy(d, s, N);                                       \
        }                                                          \
        return;

static void copy_plane(char *d, const char *s, Py_ssize_t row, Py_ssize_t count,
                       Py_ssize_t ds, Py_ssize_t ss, int stream) {
    switch (row) {
        FIXED_ROWS(1)
        FIXED_ROWS(2)
        FIXED_ROWS(4)
        FIXED_ROWS(8)
        FIXED_ROWS(16)
        FIXED_ROWS(32)
        FIXED_ROWS(64)
        default:
            break;
    }
    if (row < 64) { /* other short rows: 8-byte words, then the bytes left */
        for (Py_ssize_t r = 0; r < count; r++, d += ds, s += ss) {
            Py_ssize_t i = 0;
            for (; i + 8 <= row; i += 8) memcpy(d + i, s + i, 8);
            for (; i < row; i++) d[i] = s[i];
        }
        return;
    }
#if HAVE_STREAM
    if (stream) {
        for (Py_ssize_t r = 0; r < count; r++, d += ds, s += ss) stream_row(d, s, row);
        return;
    }
#else
    (void)stream;
#endif
    for (Py_ssize_t r = 0; r < count; r++, d += ds, s += ss) memcpy(d, s, (size_t)row);
}

/* The lowest and one past the highest byte a strided buffer covers. */
static void byte_range(const Py_buffer *v, int ndim, const Py_ssize_t *shape, char **lo,
                       char **hi) {
    char *a = (char *)v->buf, *b = (char *)v->buf + v->itemsize;
    for (int k = 0; k < ndim; k++) {
        Py_ssize_t step = (shape[k] - 1) * v->strides[k];
        if (step < 0) a += step;
        else b += step;
    }
    *lo = a;
    *hi = b;
}

static PyObject *fastcopy_copy(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *dst_obj, *src_obj;
    int stream;
    if (!PyArg_ParseTuple(args, "OOp:copy", &dst_obj, &src_obj, &stream)) return NULL;
    Py_buffer d, s;
    if (PyObject_GetBuffer(dst_obj, &d, PyBUF_STRIDES | PyBUF_WRITABLE) < 0) return NULL;
    if (PyObject_GetBuffer(src_obj, &s, PyBUF_STRIDES) < 0) {
        PyBuffer_Release(&d);
        return NULL;
    }
    PyObject *result = NULL;
    int ndim = d.ndim;
    if (ndim < 1 || ndim > MAX_DIMS || s.ndim != ndim || d.itemsize != s.itemsize) {
        PyErr_SetString(PyExc_ValueError,
                        "copy: dst and src must have the same rank (1 or more) and item size");
        goto done;
    }
    for (int k = 0; k < ndim; k++) {
        if (d.shape[k] != s.shape[k]) {
            PyErr_SetString(PyExc_ValueError, "copy: dst and src must have the same shape");
            goto done;
        }
        if (d.shape[k] == 0) {
            result = Py_None;
            goto done;
        }
    }
    if (d.strides[ndim - 1] != d.itemsize || s.strides[ndim - 1] != s.itemsize) {
        PyErr_SetString(PyExc_ValueError, "copy: the last axis must be contiguous");
        goto done;
    }
    {
        char *dlo, *dhi, *slo, *shi;
        byte_range(&d, ndim, d.shape, &dlo, &dhi);
        byte_range(&s, ndim, s.shape, &slo, &shi);
        if (dlo < shi && slo < dhi) {
            PyErr_SetString(PyExc_ValueError, "copy: dst and src overlap");
            goto done;
        }
    }
    /* Merge axes that are laid out as one in both buffers (the contiguous row grows),
     * then walk the remaining outer axes with a counter. */
    Py_ssize_t shape[MAX_DIMS], dstr[MAX_DIMS], sstr[MAX_DIMS];
    int n = 0;
    shape[0] = d.shape[ndim - 1] * d.itemsize;
    dstr[0] = 1;
    sstr[0] = 1;
    for (int k = ndim - 2; k >= 0; k--) {
        if (d.shape[k] == 1) continue;
        if (d.strides[k] == shape[n] * dstr[n] && s.strides[k] == shape[n] * sstr[n]) {
            shape[n] *= d.shape[k];
        } else {
            n++;
            shape[n] = d.shape[k];
            dstr[n] = d.strides[k];
            sstr[n] = s.strides[k];
        }
    }
    /* Axes are innermost first now: shape[0] is the row's length in bytes, axis 1 (if
     * any) the rows of one plane, the rest walked with a counter. */
    Py_ssize_t planes = 1, idx[MAX_DIMS] = {0};
    for (int k = 2; k <= n; k++) planes *= shape[k];
    Py_ssize_t count = n >= 1 ? shape[1] : 1;
    Py_ssize_t ds = n >= 1 ? dstr[1] : 0, ss = n >= 1 ? sstr[1] : 0;
    char *dp = (char *)d.buf;
    const char *sp = (const char *)s.buf;
    int use_stream = stream && HAVE_STREAM;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t p = 0; p < planes; p++) {
        copy_plane(dp, sp, shape[0], count, ds, ss, use_stream);
        for (int k = 2; k <= n; k++) {
            dp += dstr[k];
            sp += sstr[k];
            if (++idx[k] < shape[k]) break;
            dp -= dstr[k] * shape[k];
            sp -= sstr[k] * shape[k];
            idx[k] = 0;
        }
    }
#if HAVE_STREAM
    if (use_stream) _mm_sfence(); /* streamed stores are visible before we return */
#endif
    Py_END_ALLOW_THREADS
    result = Py_None;
done:
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    Py_XINCREF(result);
    return result;
}

/* copy_pieces: many boxes out of C-contiguous source buffers into C-contiguous
 * destination buffers in one call. A table row describes one box in bytes: */
enum { T_SRC, T_DOFF, T_SOFF, T_ROW, T_OUTER, T_AXES };
#define MAX_OUTER 3
#define TABLE_WIDTH (T_AXES + 3 * MAX_OUTER) /* then (count, dst step, src step) each */

typedef struct {
    Py_buffer view;
    int held;
} held_buffer;

static void release_all(held_buffer *b, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++)
        if (b[i].held) PyBuffer_Release(&b[i].view);
}

/* Whether a box of row bytes at off, walked by the outer axes of row r, stays within
 * [0, len): every term is checked against len before it is added, so nothing
 * overflows. */
static int box_fits(const int64_t *r, int64_t off, int dst, Py_ssize_t len) {
    if (off < 0 || r[T_ROW] < 0 || off > len || r[T_ROW] > len - off) return 0;
    int64_t end = off + r[T_ROW];
    for (int64_t k = 0; k < r[T_OUTER]; k++) {
        int64_t count = r[T_AXES + 3 * k], step = r[T_AXES + 3 * k + (dst ? 1 : 2)];
        if (count < 1 || step < 0) return 0;
        if (dst && count > 1 && step == 0) return 0; /* writing one place again and again */
        if (count > 1 && step > (len - end) / (count - 1)) return 0;
        end += (count - 1) * step;
    }
    return 1;
}

/* a * b for a, b >= 0, INT64_MAX where that overflows (a box's bytes, with rows that
 * overlap in the source, can outgrow its buffers). */
static int64_t mul_sat(int64_t a, int64_t b) {
    return a && b > INT64_MAX / a ? INT64_MAX : a * b;
}

/* One box, resolved to pointers; unused outer axes have a count of 1. */
typedef struct {
    char *d;
    const char *s;
    int64_t row, c[MAX_OUTER], ds[MAX_OUTER], ss[MAX_OUTER];
    int outer, stream;
    int64_t unit, per_band, at, end; /* band mode: see copy_banded */
} box_t;

static void copy_box(const box_t *b, char *d, const char *s, int64_t c_last) {
    int64_t c[MAX_OUTER] = {b->c[0], b->c[1], b->c[2]};
    if (b->outer) c[b->outer - 1] = c_last;
    for (int64_t x = 0; x < c[2]; x++)
        for (int64_t y = 0; y < c[1]; y++)
            copy_plane(d + x * b->ds[2] + y * b->ds[1], s + x * b->ss[2] + y * b->ss[1], b->row,
                       c[0], b->ds[0], b->ss[0], b->stream);
}

/* Band mode: every box is cut along its outermost axis (or, with none, its run in
 * 64-byte units) into bands of about band_bytes, and the boxes are copied a band of
 * each at a time, in turn. Boxes that read the same source rows (the pieces of one
 * source block bound for different destinations) then read them while they are in
 * cache, instead of each pass over the source reading the whole block again: a 4-way
 * column cut of 2 KiB rows streamed at 6.4-6.9 GB/s piece by piece and at 7.9-8.9 in
 * bands (one thread). Of each box's bands this call copies those of part out of
 * parts (consecutive bands), so that parts calls on as many threads share the work. */
static void copy_banded(box_t *boxes, Py_ssize_t n, int64_t band_bytes, int64_t part,
                        int64_t parts, Py_ssize_t *active) {
    Py_ssize_t live = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        box_t *b = &boxes[i];
        int64_t count;
        if (!b->row) continue; /* nothing to copy */
        if (b->outer) {
            b->unit = b->row;
            for (int k = 0; k < b->outer - 1; k++) b->unit = mul_sat(b->unit, b->c[k]);
            count = b->c[b->outer - 1];
        } else {
            b->unit = 64;
            count = (b->row + 63) / 64;
        }
        b->per_band = band_bytes / b->unit > 1 ? band_bytes / b->unit : 1;
        int64_t bands = (count + b->per_band - 1) / b->per_band;
        int64_t q = bands / parts, r = bands % parts;
        int64_t first = q * part + r * part / parts;
        int64_t last = q * (part + 1) + r * (part + 1) / parts;
        b->at = first * b->per_band;
        b->end = last * b->per_band < count ? last * b->per_band : count;
        if (b->at < b->end) active[live++] = i;
    }
    while (live) {
        Py_ssize_t kept = 0;
        for (Py_ssize_t j = 0; j < live; j++) {
            box_t *b = &boxes[active[j]];
            int64_t stop = b->end - b->at > b->per_band ? b->at + b->per_band : b->end;
            if (b->outer) {
                int k = b->outer - 1;
                copy_box(b, b->d + b->at * b->ds[k], b->s + b->at * b->ss[k], stop - b->at);
            } else {
                int64_t lo = b->at * 64, hi = stop * 64 < b->row ? stop * 64 : b->row;
                copy_plane(b->d + lo, b->s + lo, hi - lo, 1, 0, 0, b->stream);
            }
            b->at = stop;
            if (b->at < b->end) active[kept++] = active[j];
        }
        live = kept;
    }
}

static PyObject *fastcopy_copy_pieces(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *srcs_obj, *work_obj;
    Py_ssize_t stream_bytes, band_bytes = 0, part = 0, parts = 1;
    if (!PyArg_ParseTuple(args, "OOn|nnn:copy_pieces", &srcs_obj, &work_obj, &stream_bytes,
                          &band_bytes, &part, &parts))
        return NULL;
    if (parts < 1 || parts > 4096 || part < 0 || part >= parts || band_bytes < 0 ||
        (parts > 1 && band_bytes == 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "copy_pieces: need 0 <= part < parts <= 4096, band_bytes >= 0, and "
                        "band_bytes > 0 where parts > 1");
        return NULL;
    }
    PyObject *srcs = PySequence_Fast(srcs_obj, "copy_pieces: srcs must be a sequence");
    if (!srcs) return NULL;
    PyObject *work = PySequence_Fast(work_obj, "copy_pieces: work must be a sequence");
    if (!work) {
        Py_DECREF(srcs);
        return NULL;
    }
    Py_ssize_t ns = PySequence_Fast_GET_SIZE(srcs), nw = PySequence_Fast_GET_SIZE(work);
    PyObject *result = NULL;
    int streamed = 0;
    Py_ssize_t nboxes = 0;
    box_t *boxes = NULL;
    Py_ssize_t *active = NULL;
    held_buffer *sb = PyMem_Calloc((size_t)(ns > 0 ? ns : 1), sizeof(held_buffer));
    held_buffer *wb = PyMem_Calloc((size_t)(nw > 0 ? 2 * nw : 1), sizeof(held_buffer));
    if (!sb || !wb) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < ns; i++) {
        PyObject *o = PySequence_Fast_GET_ITEM(srcs, i);
        if (o == Py_None) continue;
        if (PyObject_GetBuffer(o, &sb[i].view, PyBUF_SIMPLE) < 0) goto done;
        sb[i].held = 1;
    }
    /* Take and check everything before the first byte is written: an error leaves
     * every destination as it was. */
    for (Py_ssize_t w = 0; w < nw; w++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(work, w);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "copy_pieces: work items must be (dst, table)");
            goto done;
        }
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 0), &wb[2 * w].view,
                               PyBUF_SIMPLE | PyBUF_WRITABLE) < 0)
            goto done;
        wb[2 * w].held = 1;
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(pair, 1), &wb[2 * w + 1].view, PyBUF_SIMPLE) < 0)
            goto done;
        wb[2 * w + 1].held = 1;
        const Py_buffer *d = &wb[2 * w].view, *t = &wb[2 * w + 1].view;
        if (t->len % (Py_ssize_t)(TABLE_WIDTH * sizeof(int64_t)) || ((uintptr_t)t->buf & 7)) {
            PyErr_SetString(PyExc_ValueError,
                            "copy_pieces: a table must be aligned int64 rows of TABLE_WIDTH");
            goto done;
        }
        const char *dlo = (const char *)d->buf, *dhi = dlo + d->len;
        const int64_t *rows = (const int64_t *)t->buf;
        Py_ssize_t nrows = t->len / (Py_ssize_t)(TABLE_WIDTH * sizeof(int64_t));
        for (Py_ssize_t i = 0; i < nrows; i++) {
            const int64_t *r = rows + i * TABLE_WIDTH;
            int64_t si = r[T_SRC];
            if (si < 0 || si >= ns || !sb[si].held) {
                PyErr_SetString(PyExc_ValueError, "copy_pieces: a row names a missing source");
                goto done;
            }
            const Py_buffer *s = &sb[si].view;
            if (r[T_OUTER] < 0 || r[T_OUTER] > MAX_OUTER || !box_fits(r, r[T_DOFF], 1, d->len) ||
                !box_fits(r, r[T_SOFF], 0, s->len)) {
                PyErr_SetString(PyExc_ValueError, "copy_pieces: a box out of its buffer's bounds");
                goto done;
            }
            const char *slo = (const char *)s->buf, *shi = slo + s->len;
            if (dlo < shi && slo < dhi) {
                PyErr_SetString(PyExc_ValueError, "copy_pieces: dst and src overlap");
                goto done;
            }
        }
        nboxes += nrows;
    }
    boxes = PyMem_Calloc((size_t)(nboxes > 0 ? nboxes : 1), sizeof(box_t));
    active = band_bytes ? PyMem_Calloc((size_t)(nboxes > 0 ? nboxes : 1), sizeof(Py_ssize_t))
                        : NULL;
    if (!boxes || (band_bytes && !active)) {
        PyErr_NoMemory();
        goto done;
    }
    {
        /* Streamed or not as a whole: what matters is whether the call's destinations
         * together outgrow the cache, not the size of one box. (Across 2 processes,
         * the 288 MiB fsdp -> tp relayout's receiver cuts pieces of 128 KiB-2 MiB out
         * of each stage's 64 MiB; streaming them all took 0.86-0.88x the time of
         * streaming only the boxes of 1 MiB or more, in an A/B within each of three
         * launches.) */
        int64_t total = 0;
        Py_ssize_t at = 0;
        for (Py_ssize_t w = 0; w < nw; w++) {
            char *dbase = (char *)wb[2 * w].view.buf;
            const int64_t *rows = (const int64_t *)wb[2 * w + 1].view.buf;
            Py_ssize_t nrows = wb[2 * w + 1].view.len / (Py_ssize_t)(TABLE_WIDTH * sizeof(int64_t));
            for (Py_ssize_t i = 0; i < nrows; i++, at++) {
                const int64_t *r = rows + i * TABLE_WIDTH;
                box_t *b = &boxes[at];
                int64_t bytes = r[T_ROW];
                b->row = r[T_ROW];
                b->outer = (int)r[T_OUTER];
                for (int k = 0; k < MAX_OUTER; k++) {
                    int used = k < b->outer;
                    b->c[k] = used ? r[T_AXES + 3 * k] : 1;
                    b->ds[k] = used ? r[T_AXES + 3 * k + 1] : 0;
                    b->ss[k] = used ? r[T_AXES + 3 * k + 2] : 0;
                    bytes = mul_sat(bytes, b->c[k]);
                }
                total = bytes > INT64_MAX - total ? INT64_MAX : total + bytes;
                b->d = dbase + r[T_DOFF];
                b->s = (const char *)sb[r[T_SRC]].view.buf + r[T_SOFF];
            }
        }
        streamed = HAVE_STREAM && nboxes && total >= stream_bytes;
        for (Py_ssize_t i = 0; i < nboxes; i++) boxes[i].stream = streamed;
    }
    Py_BEGIN_ALLOW_THREADS
    if (band_bytes) {
        copy_banded(boxes, nboxes, band_bytes, part, parts, active);
    } else {
        for (Py_ssize_t i = 0; i < nboxes; i++) {
            const box_t *b = &boxes[i];
            copy_box(b, b->d, b->s, b->outer ? b->c[b->outer - 1] : 1);
        }
    }
#if HAVE_STREAM
    if (streamed) _mm_sfence();
#else
    (void)streamed;
#endif
    Py_END_ALLOW_THREADS
    result = Py_None;
done:
    if (sb) release_all(sb, ns);
    if (wb) release_all(wb, 2 * nw);
    PyMem_Free(sb);
    PyMem_Free(wb);
    PyMem_Free(boxes);
    PyMem_Free(active);
    Py_DECREF(srcs);
    Py_DECREF(work);
    Py_XINCREF(result);
    return result;
}

static PyObject *fastcopy_stream_width(PyObject *self, PyObject *args) {
    (void)self;
    int max_width = 64;
    if (!PyArg_ParseTuple(args, "|i:stream_width", &max_width)) return NULL;
#if HAVE_STREAM
    return PyLong_FromLong(choose_stream(max_width));
#else
    (void)max_width;
    return PyLong_FromLong(0);
#endif
}

static PyMethodDef fastcopy_methods[] = {
    {"copy", fastcopy_copy, METH_VARARGS,
     "copy(dst, src, stream): dst[...] = src for two strided buffers of one shape and\n"
     "item size whose last axes are contiguous and whose bytes do not overlap, each\n"
     "contiguous run one memcpy, without the GIL. stream: write with non-temporal\n"
     "stores where the machine has them (x86-64), for copies much larger than the\n"
     "cache whose destination is not read again soon. Raises ValueError otherwise."},
    {"copy_pieces", fastcopy_copy_pieces, METH_VARARGS,
     "copy_pieces(srcs, work, stream_bytes): for each (dst, table) of work, copies\n"
     "the boxes the table's rows describe out of the C-contiguous buffers srcs (None\n"
     "where unused) into dst, without the GIL. A row is TABLE_WIDTH int64s: source\n"
     "index, dst byte offset, src byte offset, contiguous row bytes, number of outer\n"
     "axes (at most MAX_OUTER), then (count, dst step, src step) per outer axis,\n"
     "innermost first. The boxes are written with non-temporal stores where they\n"
     "hold stream_bytes or more together. Every row is checked against its buffers'\n"
     "bounds before anything is written; raises ValueError (nothing copied) otherwise.\n"
     "copy_pieces(srcs, work, stream_bytes, band_bytes, part, parts): the boxes cut\n"
     "into bands of about band_bytes along their outermost axis and copied a band of\n"
     "each in turn; of each box, only the bands of part out of parts (consecutive)."},
    {"stream_width", fastcopy_stream_width, METH_VARARGS,
     "stream_width(max_width=64): makes streaming stores the widest the CPU has, at\n"
     "most max_width bytes (16, 32 or 64), and returns that width (0: no streaming)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef fastcopy_module = {
    PyModuleDef_HEAD_INIT, "_fastcopy",
    "Strided copies without the GIL, each contiguous run one memcpy (optional).", -1,
    fastcopy_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fastcopy(void) {
    PyObject *m = PyModule_Create(&fastcopy_module);
#if HAVE_STREAM
    choose_stream(64);
#endif
    if (m && (PyModule_AddIntConstant(m, "HAVE_STREAM", HAVE_STREAM) < 0 ||
              PyModule_AddIntConstant(m, "TABLE_WIDTH", TABLE_WIDTH) < 0 ||
              PyModule_AddIntConstant(m, "MAX_OUTER", MAX_OUTER) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
