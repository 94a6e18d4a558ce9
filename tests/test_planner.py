"""Rules 5 and 6 compiled (mmadmit._rules_c) against the same source interpreted.

mmadmit.rules is one source in Cython's pure-Python mode: setup.py compiles
it, and --native off runs it as Python. Its compiled build types locals as C
integers and works on int64 tables, so these tests hold the two builds to one
outcome: on valid requests of every family (generated prompts, the vectors)
and on thousands of mutated requests (bad spans, grids, seconds, hashes, pad
values, placeholders, dtypes, keys, features) the outcome, abort code and
message included, must be the same. A compiled build that overflowed a C
integer, or read a tensor of another dtype as int64, would differ here.

Run with: python -m pytest tests/test_planner.py -q
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from conftest import load_vector, native_as, vector_names
from hf_oracle import FAMILIES
from mmadmit import planner, rules, wire
from mmadmit.materializer import Materializer
from mmadmit.model import Item, Materialized, MultimodalInputs, Request, ShmHandle, Tensor
from mmadmit.profile import ModelProfile, load_profile
from prompt_gen import gen_prompt

pytestmark = pytest.mark.skipif(planner._BUILT is None, reason="mmadmit._rules_c not built")


@contextmanager
def _interpreted() -> Iterator[None]:
    with native_as(False):
        assert not planner.HAVE_NATIVE
        yield


def _both(m: Materializer, req: Request) -> tuple[object, object]:
    """The outcome with rules.py compiled, then interpreted."""
    with native_as(True):  # whatever the session's setting (MMADMIT_NATIVE)
        assert planner.HAVE_NATIVE
        a = m.run(req)
    with _interpreted():
        b = m.run(req)
    return a, b


def _request(profile: ModelProfile, family: str, seed: int) -> Request:
    prompt = gen_prompt(family, seed, hf_compatible=False)
    rng = np.random.default_rng(seed)
    for item in prompt.items:  # rule 6 inputs: a hash, or a feature to hash
        if rng.random() < 0.7:
            item.hash = int(rng.integers(0, 2**63)) * 2 + int(rng.integers(0, 2))
        else:
            item.feature = Tensor.from_numpy(rng.random((3, 4), np.float32))
    mm = MultimodalInputs(
        items=prompt.items,
        im_token_id=profile.image_token_id,
        video_token_id=profile.video_token_id,
    )
    return Request(rid=f"{family}-{seed}", input_ids=prompt.input_ids, mm=mm)


def _same(a: object, b: object) -> None:
    assert type(a) is type(b), (a, b)
    if not isinstance(a, Materialized):
        assert a == b  # Abort: code and message
        return
    assert isinstance(b, Materialized)
    ra, rb = a.request, b.request
    assert a.rule is b.rule
    assert np.array_equal(ra.input_ids, rb.input_ids)
    assert (ra.input_ids_unpadded is None) == (rb.input_ids_unpadded is None)
    if ra.input_ids_unpadded is not None:
        assert np.array_equal(ra.input_ids_unpadded, rb.input_ids_unpadded)
    assert (ra.mm is None) == (rb.mm is None)
    if ra.mm is None or rb.mm is None:
        return
    for x, y in zip(ra.mm.items, rb.mm.items, strict=True):
        assert (x.hash, x.pad_value, x.modality) == (y.hash, y.pad_value, y.modality)
        # a pad value is a Python int in both builds (an encoder refuses a numpy scalar)
        assert type(x.pad_value) in (int, type(None)), x
        assert type(y.pad_value) is type(x.pad_value), (x, y)
        assert type(x) is type(y)
        assert x.offsets is y.offsets and x.side is y.side and x.feature is y.feature
    pa, pb = ra.mm.mrope_positions, rb.mm.mrope_positions
    assert (pa is None) == (pb is None)
    if pa is not None and pb is not None:
        assert np.array_equal(pa.to_numpy(), pb.to_numpy())
    assert ra.mm.mrope_position_delta_scalar == rb.mm.mrope_position_delta_scalar


@pytest.mark.parametrize("family", FAMILIES)
def test_valid_prompts_identical_outcomes_compiled_and_interpreted(family: str) -> None:
    profile = load_profile(family)
    m = Materializer(profile)
    for seed in range(60):
        req = _request(profile, family, seed)
        a, b = _both(m, req)
        assert isinstance(a, Materialized), a
        _same(a, b)
        # rule 4 (pads set upstream, input_ids_unpadded present)
        up = a.request
        assert up.mm is not None
        up.mm.mrope_positions = up.mm.mrope_position_delta = None
        up.mm.mrope_position_delta_scalar = None
        _same(*_both(m, up))


@pytest.mark.parametrize("name", vector_names())
def test_vectors_identical_through_both_paths(name: str) -> None:
    vec = load_vector(name)
    m = Materializer(load_profile(str(vec.config)))
    req = wire.decode_message(list(vec.frames)).request
    assert req is not None
    _same(*_both(m, req))


# --------------------------------------------------------------------------- mutations


def _with_spans(rng: np.random.Generator, req: Request) -> Item | None:
    """A random item that still has an int64 [k, 2] offsets array (k >= 1)."""
    assert req.mm is not None
    ok = [
        i
        for i in req.mm.items
        if isinstance(i.offsets, np.ndarray) and i.offsets.dtype == np.int64 and len(i.offsets)
    ]
    return ok[int(rng.integers(0, len(ok)))] if ok else None


def _any_item(rng: np.random.Generator, req: Request) -> Item | None:
    assert req.mm is not None
    items = req.mm.items
    return items[int(rng.integers(0, len(items)))] if items else None


def _mutations(profile: ModelProfile) -> list[Callable[[np.random.Generator, Request], None]]:
    def span(rng: np.random.Generator, req: Request) -> None:
        item = _with_spans(rng, req)
        if item is None:
            return
        off = item.offsets.copy()
        k = int(rng.integers(0, len(off)))
        j = int(rng.integers(0, 2))
        off[k, j] += int(rng.choice([-2, -1, 1, 2, -(10**6), 10**6]))
        item.offsets = off

    def span_shape(rng: np.random.Generator, req: Request) -> None:
        item = _with_spans(rng, req)
        if item is None:
            return
        choice = int(rng.integers(0, 4))
        if choice == 0:
            item.offsets = item.offsets[:0]
        elif choice == 1:
            item.offsets = item.offsets.astype(np.int32)
        elif choice == 2:
            item.offsets = np.concatenate([item.offsets, item.offsets[:1]])
        else:
            item.offsets = None

    def overlap(rng: np.random.Generator, req: Request) -> None:
        a, b = _with_spans(rng, req), _with_spans(rng, req)
        if a is not None and b is not None and a is not b:
            a.offsets = b.offsets.copy()

    def modality(rng: np.random.Generator, req: Request) -> None:
        item = _any_item(rng, req)
        if item is None:
            return
        item.modality = int(rng.choice([0, 1, 2, 3, 4, -1]))

    def hash_(rng: np.random.Generator, req: Request) -> None:
        item = _any_item(rng, req)
        if item is None:
            return
        item.hash = rng.choice([-1, 2**64, 2**64 - 1, 0, None, True])  # type: ignore[assignment]

    def pad(rng: np.random.Generator, req: Request) -> None:
        item = _any_item(rng, req)
        if item is None:
            return
        lo = 1_000_000 + (int(rng.integers(0, 3))) * 715_494_549
        item.pad_value = int(
            rng.choice([lo, lo - 1, lo + 715_494_548, lo + 715_494_549, -5, 2**40])
        )

    def placeholder(rng: np.random.Generator, req: Request) -> None:
        item = _with_spans(rng, req)
        if item is None:
            return
        a, b = item.offsets[int(rng.integers(0, len(item.offsets)))]
        ids = req.input_ids.copy()
        ids[int(rng.integers(a, b + 1))] = int(rng.integers(0, 100))
        req.input_ids = ids

    def override(rng: np.random.Generator, req: Request) -> None:
        mm = req.mm
        assert mm is not None
        if rng.random() < 0.5:
            mm.im_token_id = int(rng.choice([mm.im_token_id or 0, 5, profile.video_token_id]))
        else:
            mm.video_token_id = int(rng.choice([mm.video_token_id or 0, 7]))

    def grid(rng: np.random.Generator, req: Request) -> None:
        items = [
            i
            for i in req.mm.items
            if "image_grid_thw" in i.side or "video_grid_thw" in i.side  # type: ignore[union-attr]
        ]
        if not items:
            return
        item = items[int(rng.integers(0, len(items)))]
        key = "image_grid_thw" if "image_grid_thw" in item.side else "video_grid_thw"
        g = item.side[key].to_numpy().copy()
        choice = int(rng.integers(0, 6))
        if choice == 0:
            g.reshape(-1)[int(rng.integers(0, g.size))] += int(rng.choice([-2, -1, 1, 2]))
        elif choice == 1:
            g.reshape(-1)[int(rng.integers(0, g.size))] = int(rng.choice([0, -4, 2**40]))
        elif choice == 2:
            g = g.astype(rng.choice([np.int32, np.int16, np.float32, np.uint8]))
        elif choice == 3:
            g = g.reshape(-1)[:3] if g.shape[0] == 1 else g[:1]
        elif choice == 4:
            g = g.reshape(-1)[: max(1, g.size - 1)]
        else:
            g = np.concatenate([g, g[:1]])
        item.side = dict(item.side, **{key: Tensor.from_numpy(np.ascontiguousarray(g))})

    def seconds(rng: np.random.Generator, req: Request) -> None:
        videos = [i for i in req.mm.items if i.modality == 2]  # type: ignore[union-attr]
        if not videos:
            return
        item = videos[int(rng.integers(0, len(videos)))]
        key = str(rng.choice(["second_per_grid_ts", "video_second_per_grid"]))
        rows = item.side["video_grid_thw"].shape[0] if "video_grid_thw" in item.side else 1
        value = rng.choice([np.nan, -1.0, 0.0, 0.5, 3.25, 1e7, np.inf])
        count = int(rng.choice([1, rows, rows + 1]))
        dtype = rng.choice([np.float32, np.float32, np.float64, np.int64, np.float16])
        with np.errstate(over="ignore", invalid="ignore"):  # 1e7 as float16 is inf: fine
            arr = np.full(count, value if dtype is not np.int64 else 2, dtype)
        item.side = dict(item.side, **{key: Tensor.from_numpy(arr)})

    def keys(rng: np.random.Generator, req: Request) -> None:
        item = _any_item(rng, req)
        if item is None:
            return
        side = dict(item.side)
        choice = int(rng.integers(0, 4))
        if choice == 0 and side:
            side.pop(str(rng.choice(sorted(side))))
        elif choice == 1:
            side["image_grid_thw"] = Tensor.from_numpy(np.array([[1, 2, 2]], np.int64))
        elif choice == 2:
            side["video_grid_thw"] = Tensor.from_numpy(np.array([[1, 2, 2]], np.int64))
        else:
            side["use_audio_in_video"] = rng.choice([True, False])  # type: ignore[assignment]
        item.side = side

    def feature(rng: np.random.Generator, req: Request) -> None:
        item = _any_item(rng, req)
        if item is None:
            return
        choice = int(rng.integers(0, 4))
        item.hash = None
        if choice == 0:
            item.feature = None
        elif choice == 1:
            # a dtype numpy lacks (a byte length mismatch cannot be built)
            item.feature = Tensor("bfloat16", (2, 3), bytes(12))
        elif choice == 2:
            item.feature = None
            item.feature_shm = ShmHandle(name="seg", shape=(2, 3), dtype="float32")
        else:
            item.feature = Tensor.from_numpy(np.zeros((1,) * 9, np.float32))  # rank 9

    return [
        span,
        span_shape,
        overlap,
        modality,
        hash_,
        pad,
        placeholder,
        override,
        grid,
        seconds,
        keys,
        feature,
    ]


def _deep(req: Request) -> Request:
    """A copy whose items can be mutated without touching ``req``."""
    mm = req.mm
    assert mm is not None
    items = []
    for item in mm.items:
        twin = copy.copy(item)
        twin.side = dict(item.side)
        items.append(twin)
    return Request(
        req.rid, req.input_ids, None, MultimodalInputs(items, mm.im_token_id, mm.video_token_id)
    )


@pytest.mark.parametrize("family", ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_omni_moe"))
def test_mutated_requests_identical_compiled_and_interpreted(family: str) -> None:
    profile = load_profile(family)
    m = Materializer(profile)
    mutations = _mutations(profile)
    rng = np.random.default_rng(2026)
    aborted = materialized = 0
    for seed in range(120):
        base = _request(profile, family, seed)
        for _ in range(6):
            req = _deep(base)
            for _ in range(int(rng.integers(1, 3))):
                mutations[int(rng.integers(0, len(mutations)))](rng, req)
            a, b = _both(m, req)
            _same(a, b)
            aborted += not isinstance(b, Materialized)
            materialized += isinstance(b, Materialized)
    assert aborted > 200 and materialized > 50, (aborted, materialized)


def test_huge_grid_values_refused_alike() -> None:
    """Grid values whose products overflow int64 (and uint64 values beyond it) are
    refused with the exact numbers in both builds: C integers never wrap."""
    profile = load_profile("qwen3_omni_moe")
    m = Materializer(profile)
    candidates = [_request(profile, "qwen3_omni_moe", seed) for seed in range(20)]
    for grid in (
        np.array([[2**31, 2**31, 2**31]], np.int64),
        np.array([[1, 2**62, 2**62]], np.int64),
        np.array([[2**63 - 1, 2, 2]], np.int64),
        np.array([[2**64 - 2, 2, 2]], np.uint64),
        np.array([[1, 2**63, 2]], np.uint64),
    ):
        req = next(r for r in candidates if any(i.modality == 2 for i in r.mm.items))  # type: ignore[union-attr]
        req = _deep(req)
        assert req.mm is not None
        video = next(i for i in req.mm.items if i.modality == 2)
        video.side = dict(video.side, video_grid_thw=Tensor.from_numpy(grid))
        a, b = _both(m, req)
        _same(a, b)
        assert not isinstance(a, Materialized) and str(int(grid.max())) in str(a), a


def test_the_vocabulary_refusal_names_the_first_id_outside() -> None:
    """Rule 1's vocabulary check (rules.first_outside) names the first id outside
    [0, vocab), whatever precedes or follows it; vocab - 1 and 0 are inside, every
    negative id (INT64_MIN too) outside."""
    profile = load_profile("qwen3_5")
    m = Materializer(profile)
    vocab = profile.vocab_size
    rng = np.random.default_rng(3)
    for _ in range(200):
        n = int(rng.integers(1, 3000))
        ids = rng.integers(0, 1000, n).astype(np.int64)
        ids[int(rng.integers(0, n))] = int(rng.choice([0, vocab - 1]))
        bad_at = sorted({int(x) for x in rng.integers(0, n, int(rng.integers(0, 3)))})
        for i in bad_at:
            ids[i] = int(rng.choice([-1, vocab, vocab + 5000, -(2**62), -(2**63), 2**63 - 1]))
        got = m.run(Request(rid="v", input_ids=ids))
        if not bad_at:
            assert isinstance(got, Materialized), got
            continue
        assert not isinstance(got, Materialized)
        i = bad_at[0]
        assert f"input_ids[{i}] = {int(ids[i])} is outside the vocabulary [0, {vocab})" in str(
            got
        ), got


@pytest.mark.parametrize("vocab", [100, 0, 1, 2**63 - 1])
def test_first_outside_compiled_and_interpreted_agree(vocab: int) -> None:
    """rules.first_outside in every build: the first index outside [0, vocab) or -1,
    on random ids (short ones, and long enough for the vector loop and its tail)
    with edge values planted anywhere, read-only arrays, an empty vocabulary, and
    the largest one (where ``vocab - 1 - id`` wraps only for a negative id)."""
    rng = np.random.default_rng(35)
    top = vocab - 1 if vocab > 100 else 99
    edges = [0, 1, 99, 100, 101, -1, -(2**63), 2**63 - 1, top, top - 1]
    builds = [rules, *planner.COMPILED.values()]
    for _ in range(300):
        n = int(rng.integers(0, 40)) if rng.integers(0, 2) else int(rng.integers(40, 300))
        ids = rng.integers(0, 100, n).astype(np.int64)
        for at in rng.integers(0, max(len(ids), 1), int(rng.integers(0, 3))):
            if len(ids):
                ids[int(at)] = int(rng.choice(edges))
        ids.flags.writeable = bool(rng.integers(0, 2))
        outside = np.flatnonzero((ids < 0) | (ids >= vocab))
        want = int(outside[0]) if outside.size else -1
        for build in builds:
            assert build.first_outside(ids, vocab) == want, (build.__name__, ids, vocab)


def test_the_avx2_build_runs_only_on_a_cpu_that_lists_avx2(tmp_path: Path) -> None:
    """planner reads the CPU's flags and prefers ``_rules_avx2`` only where they list
    ``avx2`` (it is never imported elsewhere: its code may use AVX2 anywhere);
    ``_rules_c`` runs on every CPU; no flags file means the baseline build."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 bmi2\n\nprocessor\t: 1\n")
    assert planner._cpu_flags(str(cpuinfo)) >= {"sse2", "avx2"}
    assert planner._cpu_flags(str(tmp_path / "missing")) == frozenset()
    plain = planner._runnable(frozenset({"sse2"}))
    assert list(plain) == ["_rules_c"]
    wide = planner._runnable(frozenset({"sse2", "avx2"}))
    if any(Path(rules.__file__).parent.glob("_rules_avx2*")):  # setup.py on x86-64
        assert list(wide) == ["_rules_avx2", "_rules_c"]
        assert wide["_rules_avx2"].first_outside(np.arange(5, dtype=np.int64), 4) == 4
    else:
        assert list(wide) == ["_rules_c"]
    # the process picked the first build its own CPU runs
    assert planner._BUILT is next(iter(planner._runnable(planner._cpu_flags()).values()))


def test_new_items_are_copies_and_inputs_untouched() -> None:
    profile = load_profile("qwen3_omni_moe")
    req = _request(profile, "qwen3_omni_moe", 4)
    items = list(req.mm.items)  # type: ignore[union-attr]
    before = [(i.hash, i.pad_value) for i in items]
    out = Materializer(profile).run(req)
    assert isinstance(out, Materialized)
    assert [(i.hash, i.pad_value) for i in items] == before  # the request is not modified
    new = out.request.mm.items  # type: ignore[union-attr]
    assert all(type(i) is Item for i in new)
    assert all(a is not b for a, b in zip(items, new, strict=True) if a.pad_value is None)
    assert all(i.pad_value is not None for i in new)
