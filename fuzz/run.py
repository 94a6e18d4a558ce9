"""Run one fuzz target: ``python fuzz/run.py TARGET [options]`` (RELIABILITY.md).

Engines: ``atheris`` (coverage-guided libFuzzer; ``pip install -e '.[fuzz]'``)
or ``mutate`` (fuzz/mutator.py: no coverage, no extra dependency; what the
test suite's smoke run uses). ``auto`` picks atheris when it is installed.

Seeds come from ``fuzz/corpus/TARGET/`` (kept in the repository); atheris
writes the inputs it finds into ``build/fuzz/corpus/TARGET/`` (not the
repository) and crash / divergence inputs into ``build/fuzz/artifacts/``.
With ``MMADMIT_FUZZ_EXT_DIR`` set (``make fuzz`` sets it after ``make
fuzz-build``) the sanitizer builds of the extensions in that folder are
loaded instead of the regular ones; run under ``LD_PRELOAD`` of the ASan
runtime (the Makefile does).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# msgpack_walk.py, rules.py, tensorcheck.py and pbwalk.py compiled by Cython
EXTENSIONS = ("_walk_c", "_rules_c", "_tensorcheck_c", "_pbwalk_c")
# setup.py's ISA_VARIANTS: built on x86-64 only; where the sanitizer build has
# none, the regular one is kept from being imported (planner then runs _rules_c)
VARIANTS = ("_rules_avx2",)


def load_sanitized(folder: str) -> list[str]:
    """Import ``mmadmit.<ext>`` from ``folder`` before anything imports the regular ones."""
    import mmadmit  # the package only: no submodule has imported an extension yet

    loaded = []
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for ext in EXTENSIONS + VARIANTS:
        path = Path(folder) / f"{ext}{suffix}"
        if ext in VARIANTS and not path.is_file():
            sys.modules[f"mmadmit.{ext}"] = None  # type: ignore[assignment]  # ImportError
            continue
        if not path.is_file():
            raise SystemExit(f"fuzz: {path} missing (make fuzz-build)")
        name = f"mmadmit.{ext}"
        loader = importlib.machinery.ExtensionFileLoader(name, str(path))
        spec = importlib.util.spec_from_file_location(name, path, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        sys.modules[name] = module
        setattr(mmadmit, ext, module)
        loaded.append(str(path))
    return loaded


def seeds(target: str) -> list[bytes]:
    folder = ROOT / "fuzz" / "corpus" / target
    return [p.read_bytes() for p in sorted(folder.iterdir())] if folder.is_dir() else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--engine", choices=("auto", "atheris", "mutate"), default="auto")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--instrument", action="store_true",
                        help="atheris: also instrument mmadmit's Python code (slower)")  # fmt: skip
    parser.add_argument("libfuzzer_args", nargs="*", help="passed on to libFuzzer")
    args = parser.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    ext_dir = os.environ.get("MMADMIT_FUZZ_EXT_DIR")
    if ext_dir:
        for path in load_sanitized(ext_dir):
            print(f"fuzz: sanitizer build {path}", file=sys.stderr)
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if importlib.util.find_spec("atheris") else "mutate"
    if engine == "atheris":
        import atheris

        if args.instrument:
            with atheris.instrument_imports(include=["mmadmit"]):
                module = importlib.import_module(f"fuzz.targets.{args.target}_target")
        else:
            module = importlib.import_module(f"fuzz.targets.{args.target}_target")
        work = ROOT / "build" / "fuzz" / "corpus" / args.target
        artifacts = ROOT / "build" / "fuzz" / "artifacts"
        work.mkdir(parents=True, exist_ok=True)
        artifacts.mkdir(parents=True, exist_ok=True)
        lf = [
            sys.argv[0],
            str(work),
            str(ROOT / "fuzz" / "corpus" / args.target),
            f"-max_total_time={int(args.seconds)}",
            f"-artifact_prefix={artifacts}/{args.target}-",
            f"-max_len={getattr(module, 'MAX_LEN', 4096)}",
            f"-seed={args.seed}" if args.seed else "-seed=0",
            "-print_final_stats=1",
            *([f"-runs={args.runs}"] if args.runs is not None else []),
            *args.libfuzzer_args,
        ]
        atheris.Setup(lf, module.one)
        atheris.Fuzz()  # exits the process
        return 0
    from fuzz.mutator import fuzz

    module = importlib.import_module(f"fuzz.targets.{args.target}_target")
    artifacts = ROOT / "build" / "fuzz" / "artifacts"

    def save(data: bytes, i: int) -> None:
        artifacts.mkdir(parents=True, exist_ok=True)
        path = artifacts / f"{args.target}-mutate-seed{args.seed}-{i}"
        path.write_bytes(data)
        print(f"fuzz: failing input written to {path}", file=sys.stderr)

    import time

    t0 = time.monotonic()
    n = fuzz(
        module.one,
        seeds(args.target),
        runs=args.runs,
        seconds=None if args.runs is not None else args.seconds,
        seed=args.seed,
        max_len=getattr(module, "MAX_LEN", 4096),
        on_failure=save,
    )
    dt = time.monotonic() - t0
    print(f"fuzz: {args.target}: {n} runs in {dt:.1f} s ({n / max(dt, 1e-9):.0f}/s), no failure")
    return 0


if __name__ == "__main__":
    sys.exit(main())
