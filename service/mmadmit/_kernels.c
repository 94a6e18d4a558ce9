/*
 * _kernels: the materializer's per-token loops, fused, at C speed.
 *
 * numpy needs several full passes (and temporaries) per step; these loops touch
 * each output element once. mmadmit/kernels.py wraps them and falls back to
 * the numpy implementations when the extension is not built; tests assert
 * both give identical results.
 *
 *   mrope_fill(out, start, frames, rows, cols, t_off, t_index) -> int
 *       out: writable C-contiguous int64 buffer of 3*n elements ([3, n]).
 *       Runs (int64 buffers, one element per run, sorted by start, disjoint):
 *       run k covers frames*rows*cols tokens from start[k]; frame f has
 *       temporal index t_index[t_off[k] + f]. Text tokens count up by one on
 *       every axis; a run at origin s writes (s + t, s + row, s + col); the
 *       text after it resumes at s + max(t_last, rows-1, cols-1) + 1.
 *       Returns the delta (largest position + 1 - n).
 *   spans_check(ids, start, stop, expected) -> int
 *       Index of the first span k (in the given order) with a token in
 *       ids[start[k]:stop[k]] different from expected[k]; -1 when all match.
 *   spans_fill(out, ids, start, stop, value) -> None
 *       out = ids with out[start[k]:stop[k]] = value[k] for every span (out and
 *       ids of one length; out may be ids itself). Sorted spans take one pass:
 *       the stretches between them copied, each span filled; others a copy,
 *       then the fill in the given order.
 *
 * Every index is validated before any access (ValueError otherwise): memory
 * safety never depends on the Python caller. Loops run without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_native.h"



static int
get_buf(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (!is_int64(view)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous native int64 buffer", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

#define NBUF 7

static void
release_all(Py_buffer *b, int count)
{
    for (int i = 0; i < count; i++) {
        PyBuffer_Release(&b[i]);
    }
}

static int
get_bufs(PyObject *const *args, Py_ssize_t nargs, Py_ssize_t want, Py_buffer *b,
         const char *const *names, int first_writable)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "expected %zd arguments, got %zd", want, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (get_buf(args[i], &b[i], i == 0 && first_writable, names[i]) < 0) {
            release_all(b, (int)i);
            return -1;
        }
    }
    return 0;
}

/* The fill of mrope_fill over validated runs; returns the delta. */
MM_VECTORIZE static int64_t
fill_positions(int64_t *out, int64_t n, Py_ssize_t k, const int64_t *start,
               const int64_t *frames, const int64_t *rows, const int64_t *cols,
               const int64_t *t_off, const int64_t *t_index)
{
    int64_t pos = 0; /* position of the next text token */
    int64_t tok = 0; /* next token index to write */
    int64_t *o0 = out, *o1 = out + n, *o2 = out + 2 * n;
    for (Py_ssize_t r = 0; r < k; r++) {
        for (int64_t i = tok; i < start[r]; i++) {
            int64_t v = pos + (i - tok);
            o0[i] = v;
            o1[i] = v;
            o2[i] = v;
        }
        pos += start[r] - tok;
        int64_t origin = pos, i = start[r];
        const int64_t *tr = t_index + t_off[r];
        const int64_t nc = cols[r];
        for (int64_t f = 0; f < frames[r]; f++) {
            int64_t tv = origin + tr[f];
            for (int64_t h = 0; h < rows[r]; h++, i += nc) {
                int64_t hv = origin + h;
                int64_t *a = o0 + i, *b = o1 + i, *c = o2 + i;
                for (int64_t w = 0; w < nc; w++) {
                    a[w] = tv;
                    b[w] = hv;
                    c[w] = origin + w;
                }
            }
        }
        int64_t extent = tr[frames[r] - 1];
        if (rows[r] - 1 > extent) {
            extent = rows[r] - 1;
        }
        if (cols[r] - 1 > extent) {
            extent = cols[r] - 1;
        }
        pos = origin + extent + 1;
        tok = i;
    }
    for (int64_t i = tok; i < n; i++) {
        int64_t v = pos + (i - tok);
        o0[i] = v;
        o1[i] = v;
        o2[i] = v;
    }
    pos += n - tok;
    return pos - n;
}

static PyObject *
kernels_mrope_fill(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"out", "start", "frames", "rows", "cols", "t_off", "t_index"};
    Py_buffer b[NBUF];
    if (get_bufs(args, nargs, 7, b, names, 1) < 0) {
        return NULL;
    }
    int64_t *out = (int64_t *)b[0].buf;
    const int64_t *start = b[1].buf, *frames = b[2].buf, *rows = b[3].buf, *cols = b[4].buf;
    const int64_t *t_off = b[5].buf, *t_index = b[6].buf;
    Py_ssize_t total = b[0].len / 8, k = b[1].len / 8, nt = b[6].len / 8;
    const char *err = NULL;
    if (total % 3 != 0) {
        err = "out must hold 3*n elements";
    }
    else if (b[2].len / 8 != k || b[3].len / 8 != k || b[4].len / 8 != k || b[5].len / 8 != k) {
        err = "run arrays must have equal lengths";
    }
    int64_t n = total / 3, prev_end = 0;
    /* Validate every run before writing anything, and replay the position
     * arithmetic of fill_positions (per run and per frame, never per token)
     * so no value it computes can overflow int64: temporal indices come from
     * the caller, and a huge one made origin + t overflow (signed overflow is
     * undefined behaviour). Products are checked by division: n is bounded
     * only by the output buffer. */
    int64_t pos = 0, tok = 0;
    for (Py_ssize_t r = 0; err == NULL && r < k; r++) {
        if (frames[r] < 1 || rows[r] < 1 || cols[r] < 1) {
            err = "run dimensions must be positive";
        }
        else if (start[r] < prev_end) {
            err = "runs must be sorted by start and disjoint";
        }
        else if (start[r] > n || frames[r] > n || rows[r] > n / frames[r]
                 || cols[r] > (n - start[r]) / (frames[r] * rows[r])) {
            err = "a run extends past the end of the prompt";
        }
        else if (t_off[r] < 0 || t_off[r] > nt - frames[r]) {
            err = "t_off/frames out of range of t_index";
        }
        else {
            /* invariant: 0 <= tok <= start[r] <= n and 0 <= pos <= INT64_MAX - n */
            int64_t origin = pos + (start[r] - tok);
            int64_t reach = rows[r] - 1 > cols[r] - 1 ? rows[r] - 1 : cols[r] - 1;
            const int64_t *tr = t_index + t_off[r];
            for (int64_t f = 0; f < frames[r]; f++) {
                if (tr[f] < 0) {
                    err = "t_index values must be non-negative";
                    break;
                }
                reach = tr[f] > reach ? tr[f] : reach;
            }
            /* every position of the run and after it stays <= INT64_MAX */
            if (err == NULL && origin > INT64_MAX - n - 1 - reach) {
                err = "positions overflow int64";
            }
            if (err == NULL) {
                int64_t extent = tr[frames[r] - 1];
                extent = rows[r] - 1 > extent ? rows[r] - 1 : extent;
                extent = cols[r] - 1 > extent ? cols[r] - 1 : extent;
                pos = origin + extent + 1;
                tok = start[r] + frames[r] * rows[r] * cols[r];
                prev_end = tok;
            }
        }
    }
    if (err != NULL) {
        release_all(b, 7);
        PyErr_SetString(PyExc_ValueError, err);
        return NULL;
    }
    int64_t delta;
    MM_BEGIN_ALLOW_THREADS_IF(n >= MM_GIL_MIN_ELEMENTS)
    delta = fill_positions(out, n, k, start, frames, rows, cols, t_off, t_index);
    MM_END_ALLOW_THREADS_IF
    release_all(b, 7);
    return PyLong_FromLongLong(delta);
}

static int
check_spans(const Py_buffer *ids, const Py_buffer *start, const Py_buffer *stop,
            const Py_buffer *per_span)
{
    Py_ssize_t n = ids->len / 8, k = start->len / 8;
    const int64_t *a = start->buf, *z = stop->buf;
    if (stop->len / 8 != k || per_span->len / 8 != k) {
        PyErr_SetString(PyExc_ValueError, "span arrays must have equal lengths");
        return -1;
    }
    for (Py_ssize_t r = 0; r < k; r++) {
        if (a[r] < 0 || a[r] > z[r] || z[r] > n) {
            PyErr_SetString(PyExc_ValueError, "span out of range");
            return -1;
        }
    }
    return 0;
}

/* First span holding a token other than its expected id, -1 when none. */
MM_VECTORIZE static Py_ssize_t
first_bad_span(const int64_t *ids, const int64_t *a, const int64_t *z, const int64_t *want,
               Py_ssize_t k)
{
    for (Py_ssize_t r = 0; r < k; r++) {
        int64_t acc = 0, w = want[r];
        for (int64_t i = a[r]; i < z[r]; i++) {
            acc |= ids[i] ^ w; /* no early exit: the loop vectorizes */
        }
        if (acc != 0) {
            return r;
        }
    }
    return -1;
}

MM_VECTORIZE static void
fill_spans(int64_t *out, const int64_t *a, const int64_t *z, const int64_t *v, Py_ssize_t k)
{
    for (Py_ssize_t r = 0; r < k; r++) {
        int64_t *o = out + a[r];
        const int64_t len = z[r] - a[r], value = v[r];
        for (int64_t i = 0; i < len; i++) {
            o[i] = value;
        }
    }
}

/* out[at:to] = ids[at:to] unless out is ids. */
static void
copy_stretch(int64_t *out, const int64_t *ids, int64_t at, int64_t to)
{
    if (out != ids && to > at) {
        memmove(out + at, ids + at, (size_t)(to - at) * sizeof(int64_t));
    }
}

/* spans_fill over validated spans (inside [0, n], start <= stop): sorted ones in
 * one pass, every element written once (the span bytes are never copied and
 * then overwritten); otherwise a copy, then the fill. */
static void
copy_fill_spans(int64_t *out, const int64_t *ids, int64_t n, const int64_t *a, const int64_t *z,
                const int64_t *v, Py_ssize_t k)
{
    for (Py_ssize_t r = 1; r < k; r++) {
        if (a[r] < z[r - 1]) {
            copy_stretch(out, ids, 0, n);
            fill_spans(out, a, z, v, k);
            return;
        }
    }
    int64_t at = 0; /* out[:at] is written */
    for (Py_ssize_t r = 0; r < k; r++) {
        copy_stretch(out, ids, at, a[r]);
        fill_spans(out, a + r, z + r, v + r, 1);
        at = z[r];
    }
    copy_stretch(out, ids, at, n);
}

static PyObject *
kernels_spans_check(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"ids", "start", "stop", "expected"};
    Py_buffer b[4];
    if (get_bufs(args, nargs, 4, b, names, 0) < 0) {
        return NULL;
    }
    if (check_spans(&b[0], &b[1], &b[2], &b[3]) < 0) {
        release_all(b, 4);
        return NULL;
    }
    const int64_t *ids = b[0].buf, *a = b[1].buf, *z = b[2].buf, *want = b[3].buf;
    Py_ssize_t k = b[1].len / 8, bad = -1;
    MM_BEGIN_ALLOW_THREADS_IF(b[0].len / 8 >= MM_GIL_MIN_ELEMENTS)
    bad = first_bad_span(ids, a, z, want, k);
    MM_END_ALLOW_THREADS_IF
    release_all(b, 4);
    return PyLong_FromSsize_t(bad);
}

static PyObject *
kernels_spans_fill(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    static const char *const names[] = {"out", "ids", "start", "stop", "value"};
    Py_buffer b[5];
    if (get_bufs(args, nargs, 5, b, names, 1) < 0) {
        return NULL;
    }
    if (b[0].len != b[1].len) {
        PyErr_SetString(PyExc_ValueError, "out and ids must have equal lengths");
        release_all(b, 5);
        return NULL;
    }
    if (check_spans(&b[1], &b[2], &b[3], &b[4]) < 0) {
        release_all(b, 5);
        return NULL;
    }
    int64_t *out = b[0].buf;
    const int64_t *ids = b[1].buf, *a = b[2].buf, *z = b[3].buf, *v = b[4].buf;
    Py_ssize_t n = b[1].len / 8, k = b[2].len / 8;
    MM_BEGIN_ALLOW_THREADS_IF(n >= MM_GIL_MIN_ELEMENTS)
    copy_fill_spans(out, ids, n, a, z, v, k);
    MM_END_ALLOW_THREADS_IF
    release_all(b, 5);
    Py_RETURN_NONE;
}

static PyMethodDef kernels_methods[] = {
    {"mrope_fill", (PyCFunction)(void (*)(void))kernels_mrope_fill, METH_FASTCALL,
     "mrope_fill(out, start, frames, rows, cols, t_off, t_index) -> delta"},
    {"spans_check", (PyCFunction)(void (*)(void))kernels_spans_check, METH_FASTCALL,
     "spans_check(ids, start, stop, expected) -> first bad span or -1"},
    {"spans_fill", (PyCFunction)(void (*)(void))kernels_spans_fill, METH_FASTCALL,
     "spans_fill(out, ids, start, stop, value) -> None"},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot kernels_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef kernels_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mmadmit._kernels",
    .m_doc = "Fused per-token loops of the materializer (see mmadmit.kernels).",
    .m_size = 0,
    .m_methods = kernels_methods,
    .m_slots = kernels_slots,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    return PyModuleDef_Init(&kernels_module);
}
