/*
 * Shared by the C extensions of mmadmit that share the materializer's arrays
 * (_kernels.c, _planner.c): the int64 buffer check and the SIMD clone marker.
 */
#ifndef MMADMIT_NATIVE_H
#define MMADMIT_NATIVE_H

#include <Python.h>

/* Hot loops get an AVX2 clone picked at load time where the compiler can. */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define MM_VECTORIZE __attribute__((target_clones("avx2", "default")))
#else
#define MM_VECTORIZE
#endif

/* Is this a native-endian signed 64-bit int buffer? */
static inline int
is_int64(const Py_buffer *v)
{
    const char *f = v->format;
    if (v->itemsize != 8 || f == NULL) {
        return 0;
    }
    if (f[0] == '<' || f[0] == '=' || f[0] == '@') {
        f++;
    }
    return (f[0] == 'q' || (f[0] == 'l' && sizeof(long) == 8)) && f[1] == '\0';
}

#endif /* MMADMIT_NATIVE_H */
