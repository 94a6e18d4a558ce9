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
 * For the wire codec (mmadmit/wire.py), walks over whole msgpack messages
 * that check their structure only (lengths, the byte 0xc1, trailing bytes),
 * iteratively (no recursion, any nesting depth), every read bounds-checked:
 *
 *   split(src, int_fields=(), alloc=None) -> (offsets, ints)
 *       Element boundaries of the one array in `src`; the elements listed in
 *       `int_fields` that are int arrays decoded on the way into
 *       alloc(count) int64 buffers (None where one is not).
 *   array_spans(src) -> list
 *       Per element of the array in `src`: start, end, count, and where its
 *       elements 1 and 3 start (multimodal items).
 *   check_structure(src, offsets, skip, max_depth, max_len) -> None | breach
 *       The elements of split()'s offsets not in `skip`, walked against a
 *       nesting depth and a per-container length limit (limits.py).
 *   int_rows(src, starts, width, alloc) -> (table, bounds)
 *       The arrays of `width`-int rows at the given offsets (item offsets),
 *       decoded into one int64 buffer.
 *
 * Runs of one int form (decoding) or one value (encoding), such as a
 * placeholder id over an image or a pad value over its span, are taken eight
 * elements at a time; results and errors are those of the element loop.
 *
 * Plain C API, no numpy headers: buffers come through the buffer protocol.
 * The int decode and encode loops touch no Python objects and run with the GIL
 * released; the buffers stay pinned by their Py_buffer views meanwhile.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#include "_native.h"

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

/* Runs of one int form (a placeholder id repeated over an image, a pad
 * value over its span): eight elements of type byte b (0xcc..0xd3), s bytes
 * apart, decoded with independent loads instead of a chain of dependent ones.
 * Returns 1 if all eight type bytes are b and none is a uint64 above
 * INT64_MAX; otherwise 0, and out[0..7] hold nothing the caller may keep.
 * Needs 7 * s + 9 readable bytes at q and 8 writable elements at out. */
static inline int
decode_run8(const uint8_t *q, unsigned b, Py_ssize_t s, int64_t *out)
{
    unsigned same = 1;
    for (int k = 1; k < 8; k++) {
        same &= q[k * s] == b;
    }
    if (!same) {
        return 0;
    }
    unsigned shift = (64 - 8 * (1u << (b & 3))) & 63;
    uint64_t seen = 0;
    if (b >= 0xd0) {
        for (int k = 0; k < 8; k++) {
            out[k] = (int64_t)load_be64(q + k * s + 1) >> shift;
        }
    }
    else {
        for (int k = 0; k < 8; k++) {
            uint64_t raw = load_be64(q + k * s + 1);
            seen |= raw;
            out[k] = (int64_t)(raw >> shift);
        }
    }
    /* uint64 (shift 0) above INT64_MAX: left to the element loop, which
     * reports it with its index */
    return !(b == 0xcf && (seen >> 63));
}

/* Decode `count` ints starting at p[*ppos] into out[]; on success *ppos is
 * the offset just after the last one. Bytes after the array are not looked
 * at (the fast loop may read, never use, up to 8 bytes past its end). */
static int
decode_run(const uint8_t *p, Py_ssize_t len, Py_ssize_t *ppos, Py_ssize_t count,
           int64_t *out, codec_err *e)
{
    Py_ssize_t i = 0;
    Py_ssize_t pos = *ppos;

    /* Fast path, 8 elements at a time while 72 bytes are left (8 elements
     * take at most that, the last one's 8-byte load included: no bounds
     * check inside a chunk): one table lookup and one unaligned 8-byte load
     * per element, the value picked without data-dependent branches (ids mix
     * 2-, 3- and 5-byte forms at random, which a branch predictor cannot
     * follow). Before each chunk, a look for a run of one form (decode_run8),
     * taken 8 at a time while it lasts: a few independent loads per chunk. */
    while (count - i >= 8 && len - pos >= 8 * 9) {
        unsigned first = p[pos];
        if (first >= 0xcc && first <= 0xd3) {
            Py_ssize_t s = 1 + ((Py_ssize_t)1 << (first & 3));
            if (decode_run8(p + pos, first, s, out + i)) {  /* 7 * s + 9 <= 72 */
                i += 8;
                pos += 8 * s;
                continue;
            }
        }
        for (int chunk = 0; chunk < 8; chunk++, i++) {
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
            /* The step to the next element from the type byte by arithmetic, not
             * from the table: the walk is a chain of dependent loads, and this
             * keeps the table lookup off it (0xcc..0xd3: 1 + 1, 2, 4, 8 bytes). */
            unsigned fix = (b < 0x80) | (b >= 0xe0);
            pos += fix ? 1 : 1 + ((Py_ssize_t)1 << (b & 3));
        }
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
    *ppos = pos;
    return 0;
}

/* Decode `count` ints starting at p[pos] into out[]; the array must end the
 * input exactly. */
static int
decode_body(const uint8_t *p, Py_ssize_t len, Py_ssize_t pos, Py_ssize_t count,
            int64_t *out, codec_err *e)
{
    if (decode_run(p, len, &pos, count, out, e) < 0) {
        return -1;
    }
    if (pos != len) {
        e->kind = ERR_TRAILING;
        e->have = len - pos;
        e->offset = pos;
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------ */
/* Splitting: walk one msgpack array and report where each element starts.
 *
 * The walk is iterative: a single counter holds the values still to be
 * skipped (an array header adds its count, a map header twice its count), so
 * nesting depth costs neither C stack nor memory. Every length is checked
 * against the bytes that are left before it is used, and the pending count
 * is kept below the bytes left (each value takes at least one byte), so a
 * forged header fails at once instead of making the walk run long. Only the
 * structure is checked here (lengths, the never-used byte 0xc1, trailing
 * bytes); the values themselves are validated by whoever decodes them. */

typedef enum {
    SERR_OK = 0,
    SERR_EMPTY,         /* no bytes at all */
    SERR_NOT_ARRAY,     /* the input is not an array */
    SERR_COUNT,         /* declared count > bytes that follow */
    SERR_END,           /* input ended where a value was expected */
    SERR_VALUE_TRUNC,   /* a value cut short */
    SERR_PENDING,       /* more values announced than bytes left */
    SERR_BYTE,          /* the never-used type byte 0xc1 */
    SERR_TRAILING,      /* bytes after the array */
} split_err_kind;

typedef struct {
    split_err_kind kind;
    unsigned type_byte;
    Py_ssize_t element;  /* index of the top-level element (-1: the header) */
    Py_ssize_t offset;
    uint64_t need;
    Py_ssize_t have;
} split_err;

static const char *
value_type_name(unsigned b)
{
    return (b >= 0xcc && b <= 0xd3) ? "int" : type_name(b);
}

static void
set_split_error(const split_err *e)
{
    switch (e->kind) {
    case SERR_EMPTY:
        PyErr_SetString(PyExc_ValueError, "msgpack: truncated input: empty buffer");
        break;
    case SERR_NOT_ARRAY:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: expected an array, got %s (type byte 0x%02x)",
                     value_type_name(e->type_byte), e->type_byte);
        break;
    case SERR_COUNT:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: truncated input: the array header declares %llu "
                     "elements but only %zd bytes follow",
                     (unsigned long long)e->need, e->have);
        break;
    case SERR_END:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: truncated input: element %zd: input ends at "
                     "offset %zd where a value is expected",
                     e->element, e->offset);
        break;
    case SERR_VALUE_TRUNC:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: truncated input: element %zd: the %s at offset %zd "
                     "(type byte 0x%02x) needs %llu bytes, only %zd left",
                     e->element, value_type_name(e->type_byte), e->offset,
                     e->type_byte, (unsigned long long)e->need, e->have);
        break;
    case SERR_PENDING:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: truncated input: element %zd: %llu more values "
                     "announced at offset %zd but only %zd bytes left",
                     e->element, (unsigned long long)e->need, e->offset, e->have);
        break;
    case SERR_BYTE:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: element %zd: invalid type byte 0x%02x at offset %zd",
                     e->element, e->type_byte, e->offset);
        break;
    case SERR_TRAILING:
        PyErr_Format(PyExc_ValueError,
                     "msgpack: %zd trailing bytes after the array (at offset %zd)",
                     e->have, e->offset);
        break;
    default:
        PyErr_SetString(PyExc_SystemError, "msgpack: unknown split error");
    }
}

/* The head of the value at p[pos] (pos < len, its type byte not a fixint):
 * its size in bytes with its children excluded, how many values follow as its
 * children (a map: two per entry), and whether it is a container (0 no,
 * 1 array, 2 map). 0, or -1 with `e` set (the byte 0xc1, a value cut short). */
static inline int
value_head(const uint8_t *p, Py_ssize_t len, Py_ssize_t pos, uint64_t *psize,
           uint64_t *pchildren, int *pcontainer, split_err *e)
{
    unsigned b = p[pos];
    uint64_t size = 1;      /* bytes of this value, its children excluded */
    uint64_t children = 0;  /* values that follow as its elements */
    int container = 0;      /* 1 array, 2 map */
    if (b <= 0x8f) {  /* fixmap (fixints are the caller's fast path) */
        children = 2u * (b & 0x0f);
        container = 2;
    }
    else if (b <= 0x9f) {  /* fixarray */
        children = b & 0x0f;
        container = 1;
    }
    else if (b <= 0xbf) {  /* fixstr */
        size = 1 + (b & 0x1f);
    }
    else {
        int lw = 0;        /* width of a length field after the type byte */
        unsigned ext = 0;  /* ext: the type code byte after the length */
        switch (b) {
        case 0xc0: case 0xc2: case 0xc3: size = 1; break;  /* nil, bool */
        case 0xc1:
            e->kind = SERR_BYTE;
            e->type_byte = b;
            e->offset = pos;
            return -1;
        case 0xc4: case 0xd9: lw = 1; break;  /* bin8, str8 */
        case 0xc5: case 0xda: lw = 2; break;  /* bin16, str16 */
        case 0xc6: case 0xdb: lw = 4; break;  /* bin32, str32 */
        case 0xc7: lw = 1; ext = 1; break;    /* ext8 */
        case 0xc8: lw = 2; ext = 1; break;    /* ext16 */
        case 0xc9: lw = 4; ext = 1; break;    /* ext32 */
        case 0xca: size = 5; break;           /* float32 */
        case 0xcb: size = 9; break;           /* float64 */
        case 0xcc: case 0xd0: size = 2; break;
        case 0xcd: case 0xd1: size = 3; break;
        case 0xce: case 0xd2: size = 5; break;
        case 0xcf: case 0xd3: size = 9; break;
        case 0xd4: size = 3; break;           /* fixext 1 */
        case 0xd5: size = 4; break;           /* fixext 2 */
        case 0xd6: size = 6; break;           /* fixext 4 */
        case 0xd7: size = 10; break;          /* fixext 8 */
        case 0xd8: size = 18; break;          /* fixext 16 */
        case 0xdc: lw = 2; container = 1; break;
        case 0xdd: lw = 4; container = 1; break;
        case 0xde: lw = 2; container = 2; break;
        case 0xdf: lw = 4; container = 2; break;
        default: size = 1; break;  /* unreachable: 0xc0..0xdf all listed */
        }
        if (lw) {
            if (len - pos < 1 + lw) {
                size = (uint64_t)(1 + lw);
                goto truncated;
            }
            uint64_t m = load_be(p + pos + 1, lw);
            if (container) {
                size = (uint64_t)(1 + lw);
                children = container == 2 ? 2 * m : m;
            }
            else {
                size = (uint64_t)(1 + lw) + ext + m;
            }
        }
    }
    if (size > (uint64_t)(len - pos)) {
        goto truncated;
    }
    *psize = size;
    *pchildren = children;
    *pcontainer = container;
    return 0;
truncated:
    e->kind = SERR_VALUE_TRUNC;
    e->type_byte = b;
    e->offset = pos;
    e->need = size;
    e->have = len - pos;
    return -1;
}

/* Skip `n` consecutive values starting at p[*ppos]; *ppos ends after them. */
static int
skip_values(const uint8_t *p, Py_ssize_t len, Py_ssize_t *ppos, uint64_t n,
            split_err *e)
{
    Py_ssize_t pos = *ppos;
    uint64_t pending = n;
    while (pending) {
        if (pos >= len) {
            e->kind = SERR_END;
            e->offset = pos;
            return -1;
        }
        unsigned b = p[pos];
        pending--;
        if (b <= 0x7f || b >= 0xe0) {  /* positive / negative fixint */
            pos++;
            continue;
        }
        uint64_t size, children;
        int container;
        if (value_head(p, len, pos, &size, &children, &container, e) < 0) {
            return -1;
        }
        pos += (Py_ssize_t)size;
        pending += children;
        if (pending > (uint64_t)(len - pos)) {
            e->kind = SERR_PENDING;
            e->need = pending;
            e->offset = pos;
            e->have = len - pos;
            return -1;
        }
    }
    *ppos = pos;
    return 0;
}

/* Structure limits: the deepest container nesting (the array passed to
 * check_structure is depth 1) and the most elements (arrays) or entries
 * (maps) one container may declare. A breach sets `kind` (1 array, 2 map:
 * `value` its length; 3 depth: `value` the depth reached). */
#define MAX_DEPTH_CAP 1024

typedef struct {
    int max_depth;     /* 1 .. MAX_DEPTH_CAP */
    uint64_t max_len;
    int kind;
    uint64_t value;
} struct_limits;

/* Walk the one value at p[*ppos], which lies inside `base` containers, against
 * `lim`; *ppos ends after it. 0, 1 for a breach (lim->kind, lim->value), -1
 * for malformed input (e set). Iterative: one counter per open container, and
 * no container deeper than lim->max_depth is ever opened. */
static int
walk_limits(const uint8_t *p, Py_ssize_t len, Py_ssize_t *ppos, int base,
            struct_limits *lim, split_err *e)
{
    uint64_t pending[MAX_DEPTH_CAP];  /* values left in each open level */
    int top = 0;  /* level 0: the value itself */
    Py_ssize_t pos = *ppos;
    pending[0] = 1;
    for (;;) {
        while (pending[top] == 0) {
            if (top == 0) {
                *ppos = pos;
                return 0;
            }
            top--;
        }
        if (pos >= len) {
            e->kind = SERR_END;
            e->offset = pos;
            return -1;
        }
        pending[top]--;
        unsigned b = p[pos];
        if (b <= 0x7f || b >= 0xe0) {  /* fixint */
            pos++;
            continue;
        }
        uint64_t size, children;
        int container;
        if (value_head(p, len, pos, &size, &children, &container, e) < 0) {
            return -1;
        }
        pos += (Py_ssize_t)size;
        if (!container) {
            continue;
        }
        uint64_t entries = container == 2 ? children / 2 : children;
        if (entries > lim->max_len) {
            lim->kind = container;
            lim->value = entries;
            return 1;
        }
        /* this container sits inside base + top others */
        if ((uint64_t)base + (uint64_t)top + 1 > (uint64_t)lim->max_depth) {
            lim->kind = 3;
            lim->value = (uint64_t)base + (uint64_t)top + 1;
            return 1;
        }
        if (children > (uint64_t)(len - pos)) {
            e->kind = SERR_PENDING;
            e->need = children;
            e->offset = pos;
            e->have = len - pos;
            return -1;
        }
        if (children) {
            /* base >= 1, so top + 1 <= max_depth - 1 < MAX_DEPTH_CAP */
            pending[++top] = children;
        }
    }
}

/* Parse an array header at p[pos]: 1 and the count and header length if it is
 * one whose count fits in the bytes left, 0 if it is not an array header,
 * -1 (error set in e) for a cut or oversized header. */
static int
array_header_at(const uint8_t *p, Py_ssize_t len, Py_ssize_t pos, uint64_t *count,
                Py_ssize_t *hlen, split_err *e)
{
    if (pos >= len) {
        e->kind = SERR_END;
        e->offset = pos;
        return -1;
    }
    unsigned b = p[pos];
    uint64_t n;
    Py_ssize_t h;
    if (b >= 0x90 && b <= 0x9f) {
        n = b & 0x0f;
        h = 1;
    }
    else if (b == 0xdc || b == 0xdd) {
        h = (b == 0xdc) ? 3 : 5;
        if (len - pos < h) {
            e->kind = SERR_VALUE_TRUNC;
            e->type_byte = b;
            e->offset = pos;
            e->need = (uint64_t)h;
            e->have = len - pos;
            return -1;
        }
        n = load_be(p + pos + 1, (int)(h - 1));
    }
    else {
        return 0;
    }
    if (n > (uint64_t)(len - pos - h)) {
        e->kind = SERR_PENDING;
        e->need = n;
        e->offset = pos + h;
        e->have = len - pos - h;
        return -1;
    }
    *count = n;
    *hlen = h;
    return 1;
}

/* The top-level array header of `p` (the whole input must be one array). */
static int
top_header(const uint8_t *p, Py_ssize_t len, uint64_t *count, Py_ssize_t *hlen,
           split_err *e)
{
    e->element = -1;
    if (len < 1) {
        e->kind = SERR_EMPTY;
        return -1;
    }
    int rc = array_header_at(p, len, 0, count, hlen, e);
    if (rc == 0) {
        e->kind = SERR_NOT_ARRAY;
        e->type_byte = p[0];
        return -1;
    }
    if (rc < 0 && e->kind == SERR_PENDING) {
        e->kind = SERR_COUNT;
    }
    return rc < 0 ? -1 : 0;
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

/* Write the n values; needs 9 writable bytes per value at o. Runs of one
 * value (placeholder or pad runs) are written eight at a time as copies of
 * its encoding. */
static uint8_t *
write_ints(uint8_t *o, const int64_t *v, Py_ssize_t n)
{
    uint8_t *last = o;  /* where the previous value's encoding starts */
    Py_ssize_t i = 0;
    while (n - i >= 8) {
        /* Every 8 values, a look for a run of one value (8 more equal to the
         * previous one): written as copies of its encoding while it lasts.
         * The first comparison alone is a branch, rarely taken in text. */
        if (i > 0 && v[i] == v[i - 1]) {
            int64_t x = v[i - 1];
            unsigned all = 1;
            for (int k = 0; k < 8; k++) {
                all &= v[i + k] == x;
            }
            if (all) {
                /* The previous encoding (at most 9 bytes; write_int and these
                 * copies always write all 9) copied 8 times: each copy writes
                 * 9 bytes at o, within o's budget of 9 bytes a value. */
                Py_ssize_t size = o - last;
                uint64_t head;
                memcpy(&head, last, 8);
                uint8_t tail = last[8];
                for (int k = 0; k < 8; k++) {
                    memcpy(o, &head, 8);
                    o[8] = tail;
                    o += size;
                }
                last = o - size;
                i += 8;
                continue;
            }
        }
        for (int chunk = 0; chunk < 8; chunk++, i++) {
            last = o;
            o = write_int(o, v[i]);
        }
    }
    for (; i < n; i++) {
        o = write_int(o, v[i]);
    }
    return o;
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
        MM_BEGIN_ALLOW_THREADS_IF(count >= MM_GIL_MIN_ELEMENTS)
        rc = decode_body((const uint8_t *)in.buf, in.len, hlen, count,
                         (int64_t *)out.buf, &e);
        MM_END_ALLOW_THREADS_IF
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
    MM_BEGIN_ALLOW_THREADS_IF(n >= MM_GIL_MIN_ELEMENTS)
    o = write_header(start, n);
    o = write_ints(o, v, n);
    MM_END_ALLOW_THREADS_IF
    PyBuffer_Release(&in);

    if (_PyBytes_Resize(&result, o - start) < 0) {
        return NULL;
    }
    return result;
}

/* split(src, int_fields=(), alloc=None) -> (offsets, ints)
 *
 * `src` holds exactly one msgpack array of n elements. offsets: a list of
 * n + 1 ints, element i being src[offsets[i]:offsets[i + 1]] (offsets[0] is
 * the header length, offsets[n] == len(src)). For each element index listed
 * in `int_fields` that is an array of ints, ints[k] is a new int64 buffer
 * from alloc(count) holding its values, decoded in the same pass; ints[k] is
 * None when that element is absent, not an array, or not all ints (the
 * caller decodes it again for the precise error). ValueError for a
 * structurally malformed input. */
static PyObject *
intcodec_split(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer in;
    split_err e = {0};
    uint64_t n = 0;
    Py_ssize_t pos = 0;
    PyObject *fields = NULL, *alloc = Py_None;
    PyObject *offsets = NULL, *ints = NULL, *result = NULL;
    Py_ssize_t nfields = 0;
    Py_ssize_t field_idx[8];

    if (nargs < 1 || nargs > 3) {
        PyErr_Format(PyExc_TypeError,
                     "split expected 1 to 3 arguments (src, int_fields, alloc), got %zd",
                     nargs);
        return NULL;
    }
    if (nargs >= 2 && args[1] != Py_None) {
        fields = args[1];
        if (!PyTuple_Check(fields)) {
            PyErr_SetString(PyExc_TypeError, "split: int_fields must be a tuple of ints");
            return NULL;
        }
        nfields = PyTuple_GET_SIZE(fields);
        if (nfields > (Py_ssize_t)(sizeof(field_idx) / sizeof(field_idx[0]))) {
            PyErr_SetString(PyExc_ValueError, "split: at most 8 int_fields");
            return NULL;
        }
        for (Py_ssize_t k = 0; k < nfields; k++) {
            field_idx[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(fields, k));
            if (field_idx[k] == -1 && PyErr_Occurred()) {
                return NULL;
            }
        }
    }
    if (nargs >= 3) {
        alloc = args[2];
    }
    if (nfields && !PyCallable_Check(alloc)) {
        PyErr_SetString(PyExc_TypeError, "split: alloc must be callable when int_fields is given");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &in, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)in.buf;
    const Py_ssize_t len = in.len;

    if (top_header(p, len, &n, &pos, &e) < 0) {
        set_split_error(&e);
        goto done;
    }
    offsets = PyList_New((Py_ssize_t)n + 1);
    ints = PyList_New(nfields);
    if (offsets == NULL || ints == NULL) {
        goto done;
    }
    for (Py_ssize_t k = 0; k < nfields; k++) {
        Py_INCREF(Py_None);
        PyList_SET_ITEM(ints, k, Py_None);
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        PyObject *start = PyLong_FromSsize_t(pos);
        if (start == NULL) {
            goto done;
        }
        PyList_SET_ITEM(offsets, i, start);
        e.element = i;
        Py_ssize_t k = 0;
        while (k < nfields && field_idx[k] != i) {
            k++;
        }
        if (k < nfields) {
            uint64_t count = 0;
            Py_ssize_t hlen = 0;
            int rc = array_header_at(p, len, pos, &count, &hlen, &e);
            if (rc < 0) {
                set_split_error(&e);
                goto done;
            }
            if (rc > 0) {
                PyObject *arr = PyObject_CallFunction(alloc, "n", (Py_ssize_t)count);
                if (arr == NULL) {
                    goto done;
                }
                Py_buffer out;
                if (get_int64_buffer(arr, &out, 1, "alloc(count)") < 0) {
                    Py_DECREF(arr);
                    goto done;
                }
                if (out.len / 8 != (Py_ssize_t)count) {
                    PyErr_Format(PyExc_ValueError,
                                 "split: alloc(%zd) returned %zd elements",
                                 (Py_ssize_t)count, out.len / 8);
                    PyBuffer_Release(&out);
                    Py_DECREF(arr);
                    goto done;
                }
                codec_err ce = {0};
                Py_ssize_t q = pos + hlen;
                int drc;
                MM_BEGIN_ALLOW_THREADS_IF((Py_ssize_t)count >= MM_GIL_MIN_ELEMENTS)
                drc = decode_run(p, len, &q, (Py_ssize_t)count, (int64_t *)out.buf, &ce);
                MM_END_ALLOW_THREADS_IF
                PyBuffer_Release(&out);
                if (drc == 0) {
                    PyList_SetItem(ints, k, arr);  /* steals arr, drops the None */
                    pos = q;
                    continue;
                }
                Py_DECREF(arr);  /* not all ints: walked again below */
            }
        }
        if (skip_values(p, len, &pos, 1, &e) < 0) {
            set_split_error(&e);
            goto done;
        }
    }
    if (pos != len) {
        e.kind = SERR_TRAILING;
        e.have = len - pos;
        e.offset = pos;
        set_split_error(&e);
        goto done;
    }
    {
        PyObject *end = PyLong_FromSsize_t(pos);
        if (end == NULL) {
            goto done;
        }
        PyList_SET_ITEM(offsets, (Py_ssize_t)n, end);
    }
    result = PyTuple_Pack(2, offsets, ints);

done:
    Py_XDECREF(offsets);
    Py_XDECREF(ints);
    PyBuffer_Release(&in);
    return result;
}

/* array_spans(src) -> list of ints, 5 per element of the array in `src`:
 * start, end, count, start of its element 1, start of its element 3. For an
 * element that is not an array, count is -1; the last two are -1 when the
 * element has fewer than 3 elements. ValueError for malformed input. */
static PyObject *
intcodec_array_spans(PyObject *Py_UNUSED(module), PyObject *src)
{
    Py_buffer in;
    split_err e = {0};
    uint64_t n = 0;
    Py_ssize_t pos = 0;
    PyObject *out = NULL;

    if (PyObject_GetBuffer(src, &in, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)in.buf;
    const Py_ssize_t len = in.len;
    if (top_header(p, len, &n, &pos, &e) < 0) {
        set_split_error(&e);
        goto fail;
    }
    out = PyList_New(5 * (Py_ssize_t)n);
    if (out == NULL) {
        goto fail;
    }
    for (Py_ssize_t i = 0; i < (Py_ssize_t)n; i++) {
        Py_ssize_t row[5] = {pos, -1, -1, -1, -1};
        uint64_t count = 0;
        Py_ssize_t hlen = 0;
        e.element = i;
        int rc = array_header_at(p, len, pos, &count, &hlen, &e);
        if (rc < 0) {
            set_split_error(&e);
            goto fail;
        }
        if (rc == 0) {
            if (skip_values(p, len, &pos, 1, &e) < 0) {
                set_split_error(&e);
                goto fail;
            }
        }
        else {
            row[2] = (Py_ssize_t)count;
            pos += hlen;
            if (count >= 3) {
                if (skip_values(p, len, &pos, 1, &e) < 0) {
                    set_split_error(&e);
                    goto fail;
                }
                row[3] = pos;
                if (skip_values(p, len, &pos, 2, &e) < 0) {
                    set_split_error(&e);
                    goto fail;
                }
                row[4] = pos;
                count -= 3;
            }
            if (skip_values(p, len, &pos, count, &e) < 0) {
                set_split_error(&e);
                goto fail;
            }
        }
        row[1] = pos;
        for (int k = 0; k < 5; k++) {
            PyObject *v = PyLong_FromSsize_t(row[k]);
            if (v == NULL) {
                goto fail;
            }
            PyList_SET_ITEM(out, 5 * i + k, v);
        }
    }
    if (pos != len) {
        e.kind = SERR_TRAILING;
        e.have = len - pos;
        e.offset = pos;
        set_split_error(&e);
        goto fail;
    }
    PyBuffer_Release(&in);
    return out;

fail:
    Py_XDECREF(out);
    PyBuffer_Release(&in);
    return NULL;
}

/* int_rows(src, starts, width, alloc) -> (table, bounds)
 *
 * For each offset in `starts` (a list of ints), the msgpack value there is
 * nil or an array of rows, each an array of exactly `width` ints in the int64
 * range. Every row of every such array is decoded, in order, into one int64
 * buffer table = alloc(total_rows * width); bounds holds 2 ints per start:
 * the first row and the end row of its array in table, or -1, -1 for nil.
 * ValueError for anything else (the caller then decodes the values the slow
 * way for a precise error). */
static PyObject *
intcodec_int_rows(PyObject *Py_UNUSED(module), PyObject *const *args, Py_ssize_t nargs)
{
    Py_buffer in;
    PyObject *bounds = NULL, *table = NULL, *result = NULL;
    Py_buffer out = {0};
    int have_out = 0;
    Py_ssize_t *at_of = NULL;  /* the starts, read once: alloc() runs Python code */

    if (nargs != 4) {
        PyErr_Format(PyExc_TypeError,
                     "int_rows expected 4 arguments (src, starts, width, alloc), got %zd",
                     nargs);
        return NULL;
    }
    PyObject *starts = args[1];
    if (!PyList_Check(starts)) {
        PyErr_SetString(PyExc_TypeError, "int_rows: starts must be a list of ints");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    if (width == -1 && PyErr_Occurred()) {
        return NULL;
    }
    if (width < 1 || width > 15) {
        PyErr_SetString(PyExc_ValueError, "int_rows: width must be 1..15");
        return NULL;
    }
    if (PyObject_GetBuffer(args[0], &in, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)in.buf;
    const Py_ssize_t len = in.len;
    const Py_ssize_t n = PyList_GET_SIZE(starts);
    split_err e = {0};

    bounds = PyList_New(2 * n);
    at_of = PyMem_New(Py_ssize_t, n > 0 ? n : 1);
    if (bounds == NULL || at_of == NULL) {
        if (at_of == NULL) {
            PyErr_NoMemory();
        }
        goto done;
    }
    /* Pass 1: the row count of each array (headers only). */
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t at = PyLong_AsSsize_t(PyList_GET_ITEM(starts, k));
        if (at == -1 && PyErr_Occurred()) {
            goto done;
        }
        at_of[k] = at;
        if (at < 0 || at >= len) {
            PyErr_Format(PyExc_ValueError, "int_rows: start %zd outside the input", at);
            goto done;
        }
        Py_ssize_t lo = -1, hi = -1;
        if (p[at] != 0xc0) {
            uint64_t rows = 0;
            Py_ssize_t hlen = 0;
            int rc = array_header_at(p, len, at, &rows, &hlen, &e);
            if (rc <= 0) {
                PyErr_Format(PyExc_ValueError,
                             "int_rows: the value at offset %zd is not an array "
                             "of rows", at);
                goto done;
            }
            lo = (Py_ssize_t)total;
            total += rows;  /* rows <= len each: no overflow for any real n */
            hi = (Py_ssize_t)total;
        }
        PyObject *a = PyLong_FromSsize_t(lo), *b = PyLong_FromSsize_t(hi);
        if (a == NULL || b == NULL) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto done;
        }
        PyList_SET_ITEM(bounds, 2 * k, a);
        PyList_SET_ITEM(bounds, 2 * k + 1, b);
    }
    if (total > (uint64_t)PY_SSIZE_T_MAX / 8 / (uint64_t)width) {
        PyErr_SetString(PyExc_ValueError, "int_rows: too many rows");
        goto done;
    }
    table = PyObject_CallFunction(args[3], "n", (Py_ssize_t)(total * (uint64_t)width));
    if (table == NULL) {
        goto done;
    }
    if (get_int64_buffer(table, &out, 1, "alloc(count)") < 0) {
        goto done;
    }
    have_out = 1;
    if ((uint64_t)(out.len / 8) != total * (uint64_t)width) {
        PyErr_SetString(PyExc_ValueError, "int_rows: alloc returned the wrong size");
        goto done;
    }
    /* Pass 2: every row, checked and decoded. Everything is checked again
     * (alloc() ran Python code that could have written to a writable src):
     * the worst a changed input can do is an error, never a write past o_end. */
    int64_t *o = (int64_t *)out.buf;
    int64_t *const o_end = o + total * (uint64_t)width;
    for (Py_ssize_t k = 0; k < n; k++) {
        Py_ssize_t at = at_of[k];
        if (p[at] == 0xc0) {
            continue;
        }
        uint64_t rows = 0;
        Py_ssize_t hlen = 0;
        if (array_header_at(p, len, at, &rows, &hlen, &e) <= 0) {
            PyErr_SetString(PyExc_ValueError, "int_rows: the input changed");
            goto done;
        }
        Py_ssize_t pos = at + hlen;
        for (uint64_t r = 0; r < rows; r++) {
            uint64_t cells = 0;
            Py_ssize_t rh = 0;
            codec_err ce = {0};
            if (o_end - o < width) {
                PyErr_SetString(PyExc_ValueError, "int_rows: the input changed");
                goto done;
            }
            if (array_header_at(p, len, pos, &cells, &rh, &e) <= 0
                || cells != (uint64_t)width) {
                PyErr_Format(PyExc_ValueError,
                             "int_rows: row %llu of the array at offset %zd is not "
                             "an array of %zd ints",
                             (unsigned long long)r, at, width);
                goto done;
            }
            pos += rh;
            if (decode_run(p, len, &pos, width, o, &ce) < 0) {
                PyErr_Format(PyExc_ValueError,
                             "int_rows: row %llu of the array at offset %zd is not "
                             "an array of %zd int64 values",
                             (unsigned long long)r, at, width);
                goto done;
            }
            o += width;
        }
    }
    result = PyTuple_Pack(2, table, bounds);

done:
    if (have_out) {
        PyBuffer_Release(&out);
    }
    PyMem_Free(at_of);
    Py_XDECREF(table);
    Py_XDECREF(bounds);
    PyBuffer_Release(&in);
    return result;
}

/* check_structure(src, offsets, skip, max_depth, max_len) -> None | (kind, element, value)
 *
 * `offsets`: split()'s n + 1 element offsets of the array in `src`; each
 * element whose index is not in the tuple `skip` is walked against the limits
 * (the array itself is depth 1; its own length is the caller's to check).
 * None when every walked element is within them, else the first breach:
 * kind 1 (array) or 2 (map) with its length, or 3 (depth) with the depth
 * reached, and the index of the element holding it. The offsets are checked
 * (increasing, inside src, each span exactly one value): ValueError else. */
static PyObject *
intcodec_check_structure(PyObject *Py_UNUSED(module), PyObject *const *args,
                         Py_ssize_t nargs)
{
    Py_buffer in;
    split_err e = {0};
    struct_limits lim = {0};
    PyObject *result = NULL;

    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "check_structure expected 5 arguments (src, offsets, skip, "
                     "max_depth, max_len), got %zd", nargs);
        return NULL;
    }
    PyObject *offsets = args[1], *skip = args[2];
    if (!PyList_Check(offsets) || PyList_GET_SIZE(offsets) < 1) {
        PyErr_SetString(PyExc_TypeError, "check_structure: offsets must be a non-empty list");
        return NULL;
    }
    if (!PyTuple_Check(skip)) {
        PyErr_SetString(PyExc_TypeError, "check_structure: skip must be a tuple of ints");
        return NULL;
    }
    long depth = PyLong_AsLong(args[3]);
    if (depth == -1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long long max_len = PyLong_AsUnsignedLongLong(args[4]);
    if (max_len == (unsigned long long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    if (depth < 1 || depth > MAX_DEPTH_CAP) {
        PyErr_Format(PyExc_ValueError, "check_structure: max_depth must be 1..%d",
                     MAX_DEPTH_CAP);
        return NULL;
    }
    lim.max_depth = (int)depth;
    lim.max_len = (uint64_t)max_len;
    Py_ssize_t nskip = PyTuple_GET_SIZE(skip);
    Py_ssize_t skip_idx[8];
    if (nskip > 8) {
        PyErr_SetString(PyExc_ValueError, "check_structure: at most 8 skipped elements");
        return NULL;
    }
    for (Py_ssize_t k = 0; k < nskip; k++) {
        skip_idx[k] = PyLong_AsSsize_t(PyTuple_GET_ITEM(skip, k));
        if (skip_idx[k] == -1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    if (PyObject_GetBuffer(args[0], &in, PyBUF_SIMPLE) < 0) {
        return NULL;
    }
    const uint8_t *p = (const uint8_t *)in.buf;
    const Py_ssize_t len = in.len;
    Py_ssize_t n = PyList_GET_SIZE(offsets) - 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* read both bounds on every turn: nothing here runs Python code, but
         * the list is the caller's and is trusted for nothing */
        Py_ssize_t start = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, i));
        Py_ssize_t end = PyLong_AsSsize_t(PyList_GET_ITEM(offsets, i + 1));
        if ((start == -1 || end == -1) && PyErr_Occurred()) {
            goto done;
        }
        if (start < 0 || end < start || end > len) {
            PyErr_Format(PyExc_ValueError,
                         "check_structure: element %zd spans %zd..%zd of %zd bytes",
                         i, start, end, len);
            goto done;
        }
        Py_ssize_t k = 0;
        while (k < nskip && skip_idx[k] != i) {
            k++;
        }
        if (k < nskip) {
            continue;
        }
        Py_ssize_t pos = start;
        e.element = i;
        int rc = walk_limits(p, end, &pos, 1, &lim, &e);
        if (rc < 0) {
            set_split_error(&e);
            goto done;
        }
        if (rc > 0) {
            result = Py_BuildValue("(inK)", lim.kind, i, (unsigned long long)lim.value);
            goto done;
        }
        if (pos != end) {
            PyErr_Format(PyExc_ValueError,
                         "check_structure: element %zd is not one value (%zd of %zd bytes)",
                         i, pos - start, end - start);
            goto done;
        }
    }
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&in);
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
    {"split", (PyCFunction)(void (*)(void))intcodec_split, METH_FASTCALL,
     "split(src, int_fields=(), alloc=None) -> (offsets, ints)\n\nElement "
     "boundaries of the msgpack array in src (n + 1 offsets), decoding the "
     "int-array elements listed in int_fields into alloc(count) int64 buffers "
     "in the same pass (None where an element is not an int array). "
     "ValueError on malformed input."},
    {"int_rows", (PyCFunction)(void (*)(void))intcodec_int_rows, METH_FASTCALL,
     "int_rows(src, starts, width, alloc) -> (table, bounds)\n\nDecode the "
     "arrays of width-int rows found at the given offsets of src (or nil) "
     "into one int64 buffer alloc(rows * width); bounds: first and end row "
     "per offset (-1, -1 for nil). ValueError for anything else."},
    {"check_structure", (PyCFunction)(void (*)(void))intcodec_check_structure,
     METH_FASTCALL,
     "check_structure(src, offsets, skip, max_depth, max_len) -> None or "
     "(kind, element, value)\n\nWalk the elements of split()'s offsets not in "
     "skip against a nesting depth (the array: 1) and a container length "
     "limit; the first breach: kind 1 array / 2 map (value: its length) or "
     "3 depth (value: the depth reached)."},
    {"array_spans", (PyCFunction)intcodec_array_spans, METH_O,
     "array_spans(src) -> list\n\n5 ints per element of the msgpack array in "
     "src: start, end, count (-1: not an array), start of its element 1 and "
     "of its element 3 (-1: fewer than 3 elements). ValueError on malformed "
     "input."},
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
