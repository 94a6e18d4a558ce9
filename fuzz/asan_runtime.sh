#!/bin/sh
# The ASan runtime to LD_PRELOAD into Python for the sanitizer build: atheris'
# (ASan + libFuzzer in one) when it is installed, else the compiler's own
# (gcc's with FUZZ_CC=gcc).
PYTHON=${1:-.venv/bin/python}
if [ "${FUZZ_CC:-}" = gcc ]; then  # a gcc build needs gcc's runtime (and the mutate engine)
    lib=$(gcc -print-file-name=libasan.so) && [ -f "$lib" ] && echo "$lib" && exit 0
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
