"""What one request may hold: the per-request limits, in one frozen object.

Every field is a setting (``config.ServeConfig``, docs/spec/CLI.md) and each breach is
one terminal outcome naming the limit's flag:

* ``TOO_LARGE``: tokens, items, bytes of one tensor, tensor rank, one tensor
  dimension, the length of one msgpack container (array elements or map
  entries), the request ids of one ZMQ ABORT;
* ``INVALID_REQUEST``: msgpack nested deeper than ``max_msgpack_depth`` (a
  structure no request has, so a malformed one, not a large one).

Where they are decided: the ZMQ codec (:mod:`mmadmit.wire`) reads every
count from its msgpack header and walks the structure's headers
(:func:`mmadmit.msgpack_walk.check_structure`) *before* it decodes an element, so
a breach allocates nothing sized by the sender; the gRPC request deserializer
counts from the wire bytes (:func:`mmadmit.pbwire.check_admit_limits`); every
received tensor is built as a :class:`mmadmit.model.Tensor` with the limits,
which checks its rank, dimensions and bytes from its shape. The materializer
checks the same limits again on every request whatever its transport. How a
breach reads is decided here, one function per limit (:func:`tokens_over`,
:func:`items_over`, :func:`check_shape`, :func:`tensor_bytes_over`, ...), so
every transport words it alike. The transport limits
(message bytes, frames per message, in flight per ZMQ peer, gRPC streams and
requests per stream) belong to the transports and are their constructors'
arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest, TooLarge

# The ceiling of --max-msgpack-depth: the deepest nesting the codec's structure
# walk (mmadmit.msgpack_walk.check_structure) keeps a stack for. Defined here so
# that the configuration and the materializer load no codec (tests/test_layering.py).
MAX_DEPTH = 1024
# The other ceilings of the limit settings (``config.ServeConfig`` checks every
# ``--max-*`` value against its range at start-up; docs/spec/CLI.md).
MAX_RANK = 64  # numpy's largest rank (NPY_MAXDIMS): no higher one can be built
INT32_MAX = 2**31 - 1  # counts: gRPC's options and the engines' indices are C ints
INT64_MAX = 2**63 - 1  # byte sizes and dimensions: int64, as the native code reads them
MSGPACK_MAX_LEN = 2**32 - 1  # msgpack's longest array or map: no higher limit bites

__all__ = [
    "DEFAULT_LIMITS",
    "INT32_MAX",
    "INT64_MAX",
    "MAX_DEPTH",
    "MAX_RANK",
    "MSGPACK_MAX_LEN",
    "Limits",
    "abort_ids_over",
    "check_shape",
    "depth_over",
    "items_over",
    "msgpack_len_over",
    "placeholders_over",
    "tensor_bytes_over",
    "tokens_over",
]


@dataclass(frozen=True)
class Limits:
    """Per-request limits (docs/spec/CLI.md); see the module docstring for the codes."""

    max_tokens: int = 262_144
    max_items: int = 256
    max_tensor_bytes: int = 536_870_912
    max_tensor_rank: int = 8
    # int32-indexable: engines' kernels index features with 32-bit ints
    max_tensor_dim: int = 2**31 - 1
    # the deepest request structure is 7 (payload, multimodal_inputs, items,
    # item, model_specific_data, tensor, shape); sampling params nest a little
    max_msgpack_depth: int = 32
    max_msgpack_len: int = 65_536
    max_abort_ids: int = 4_096


DEFAULT_LIMITS = Limits()


def check_shape(what: Any, shape: Sequence[int], limits: Limits) -> None:
    """A tensor's rank and dimensions within ``limits`` (``what`` names it), else
    :class:`~mmadmit.errors.TooLarge`; :class:`~mmadmit.model.Tensor` and the
    materializer's shared-memory handles ask."""
    if len(shape) > limits.max_tensor_rank:
        raise TooLarge(
            f"{what}: rank {len(shape)} exceeds the limit of {limits.max_tensor_rank} "
            "(--max-tensor-rank)"
        )
    if shape and max(shape) > limits.max_tensor_dim:
        raise TooLarge(
            f"{what}: dimension {max(shape)} exceeds the limit of {limits.max_tensor_dim} "
            "(--max-tensor-dim)"
        )


def tensor_bytes_over(
    what: Any, shape: Sequence[int], dtype: str, nbytes: int, limit: int
) -> TooLarge:
    """``--max-tensor-bytes``: a tensor whose shape needs ``nbytes`` over ``limit``."""
    return TooLarge(
        f"{what}: shape {list(shape)} of {dtype} is {nbytes} bytes, over the limit of {limit} "
        "(--max-tensor-bytes)"
    )


def tokens_over(name: str, count: int, limit: int, *, at_least: bool = False) -> TooLarge:
    """``--max-tokens``: ``name`` (``input_ids``, ``input_ids_unpadded``) holds ``count``
    tokens (``at_least``: a transport that stops counting at the breach)."""
    more = "at least " if at_least else ""
    return TooLarge(f"{name}: {more}{count} tokens exceed the limit of {limit} (--max-tokens)")


def placeholders_over(item: int, count: int, limit: int) -> TooLarge:
    """``--max-tokens`` bounds one item's placeholder ranges too (each covers a token)."""
    return TooLarge(
        f"item {item}: at least {count} placeholders exceed the limit of {limit} (--max-tokens)"
    )


def items_over(count: int, limit: int, *, at_least: bool = False) -> TooLarge:
    """``--max-items``: the request has ``count`` items."""
    more = "at least " if at_least else ""
    return TooLarge(f"{more}{count} items exceed the limit of {limit} (--max-items)")


def msgpack_len_over(
    where: str, count: int, unit: str, limit: int, *, container: str = "", at_least: bool = False
) -> TooLarge:
    """``--max-msgpack-len``: ``where`` holds ``count`` ``unit`` (``elements`` of an
    array, ``entries`` of a map, protobuf ``fields``), ``container`` says which."""
    more = "at least " if at_least else ""
    return TooLarge(
        f"{where}: {container}{more}{count} {unit}, over the limit of {limit} (--max-msgpack-len)"
    )


def depth_over(where: str, depth: int, limit: int) -> InvalidRequest:
    """``--max-msgpack-depth`` (INVALID_REQUEST: no request nests that deep)."""
    return InvalidRequest(
        f"{where}: msgpack nested {depth} levels deep, over the limit of {limit} "
        "(--max-msgpack-depth)"
    )


def abort_ids_over(count: int, limit: int) -> TooLarge:
    """``--max-abort-ids``: one ZMQ ABORT names ``count`` request ids."""
    return TooLarge(
        f"ABORT payload: {count} request ids exceed the limit of {limit} (--max-abort-ids)"
    )
