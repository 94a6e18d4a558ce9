"""What one request may hold: the per-request limits, in one frozen object.

Every field is a setting (``config.ServeConfig``, CLI.md) and each breach is
one terminal outcome naming the limit's flag:

* ``TOO_LARGE``: tokens, items, bytes of one tensor, tensor rank, one tensor
  dimension, the length of one msgpack container (array elements or map
  entries), the request ids of one ZMQ ABORT;
* ``INVALID_REQUEST``: msgpack nested deeper than ``max_msgpack_depth`` (a
  structure no request has, so a malformed one, not a large one).

Where they are decided: the ZMQ codec (:mod:`mmadmit.wire`) reads every
count from its msgpack header and walks the structure's headers
(:func:`mmadmit.intcodec.check_structure`) *before* it decodes an element, so
a breach allocates nothing sized by the sender. The materializer checks the
same limits again on every request whatever its transport (gRPC requests are
parsed by protobuf within ``--max-message-bytes`` first). The transport limits
(message bytes, frames per message, in flight per ZMQ peer, gRPC streams and
requests per stream) belong to the transports and are their constructors'
arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import TooLarge
from .msgpack_walk import MAX_DEPTH

# MAX_DEPTH, the ceiling of --max-msgpack-depth: the deepest nesting the codec's
# structure walk (mmadmit.intcodec.check_structure) keeps a stack for.

__all__ = ["DEFAULT_LIMITS", "MAX_DEPTH", "Limits", "check_shape"]


@dataclass(frozen=True)
class Limits:
    """Per-request limits (CLI.md); see the module docstring for the codes."""

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
    :class:`~mmadmit.errors.TooLarge`; the codec and the materializer both ask."""
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
