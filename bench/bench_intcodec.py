"""msgpack int-array codec benchmark (mmadmit.intcodec). Not a test.

    python bench/bench_intcodec.py [--n 131072] [--repeat 31]

Prints the median time to decode and to encode N token ids (realistic ids:
mostly uint16/uint32 forms, a few fixints) with the compiled walker
(``mmadmit._walk_c``, Cython's build of ``msgpack_walk.py``), the same source
interpreted (what ``--native off`` runs; median of 3 runs), msgpack-python and
msgspec (both of which build one Python int per element; "msgpack + np.array"
is what the codec replaces).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import msgpack
import msgspec
import numpy as np
from mmadmit import intcodec, msgpack_walk

INTERPRETED_REPEAT = 3  # the interpreted walker takes 0.1-0.2 s per 128K ids


def median_ms(fn: Callable[[], object], repeat: int) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=131072, help="ids per array (default 128K)")
    parser.add_argument("--repeat", type=int, default=31, help="timed runs per case")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 152064, size=args.n, dtype=np.int64)  # a Qwen-sized vocabulary
    ids[rng.integers(0, args.n, size=args.n // 20)] = rng.integers(0, 128, size=args.n // 20)
    raw = msgpack.packb(ids.tolist())
    as_list = ids.tolist()
    list_decoder = msgspec.msgpack.Decoder(list[int])
    assert msgpack_walk.encode(ids) == raw
    assert np.array_equal(msgpack_walk.decode(memoryview(raw)), ids)

    decode: list[tuple[str, Callable[[], object]]] = []
    encode: list[tuple[str, Callable[[], object]]] = []
    built = intcodec._BUILT
    if built is not None:
        assert built.encode(ids) == raw
        decode.append(("compiled walker", lambda: built.decode(memoryview(raw))))
        encode.append(("compiled walker", lambda: built.encode(ids)))
    decode += [
        ("interpreted walker", lambda: msgpack_walk.decode(memoryview(raw))),
        ("msgpack.unpackb + np.array", lambda: np.array(msgpack.unpackb(raw), dtype=np.int64)),
        ("msgpack.unpackb (list only)", lambda: msgpack.unpackb(raw)),
        ("msgspec list[int] (list only)", lambda: list_decoder.decode(raw)),
    ]
    encode += [
        ("interpreted walker", lambda: msgpack_walk.encode(ids)),
        ("msgpack.packb(arr.tolist())", lambda: msgpack.packb(ids.tolist())),
        ("msgspec encode(arr.tolist())", lambda: msgspec.msgpack.encode(ids.tolist())),
        ("msgpack.packb(list) (list given)", lambda: msgpack.packb(as_list)),
    ]

    print(
        f"{args.n} ids, {len(raw)} bytes, median of {args.repeat}; "
        f"compiled walker (_walk_c): {'built' if built is not None else 'NOT built'}\n"
    )
    for title, cases in (("decode (msgpack -> int64 ndarray)", decode),
                         ("encode (int64 ndarray -> msgpack)", encode)):  # fmt: skip
        print(f"| {title} | ms |\n|---|---:|")
        for name, fn in cases:
            repeat = INTERPRETED_REPEAT if name.startswith("interpreted") else args.repeat
            print(f"| {name} | {median_ms(fn, repeat):.3f} |")
        print()


if __name__ == "__main__":
    main()
