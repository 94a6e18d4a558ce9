/*
 * _intcodec: msgpack arrays of ints <-> int64 buffers, at C speed.
 *
 * The msgpack wire carries token ids as one msgpack array of ints (128K
 * elements for a long prompt). msgpack/msgspec decoding builds one Python int
 * per element; this module decodes straight into a caller-provided int64
 * buffer (a numpy array) and encodes from one, with no per-element objects.
 *
 * Python API (wrapped by mmadmit/intcodec.py, which also holds the pure-Python
 * fallback that must behave identically, error messages included):
 *
 *   array_len(src) -> int
 *       Parse the array header of `src` (any contiguous bytes-like object) and
 *       return its element count. Raises ValueError for a non-array, a
 *       truncated header, or a count larger than the bytes that follow (every
 *       element takes at least one byte, so the caller may allocate `count`
 *       int64 safely).
 *   decode_into(src, out) -> None
 *       Decode the single msgpack array in `src` into `out`, a writable
 *       C-contiguous native int64 buffer of exactly array_len(src) elements.
 *       Raises ValueError for a non-int element (index and type byte
 *       reported), truncated input, a uint64 above INT64_MAX, trailing bytes.
 *   encode(values) -> bytes
 *       `values`: a C-contiguous native int64 buffer. Returns the smallest
 *       array header followed by each value in its smallest int encoding:
 *       byte for byte what msgpack.packb(list_of_ints) produces.
 *
 * Plain C API, no numpy headers: buffers come through the buffer protocol.
 * The parse and write loops touch no Python objects and run with the GIL
 * released; the buffers stay pinned by their Py_buffer views meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define MAX_ARRAY_COUNT 0xFFFFFFFFULL /* array32 */

/* ------------------------------------------------------------------------ */
/* Errors: the core records what went wrong; messages are formatted after the
 * GIL is re-acquired. Keep the texts in sync with intcodec.py's fallback. */

typedef enum {
    ERR_OK = 0,
    ERR_EMPTY,          /* no bytes at all */
    ERR_NOT_ARRAY,      /* first byte is not an array header */
    ERR_HEADER_TRUNC,   /* array16/32 header cut short */
    ERR_COUNT,          /* declared count > bytes that follow */
    ERR_ELEM_MISSING,   /* input ended before element `index` */
    ERR_ELEM_TYPE,      /* element `index` is not an int */
    ERR_ELEM_TRUNC,     /* element `index` cut short */
    ERR_UINT64_RANGE,   /* uint64 element above INT64_MAX */
    ERR_TRAILING,       /* bytes after the array */
} err_kind;

typedef struct {
    err_kind kind;
    unsigned type_byte;
    Py_ssize_t index;    /* element index */
    Py_ssize_t offset;   /* byte offset */
    Py_ssize_t need;     /* bytes needed */
    Py_ssize_t have;     /* bytes available */
    uint64_t value;      /* count (ERR_COUNT) or uint64 value */
} codec_err;

static const char *
type_name(unsigned b)
{
    if (b <= 0x7f || b >= 0xe0) return "int";
    if (b <= 0x8f) return "map";
    if (b <= 0x9f) return "array";
    if (b <= 0xbf) return "str";
    switch (b) {
    case 0xc0: return "nil";
    case 0xc1: return "never-used byte";
    case 0xc2: case 0xc3: return "bool";
    case 0xc4: case 0xc5: case 0xc6: return "bin";
    case 0xc7: case 0xc8: case 0xc9: return "ext";
    case 0xca: return "float32";
    case 0xcb: return "float64";
    case 0xd4: case 0xd5: case 0xd6: case 0xd7: case 0xd8: return "ext";
    case 0xd9: case 0xda: case 0xdb: return "str";
    case 0xdc: case 0xdd: return "array";
    case 0xde: case 0xdf: return "map";
    default: return "int";  /* 0xcc..0xd3 */
    }
}

static void
set_error(const codec_err *e)
{
    switch (e->kind) {
    case ERR_EMPTY:
        PyErr_SetString(PyExc_ValueError,
                        "msgpack int array: truncated input: empty buffer");
        break;
    case ERR_NOT_ARRAY:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: expected an array header, got %s "
                     "(type byte 0x%02x)",
                     type_name(e->type_byte), e->type_byte);
        break;
    case ERR_HEADER_TRUNC:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: truncated input: array header "
                     "(type byte 0x%02x) needs %zd bytes, only %zd given",
                     e->type_byte, e->need, e->have);
        break;
    case ERR_COUNT:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: truncated input: array header declares "
                     "%llu elements but only %zd bytes follow",
                     (unsigned long long)e->value, e->have);
        break;
    case ERR_ELEM_MISSING:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: truncated input: element %zd missing "
                     "at offset %zd",
                     e->index, e->offset);
        break;
    case ERR_ELEM_TYPE:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: element %zd: expected an int, got %s "
                     "(type byte 0x%02x)",
                     e->index, type_name(e->type_byte), e->type_byte);
        break;
    case ERR_ELEM_TRUNC:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: truncated input: element %zd "
                     "(type byte 0x%02x) needs %zd bytes at offset %zd, only "
                     "%zd left",
                     e->index, e->type_byte, e->need, e->offset, e->have);
        break;
    case ERR_UINT64_RANGE:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: element %zd: uint64 value %llu exceeds "
                     "the int64 range",
                     e->index, (unsigned long long)e->value);
        break;
    case ERR_TRAILING:
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: %zd trailing bytes after the array "
                     "(at offset %zd)",
                     e->have, e->offset);
        break;
    case ERR_OK:
        break;
    }
}

/* ------------------------------------------------------------------------ */
/* Core (no Python API). */

static inline uint64_t
load_be(const uint8_t *p, int width)
{
    uint64_t v = 0;
    for (int k = 0; k < width; k++) {
        v = (v << 8) | p[k];
    }
    return v;
}

static inline void
store_be(uint8_t *p, uint64_t v, int width)
{
    for (int k = width - 1; k >= 0; k--) {
        p[k] = (uint8_t)v;
        v >>= 8;
    }
}

/* 8 bytes at p, big-endian (unaligned load). */
static inline uint64_t
load_be64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
#if PY_LITTLE_ENDIAN
#  if defined(__GNUC__) || defined(__clang__)
    v = __builtin_bswap64(v);
#  else
    v = load_be(p, 8);
#  endif
#endif
    return v;
}

static inline void
store_be64(uint8_t *p, uint64_t v)
{
#if PY_LITTLE_ENDIAN
#  if defined(__GNUC__) || defined(__clang__)
    v = __builtin_bswap64(v);
    memcpy(p, &v, 8);
#  else
    store_be(p, v, 8);
#  endif
#else
    memcpy(p, &v, 8);
#endif
}

/* Element type byte -> payload width in the low 4 bits (0: a fixint, the
 * byte is the value; 1, 2, 4, 8: uint/int 8..64) plus flags. */
#define T_WIDTH   0x0f
#define T_SIGNED  0x10  /* int8..int64 (0xd0..0xd3) */
#define T_U64     0x20  /* uint64 (0xcf): may exceed INT64_MAX */
#define T_INVALID 0x40  /* not an int */

static const uint8_t TYPE_INFO[256] = {
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x00 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x10 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x20 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x30 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x40 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x50 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x60 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0x70 */
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,  /* 0x80 */
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,  /* 0x90 */
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,  /* 0xa0 */
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,  /* 0xb0 */
    0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x01, 0x02, 0x04, 0x28,  /* 0xc0 */
    0x11, 0x12, 0x14, 0x18, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40, 0x40,  /* 0xd0 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0xe0 */
    0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  /* 0xf0 */
};

/* Parse the array header: element count and header length. */
static int
parse_header(const uint8_t *p, Py_ssize_t len, Py_ssize_t *count,
             Py_ssize_t *hlen, codec_err *e)
{
    uint64_t n;
    Py_ssize_t h;
    if (len < 1) {
        e->kind = ERR_EMPTY;
        return -1;
    }
    unsigned b = p[0];
    if (b >= 0x90 && b <= 0x9f) {
        n = b & 0x0f;
        h = 1;
    }
    else if (b == 0xdc || b == 0xdd) {
        h = (b == 0xdc) ? 3 : 5;
        if (len < h) {
            e->kind = ERR_HEADER_TRUNC;
            e->type_byte = b;
            e->need = h;
            e->have = len;
            return -1;
        }
        n = load_be(p + 1, (int)(h - 1));
    }
    else {
        e->kind = ERR_NOT_ARRAY;
        e->type_byte = b;
        return -1;
    }
    /* Each element takes at least one byte: refusing a larger count here
     * keeps a forged header from making the caller allocate gigabytes. */
    if (n > (uint64_t)(len - h)) {
        e->kind = ERR_COUNT;
        e->value = n;
        e->have = len - h;
        return -1;
    }
    *count = (Py_ssize_t)n;
    *hlen = h;
    return 0;
}

/* Decode `count` ints starting at p[pos] into out[]; the array must end the
 * input exactly. */
static int
decode_body(const uint8_t *p, Py_ssize_t len, Py_ssize_t pos, Py_ssize_t count,
            int64_t *out, codec_err *e)
{
    Py_ssize_t i = 0;

    /* Fast path, while the largest element (9 bytes) still fits: one table
     * lookup and one unaligned 8-byte load per element, the value picked
     * without data-dependent branches (ids mix 2-, 3- and 5-byte forms at
     * random, which a branch predictor cannot follow). */
    for (; i < count && len - pos >= 9; i++) {
        unsigned b = p[pos];
        unsigned info = TYPE_INFO[b];
        if (info & T_INVALID) {
            e->kind = ERR_ELEM_TYPE;
            e->index = i;
            e->type_byte = b;
            return -1;
        }
        unsigned width = info & T_WIDTH;
        unsigned shift = (64 - 8 * width) & 63;  /* width 0: unused, keep it defined */
        uint64_t raw = load_be64(p + pos + 1);
        int64_t as_unsigned = (int64_t)(raw >> shift);
        /* Arithmetic right shift of a negative value: what GCC, Clang and
         * MSVC do (implementation-defined in C99). */
        int64_t as_signed = (int64_t)raw >> shift;
        int64_t fixint = (int64_t)(int8_t)b;  /* 0x00..0x7f and 0xe0..0xff */
        int64_t value = (info & T_SIGNED) ? as_signed : as_unsigned;
        value = width ? value : fixint;
        if ((info & T_U64) && as_unsigned < 0) {
            e->kind = ERR_UINT64_RANGE;
            e->index = i;
            e->value = raw;
            return -1;
        }
        out[i] = value;
        pos += 1 + (Py_ssize_t)width;
    }

    /* The last few elements: every read checked. */
    for (; i < count; i++) {
        if (pos >= len) {
            e->kind = ERR_ELEM_MISSING;
            e->index = i;
            e->offset = pos;
            return -1;
        }
        unsigned b = p[pos];
        unsigned info = TYPE_INFO[b];
        if (info & T_INVALID) {
            e->kind = ERR_ELEM_TYPE;
            e->index = i;
            e->type_byte = b;
            return -1;
        }
        int width = (int)(info & T_WIDTH);
        if (len - pos < 1 + width) {
            e->kind = ERR_ELEM_TRUNC;
            e->index = i;
            e->type_byte = b;
            e->need = 1 + width;
            e->offset = pos;
            e->have = len - pos;
            return -1;
        }
        int64_t value;
        if (width == 0) {
            value = (int64_t)(int8_t)b;
        }
        else {
            uint64_t u = load_be(p + pos + 1, width);
            unsigned shift = (unsigned)(64 - 8 * width);
            if (info & T_SIGNED) {
                value = (int64_t)(u << shift) >> shift;  /* sign-extend */
            }
            else if (u > (uint64_t)INT64_MAX) {
                e->kind = ERR_UINT64_RANGE;
                e->index = i;
                e->value = u;
                return -1;
            }
            else {
                value = (int64_t)u;
            }
        }
        out[i] = value;
        pos += 1 + width;
    }
    if (pos != len) {
        e->kind = ERR_TRAILING;
        e->have = len - pos;
        e->offset = pos;
        return -1;
    }
    return 0;
}

/* Size class of one int, exactly msgpack-python's choice of form, computed
 * without data-dependent branches: `fixint` (1 byte) or a payload of
 * 1 << k bytes after the type byte 0xcc + k (uint) / 0xd0 + k (int). */
typedef struct {
    unsigned fixint;
    unsigned k;
    unsigned neg;
} int_form;

static inline int_form
form_of(int64_t v)
{
    uint64_t u = (uint64_t)v;
    unsigned neg = (unsigned)(u >> 63);
    /* For v < 0, ~v: the int8/16/32 ranges are then ~v <= 0x7f, 0x7fff,
     * 0x7fffffff and negative fixints ~v <= 31; for v >= 0 the uint8/16/32
     * ranges are v <= 0xff, 0xffff, 0xffffffff and fixints v <= 127. */
    uint64_t m = u ^ (0 - (uint64_t)neg);
    int_form f;
    f.neg = neg;
    f.fixint = m <= (127u >> (2 * neg));
    f.k = (unsigned)(m > (0xffULL >> neg)) + (unsigned)(m > (0xffffULL >> neg))
          + (unsigned)(m > (0xffffffffULL >> neg));
    return f;
}

/* Write v at o; needs 9 writable bytes at o even when it uses fewer. */
static inline uint8_t *
write_int(uint8_t *o, int64_t v)
{
    uint64_t u = (uint64_t)v;
    int_form f = form_of(v);
    unsigned width = 1u << f.k;
    uint8_t type_byte = (uint8_t)(0xcc + 4 * f.neg + f.k);
    o[0] = f.fixint ? (uint8_t)u : type_byte;
    /* The payload's bytes first, big-endian; the rest is overwritten next. */
    store_be64(o + 1, u << ((64 - 8 * width) & 63));
    return o + (f.fixint ? 1 : 1 + width);
}

static inline Py_ssize_t
header_size(Py_ssize_t n)
{
    return n < 16 ? 1 : (n <= 0xffff ? 3 : 5);
}

static uint8_t *
write_header(uint8_t *o, Py_ssize_t n)
{
    if (n < 16) {
        *o++ = (uint8_t)(0x90 | n);
    }
    else if (n <= 0xffff) {
        *o++ = 0xdc;
        store_be(o, (uint64_t)n, 2);
        o += 2;
    }
    else {
        *o++ = 0xdd;
        store_be(o, (uint64_t)n, 4);
        o += 4;
    }
    return o;
}

/* ------------------------------------------------------------------------ */
/* Python glue. */

/* Is this buffer a native-endian signed 64-bit int one? */
static int
is_native_int64(const Py_buffer *view)
{
    const char *f = view->format;
    if (view->itemsize != 8 || f == NULL) {
        return 0;
    }
    if (*f == '@' || *f == '=') {
        f++;
    }
#if PY_LITTLE_ENDIAN
    else if (*f == '<') {
        f++;
    }
#else
    else if (*f == '>' || *f == '!') {
        f++;
    }
#endif
    if (f[0] == '\0' || f[1] != '\0') {
        return 0;
    }
    return f[0] == 'q' || (f[0] == 'l' && sizeof(long) == 8);
}

static int
get_int64_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT;
    if (writable) {
        flags |= PyBUF_WRITABLE;
    }
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    if (!is_native_int64(view)) {
        PyErr_Format(PyExc_TypeError,
                     "%s must be a C-contiguous native int64 buffer "
                     "(format %s, itemsize %zd)",
                     what, view->format ? view->format : "B", view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *
intcodec_array_len(PyObject *Py_UNUSED(module), PyObject *src)
{
    Py_buffer in;
    codec_err e = {0};
    Py_ssize_t count = 0, hlen = 0;
    if (PyObject_GetBuffer(src, &in, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    int rc = parse_header((const uint8_t *)in.buf, in.len, &count, &hlen, &e);
    PyBuffer_Release(&in);
    if (rc < 0) {
        set_error(&e);
        return NULL;
    }
    return PyLong_FromSsize_t(count);
}

static PyObject *
intcodec_decode_into(PyObject *Py_UNUSED(module), PyObject *const *args,
                     Py_ssize_t nargs)
{
    Py_buffer in, out;
    codec_err e = {0};
    Py_ssize_t count = 0, hlen = 0;
    int rc;

    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError,
                     "decode_into expected 2 arguments (src, out), got %zd", nargs);
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &in, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    if (get_int64_buffer(args[1], &out, 1, "out") < 0) {
        PyBuffer_Release(&in);
        return NULL;
    }
    rc = parse_header((const uint8_t *)in.buf, in.len, &count, &hlen, &e);
    if (rc == 0 && count != out.len / 8) {
        PyErr_Format(PyExc_ValueError,
                     "decode_into: out holds %zd elements, the array has %zd",
                     out.len / 8, count);
        PyBuffer_Release(&out);
        PyBuffer_Release(&in);
        return NULL;
    }
    if (rc == 0) {
        Py_BEGIN_ALLOW_THREADS
        rc = decode_body((const uint8_t *)in.buf, in.len, hlen, count,
                         (int64_t *)out.buf, &e);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&out);
    PyBuffer_Release(&in);
    if (rc < 0) {
        set_error(&e);
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *
intcodec_encode(PyObject *Py_UNUSED(module), PyObject *values)
{
    Py_buffer in;
    Py_ssize_t n, capacity;
    PyObject *result;

    if (get_int64_buffer(values, &in, 0, "values") < 0) {
        return NULL;
    }
    n = in.len / 8;
    if ((uint64_t)n > MAX_ARRAY_COUNT) {
        PyErr_Format(PyExc_ValueError,
                     "msgpack int array: %zd elements exceed the array32 limit", n);
        PyBuffer_Release(&in);
        return NULL;
    }
    const int64_t *v = (const int64_t *)in.buf;

    /* One pass into a buffer sized for the worst case (9 bytes an element),
     * then shrunk in place: no sizing pass, and no write can overrun it even
     * if another thread changes `values` while the GIL is released. */
    if (n > (PY_SSIZE_T_MAX - 5) / 9) {
        PyBuffer_Release(&in);
        return PyErr_NoMemory();
    }
    capacity = header_size(n) + 9 * n;
    result = PyBytes_FromStringAndSize(NULL, capacity);
    if (result == NULL) {
        PyBuffer_Release(&in);
        return NULL;
    }
    uint8_t *const start = (uint8_t *)PyBytes_AS_STRING(result);
    uint8_t *o;
    Py_BEGIN_ALLOW_THREADS
    o = write_header(start, n);
    for (Py_ssize_t i = 0; i < n; i++) {
        o = write_int(o, v[i]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&in);

    if (_PyBytes_Resize(&result, o - start) < 0) {
        return NULL;
    }
    return result;
}

static PyMethodDef intcodec_methods[] = {
    {"array_len", (PyCFunction)intcodec_array_len, METH_O,
     "array_len(src) -> int\n\nElement count of the msgpack array in src "
     "(header only; ValueError if it cannot be the start of a valid array)."},
    {"decode_into", (PyCFunction)(void (*)(void))intcodec_decode_into, METH_FASTCALL,
     "decode_into(src, out) -> None\n\nDecode the single msgpack int array in "
     "src into out (writable C-contiguous int64 buffer of array_len(src) "
     "elements). ValueError on malformed input."},
    {"encode", (PyCFunction)intcodec_encode, METH_O,
     "encode(values) -> bytes\n\nmsgpack array of the int64 buffer's values, "
     "each in its smallest form (as msgpack.packb)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot intcodec_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef intcodec_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mmadmit._intcodec",
    .m_doc = "msgpack int arrays <-> int64 buffers (see mmadmit.intcodec).",
    .m_size = 0,
    .m_methods = intcodec_methods,
    .m_slots = intcodec_slots,
};

PyMODINIT_FUNC
PyInit__intcodec(void)
{
    return PyModuleDef_Init(&intcodec_module);
}
