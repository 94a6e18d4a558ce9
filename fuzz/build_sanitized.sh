#!/bin/sh
# Build the C that Cython generates from the pure-Python modules setup.py compiles
# (CYTHON_MODULES: msgpack_walk.py -> _walk_c, rules.py -> _rules_c, tensorcheck.py ->
# _tensorcheck_c, pbwalk.py -> _pbwalk_c), with
# AddressSanitizer and UndefinedBehaviorSanitizer into build/fuzz/mmadmit/
# (never over the regular build in service/mmadmit/).
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
# The modules in setup.py's CYTHON_MODULES (read from the file: importing
# setup.py would run setup()): Cython's C for each, in build/fuzz/cython/.
CYDIR=$(dirname "$OUT")/cython
mkdir -p "$CYDIR"
# On x86-64 also ISA_VARIANTS (name, source, flag): the same C with one more flag.
"$PYTHON" -c '
import ast, platform
x86_64 = platform.machine().lower() in ("x86_64", "amd64")
for node in ast.parse(open("setup.py").read()).body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "CYTHON_MODULES":
        for name, source in ast.literal_eval(node.value):
            print(name, source)
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "ISA_VARIANTS":
        for name, source, flag in ast.literal_eval(node.value) if x86_64 else []:
            print(name, source, flag)
' > "$CYDIR/modules.txt"
while read -r name source flag; do
    ext=${name##*.}
    echo "cython $source -> $CYDIR/$ext.c; $CC [asan,ubsan] ${flag:-} -> $OUT/$ext$SUFFIX"
    "$PYTHON" -m cython -3 --module-name "$name" "$source" -o "$CYDIR/$ext.c"
    # shellcheck disable=SC2086
    "$CC" $FLAGS ${flag:-} -Wno-unused-function -I"$INCLUDE" "$CYDIR/$ext.c" -o "$OUT/$ext$SUFFIX"
done < "$CYDIR/modules.txt"
