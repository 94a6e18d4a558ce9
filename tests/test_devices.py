"""The CUDA code path's array work, checked through the same interfaces on CPU.

``TorchArrayOps`` is what each CUDA worker runs on its own stream. Here it runs
with the ``HostStream`` stand-in on the CPU device and must be bit-identical
to the numpy ops on every vector and on generated prompts. The ``cuda`` cases
run the real streams and skip without a device.

Run with: python -m pytest tests/test_devices.py -q
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_vector, vector_names
from mmadmit import wire
from mmadmit.devices import HostStream, TorchArrayOps, resolve_device
from mmadmit.errors import ConfigError
from mmadmit.materializer import CPU_OPS, Materializer
from mmadmit.model import Materialized
from mmadmit.profile import load_profile

torch = pytest.importorskip("torch")

HAS_CUDA = torch.cuda.is_available()


def _outcomes(ops, name: str):
    vec = load_vector(name)
    mat = Materializer(load_profile(str(vec.config)))
    req = wire.decode_message(list(vec.frames)).request
    return mat.run(req, CPU_OPS), mat.run(req, ops)


def _same(a, b) -> None:
    assert type(a) is type(b)
    if not isinstance(a, Materialized):
        assert a == b
        return
    ra, rb = a.request, b.request
    assert np.array_equal(ra.input_ids, rb.input_ids) and ra.input_ids.dtype == rb.input_ids.dtype
    if ra.mm is not None:
        pa, pb = ra.mm.mrope_positions, rb.mm.mrope_positions
        assert (pa is None) == (pb is None)
        if pa is not None:
            assert np.array_equal(pa.to_numpy(), pb.to_numpy())
            assert pa.dtype == pb.dtype and pa.shape == pb.shape
        assert ra.mm.mrope_position_delta_scalar == rb.mm.mrope_position_delta_scalar
        assert [i.pad_value for i in ra.mm.items] == [i.pad_value for i in rb.mm.items]


@pytest.mark.parametrize("name", vector_names())
def test_torch_ops_on_host_stream_match_numpy_on_every_vector(name: str) -> None:
    _same(*_outcomes(TorchArrayOps("cpu", HostStream()), name))


def test_torch_ops_match_numpy_on_generated_prompts() -> None:
    from mmadmit import rules
    from prompt_gen import gen_prompt  # the oracle tests' seeded prompt generator

    ops = TorchArrayOps("cpu")
    for family in ("qwen2_vl", "qwen2_5_vl", "qwen3_5", "qwen3_omni_moe"):
        profile = load_profile(family)
        for seed in range(20):
            prompt = gen_prompt(family, seed, hf_compatible=False)
            plan = rules.plan_runs(profile, prompt.items)
            n = len(prompt.input_ids)
            a, da = CPU_OPS.positions(n, plan)
            b, db = ops.positions(n, plan)
            assert np.array_equal(a, b) and da == db, (family, seed)


def test_substitute_identical_and_input_untouched() -> None:
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, 4096)
    before = ids.copy()
    for n_spans in (3, 300):  # slice fills and the difference-array path
        starts = np.sort(rng.choice(np.arange(0, 4000, 13), n_spans, replace=False))
        stops = starts + rng.integers(1, 13, n_spans)
        values = rng.integers(10**6, 2 * 10**6, n_spans)
        got = TorchArrayOps("cpu").substitute(ids, starts, stops, values)
        want = ids.copy()
        for a, b, v in zip(starts, stops, values, strict=True):
            want[a:b] = v
        assert np.array_equal(got, want)
        assert np.array_equal(CPU_OPS.substitute(ids, starts, stops, values), want)
        assert np.array_equal(ids, before)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("auto") == ("cuda" if HAS_CUDA else "cpu")
    if not HAS_CUDA:
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("name", vector_names())
def test_cuda_stream_ops_bit_identical_on_every_vector(name: str) -> None:
    from mmadmit.devices import cuda_ops_factory

    ops = cuda_ops_factory()(0)
    _same(*_outcomes(ops, name))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_cuda_pool_workers_own_streams() -> None:
    from mmadmit.devices import cuda_ops_factory

    make = cuda_ops_factory()
    a, b = make(0), make(1)
    assert a.stream.stream != b.stream.stream  # type: ignore[attr-defined]
