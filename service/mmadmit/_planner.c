/*
 * _planner: the per-item work of a materialization (rule 5 checks, the M-RoPE
 * run plan, pad values from hashes) in one C pass over the items.
 *
 * This is an accelerator, not a second implementation of the rules: it
 * answers either "valid, and here is everything the materializer needs" or
 * None ("not sure"). On None the materializer runs its Python path, which
 * raises the exact abort (or succeeds for an input shape this pass does not
 * handle, e.g. an int16 grid or a shared-memory feature). Tests compare both
 * paths on valid and on mutated requests; this file never produces an error
 * message of its own.
 *
 *   check_tensors(items, ctx, rank_max, bytes_max[, dim_max]) -> bool
 *       True when every feature and side tensor of every item is within the
 *       rank and byte limits, holds exactly prod(shape) * itemsize bytes, and
 *       no feature_shm is set (False: let Python look).
 *   plan(items, ids, ctx, ph_image, ph_video, ph_audio, need_pad) -> None | tuple
 *       ids: the original (unpadded) int64 ids. ph_*: placeholder id per
 *       modality, -1 for none. Returns (data, n_spans, n_runs, n_tindex) where
 *       data is a bytearray holding int64 arrays back to back:
 *       span_start[S] span_stop[S] span_value_owner[S] (item index)
 *       run_start[R] run_frames[R] run_rows[R] run_cols[R] run_t_off[R]
 *       t_index[T] pad[I] (I = len(items); -1 where the item needs a content
 *       hash of its feature). Spans and runs are sorted by start. Then
 *       new_items: the items with rule 6 applied: the same object where
 *       pad_value was set, a copy with hash and pad_value set where a hash
 *       was supplied, None where the feature must be hashed first.
 *
 *   ctx: (tensor_type, supported_mask, merge, split_video, time_mode, tps,
 *         pps, default_seconds, dt_int64, dt_int32, dt_float32, time_keys,
 *         item_type)
 *       time_mode 0: t_index = frame number; 1: Qwen2.5-VL trunc((k*s)*tps);
 *       2: Qwen3-Omni trunc(k*(s*pps)), float32 arithmetic throughout.
 *       time_keys: tuple of side keys holding seconds per grid row.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>

#include "_native.h"
#include <stdlib.h>
#include <string.h>


#define PAD_BASE 1000000LL
#define PAD_SLOTS 715494549LL
#define MAX_SECONDS 1e6f

static PyObject *s_modality, *s_hash, *s_pad_value, *s_offsets, *s_feature, *s_feature_shm,
    *s_side, *s_dtype, *s_shape, *s_data, *s_itemsize, *k_image_grid, *k_video_grid,
    *k_audio_in_video;

/* ------------------------------------------------------------------ vectors */

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} vec;

static int
vec_push(vec *a, int64_t x)
{
    if (a->n == a->cap) {
        Py_ssize_t cap = a->cap ? 2 * a->cap : 64;
        int64_t *p = realloc(a->v, (size_t)cap * sizeof(int64_t));
        if (p == NULL) {
            return -1;
        }
        a->v = p;
        a->cap = cap;
    }
    a->v[a->n++] = x;
    return 0;
}

#define NVEC 10
enum { SP_START, SP_STOP, SP_OWNER, RUN_START, RUN_FRAMES, RUN_ROWS, RUN_COLS, RUN_TOFF,
       T_INDEX, SP_MOD };

/* ------------------------------------------------------------------ buffers */


/* A C-contiguous int64 buffer of obj, or -1 with TypeError set. */
static int
get_ids(PyObject *obj, Py_buffer *view)
{
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (!is_int64(view)) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "ids must be a C-contiguous int64 buffer");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ context */

typedef struct {
    PyObject *tensor_type;
    long supported;
    int64_t merge;
    int split_video;
    int time_mode;
    float tps, pps, default_seconds;
    PyObject *dt_int64, *dt_int32, *dt_float32;
    PyObject *time_keys;
    PyObject *item_type;
} ctx_t;

static int
parse_ctx(PyObject *o, ctx_t *c)
{
    if (!PyTuple_Check(o) || PyTuple_GET_SIZE(o) != 13) {
        PyErr_SetString(PyExc_TypeError, "ctx must be a 13-tuple");
        return -1;
    }
    c->tensor_type = PyTuple_GET_ITEM(o, 0);
    c->supported = PyLong_AsLong(PyTuple_GET_ITEM(o, 1));
    c->merge = PyLong_AsLongLong(PyTuple_GET_ITEM(o, 2));
    c->split_video = PyObject_IsTrue(PyTuple_GET_ITEM(o, 3));
    c->time_mode = (int)PyLong_AsLong(PyTuple_GET_ITEM(o, 4));
    c->tps = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(o, 5));
    c->pps = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(o, 6));
    c->default_seconds = (float)PyFloat_AsDouble(PyTuple_GET_ITEM(o, 7));
    c->dt_int64 = PyTuple_GET_ITEM(o, 8);
    c->dt_int32 = PyTuple_GET_ITEM(o, 9);
    c->dt_float32 = PyTuple_GET_ITEM(o, 10);
    c->time_keys = PyTuple_GET_ITEM(o, 11);
    c->item_type = PyTuple_GET_ITEM(o, 12);
    if (PyErr_Occurred()) {
        return -1;
    }
    if (!PyType_Check(c->tensor_type) || !PyTuple_Check(c->time_keys) || c->merge < 1
        || !PyType_Check(c->item_type)) {
        PyErr_SetString(PyExc_TypeError, "malformed ctx");
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------ tensors */

/* A tensor's facts; 0 = usable, 1 = not a plain Tensor (let Python look). */
typedef struct {
    PyObject *dtype;     /* borrowed while the tensor is alive */
    int64_t itemsize;
    Py_ssize_t rank;
    int64_t shape[8];
    int64_t numel;       /* -1 when it overflows */
    int64_t maxdim;      /* the largest dimension (0 for a scalar) */
    const char *buf;
    Py_ssize_t nbytes;
} tensor_t;

/* Fills t; returns 0 ok, 1 unusable, -1 Python error. Keeps no references:
 * the tensor object keeps its dtype, shape and data alive. */
static int
read_tensor(PyObject *obj, const ctx_t *c, tensor_t *t)
{
    if (Py_TYPE(obj) != (PyTypeObject *)c->tensor_type) {
        return 1;
    }
    PyObject *dtype = PyObject_GetAttr(obj, s_dtype);
    PyObject *shape = PyObject_GetAttr(obj, s_shape);
    PyObject *data = PyObject_GetAttr(obj, s_data);
    PyObject *isz = dtype ? PyObject_GetAttr(dtype, s_itemsize) : NULL;
    int rc = 1;
    if (dtype == NULL || shape == NULL || data == NULL || isz == NULL) {
        rc = -1;
        goto done;
    }
    if (!PyTuple_Check(shape) || !PyMemoryView_Check(data) || !PyLong_Check(isz)) {
        goto done;
    }
    Py_buffer *view = PyMemoryView_GET_BUFFER(data);
    if (!PyBuffer_IsContiguous(view, 'C')) {
        goto done;
    }
    t->dtype = dtype;
    t->itemsize = PyLong_AsLongLong(isz);
    t->rank = PyTuple_GET_SIZE(shape);
    t->buf = view->buf;
    t->nbytes = view->len;
    int64_t numel = 1;
    t->maxdim = 0;
    for (Py_ssize_t d = 0; d < t->rank; d++) {
        PyObject *dim = PyTuple_GET_ITEM(shape, d);
        if (!PyLong_CheckExact(dim)) {
            goto done;
        }
        int ovf = 0;
        long long v = PyLong_AsLongLongAndOverflow(dim, &ovf);
        if (ovf || v < 0) {
            goto done;
        }
        if (d < 8) {
            t->shape[d] = v;
        }
        if (v > t->maxdim) {
            t->maxdim = v;
        }
        if (numel >= 0 && v != 0 && numel > INT64_MAX / v) {
            numel = -1;
        }
        else if (numel >= 0) {
            numel *= v;
        }
    }
    t->numel = numel;
    rc = 0;
done:
    if (PyErr_Occurred()) {
        rc = -1;
    }
    Py_XDECREF(dtype);
    Py_XDECREF(shape);
    Py_XDECREF(data);
    Py_XDECREF(isz);
    return rc;
}

/* 0: within limits and exact byte length; 1: not (or unusable); -1: error. */
static int
tensor_ok(PyObject *obj, const ctx_t *c, Py_ssize_t rank_max, int64_t bytes_max,
          int64_t dim_max)
{
    tensor_t t;
    int rc = read_tensor(obj, c, &t);
    if (rc != 0) {
        return rc;
    }
    if (t.rank > rank_max || t.nbytes > bytes_max || t.maxdim > dim_max || t.numel < 0
        || t.itemsize <= 0
        || t.numel > INT64_MAX / t.itemsize || t.numel * t.itemsize != t.nbytes) {
        return 1;
    }
    return 0;
}

static PyObject *
planner_check_tensors(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ctx_t c;
    if (nargs != 4 && nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "check_tensors(items, ctx, rank_max, bytes_max[, dim_max])");
        return NULL;
    }
    PyObject *items = args[0];
    if (!PyList_Check(items) || parse_ctx(args[1], &c) < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "items must be a list");
        }
        return NULL;
    }
    Py_ssize_t rank_max = PyLong_AsSsize_t(args[2]);
    int64_t bytes_max = PyLong_AsLongLong(args[3]);
    int64_t dim_max = nargs == 5 ? PyLong_AsLongLong(args[4]) : INT64_MAX;
    if (PyErr_Occurred()) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(items); i++) {
        PyObject *item = PyList_GET_ITEM(items, i);
        PyObject *feature = PyObject_GetAttr(item, s_feature);
        PyObject *shm = feature ? PyObject_GetAttr(item, s_feature_shm) : NULL;
        PyObject *side = shm ? PyObject_GetAttr(item, s_side) : NULL;
        int rc = 0;
        if (side == NULL) {
            rc = -1;
        }
        else if (shm != Py_None || !PyDict_CheckExact(side)) {
            rc = 1;
        }
        else if (feature != Py_None) {
            rc = tensor_ok(feature, &c, rank_max, bytes_max, dim_max);
        }
        Py_ssize_t pos = 0;
        PyObject *key, *value;
        while (rc == 0 && PyDict_Next(side, &pos, &key, &value)) {
            if (Py_TYPE(value) == (PyTypeObject *)c.tensor_type) {
                rc = tensor_ok(value, &c, rank_max, bytes_max, dim_max);
            }
        }
        Py_XDECREF(feature);
        Py_XDECREF(shm);
        Py_XDECREF(side);
        if (rc < 0) {
            return NULL;
        }
        if (rc > 0) {
            Py_RETURN_FALSE;
        }
    }
    Py_RETURN_TRUE;
}

/* ------------------------------------------------------------------ plan */

/* Reads a small grid tensor into rows[3*r]; 0 ok, 1 unusable, -1 error. */
static int
read_grid(PyObject *obj, const ctx_t *c, int64_t **rows, Py_ssize_t *nrows)
{
    tensor_t t;
    int rc = read_tensor(obj, c, &t);
    if (rc != 0) {
        return rc;
    }
    Py_ssize_t r;
    if (t.rank == 1 && t.shape[0] == 3) {
        r = 1;
    }
    else if (t.rank == 2 && t.shape[1] == 3 && t.shape[0] > 0) {
        r = (Py_ssize_t)t.shape[0];
    }
    else {
        return 1;
    }
    int is64 = t.dtype == c->dt_int64, is32 = t.dtype == c->dt_int32;
    /* The byte length is checked by division: r comes from the shape, which a
     * caller may set to anything, so r * 3 * width could overflow (a forged
     * shape [2**61, 3] once passed a multiplied check and sized the malloc
     * below too small). */
    Py_ssize_t width = is64 ? 8 : 4;
    if (!(is64 || is32) || t.nbytes % (3 * width) != 0 || r != t.nbytes / (3 * width)) {
        return 1;
    }
    int64_t *out = malloc((size_t)r * 3 * sizeof(int64_t));
    if (out == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t k = 0; k < 3 * r; k++) {
        if (is64) {
            memcpy(&out[k], t.buf + 8 * k, 8);
        }
        else {
            int32_t v;
            memcpy(&v, t.buf + 4 * k, 4);
            out[k] = v;
        }
    }
    *rows = out;
    *nrows = r;
    return 0;
}

/* Seconds per grid row (float32) for a video item; 0 ok, 1 unusable, -1 error. */
static int
read_seconds(PyObject *side, const ctx_t *c, Py_ssize_t nrows, float *out)
{
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(c->time_keys); k++) {
        PyObject *obj = PyDict_GetItemWithError(side, PyTuple_GET_ITEM(c->time_keys, k));
        if (obj == NULL) {
            if (PyErr_Occurred()) {
                return -1;
            }
            continue;
        }
        tensor_t t;
        int rc = read_tensor(obj, c, &t);
        if (rc != 0) {
            return rc;
        }
        if (t.dtype != c->dt_float32 || t.nbytes % 4 != 0 || t.numel != t.nbytes / 4) {
            return 1;
        }
        Py_ssize_t count = t.nbytes / 4;
        if (count != 1 && count != nrows) {
            return 1;
        }
        for (Py_ssize_t i = 0; i < nrows; i++) {
            float v;
            memcpy(&v, t.buf + 4 * (count == 1 ? 0 : i), 4);
            if (!(v >= 0.0f && v < MAX_SECONDS)) { /* NaN fails too */
                return 1;
            }
            out[i] = v;
        }
        return 0;
    }
    for (Py_ssize_t i = 0; i < nrows; i++) {
        out[i] = c->default_seconds;
    }
    return 0;
}

/* The temporal index of frame k (k >= 0), or -1 when it is not below
 * MAX_TEMPORAL_INDEX (mrope.MAX_TEMPORAL_INDEX: the Python path words that
 * abort). Checked before the conversion: a float at or above 2**63 (or NaN)
 * converted to int64 is undefined behaviour. */
#define MAX_TEMPORAL_INDEX 1099511627776.0f /* 2**40 */
static int64_t
temporal_index(const ctx_t *c, int64_t k, float seconds)
{
    /* volatile keeps every product rounded to float32, as numpy does */
    volatile float kf = (float)k, a, b;
    switch (c->time_mode) {
    case 1:
        a = kf * seconds;
        b = a * c->tps;
        break;
    case 2:
        a = seconds * c->pps;
        b = kf * a;
        break;
    default:
        return k;
    }
    if (!(b >= 0.0f && b < MAX_TEMPORAL_INDEX)) {
        return -1;
    }
    return (int64_t)b;
}

/* All of p[a:z] equal to want (no early exit: the loop vectorizes). */
MM_VECTORIZE static int
all_equal(const int64_t *p, int64_t a, int64_t z, int64_t want)
{
    int64_t acc = 0;
    for (int64_t i = a; i < z; i++) {
        acc |= p[i] ^ want;
    }
    return acc == 0;
}

typedef struct {
    int64_t start, stop, owner;
} span_t;

static int
cmp_span(const void *x, const void *y)
{
    const span_t *a = x, *b = y;
    return (a->start > b->start) - (a->start < b->start);
}

typedef struct {
    int64_t start, frames, rows, cols, t_off;
} run_t;

static int
cmp_run(const void *x, const void *y)
{
    const run_t *a = x, *b = y;
    return (a->start > b->start) - (a->start < b->start);
}

/* Per item: 0 ok, 1 not sure (fall back), -1 Python error. */
static int
plan_item(PyObject *item, Py_ssize_t idx, const ctx_t *c, int64_t n, int need_pad,
          vec *spans, vec *runs_v, vec *t_index, int64_t *pad_out, int *mod_out,
          uint64_t *hash_out, signed char *kind_out)
{
    int rc = 1;
    PyObject *mod_o = NULL, *offsets = NULL, *hash_o = NULL, *pad_o = NULL, *side = NULL,
             *feature = NULL;
    int64_t *grid = NULL;
    float *seconds = NULL;
    Py_buffer ob;
    int have_ob = 0;

    mod_o = PyObject_GetAttr(item, s_modality);
    offsets = mod_o ? PyObject_GetAttr(item, s_offsets) : NULL;
    hash_o = offsets ? PyObject_GetAttr(item, s_hash) : NULL;
    pad_o = hash_o ? PyObject_GetAttr(item, s_pad_value) : NULL;
    side = pad_o ? PyObject_GetAttr(item, s_side) : NULL;
    feature = side ? PyObject_GetAttr(item, s_feature) : NULL;
    if (feature == NULL) {
        rc = -1;
        goto done;
    }
    if (!PyLong_CheckExact(mod_o) || !PyDict_CheckExact(side) || offsets == Py_None) {
        goto done;
    }
    long mod = PyLong_AsLong(mod_o);
    if (mod < 1 || mod > 3 || !((c->supported >> mod) & 1)) {
        PyErr_Clear();
        goto done;
    }
    *mod_out = (int)mod;

    /* hash and pad value (rule 5 ranges; rule 6 pad from the hash) */
    int64_t lo = PAD_BASE + (mod - 1) * PAD_SLOTS, hi = lo + PAD_SLOTS - 1;
    int has_hash = hash_o != Py_None;
    unsigned long long hv = 0;
    if (has_hash) {
        if (!PyLong_Check(hash_o)) {
            goto done;
        }
        hv = PyLong_AsUnsignedLongLong(hash_o);
        if (PyErr_Occurred()) { /* negative or above 2**64 - 1 */
            PyErr_Clear();
            goto done;
        }
    }
    if (pad_o != Py_None) {
        if (!PyLong_Check(pad_o)) {
            goto done;
        }
        int ovf = 0;
        long long pv = PyLong_AsLongLongAndOverflow(pad_o, &ovf);
        if (ovf || pv < lo || pv > hi) {
            PyErr_Clear();
            goto done;
        }
        *pad_out = pv;
        *kind_out = 0;
    }
    else if (need_pad) {
        goto done;
    }
    else if (has_hash) {
        *pad_out = lo + (int64_t)(hv % (unsigned long long)PAD_SLOTS);
        *hash_out = hv;
        *kind_out = 1;
    }
    else {
        /* needs a content hash of its feature: a plain tensor of exact length */
        tensor_t ft;
        int frc = feature == Py_None ? 1 : read_tensor(feature, c, &ft);
        if (frc != 0) {
            rc = frc;
            goto done;
        }
        if (ft.numel < 0 || ft.itemsize <= 0 || ft.numel > INT64_MAX / ft.itemsize
            || ft.numel * ft.itemsize != ft.nbytes) {
            goto done;
        }
        *pad_out = -1;
        *kind_out = 2;
    }

    /* offsets: int64 [k, 2], k >= 1 */
    if (PyObject_GetBuffer(offsets, &ob, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        goto done;
    }
    have_ob = 1;
    if (!is_int64(&ob) || ob.ndim != 2 || ob.shape[1] != 2 || ob.shape[0] < 1) {
        goto done;
    }
    const int64_t *off = ob.buf;
    Py_ssize_t nspans = ob.shape[0];
    for (Py_ssize_t k = 0; k < nspans; k++) {
        int64_t a = off[2 * k], b = off[2 * k + 1];
        if (a < 0 || a > b || b >= n) {
            goto done;
        }
        if (vec_push(&spans[0], a) < 0 || vec_push(&spans[1], b + 1) < 0
            || vec_push(&spans[2], idx) < 0) {
            PyErr_NoMemory();
            rc = -1;
            goto done;
        }
    }

    if (PyDict_GetItemWithError(side, k_audio_in_video) != NULL || PyErr_Occurred()) {
        rc = PyErr_Occurred() ? -1 : 1;
        goto done;
    }
    PyObject *img = PyDict_GetItemWithError(side, k_image_grid);
    PyObject *vid = img || PyErr_Occurred() ? NULL : PyDict_GetItemWithError(side, k_video_grid);
    if (PyErr_Occurred()) {
        rc = -1;
        goto done;
    }
    if (mod == 3) { /* audio: no grid, no run */
        if (img != NULL || vid != NULL || PyDict_Contains(side, k_video_grid)) {
            goto done;
        }
        rc = 0;
        goto done;
    }
    int is_video = mod == 2;
    PyObject *g = is_video ? vid : img;
    if (g == NULL) { /* missing, or the other modality's key present */
        goto done;
    }
    if (!is_video && PyDict_Contains(side, k_video_grid)) {
        goto done;
    }
    Py_ssize_t nrows = 0;
    int grc = read_grid(g, c, &grid, &nrows);
    if (grc != 0) {
        rc = grc;
        goto done;
    }
    int64_t merge = c->merge;
    int split = is_video && c->split_video;
    int64_t expected = 0;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        int64_t t = grid[3 * r], h = grid[3 * r + 1], w = grid[3 * r + 2];
        if (t <= 0 || h <= 0 || w <= 0 || h % merge || w % merge || (!is_video && t != 1)
            || t > n) {
            goto done;
        }
        expected += split ? t : 1; /* t <= n and expected <= nspans: no overflow */
        if (expected > nspans) {
            goto done;
        }
    }
    if (expected != nspans) {
        goto done;
    }
    if (is_video) { /* validated for every video, used where runs span frames */
        seconds = malloc((size_t)nrows * sizeof(float));
        if (seconds == NULL) {
            PyErr_NoMemory();
            rc = -1;
            goto done;
        }
        int src = read_seconds(side, c, nrows, seconds);
        if (src != 0) {
            rc = src;
            goto done;
        }
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t r = 0; r < nrows; r++) {
        int64_t t = grid[3 * r], hh = grid[3 * r + 1] / merge, ww = grid[3 * r + 2] / merge;
        int64_t units = split ? t : 1, unit_t = split ? 1 : t;
        /* Products by division: n is only bounded by the ids buffer. */
        if (hh > n || ww > n || hh > n / ww) {
            goto done;
        }
        int64_t cells = hh * ww; /* <= n */
        for (int64_t u = 0; u < units; u++, k++) {
            int64_t a = off[2 * k], b = off[2 * k + 1];
            int64_t len = b - a + 1; /* 1 <= len <= n */
            if (len % cells != 0 || len / cells != unit_t) {
                goto done;
            }
            if (vec_push(&runs_v[0], a) < 0 || vec_push(&runs_v[1], unit_t) < 0
                || vec_push(&runs_v[2], hh) < 0 || vec_push(&runs_v[3], ww) < 0
                || vec_push(&runs_v[4], t_index->n) < 0) {
                PyErr_NoMemory();
                rc = -1;
                goto done;
            }
            for (int64_t fr = 0; fr < unit_t; fr++) {
                int64_t tv = (is_video && !split) ? temporal_index(c, fr, seconds[r]) : 0;
                if (tv < 0) {
                    goto done;
                }
                if (vec_push(t_index, tv) < 0) {
                    PyErr_NoMemory();
                    rc = -1;
                    goto done;
                }
            }
        }
    }
    rc = 0;
done:
    if (have_ob) {
        PyBuffer_Release(&ob);
    }
    free(grid);
    free(seconds);
    Py_XDECREF(mod_o);
    Py_XDECREF(offsets);
    Py_XDECREF(hash_o);
    Py_XDECREF(pad_o);
    Py_XDECREF(side);
    Py_XDECREF(feature);
    return rc;
}

/* A copy of item (a plain instance of ctx's item type) with hash and pad_value
 * set: its attribute dict copied, as dataclasses.replace would end up with. */
static PyObject *
with_pad(PyObject *item, const ctx_t *c, unsigned long long hash, int64_t pad)
{
    if (Py_TYPE(item) != (PyTypeObject *)c->item_type) {
        return Py_NewRef(Py_None); /* let Python do it */
    }
    PyObject *src = PyObject_GenericGetDict(item, NULL);
    if (src == NULL) {
        return NULL;
    }
    PyObject *d = PyDict_Copy(src);
    Py_DECREF(src);
    PyObject *h = d ? PyLong_FromUnsignedLongLong(hash) : NULL;
    PyObject *p = h ? PyLong_FromLongLong(pad) : NULL;
    PyObject *out = NULL;
    if (p != NULL && PyDict_SetItem(d, s_hash, h) == 0 && PyDict_SetItem(d, s_pad_value, p) == 0) {
        PyTypeObject *t = (PyTypeObject *)c->item_type;
        out = t->tp_alloc(t, 0);
        if (out != NULL && PyObject_GenericSetDict(out, d, NULL) < 0) {
            Py_CLEAR(out);
        }
    }
    Py_XDECREF(d);
    Py_XDECREF(h);
    Py_XDECREF(p);
    return out;
}

static PyObject *
planner_plan(PyObject *Py_UNUSED(m), PyObject *const *args, Py_ssize_t nargs)
{
    ctx_t c;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError,
                        "plan(items, ids, ctx, ph_image, ph_video, ph_audio, need_pad)");
        return NULL;
    }
    PyObject *items = args[0];
    if (!PyList_Check(items)) {
        PyErr_SetString(PyExc_TypeError, "items must be a list");
        return NULL;
    }
    if (parse_ctx(args[2], &c) < 0) {
        return NULL;
    }
    /* A placeholder id comes from the request (im_token_id / video_token_id
     * overrides) and may be any msgpack int: one outside int64 matches no
     * token, so it is "not sure" (the Python path words the abort), never an
     * OverflowError (which the materializer would turn into INTERNAL). */
    int64_t ph[4] = {-1, -1, -1, -1};
    for (int k = 1; k <= 3; k++) {
        if (!PyLong_Check(args[2 + k])) {
            PyErr_SetString(PyExc_TypeError, "placeholder ids must be ints");
            return NULL;
        }
        int ovf = 0;
        long long v = PyLong_AsLongLongAndOverflow(args[2 + k], &ovf);
        if (v == -1 && PyErr_Occurred()) {
            return NULL;
        }
        ph[k] = ovf ? -2 : v; /* -2: out of range, makes the pass answer None */
    }
    int need_pad = PyObject_IsTrue(args[6]);
    if (need_pad < 0) {
        return NULL;
    }
    Py_buffer ib;
    if (get_ids(args[1], &ib) < 0) {
        return NULL;
    }
    const int64_t *ids = ib.buf;
    int64_t n = ib.len / 8;
    Py_ssize_t ni = PyList_GET_SIZE(items);

    vec v[NVEC];
    memset(v, 0, sizeof(v));
    int64_t *pads = calloc((size_t)(ni ? ni : 1), sizeof(int64_t));
    uint64_t *hashes = calloc((size_t)(ni ? ni : 1), sizeof(uint64_t));
    signed char *kind = calloc((size_t)(ni ? ni : 1), 1); /* 0 pad set, 1 from hash, 2 hash me */
    int *mods = calloc((size_t)(ni ? ni : 1), sizeof(int));
    span_t *sp = NULL;
    run_t *rs = NULL;
    PyObject *result = NULL;
    int rc = 0;
    if (pads == NULL || mods == NULL || hashes == NULL || kind == NULL) {
        PyErr_NoMemory();
        rc = -1;
    }
    for (Py_ssize_t i = 0; rc == 0 && i < ni; i++) {
        rc = plan_item(PyList_GET_ITEM(items, i), i, &c, n, need_pad, &v[SP_START],
                       &v[RUN_START], &v[T_INDEX], &pads[i], &mods[i], &hashes[i], &kind[i]);
    }
    Py_ssize_t S = v[SP_START].n, R = v[RUN_START].n, T = v[T_INDEX].n;
    if (rc == 0 && S > 0) {
        sp = malloc((size_t)S * sizeof(span_t));
        rs = malloc((size_t)(R ? R : 1) * sizeof(run_t));
        if (sp == NULL || rs == NULL) {
            PyErr_NoMemory();
            rc = -1;
        }
    }
    if (rc == 0 && S > 0) {
        int sorted = 1;
        for (Py_ssize_t k = 0; k < S; k++) {
            sp[k].start = v[SP_START].v[k];
            sp[k].stop = v[SP_STOP].v[k];
            sp[k].owner = v[SP_OWNER].v[k];
            sorted &= k == 0 || sp[k - 1].start <= sp[k].start;
        }
        if (!sorted) {
            qsort(sp, (size_t)S, sizeof(span_t), cmp_span);
        }
        for (Py_ssize_t k = 1; rc == 0 && k < S; k++) {
            if (sp[k].start < sp[k - 1].stop) { /* overlap */
                rc = 1;
            }
        }
        int bad = 0;
        MM_BEGIN_ALLOW_THREADS_IF(ib.len / 8 >= MM_GIL_MIN_ELEMENTS)
        for (Py_ssize_t k = 0; rc == 0 && k < S && !bad; k++) {
            int64_t want = ph[mods[sp[k].owner]];
            if (want < 0 || !all_equal(ids, sp[k].start, sp[k].stop, want)) {
                bad = 1;
            }
        }
        MM_END_ALLOW_THREADS_IF
        if (bad) {
            rc = 1;
        }
        if (rc == 0) {
            int rsorted = 1;
            for (Py_ssize_t k = 0; k < R; k++) {
                rs[k].start = v[RUN_START].v[k];
                rs[k].frames = v[RUN_FRAMES].v[k];
                rs[k].rows = v[RUN_ROWS].v[k];
                rs[k].cols = v[RUN_COLS].v[k];
                rs[k].t_off = v[RUN_TOFF].v[k];
                rsorted &= k == 0 || rs[k - 1].start <= rs[k].start;
            }
            if (!rsorted) {
                qsort(rs, (size_t)R, sizeof(run_t), cmp_run);
            }
        }
    }
    if (rc == 0) {
        Py_ssize_t total = 3 * S + 5 * R + T + ni;
        result = PyByteArray_FromStringAndSize(NULL, total * 8); /* writable for numpy / torch */
        if (result != NULL) {
            int64_t *o = (int64_t *)PyByteArray_AS_STRING(result);
            for (Py_ssize_t k = 0; k < S; k++) {
                o[k] = sp[k].start;
                o[S + k] = sp[k].stop;
                o[2 * S + k] = sp[k].owner;
            }
            o += 3 * S;
            for (Py_ssize_t k = 0; k < R; k++) {
                o[k] = rs[k].start;
                o[R + k] = rs[k].frames;
                o[2 * R + k] = rs[k].rows;
                o[3 * R + k] = rs[k].cols;
                o[4 * R + k] = rs[k].t_off;
            }
            o += 5 * R;
            if (T) {
                memcpy(o, v[T_INDEX].v, (size_t)T * 8);
            }
            o += T;
            if (ni) {
                memcpy(o, pads, (size_t)ni * 8);
            }
            PyObject *new_items = PyList_New(ni);
            for (Py_ssize_t i = 0; new_items != NULL && i < ni; i++) {
                PyObject *item = PyList_GET_ITEM(items, i);
                PyObject *x = kind[i] == 0   ? Py_NewRef(item)
                              : kind[i] == 1 ? with_pad(item, &c, hashes[i], pads[i])
                                             : Py_NewRef(Py_None);
                if (x == NULL) {
                    Py_CLEAR(new_items);
                    break;
                }
                PyList_SET_ITEM(new_items, i, x);
            }
            if (new_items == NULL) {
                Py_CLEAR(result);
            }
            else {
                result = Py_BuildValue("(NnnnN)", result, S, R, T, new_items);
            }
        }
    }
    else if (rc > 0) {
        result = Py_NewRef(Py_None);
    }
    PyBuffer_Release(&ib);
    for (int k = 0; k < NVEC; k++) {
        free(v[k].v);
    }
    free(pads);
    free(hashes);
    free(kind);
    free(mods);
    free(sp);
    free(rs);
    return result;
}

static PyMethodDef planner_methods[] = {
    {"check_tensors", (PyCFunction)(void (*)(void))planner_check_tensors, METH_FASTCALL,
     "check_tensors(items, ctx, rank_max, bytes_max[, dim_max]) -> bool"},
    {"plan", (PyCFunction)(void (*)(void))planner_plan, METH_FASTCALL,
     "plan(items, ids, ctx, ph_image, ph_video, ph_audio, need_pad) -> None | tuple"},
    {NULL, NULL, 0, NULL},
};

static int
planner_exec(PyObject *Py_UNUSED(m))
{
#define INTERN(var, text)                                                                    \
    if (var == NULL && (var = PyUnicode_InternFromString(text)) == NULL) {                   \
        return -1;                                                                           \
    }
    INTERN(s_modality, "modality");
    INTERN(s_hash, "hash");
    INTERN(s_pad_value, "pad_value");
    INTERN(s_offsets, "offsets");
    INTERN(s_feature, "feature");
    INTERN(s_feature_shm, "feature_shm");
    INTERN(s_side, "side");
    INTERN(s_dtype, "dtype");
    INTERN(s_shape, "shape");
    INTERN(s_data, "data");
    INTERN(s_itemsize, "itemsize");
    INTERN(k_image_grid, "image_grid_thw");
    INTERN(k_video_grid, "video_grid_thw");
    INTERN(k_audio_in_video, "use_audio_in_video");
#undef INTERN
    return 0;
}

static PyModuleDef_Slot planner_slots[] = {
    {Py_mod_exec, planner_exec},
    {0, NULL},
};

static struct PyModuleDef planner_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mmadmit._planner",
    .m_doc = "Per-item validation and M-RoPE planning in one pass (see mmadmit.planner).",
    .m_size = 0,
    .m_methods = planner_methods,
    .m_slots = planner_slots,
};

PyMODINIT_FUNC
PyInit__planner(void)
{
    return PyModuleDef_Init(&planner_module);
}
