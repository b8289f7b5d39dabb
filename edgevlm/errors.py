"""Typed errors shared by the runtime, the daemon, the SDK and the CLI.

Every error that crosses the wire carries a stable :class:`ErrorCode`; the SDK raises the
matching subclass of :class:`EdgeVLMError`, and the CLI prints its one-line message and exits 2.
"""

from __future__ import annotations

from enum import Enum


class ErrorCode(str, Enum):
    """Stable error codes of the wire protocol (``error.code`` in a response)."""

    INVALID_REQUEST = "INVALID_REQUEST"
    INVALID_IMAGE = "INVALID_IMAGE"
    UNKNOWN_SOURCE = "UNKNOWN_SOURCE"
    BUSY = "BUSY"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"


class EdgeVLMError(Exception):
    """Base class of edgevlm's typed errors. ``code`` is the wire error code."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, *, details: dict | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details = details or {}

    def __str__(self) -> str:
        return self.message


class InvalidRequestError(EdgeVLMError, ValueError):
    code = ErrorCode.INVALID_REQUEST


class PromptTooLongError(InvalidRequestError):
    """The prompt with its vision tokens does not fit the KV cache (``Engine.prepare``): ``tokens``
    (vision included) >= ``capacity`` positions. The daemon then runs a point its latency controller
    chose with fewer vision tokens, if one fits (:mod:`edgevlm.daemon.scheduler`). ``details``:
    ``reason`` ``prompt_too_long``, ``prompt_tokens``, ``vision_tokens``, ``max_seq_len``."""

    def __init__(self, message: str, *, tokens: int, capacity: int, vision_tokens: int = 0,
                 details: dict | None = None) -> None:
        super().__init__(message, details={"reason": "prompt_too_long", "prompt_tokens": tokens,
                                           "vision_tokens": vision_tokens, "max_seq_len": capacity, **(details or {})})
        self.tokens, self.capacity, self.vision_tokens = tokens, capacity, vision_tokens


class InvalidImageError(EdgeVLMError, ValueError):
    code = ErrorCode.INVALID_IMAGE


class UnknownSourceError(EdgeVLMError, KeyError):
    code = ErrorCode.UNKNOWN_SOURCE

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class BusyError(EdgeVLMError):
    """``BUSY``: the daemon cannot take the request now. ``details.reason`` tells why: ``queue_full``
    (:data:`QUEUE_FULL`: retry later, the SDK raises it at once) or ``shutting_down`` (:data:`SHUTTING_DOWN`:
    the daemon is stopping; the SDK keeps the request and re-sends it when the daemon is back online)."""

    code = ErrorCode.BUSY


QUEUE_FULL = "queue_full"
"""``details.reason`` of a ``BUSY`` answered because the request queue is full (``queue_max_size``)."""

SHUTTING_DOWN = "shutting_down"
"""``details.reason`` of a ``BUSY`` answered because the daemon is stopping (SIGTERM, ``systemctl restart``):
a queued request, a request that arrives while it stops, or one still running after
``service.shutdown_timeout_s``."""


def shutting_down_error(message: str = "the daemon is shutting down") -> BusyError:
    """The ``BUSY`` error of a daemon that is stopping (``details.reason`` :data:`SHUTTING_DOWN`): the one
    place every part of the daemon (MQTT bridge, scheduler, fronts, HTTP API) builds it."""
    return BusyError(message, details={"reason": SHUTTING_DOWN})


class DeadlineExceededError(EdgeVLMError, TimeoutError):
    code = ErrorCode.DEADLINE_EXCEEDED


class InternalError(EdgeVLMError):
    code = ErrorCode.INTERNAL


class BrokerUnreachableError(EdgeVLMError, ConnectionError):
    """The SDK cannot reach the MQTT broker (refused, unreachable, TLS failure, or not reconnected
    in time). A local error: it never crosses the wire (``code`` is ``INTERNAL``)."""

    code = ErrorCode.INTERNAL


class StreamNotEndedError(EdgeVLMError, RuntimeError):
    """:attr:`edgevlm.runtime.engine.Stream.answer` read before the stream ended: iterate it to the end
    first (or use :meth:`~edgevlm.runtime.Engine.ask`). Also raised when the stream was closed early or
    its iteration raised: such a stream has no answer. A caller mistake, local like
    :class:`BrokerUnreachableError` (never on the wire; ``code`` is ``INTERNAL``); a ``RuntimeError``."""

    code = ErrorCode.INTERNAL


class ClientClosedError(EdgeVLMError, ConnectionError):
    """An SDK :class:`~edgevlm.Client` used after :meth:`~edgevlm.Client.close` (or its ``with`` block), or
    closed while an ``ask`` waited. A caller mistake, not a network state: it is a ``ConnectionError`` (what
    the SDK documents for a closed client) but not a :class:`BrokerUnreachableError`, so a loop that waits
    for the broker to come back does not wait on it for ever (make a new ``Client``). Local: never on the
    wire (``code`` is ``INTERNAL``)."""

    code = ErrorCode.INTERNAL


class ModelLoadError(EdgeVLMError):
    """A model folder or bundle cannot be loaded (missing file, bad config, hash mismatch)."""

    code = ErrorCode.INTERNAL


class ConfigError(EdgeVLMError, ValueError):
    """A config or profile file does not validate; the message names the key path."""

    code = ErrorCode.INVALID_REQUEST


_BY_CODE: dict[ErrorCode, type[EdgeVLMError]] = {
    ErrorCode.INVALID_REQUEST: InvalidRequestError,
    ErrorCode.INVALID_IMAGE: InvalidImageError,
    ErrorCode.UNKNOWN_SOURCE: UnknownSourceError,
    ErrorCode.BUSY: BusyError,
    ErrorCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    ErrorCode.INTERNAL: InternalError,
}


def error_for_code(code: ErrorCode | str, message: str, details: dict | None = None) -> EdgeVLMError:
    """Build the typed exception for a wire error code (unknown codes map to ``InternalError``)."""
    try:
        cls = _BY_CODE[ErrorCode(code)]
    except ValueError:
        cls = InternalError
        message = f"[{code}] {message}"
    return cls(message, details=details)
