#!/bin/sh
# The ASan runtime to LD_PRELOAD into Python for the sanitizer build: atheris'
# (ASan + libFuzzer in one) for a clang build when it is installed, else the
# compiler's own (gcc's for a gcc build: FUZZ_CC=gcc, or no clang installed).
PYTHON=${1:-.venv/bin/python}
# The compiler fuzz/build_sanitized.sh picks: clang when installed, else gcc.
CC=${FUZZ_CC:-$(command -v clang || echo gcc)}
if ! "$CC" --version 2>/dev/null | grep -q clang; then  # a gcc build needs gcc's runtime
    lib=$("$CC" -print-file-name=libasan.so) && [ -f "$lib" ] && echo "$lib" && exit 0
fi
lib=$("$PYTHON" -c 'import atheris, os; print(os.path.join(atheris.path(), "asan_with_fuzzer.so"))' 2>/dev/null)
if [ -n "$lib" ] && [ -f "$lib" ]; then echo "$lib"; exit 0; fi
for cc in clang gcc; do
    for name in libclang_rt.asan-x86_64.so libasan.so; do
        lib=$("$cc" -print-file-name="$name" 2>/dev/null)
        if [ -n "$lib" ] && [ -f "$lib" ]; then echo "$lib"; exit 0; fi
    done
done
echo "asan_runtime: no ASan runtime found (install clang or gcc's libasan)" >&2
exit 1
