/*
 * Shared by mmadmit's C extensions (_kernels.c): the
 * int64 buffer check, the SIMD clone marker and the conditional GIL release.
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

/* Release the GIL only around long work. A thread that lets the GIL go for a
 * few microseconds of work must then win it back from a busy event loop or
 * worker, which under contention costs far more than the work (a convoy). */
#define MM_GIL_MIN_ELEMENTS ((Py_ssize_t)1 << 16)
#define MM_BEGIN_ALLOW_THREADS_IF(cond) \
    {                                   \
        PyThreadState *mm_save_ = (cond) ? PyEval_SaveThread() : NULL;
#define MM_END_ALLOW_THREADS_IF        \
    if (mm_save_ != NULL) {            \
        PyEval_RestoreThread(mm_save_); \
    }                                  \
    }

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
