"""``mmadmit.model.Tensor`` cannot be built inconsistent (issue 17 item 3).

Dtype, shape, byte length and, when given, the limits are checked once, when
the tensor is built, and a built tensor cannot be changed; every limit breach
is worded by :mod:`mmadmit.limits` (the messages here are compared with what
its functions say). The transports build every received tensor this way:
``test_wire.py``, ``test_limits.py`` and ``test_grpc_api.py`` hold them to it
over the ZMQ and gRPC wires. The checks are :mod:`mmadmit.tensorcheck`, compiled
unless native code is off: every test runs both ways, and the two builds give the
same outcome, message included, on random and mutated tensors.

Run with: python -m pytest tests/test_tensor.py -q
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest
from mmadmit import limits as lim
from mmadmit import model, tensorcheck
from mmadmit.dtypes import parse_dtype
from mmadmit.errors import AbortCode, InvalidRequest, TooLarge
from mmadmit.limits import DEFAULT_LIMITS, Limits
from mmadmit.model import Tensor
from mmadmit.tensorcheck import TensorName

F32 = parse_dtype("float32")
NAME = TensorName(3, "feature")

pytestmark = pytest.mark.usefixtures("native_mode")


def test_a_consistent_tensor_is_a_view_on_its_buffer() -> None:
    buf = bytearray(24)
    t = Tensor("float32", [2, 3], buf, NAME, DEFAULT_LIMITS)
    assert t.dtype is F32 and t.shape == (2, 3) and t.nbytes == 24
    buf[0] = 1
    assert t.data[0] == 1  # no copy
    assert Tensor(F32, (), bytes(4)).shape == ()  # a scalar
    assert Tensor(F32, (0, 5), b"").nbytes == 0  # empty


@pytest.mark.parametrize(
    ("shape", "nbytes"), [((2, 3), 23), ((2, 3), 25), ((0,), 4), ((), 0), ((4,), 0)]
)
def test_wrong_byte_length_is_invalid_request(shape: tuple[int, ...], nbytes: int) -> None:
    with pytest.raises(InvalidRequest) as info:
        Tensor(F32, shape, bytes(nbytes), NAME)
    need = int(np.prod(shape)) * 4
    assert info.value.code is AbortCode.INVALID_REQUEST
    assert info.value.message == (
        f"item 3 feature: {nbytes} data bytes but shape {list(shape)} of float32 needs {need}"
    )


@pytest.mark.parametrize(
    "shape", [(-1, 2), (2, True), (2.0, 1), ("2",), (None,), "23", 6, {2: 3}, ((2,), 3)]
)
def test_bad_shape_is_invalid_request(shape: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        Tensor(F32, shape, bytes(24), NAME)
    assert info.value.code is AbortCode.INVALID_REQUEST
    got = list(shape) if isinstance(shape, (list, tuple)) else shape
    want = f"item 3 feature: shape must be a list of non-negative ints, got {got!r}"
    assert info.value.message == want


@pytest.mark.parametrize("dtype", ["float33", "", 5, None, ",loat16", "complex64"])
def test_bad_dtype_is_invalid_request_naming_the_tensor(dtype: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        Tensor(dtype, (1,), bytes(4), NAME)
    assert info.value.message.startswith("item 3 feature: ")
    assert "dtype" in info.value.message


def test_data_must_be_contiguous_bytes() -> None:
    strided = memoryview(bytes(48))[::2]
    with pytest.raises(InvalidRequest, match="C-contiguous"):
        Tensor(F32, (6,), strided, NAME)
    # a typed buffer is taken as its bytes
    arr = np.arange(6, dtype=np.float32)
    assert bytes(Tensor(F32, (2, 3), arr.data).data) == arr.tobytes()
    with pytest.raises(InvalidRequest, match="C-contiguous"):
        Tensor(F32, (3,), np.arange(6, dtype=np.float32)[::2].data)


CASES = [
    # (limits at the limit, one past it, shape, the limits.py wording of the breach)
    (Limits(max_tensor_rank=3), Limits(max_tensor_rank=2), (1, 2, 3), "rank"),
    (Limits(max_tensor_dim=7), Limits(max_tensor_dim=6), (7, 1), "dim"),
    (Limits(max_tensor_bytes=7 * 4), Limits(max_tensor_bytes=7 * 4 - 1), (7,), "bytes"),
]


@pytest.mark.parametrize(("at", "past", "shape", "which"), CASES)
def test_limits_at_the_limit_and_one_past(
    at: Limits, past: Limits, shape: tuple[int, ...], which: str
) -> None:
    data = bytes(int(np.prod(shape)) * 4)
    assert Tensor(F32, shape, data, NAME, at).shape == shape
    with pytest.raises(TooLarge) as info:
        Tensor(F32, shape, data, NAME, past)
    assert info.value.code is AbortCode.TOO_LARGE
    if which == "bytes":
        want = lim.tensor_bytes_over(NAME, shape, "float32", len(data), past.max_tensor_bytes)
    else:
        with pytest.raises(TooLarge) as worded:
            lim.check_shape(NAME, shape, past)
        want = worded.value
    assert info.value.message == want.message
    flag = {"rank": "--max-tensor-rank", "dim": "--max-tensor-dim", "bytes": "--max-tensor-bytes"}
    assert info.value.message.startswith("item 3 feature: ") and flag[which] in info.value.message
    Tensor(F32, shape, data, NAME)  # no limits given: only consistency


def test_limits_are_decided_from_the_shape_before_the_bytes() -> None:
    """4 TiB promised over 8 bytes: TOO_LARGE (the shape), not a byte mismatch."""
    with pytest.raises(TooLarge, match="--max-tensor-bytes"):
        Tensor(F32, (2**20, 2**20), bytes(8), NAME, DEFAULT_LIMITS)
    with pytest.raises(TooLarge, match="--max-tensor-dim"):
        Tensor(F32, (2**62 + 1,), bytes(4), NAME, DEFAULT_LIMITS)


def test_a_tensor_cannot_be_changed() -> None:
    t = Tensor.from_numpy(np.zeros((2, 3), np.float32))
    for key, value in (("shape", (3, 2)), ("data", memoryview(b"")), ("dtype", F32), ("x", 1)):
        with pytest.raises(AttributeError):
            setattr(t, key, value)
    with pytest.raises(AttributeError):
        del t.shape
    assert t.shape == (2, 3) and t.nbytes == 24


def test_equality_is_identity() -> None:
    a = Tensor.from_numpy(np.zeros(3, np.int64))
    b = Tensor.from_numpy(np.zeros(3, np.int64))
    assert a == a and a != b and {"k": a} != {"k": b}
    assert "int64" in repr(a) and "24 bytes" in repr(a)


def test_numpy_constructors_are_consistent() -> None:
    arr = np.arange(12, dtype=">i4").reshape(3, 4)  # big-endian: made little-endian
    t = Tensor.from_numpy(arr)
    assert t.dtype.name == "int32" and t.shape == (3, 4)
    np.testing.assert_array_equal(t.to_numpy(), arr)
    t = Tensor.of_int64(np.arange(6, dtype=np.int64).reshape(2, 3)[:, ::2])  # not contiguous
    assert t.shape == (2, 2) and t.to_numpy().tolist() == [[0, 2], [3, 5]]
    t = Tensor.from_numpy(np.array([True, False]))
    assert t.dtype.name == "bool" and t.nbytes == 2


def _random_tensor_args(rng: random.Random) -> tuple[Any, ...]:
    """Constructor arguments, mostly near-valid: a dtype (name, DType, junk), a shape
    (list, tuple, junk dims), data (bytes, views of every kind), a name, limits."""
    dtype = rng.choice(["float32", "int64", "bfloat16", "uint8", "bool", F32, parse_dtype("int8"),
                        "float33", "", 5, None, b"float32", "<f4", "i8"])  # fmt: skip
    dims = [rng.choice([0, 1, 2, 3, 4, 7, 2**31, 2**62 + 1, -1, True, 2.0, "2", None])
            for _ in range(rng.choice([0, 1, 1, 2, 2, 3, 5]))]  # fmt: skip
    shape: Any = rng.choice([dims, tuple(dims), tuple(dims), "23", 6, {2: 3}])
    size = rng.choice([0, 1, 2, 4, 6, 8, 12, 16, 24, 48])
    kind = rng.randrange(6)
    data: Any
    if kind == 0:
        data = bytes(size)
    elif kind == 1:
        data = bytearray(size)
    elif kind == 2:
        data = memoryview(bytes(2 * size))[::2]  # strided
    elif kind == 3:
        data = np.zeros(max(1, size // 4), np.float32).data  # format "f"
    elif kind == 4:
        data = memoryview(bytes(size)).cast("B", (1, size)) if size else memoryview(b"")
    else:
        data = memoryview(bytes(size))
    name = rng.choice([NAME, (5, "image_grid_thw"), "mrope_positions", (None, "delta")])
    limits = rng.choice([None, DEFAULT_LIMITS, Limits(max_tensor_rank=2),
                         Limits(max_tensor_dim=3), Limits(max_tensor_bytes=10)])  # fmt: skip
    return dtype, shape, data, name, limits


def _consistent_or_mutated(rng: random.Random) -> tuple[Any, ...]:
    """A consistent tensor's arguments (dims of 0-7, its exact bytes in some buffer),
    with one of them replaced by a random one a third of the time."""
    dtype = rng.choice(["float32", "int64", "uint8", "bfloat16", F32, parse_dtype("int16")])
    itemsize = parse_dtype(dtype).itemsize if isinstance(dtype, str) else dtype.itemsize
    dims = [rng.randrange(8) for _ in range(rng.randrange(4))]
    size = itemsize * int(np.prod(dims))
    data: Any = rng.choice([bytes(size), bytearray(size), memoryview(bytes(size))])
    if size % 4 == 0 and size and rng.random() < 0.3:
        data = np.zeros(size // 4, np.int32).data  # a typed view: taken as its bytes
    args = [dtype, rng.choice([dims, tuple(dims)]), data, NAME, rng.choice([None, DEFAULT_LIMITS])]
    if rng.random() < 1 / 3:
        k = rng.randrange(5)
        args[k] = _random_tensor_args(rng)[k]
    return tuple(args)


def _outcome(args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        t = Tensor(*args)
    except (InvalidRequest, TooLarge) as exc:
        return ("refused", type(exc).__name__, exc.code, exc.message)
    return ("built", t.dtype, t.shape, bytes(t.data), t.data.format, t.data.ndim, t.name)


def test_compiled_and_interpreted_checks_agree() -> None:
    """tensorcheck compiled (``_tensorcheck_c``) and interpreted: the same tensor or the
    same refusal on 3,000 argument sets, random or consistent and then mutated."""
    if model._BUILT is None:
        pytest.skip("_tensorcheck_c not built: the interpreted checks are the only ones")
    rng = random.Random(3)
    refused = 0
    saved = model._check
    try:
        for _ in range(3000):
            args = _random_tensor_args(rng) if rng.random() < 0.5 else _consistent_or_mutated(rng)
            model._route_checks(model._BUILT.check)
            compiled = _outcome(args)
            model._route_checks(tensorcheck.check)
            interpreted = _outcome(args)
            assert compiled == interpreted, args
            refused += compiled[0] == "refused"
    finally:
        model._route_checks(saved)
    assert 600 < refused < 2400, refused


def test_the_native_switch_picks_the_build() -> None:
    from mmadmit import native

    assert model._check is (model._BUILT.check if model.HAVE_NATIVE else tensorcheck.check)
    assert model.HAVE_NATIVE == (native.enabled() and model._BUILT is not None)
    # Tensor.__post_init__ is the build's own post_init; with native off it routes
    # every tensor to the interpreted check
    post = model._BUILT if model._BUILT is not None else tensorcheck
    assert Tensor.__post_init__ is post.post_init
    want = None if model._check is post.check else tensorcheck.check
    assert post._route is want
