"""The one error taxonomy of mmadmit and its single mapping to abort codes.

Every request ends in exactly one outcome: materialized, or aborted with an
:class:`AbortCode` and a message an operator can act on. Both transports carry
aborts *in band* (gRPC: ``AbortStatus`` with status OK; ZMQ: the ``0x01`` reply
or a ``validation_error`` forwarded downstream).

Exception tree (all per-request, none fatal to the process)::

    AdmissionError                 carries .code (AbortCode) and .message
    ├── InvalidRequest             INVALID_REQUEST  (malformed or inconsistent input)
    ├── TextOnlyModel              TEXT_ONLY_MODEL
    ├── Unsupported                UNSUPPORTED
    ├── TooLarge                   TOO_LARGE
    ├── Overloaded                 OVERLOADED       (pool full)
    ├── Cancelled                  CANCELLED
    ├── DeadlineExceeded           DEADLINE_EXCEEDED
    └── ShuttingDown               SHUTTING_DOWN

Anything else raised while serving a request is a bug: it is logged with its
traceback at the transport boundary and answered ``INTERNAL``
(:func:`abort_from_exception`). Configuration problems are :class:`ConfigError`,
fatal at start-up (exit status 2), never a request outcome.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AbortCode(enum.Enum):
    """Terminal abort codes (docs/spec/MATERIALIZE.md). Values are the names on the wire."""

    INVALID_REQUEST = "INVALID_REQUEST"
    TEXT_ONLY_MODEL = "TEXT_ONLY_MODEL"
    UNSUPPORTED = "UNSUPPORTED"
    TOO_LARGE = "TOO_LARGE"
    OVERLOADED = "OVERLOADED"
    CANCELLED = "CANCELLED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    SHUTTING_DOWN = "SHUTTING_DOWN"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class Abort:
    """A terminal abort outcome: what every transport reports in band."""

    code: AbortCode
    message: str

    def as_validation_error(self) -> str:
        """The ``validation_error`` string of the msgpack wire: ``"<CODE>: <message>"``."""
        return f"{self.code.value}: {self.message}"


class ConfigError(Exception):
    """A start-up configuration problem (bad flag, unreadable model config)."""


class AdmissionError(Exception):
    """Base of every per-request failure; ``code`` says which abort it becomes."""

    code: AbortCode = AbortCode.INTERNAL

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_abort(self) -> Abort:
        return Abort(self.code, self.message)


class InvalidRequest(AdmissionError):
    code = AbortCode.INVALID_REQUEST


class TextOnlyModel(AdmissionError):
    code = AbortCode.TEXT_ONLY_MODEL


class Unsupported(AdmissionError):
    code = AbortCode.UNSUPPORTED


class TooLarge(AdmissionError):
    code = AbortCode.TOO_LARGE


class Overloaded(AdmissionError):
    code = AbortCode.OVERLOADED


class Cancelled(AdmissionError):
    code = AbortCode.CANCELLED


class DeadlineExceeded(AdmissionError):
    code = AbortCode.DEADLINE_EXCEEDED


class ShuttingDown(AdmissionError):
    code = AbortCode.SHUTTING_DOWN


def abort_from_exception(exc: BaseException) -> Abort:
    """The one mapping from an exception to an in-band abort.

    Callers log unexpected exceptions (``logger.exception``) before calling this;
    the message of an unexpected error names only its type so internals do not
    leak to clients.
    """
    if isinstance(exc, AdmissionError):
        return exc.to_abort()
    return Abort(AbortCode.INTERNAL, f"internal error ({type(exc).__name__}); see the service log")
