/*
 * _pbwire: protobuf wire-format shortcuts for the gRPC transport (see
 * mmadmit/pbwire.py, which holds the Python fallback that must give the very
 * same results, byte for byte).
 *
 * Python API:
 *
 *   packed_uint32_field(field_number, values) -> bytes
 *       `values`: a C-contiguous native int64 buffer. Returns one packed
 *       `repeated uint32` field: the tag (wire type 2), the payload length and
 *       each value's varint; b"" for no values. A value outside
 *       [0, 2**32 - 1] raises ValueError("Value out of range: V") for the
 *       first such value (protobuf's own message for `extend`).
 *   strip_inline(data, min_bytes, nonce) -> (bytes, list[memoryview]) | None
 *       `data`: a serialized mmadmit.v1.AdmitRequest (bytes). Walks the
 *       fields listed in pbwire.py's schema and replaces the contents of
 *       every TensorData.inline of `min_bytes` or more by the marker
 *       `nonce + index.to_bytes(4, "little")`, rewriting the enclosing
 *       lengths (minimal varints); every other byte is copied as is (a map
 *       entry with a field other than key and value is left whole). Returns
 *       the new message and the replaced contents as memoryview slices of
 *       `data`, in wire order; None when nothing was replaced or when the
 *       bytes are not understood (truncated, malformed varint, a tag or a
 *       length over 5 bytes, field number 0 or above 2**29 - 1, groups or a
 *       reserved wire type: nothing upb refuses is ever stripped).
 *   within_limits(data, max_tokens, max_items, max_fields) -> bool
 *       `data`: a serialized mmadmit.v1.AdmitRequest (or SMG's GenerateRequest,
 *       same numbers). True when pbwire._Count's walk of the wire bytes would
 *       end cleanly within every limit: input_ids and input_ids_unpadded
 *       (max_tokens, added over every occurrence, packed or not), items
 *       (max_items), placeholders per item (max_tokens), map entries per item
 *       and other fields per message walked (max_fields). False for a breach
 *       and for bytes the walk does not understand; the Python walk then
 *       decides and words the refusal. Never True where that walk refuses.
 *   take_ids(data, unpadded) -> (bytes, bytearray, bytearray | None) | None
 *       `data`: a serialized AdmitRequest or GenerateRequest (any buffer). The
 *       message without its TokenizedInput.input_ids (field 1 of every field 2)
 *       and, with `unpadded`, without AdmitRequest.input_ids_unpadded (field
 *       100), each enclosing length rewritten (minimal varint), every other
 *       byte kept; the removed values in wire order as native int64 (packed
 *       and unpacked occurrences alike, as protobuf concatenates them); the
 *       unpadded values (None without `unpadded` or when field 100 is absent).
 *       None when there is nothing to take, and for anything the walk does
 *       not take exactly as upb would parse it: malformed or truncated bytes,
 *       a tag or a length over 5 bytes (upb refuses them; the fields taken
 *       and rewritten would lose them), field number 0 or above 2**29 - 1,
 *       groups or reserved wire types, a field 2, 1 or 100 of an unexpected
 *       wire type, a value above 2**32 - 1 (upb would truncate).
 *
 * Plain C API, no numpy headers: buffers come through the buffer protocol.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

/* ------------------------------------------------------------------------ */
/* varints */

static inline Py_ssize_t
varint_size(uint64_t v)
{
    Py_ssize_t n = 1;
    while (v > 0x7F) {
        v >>= 7;
        n++;
    }
    return n;
}

static inline uint8_t *
put_varint(uint8_t *out, uint64_t v)
{
    while (v > 0x7F) {
        *out++ = (uint8_t)((v & 0x7F) | 0x80);
        v >>= 7;
    }
    *out++ = (uint8_t)v;
    return out;
}

/* Read a varint of at most `most` bytes from [*pos, end); 0 on failure. A value
 * takes up to 10 bytes (64 bits; the walks refuse more). A tag or a length takes
 * at most 5 (SHORT_MAX): upb calls a 6th byte corrupt even where the value is
 * small (a non-minimal encoding of up to 5 bytes it takes). */
#define SHORT_MAX 5
static inline int
get_varint_n(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, uint64_t *value, int most)
{
    uint64_t result = 0;
    Py_ssize_t p = *pos;
    for (int k = 0; k < most; k++) {
        if (p >= end)
            return 0;
        uint8_t b = buf[p++];
        result |= (uint64_t)(b & 0x7F) << (7 * k);
        if (b < 0x80) {
            if (k == 9 && b > 1)
                return 0; /* more than 64 bits */
            *pos = p;
            *value = result;
            return 1;
        }
    }
    return 0;
}

#define get_varint(buf, pos, end, value) get_varint_n(buf, pos, end, value, 10)
#define get_length(buf, pos, end, value) get_varint_n(buf, pos, end, value, SHORT_MAX)

/* A field's key: 5 bytes at most and a field number in [1, 2**29 - 1], as upb
 * takes them (it refuses any other); 0 otherwise. */
static inline int
get_key(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, uint64_t *number, int *wire_type)
{
    uint64_t key;
    if (!get_varint_n(buf, pos, end, &key, SHORT_MAX))
        return 0;
    *number = key >> 3;
    *wire_type = (int)(key & 7);
    return *number != 0 && *number <= 0x1FFFFFFF;
}

/* ------------------------------------------------------------------------ */
/* packed_uint32_field */

static PyObject *
pbwire_packed_uint32_field(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "packed_uint32_field(field_number, values)");
        return NULL;
    }
    long field = PyLong_AsLong(args[0]);
    if (field == -1 && PyErr_Occurred())
        return NULL;
    if (field < 1 || field > 0x1FFFFFFF) {
        PyErr_SetString(PyExc_ValueError, "field number out of range");
        return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (view.len % 8 != 0) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "values must be an int64 buffer");
        return NULL;
    }
    const int64_t *values = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / 8;
    if (n == 0) {
        PyBuffer_Release(&view);
        return PyBytes_FromStringAndSize(NULL, 0);
    }
    Py_ssize_t payload = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t v = values[i];
        if (v < 0 || v > (int64_t)UINT32_MAX) {
            PyBuffer_Release(&view);
            PyErr_Format(PyExc_ValueError, "Value out of range: %lld", (long long)v);
            return NULL;
        }
        payload += 1 + (v >= (1 << 7)) + (v >= (1 << 14)) + (v >= (1 << 21)) + (v >= (1 << 28));
    }
    uint64_t key = ((uint64_t)field << 3) | 2;
    Py_ssize_t total = varint_size(key) + varint_size((uint64_t)payload) + payload;
    PyObject *result = PyBytes_FromStringAndSize(NULL, total);
    if (result == NULL) {
        PyBuffer_Release(&view);
        return NULL;
    }
    uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
    out = put_varint(out, key);
    out = put_varint(out, (uint64_t)payload);
    for (Py_ssize_t i = 0; i < n; i++) {
        uint32_t v = (uint32_t)values[i];
        if (v < 0x80) {
            *out++ = (uint8_t)v;
            continue;
        }
        out = put_varint(out, v);
    }
    PyBuffer_Release(&view);
    return result;
}

/* ------------------------------------------------------------------------ */
/* strip_inline: keep the schema in sync with pbwire.py's _SCHEMA. */

enum { K_ADMIT, K_MM, K_ITEM, K_ENTRY, K_MROPE, K_TENSOR, K_INLINE, K_NONE };

static int
sub_kind(int kind, uint64_t number)
{
    switch (kind) {
    case K_ADMIT:
        return number == 9 ? K_MM : number == 101 ? K_MROPE : K_NONE;
    case K_MM:
        return number == 1 ? K_ITEM : K_NONE;
    case K_ITEM:
        return number == 3 ? K_TENSOR : number == 4 ? K_ENTRY : K_NONE;
    case K_ENTRY:
        return number == 2 ? K_TENSOR : K_NONE;
    case K_MROPE:
        return number == 1 ? K_TENSOR : K_NONE;
    case K_TENSOR:
        return number == 3 ? K_INLINE : K_NONE;
    default:
        return K_NONE;
    }
}

#define WALK_BAIL (-1)  /* not understood: no Python error set */
#define WALK_ERROR (-2) /* Python error set */

typedef struct {
    const uint8_t *buf;
    Py_ssize_t min_bytes;
    const uint8_t *nonce;
    Py_ssize_t nonce_len;
    PyObject *view;      /* write pass: memoryview of data */
    PyObject *payloads;  /* write pass: list of memoryview slices */
} walker;

/*
 * The new size of the message buf[start:end] of `kind`, and in *stripped the
 * number of inline payloads replaced in it (a sub-message without any is kept
 * byte for byte). With out == NULL only counts; otherwise also writes the new
 * contents at out (exactly the counted size) and appends the payload slices.
 */
static Py_ssize_t
walk(walker *w, Py_ssize_t start, Py_ssize_t end, int kind, uint8_t *out, Py_ssize_t *stripped)
{
    const uint8_t *buf = w->buf;
    Py_ssize_t pos = start, size = 0;
    Py_ssize_t kept_from = start; /* unchanged bytes not yet written */
    int plain = 1;                /* a map entry of key (1) and value (2) only */
    *stripped = 0;
    while (pos < end) {
        Py_ssize_t field_start = pos;
        uint64_t number, v;
        int wire_type;
        if (!get_key(buf, &pos, end, &number, &wire_type))
            return WALK_BAIL;
        Py_ssize_t tag_end = pos;
        if (number > 2 || wire_type != 2)
            plain = 0;
        switch (wire_type) {
        case 0:
            if (!get_varint(buf, &pos, end, &v))
                return WALK_BAIL;
            continue;
        case 1:
            if (end - pos < 8)
                return WALK_BAIL;
            pos += 8;
            continue;
        case 5:
            if (end - pos < 4)
                return WALK_BAIL;
            pos += 4;
            continue;
        case 2:
            break;
        default:
            return WALK_BAIL; /* groups and reserved wire types */
        }
        uint64_t length;
        if (!get_length(buf, &pos, end, &length))
            return WALK_BAIL;
        if (length > (uint64_t)(end - pos))
            return WALK_BAIL;
        Py_ssize_t data_start = pos;
        pos += (Py_ssize_t)length;
        int sub = sub_kind(kind, number);
        if (sub == K_NONE)
            continue;
        Py_ssize_t new_size, inner = 0;
        if (sub == K_INLINE) {
            if ((Py_ssize_t)length < w->min_bytes)
                continue;
            new_size = w->nonce_len + 4;
            inner = 1;
        }
        else {
            /* Counted first: its new length goes before its contents. */
            new_size = walk(w, data_start, pos, sub, NULL, &inner);
            if (new_size < 0)
                return new_size;
            if (inner == 0)
                continue; /* unchanged: kept byte for byte */
        }
        *stripped += inner;
        Py_ssize_t head = field_start - kept_from;
        Py_ssize_t tag_len = tag_end - field_start;
        Py_ssize_t field_size = tag_len + varint_size((uint64_t)new_size) + new_size;
        if (out != NULL) {
            uint8_t *o = out + size;
            memcpy(o, buf + kept_from, (size_t)head);
            o += head;
            memcpy(o, buf + field_start, (size_t)tag_len);
            o += tag_len;
            o = put_varint(o, (uint64_t)new_size);
            if (sub == K_INLINE) {
                Py_ssize_t index = PyList_GET_SIZE(w->payloads);
                memcpy(o, w->nonce, (size_t)w->nonce_len);
                o += w->nonce_len;
                for (int b = 0; b < 4; b++)
                    *o++ = (uint8_t)((uint64_t)index >> (8 * b));
                PyObject *slice = PySequence_GetSlice(w->view, data_start, pos);
                if (slice == NULL)
                    return WALK_ERROR;
                int rc = PyList_Append(w->payloads, slice);
                Py_DECREF(slice);
                if (rc < 0)
                    return WALK_ERROR;
            }
            else {
                Py_ssize_t again;
                Py_ssize_t wrote = walk(w, data_start, pos, sub, o, &again);
                if (wrote < 0)
                    return wrote;
            }
        }
        size += head + field_size;
        kept_from = pos;
    }
    if (kind == K_ENTRY && !plain) {
        /* upb keeps a map entry with any other field whole, as an unknown field of
         * the item: its bytes stay as they are. (Only reached when counting: the
         * write pass never enters a sub-message counted as unchanged.) */
        *stripped = 0;
        return end - start;
    }
    Py_ssize_t tail = end - kept_from;
    if (out != NULL)
        memcpy(out + size, buf + kept_from, (size_t)tail);
    return size + tail;
}

static PyObject *
pbwire_strip_inline(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "strip_inline(data, min_bytes, nonce)");
        return NULL;
    }
    PyObject *data = args[0];
    if (!PyBytes_Check(data)) {
        PyErr_SetString(PyExc_TypeError, "strip_inline: data must be bytes");
        return NULL;
    }
    Py_ssize_t min_bytes = PyLong_AsSsize_t(args[1]);
    if (min_bytes == -1 && PyErr_Occurred())
        return NULL;
    if (min_bytes < 1) {
        PyErr_SetString(PyExc_ValueError, "strip_inline: min_bytes must be positive");
        return NULL;
    }
    if (!PyBytes_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "strip_inline: nonce must be bytes");
        return NULL;
    }
    walker w = {
        .buf = (const uint8_t *)PyBytes_AS_STRING(data),
        .min_bytes = min_bytes,
        .nonce = (const uint8_t *)PyBytes_AS_STRING(args[2]),
        .nonce_len = PyBytes_GET_SIZE(args[2]),
        .view = NULL,
        .payloads = NULL,
    };
    Py_ssize_t n = PyBytes_GET_SIZE(data), stripped = 0;
    Py_ssize_t size = walk(&w, 0, n, K_ADMIT, NULL, &stripped);
    if (size == WALK_ERROR)
        return NULL;
    if (size == WALK_BAIL || stripped == 0)
        Py_RETURN_NONE;
    PyObject *result = PyBytes_FromStringAndSize(NULL, size);
    if (result == NULL)
        return NULL;
    w.view = PyMemoryView_FromObject(data);
    w.payloads = PyList_New(0);
    if (w.view == NULL || w.payloads == NULL)
        goto error;
    Py_ssize_t wrote = walk(&w, 0, n, K_ADMIT, (uint8_t *)PyBytes_AS_STRING(result), &stripped);
    if (wrote < 0) {
        if (wrote == WALK_BAIL) /* cannot happen: the count pass saw the same bytes */
            PyErr_SetString(PyExc_SystemError, "strip_inline: write pass disagrees");
        goto error;
    }
    if (wrote != size) {
        PyErr_SetString(PyExc_SystemError, "strip_inline: size mismatch");
        goto error;
    }
    Py_DECREF(w.view);
    PyObject *pair = PyTuple_Pack(2, result, w.payloads);
    Py_DECREF(result);
    Py_DECREF(w.payloads);
    return pair;
error:
    Py_XDECREF(w.view);
    Py_XDECREF(w.payloads);
    Py_DECREF(result);
    return NULL;
}

/* ------------------------------------------------------------------------ */
/* within_limits: keep the schema in sync with pbwire.py's _COUNT_SCHEMA. */

enum { C_ADMIT, C_TOKENIZED, C_MM, C_ITEM, C_RID, C_IDS, C_UNPADDED, C_ENTRY, C_PLACEHOLDER,
       C_NONE };

static int
count_kind(int kind, uint64_t number)
{
    switch (kind) {
    case C_ADMIT:
        return number == 1     ? C_RID
               : number == 2   ? C_TOKENIZED
               : number == 9   ? C_MM
               : number == 100 ? C_UNPADDED
                               : C_NONE;
    case C_TOKENIZED:
        return number == 1 ? C_IDS : C_NONE;
    case C_MM:
        return number == 1 ? C_ITEM : C_NONE;
    case C_ITEM:
        return number == 4 ? C_ENTRY : number == 5 ? C_PLACEHOLDER : C_NONE;
    default:
        return C_NONE;
    }
}

typedef struct {
    const uint8_t *buf;
    long long max_tokens, max_items, max_fields;
    long long ids, unpadded, items;
} counter;

/* 1: the message buf[start:end] of `kind` is walked within the limits; 0: a breach,
 * or bytes the walk does not understand (pbwire._Count's _Bail). */
static int
count_message(counter *c, Py_ssize_t start, Py_ssize_t end, int kind)
{
    const uint8_t *buf = c->buf;
    long long fields = 0, entries = 0, placeholders = 0;
    Py_ssize_t pos = start;
    while (pos < end) {
        uint64_t number, length;
        int wire_type;
        if (!get_key(buf, &pos, end, &number, &wire_type))
            return 0;
        int sub = count_kind(kind, number);
        int bounded = sub == C_IDS || sub == C_UNPADDED || sub == C_ITEM || sub == C_ENTRY ||
                      sub == C_PLACEHOLDER;
        if (!bounded && ++fields > c->max_fields)
            return 0;
        Py_ssize_t data_start = pos;
        int packed;
        if (wire_type == 2) {
            if (!get_length(buf, &pos, end, &length) || length > (uint64_t)(end - pos))
                return 0;
            data_start = pos;
            pos += (Py_ssize_t)length;
            packed = 1;
        }
        else if (wire_type == 0) {
            uint64_t ignored;
            if (!get_varint(buf, &pos, end, &ignored))
                return 0;
            packed = 0;
        }
        else if (wire_type == 1 || wire_type == 5) {
            Py_ssize_t size = wire_type == 1 ? 8 : 4;
            if (end - pos < size)
                return 0;
            pos += size;
            continue;
        }
        else {
            return 0; /* groups and the reserved wire types */
        }
        if (sub == C_NONE)
            continue;
        if (sub == C_IDS || sub == C_UNPADDED) {
            long long values = 1;
            if (packed) { /* one varint ends at each byte below 0x80 */
                values = 0;
                for (Py_ssize_t k = data_start; k < pos; k++)
                    values += buf[k] < 0x80;
            }
            long long *n = sub == C_IDS ? &c->ids : &c->unpadded;
            *n += values;
            if (*n > c->max_tokens)
                return 0;
        }
        else if (!packed || sub == C_RID) {
            continue;
        }
        else if (sub == C_PLACEHOLDER) {
            if (++placeholders > c->max_tokens)
                return 0;
        }
        else if (sub == C_ENTRY) {
            if (++entries > c->max_fields)
                return 0;
        }
        else {
            if (sub == C_ITEM && ++c->items > c->max_items)
                return 0;
            if (!count_message(c, data_start, pos, sub))
                return 0;
        }
    }
    return pos == end;
}

static PyObject *
pbwire_within_limits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError,
                        "within_limits(data, max_tokens, max_items, max_fields)");
        return NULL;
    }
    counter c = {NULL, 0, 0, 0, 0, 0, 0};
    long long *limits[3] = {&c.max_tokens, &c.max_items, &c.max_fields};
    for (int i = 0; i < 3; i++) {
        *limits[i] = PyLong_AsLongLong(args[1 + i]);
        if (*limits[i] == -1 && PyErr_Occurred())
            return NULL;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    c.buf = (const uint8_t *)view.buf;
    int ok = count_message(&c, 0, view.len, C_ADMIT);
    PyBuffer_Release(&view);
    return PyBool_FromLong(ok);
}

/* ------------------------------------------------------------------------ */
/* take_ids */

/* Skip the value of a field of `wire_type` at *pos (its key read); 0 when cut or
 * of a wire type the walk does not take (groups, reserved). */
static int
skip_value(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int wire_type)
{
    uint64_t v;
    switch (wire_type) {
    case 0:
        return get_varint(buf, pos, end, &v);
    case 1:
    case 5: {
        Py_ssize_t size = wire_type == 1 ? 8 : 4;
        if (end - *pos < size)
            return 0;
        *pos += size;
        return 1;
    }
    case 2:
        if (!get_length(buf, pos, end, &v) || v > (uint64_t)(end - *pos))
            return 0;
        *pos += (Py_ssize_t)v;
        return 1;
    default:
        return 0;
    }
}

/* The uint32 values of one repeated field's occurrence whose key was just read
 * (wire type 0: one varint; 2: packed), appended at out[*n]; 0 for a cut or
 * malformed value, a value above 2**32 - 1 or another wire type. With out NULL
 * a packed run is only counted (a varint ends at each byte below 0x80) and
 * checked to end with a whole varint: the write pass checks each value. */
static int
take_values(const uint8_t *buf, Py_ssize_t *pos, Py_ssize_t end, int wire_type, int64_t *out,
            Py_ssize_t *n)
{
    uint64_t v;
    if (wire_type == 0) {
        if (!get_varint(buf, pos, end, &v) || v > UINT32_MAX)
            return 0;
        if (out != NULL)
            out[*n] = (int64_t)v;
        (*n)++;
        return 1;
    }
    if (wire_type != 2)
        return 0;
    uint64_t length;
    if (!get_length(buf, pos, end, &length) || length > (uint64_t)(end - *pos))
        return 0;
    Py_ssize_t p = *pos, stop = p + (Py_ssize_t)length;
    if (out == NULL) {
        if (stop > p && buf[stop - 1] >= 0x80)
            return 0; /* the last varint is cut */
        Py_ssize_t count = 0;
        for (Py_ssize_t k = p; k < stop; k++)
            count += buf[k] < 0x80;
        *n += count;
        *pos = stop;
        return 1;
    }
    int64_t *o = out + *n;
    while (p < stop) {
        uint8_t b = buf[p];
        if (b < 0x80) { /* most token ids below 128 take one byte */
            *o++ = b;
            p++;
            continue;
        }
        if (!get_varint(buf, &p, stop, &v) || v > UINT32_MAX)
            return 0;
        *o++ = (int64_t)v;
    }
    *n = o - out;
    *pos = stop;
    return 1;
}

typedef struct {
    const uint8_t *buf;
    int unpadded;     /* take field 100 too */
    int64_t *ids;     /* write pass: the values of input_ids */
    int64_t *unp;     /* write pass: the values of input_ids_unpadded */
    Py_ssize_t n_ids, n_unp;
    int seen_unp;     /* field 100 met */
    /* the new sizes of the first TAKE_SIZES TokenizedInput fields, from the count
     * pass (a later one is counted again in the write pass) */
#define TAKE_SIZES 4
    Py_ssize_t sizes[TAKE_SIZES];
    int n_sizes, k_sizes;
} taker;

enum { T_REQUEST, T_TOKENIZED };

/* The new size of the message buf[start:end] of `kind` without the fields taken
 * (a request: field 100 with t->unpadded, and field 1 of each TokenizedInput,
 * field 2), written at out unless NULL; -1 for bytes not taken. */
static Py_ssize_t
take_message(taker *t, Py_ssize_t start, Py_ssize_t end, int kind, uint8_t *out)
{
    const uint8_t *buf = t->buf;
    Py_ssize_t pos = start, size = 0;
    while (pos < end) {
        Py_ssize_t field_start = pos;
        uint64_t number;
        int wire_type;
        if (!get_key(buf, &pos, end, &number, &wire_type))
            return -1;
        Py_ssize_t tag_end = pos;
        if (kind == T_TOKENIZED && number == 1) {
            if (!take_values(buf, &pos, end, wire_type, t->ids, &t->n_ids))
                return -1;
            continue;
        }
        if (kind == T_REQUEST && number == 100 && t->unpadded) {
            t->seen_unp = 1;
            if (!take_values(buf, &pos, end, wire_type, t->unp, &t->n_unp))
                return -1;
            continue;
        }
        if (kind == T_REQUEST && number == 2) {
            uint64_t length;
            if (wire_type != 2 || !get_length(buf, &pos, end, &length) ||
                length > (uint64_t)(end - pos))
                return -1;
            Py_ssize_t inner_start = pos;
            pos += (Py_ssize_t)length;
            Py_ssize_t tag_len = tag_end - field_start;
            Py_ssize_t inner;
            if (out == NULL) {
                inner = take_message(t, inner_start, pos, T_TOKENIZED, NULL);
                if (inner < 0)
                    return -1;
                if (t->n_sizes < TAKE_SIZES)
                    t->sizes[t->n_sizes++] = inner;
            }
            else {
                if (t->k_sizes < t->n_sizes) {
                    inner = t->sizes[t->k_sizes++];
                }
                else { /* count it again, its values aside */
                    Py_ssize_t n_ids = t->n_ids;
                    int64_t *ids = t->ids;
                    t->ids = NULL;
                    inner = take_message(t, inner_start, pos, T_TOKENIZED, NULL);
                    t->ids = ids;
                    t->n_ids = n_ids;
                    if (inner < 0)
                        return -1;
                }
                uint8_t *o = out + size;
                memcpy(o, buf + field_start, (size_t)tag_len);
                o = put_varint(o + tag_len, (uint64_t)inner);
                if (take_message(t, inner_start, pos, T_TOKENIZED, o) != inner)
                    return -1;
            }
            size += tag_len + varint_size((uint64_t)inner) + inner;
            continue;
        }
        if (!skip_value(buf, &pos, end, wire_type))
            return -1;
        if (out != NULL)
            memcpy(out + size, buf + field_start, (size_t)(pos - field_start));
        size += pos - field_start;
    }
    return size;
}

static PyObject *
pbwire_take_ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "take_ids(data, unpadded)");
        return NULL;
    }
    int unpadded = PyObject_IsTrue(args[1]);
    if (unpadded < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *result = NULL, *small = NULL, *ids = NULL, *unp = NULL;
    taker t = {(const uint8_t *)view.buf, unpadded, NULL, NULL, 0, 0, 0, {0}, 0, 0};
    Py_ssize_t size = take_message(&t, 0, view.len, T_REQUEST, NULL);
    if (size < 0 || size == view.len) { /* not taken, or nothing to take */
        PyBuffer_Release(&view);
        Py_RETURN_NONE;
    }
    Py_ssize_t n_ids = t.n_ids, n_unp = t.n_unp;
    small = PyBytes_FromStringAndSize(NULL, size);
    ids = PyByteArray_FromStringAndSize(NULL, n_ids * 8);
    if (small == NULL || ids == NULL)
        goto done;
    if (t.seen_unp) {
        unp = PyByteArray_FromStringAndSize(NULL, n_unp * 8);
        if (unp == NULL)
            goto done;
    }
    else {
        unp = Py_NewRef(Py_None);
    }
    t.ids = (int64_t *)PyByteArray_AS_STRING(ids);
    t.unp = t.seen_unp ? (int64_t *)PyByteArray_AS_STRING(unp) : NULL;
    t.n_ids = t.n_unp = 0;
    Py_ssize_t wrote = take_message(&t, 0, view.len, T_REQUEST, (uint8_t *)PyBytes_AS_STRING(small));
    if (wrote < 0) { /* a value the count pass did not check (see take_values) */
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (wrote != size || t.n_ids != n_ids || t.n_unp != n_unp) {
        PyErr_SetString(PyExc_SystemError, "take_ids: write pass disagrees");
        goto done;
    }
    result = PyTuple_Pack(3, small, ids, unp);
done:
    PyBuffer_Release(&view);
    Py_XDECREF(small);
    Py_XDECREF(ids);
    Py_XDECREF(unp);
    return result;
}

static PyMethodDef pbwire_methods[] = {
    {"packed_uint32_field", (PyCFunction)(void (*)(void))pbwire_packed_uint32_field,
     METH_FASTCALL,
     "packed_uint32_field(field_number, values) -> bytes\n\nOne packed repeated uint32 "
     "field from a C-contiguous int64 buffer (ValueError for a value out of range)."},
    {"strip_inline", (PyCFunction)(void (*)(void))pbwire_strip_inline, METH_FASTCALL,
     "strip_inline(data, min_bytes, nonce) -> (bytes, list) | None\n\nAn AdmitRequest "
     "with its large TensorData.inline contents replaced by markers (see pbwire.py)."},
    {"take_ids", (PyCFunction)(void (*)(void))pbwire_take_ids, METH_FASTCALL,
     "take_ids(data, unpadded) -> (bytes, bytearray, bytearray | None) | None\n\nThe "
     "request without its input_ids (and input_ids_unpadded), and their values as int64."},
    {"within_limits", (PyCFunction)(void (*)(void))pbwire_within_limits, METH_FASTCALL,
     "within_limits(data, max_tokens, max_items, max_fields) -> bool\n\nTrue when the "
     "AdmitRequest's wire bytes are walked within the limits (see pbwire.check_admit_limits)."},
    {NULL, NULL, 0, NULL},
};

static PyModuleDef_Slot pbwire_slots[] = {
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

static struct PyModuleDef pbwire_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "mmadmit._pbwire",
    .m_doc = "protobuf wire-format shortcuts for the gRPC transport (see mmadmit.pbwire).",
    .m_size = 0,
    .m_methods = pbwire_methods,
    .m_slots = pbwire_slots,
};

PyMODINIT_FUNC
PyInit__pbwire(void)
{
    return PyModuleDef_Init(&pbwire_module);
}
