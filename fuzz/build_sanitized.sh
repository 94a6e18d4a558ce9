#!/bin/sh
# Build the four C extensions with AddressSanitizer and UndefinedBehaviorSanitizer
# into build/fuzz/mmadmit/ (never over the regular build in service/mmadmit/).
# fuzz/run.py loads them from there when MMADMIT_FUZZ_EXT_DIR names that folder
# (make fuzz does), under LD_PRELOAD of the ASan runtime (see RELIABILITY.md).
#
#   FUZZ_CC  compiler (default clang when installed, else gcc: ASan/UBSan without coverage)
#   PYTHON   the interpreter the extensions are for (default .venv/bin/python)
#   OUT      output folder (default build/fuzz/mmadmit)
set -eu
CC=${FUZZ_CC:-$(command -v clang || echo gcc)}
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-build/fuzz/mmadmit}
INCLUDE=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
SUFFIX=$("$PYTHON" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
FLAGS="-shared -fPIC -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined"
# UB is an error, not a warning; pointer overflow and float->int casts included.
FLAGS="$FLAGS -fno-sanitize-recover=all -fsanitize=float-cast-overflow,pointer-overflow"
FLAGS="$FLAGS -Wall -Wextra -Wno-unused-parameter -Wno-missing-field-initializers"
if "$CC" --version 2>/dev/null | grep -q clang; then
    FLAGS="$FLAGS -fsanitize=fuzzer-no-link"  # libFuzzer coverage for atheris
fi
mkdir -p "$OUT"
for ext in _intcodec _pbwire _planner _kernels; do
    echo "$CC [asan,ubsan] service/mmadmit/$ext.c -> $OUT/$ext$SUFFIX"
    # shellcheck disable=SC2086
    "$CC" $FLAGS -I"$INCLUDE" -Iservice/mmadmit "service/mmadmit/$ext.c" -o "$OUT/$ext$SUFFIX"
done
