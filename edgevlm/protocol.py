"""The MQTT wire protocol: topics and JSON payloads (torch-free, cv2-free).

Request/response follows MQTT v5's request/response pattern (OASIS MQTT Version 5.0, section
4.10): the requester publishes a :class:`Request` on ``<prefix>/<device_id>/request`` with a
*Response Topic* and *Correlation Data* property; the daemon publishes one :class:`Response` on that
Response Topic with the Correlation Data echoed byte for byte.

MQTT 3.1.1 clients have no properties, so a request may carry the documented fallback fields
``reply_to`` (the response topic) and ``correlation_id`` (a string echoed in the response's
``correlation_id`` field). A Response Topic property wins over ``reply_to``.

Topics (``prefix`` defaults to ``edgevlm``)::

    <prefix>/<device_id>/request            requests (the daemon subscribes)
    <prefix>/<device_id>/status             retained StatusMessage, "online" / "offline" (last will)
    <prefix>/<device_id>/events/<monitor>   monitor events (later issues)
    <prefix>/<device_id>/telemetry          periodic telemetry (later issues)
    <prefix>/<device_id>/response/<token>   the SDK's per-client response topic
    <prefix>/pools/<pool>/request           requests to any member of a pool (shared subscription
                                            $share/<group>/<prefix>/pools/<pool>/request)
    <prefix>/pools/<pool>/response/<token>  a pool client's response topic

Every payload is a UTF-8 JSON object with ``schema_version`` (:data:`SCHEMA_VERSION`). Parse errors
become :class:`~edgevlm.errors.InvalidRequestError` whose message starts with the JSON field path
(``$`` for the payload itself) and whose ``details`` hold ``{"path": ..., "errors": [...]}``.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
import time
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    StrictStr,
    ValidationError,
    model_validator,
)

from edgevlm.errors import EdgeVLMError, ErrorCode, InvalidRequestError, error_for_code
from edgevlm.types import Answer, Stats

SCHEMA_VERSION = 1
"""Version of the JSON payloads. Bumped on an incompatible change; requests naming another
version are refused with ``INVALID_REQUEST``."""

INT64_MAX = 9223372036854775807
NO_DEADLINE_MS = INT64_MAX
"""``timeout_ms`` value meaning "no deadline" (the largest signed 64-bit integer)."""



def deadline_s(timeout_ms: int | None) -> float | None:
    """The one "no deadline" rule: seconds a request may take from its receipt, or None when it has
    no deadline (``timeout_ms`` None or :data:`NO_DEADLINE_MS`)."""
    if timeout_ms is None or timeout_ms >= NO_DEADLINE_MS:
        return None
    return timeout_ms / 1000.0


def request_timeout_ms(timeout_ms: int | None, default_timeout_ms: int, message_expiry_s: int | None = None) -> int:
    """The deadline rule, in one place: how long (ms, from the daemon's receipt) a request may take.

    The request's ``timeout_ms`` (``default_timeout_ms`` when it gives none), capped by the MQTT v5
    *Message Expiry Interval* it arrived with (OASIS MQTT 5.0 section 3.3.2.3.3: the broker forwards
    the interval *remaining*, so time spent queued in the broker is already taken off; the SDK sets it
    from ``timeout_s``). :data:`NO_DEADLINE_MS` means no deadline (:func:`deadline_s`). Every
    deadline check of the daemon (queue expiry, dequeue, the latency controller's budget, the frame
    wait, batching, the late-answer metric) derives from this value.
    """
    limit = default_timeout_ms if timeout_ms is None else timeout_ms
    if message_expiry_s is not None and message_expiry_s >= 0:
        limit = min(limit, max(1, int(message_expiry_s) * 1000))
    return limit


MAX_MESSAGE_EXPIRY_S = 4294967295
"""The largest MQTT v5 Message Expiry Interval (a Four Byte Integer, seconds)."""


def response_expiry_s(timeout_ms: int | None, elapsed_s: float) -> int | None:
    """The MQTT v5 Message Expiry Interval (seconds) of the response to a request whose deadline is
    ``timeout_ms`` (:func:`request_timeout_ms`, from its receipt), published ``elapsed_s`` seconds after
    that receipt: the time left until the deadline, in whole seconds rounded up, at least 1 (an answer
    sent at or after the deadline still goes out, but a broker holding it for a disconnected requester
    drops it within a second), at most :data:`MAX_MESSAGE_EXPIRY_S`. None when the request has no
    deadline (:func:`deadline_s`): the response then carries no Message Expiry Interval."""
    limit = deadline_s(timeout_ms)
    if limit is None:
        return None
    return min(MAX_MESSAGE_EXPIRY_S, max(1, math.ceil(limit - elapsed_s)))


DEFAULT_PREFIX = "edgevlm"
MAX_PROMPT_CHARS = 8192
MAX_NEW_TOKENS_LIMIT = 4096
MAX_STOP_STRINGS = 4
"""At most this many stop strings per request (the OpenAI chat API's limit)."""

MAX_INT_DIGITS = 4300
"""Python's default limit on the digits of an integer parsed from text (``sys.get_int_max_str_digits``);
a JSON integer longer than that is refused as ``INVALID_REQUEST``."""
MAX_REQUEST_FRAMES = 32
"""The most recent frames of a source one request may ask about (``frames``); sources keep that many."""
MAX_REQUEST_FRAMES_S = 10.0
"""The longest window of recent frames (``frames_s``, seconds) one request may ask about."""

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]+$")


def check_prompt(prompt: str) -> str:
    """The one rule for a question's text, on the wire (:class:`Request`'s ``prompt``: MQTT, HTTP, the SDK's
    local check) and in :meth:`edgevlm.runtime.Engine.ask`: it holds something besides whitespace (an empty
    or blank question has nothing to answer). Returns ``prompt`` unchanged.

    Raises:
        ValueError: ``must hold a question (it is empty or only whitespace)``; the callers name the field
            (``prompt: ...``).
    """
    if not prompt.strip():
        raise ValueError("must hold a question (it is empty or only whitespace)")
    return prompt


# --------------------------------------------------------------------------------------- topics


def _check_level(value: str, what: str) -> str:
    if not value or not _NAME_RE.match(value):
        raise ValueError(f"{what} must be a non-empty topic level of [A-Za-z0-9_.-], got {value!r}")
    return value


def check_prefix(prefix: str) -> str:
    """Validate a topic prefix: one or more levels of ``[A-Za-z0-9_.-]`` joined by ``/``
    (no wildcards, no empty level). Returns it; raises ``ValueError``."""
    if not prefix:
        raise ValueError("prefix must not be empty")
    for level in prefix.split("/"):
        _check_level(level, "every prefix level")
    return prefix


def check_device_id(device_id: str) -> str:
    """Validate a device id (one topic level of ``[A-Za-z0-9_.-]``). Raises ``ValueError``."""
    return _check_level(device_id, "device_id")


def default_device_id() -> str:
    """This host's default device id: its host name, every character outside ``[A-Za-z0-9_.-]``
    replaced by ``-``, at most 64 characters (``edgevlm`` for an empty name). A daemon whose config
    gives no ``mqtt.device_id`` takes it, and so does a :class:`~edgevlm.client.Client` given none."""
    import socket

    host = re.sub(r"[^A-Za-z0-9_.-]", "-", socket.gethostname()) or "edgevlm"
    return host[:64]


def request_topic(prefix: str, device_id: str) -> str:
    """``<prefix>/<device_id>/request``: where requests are published."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/request"


def status_topic(prefix: str, device_id: str) -> str:
    """``<prefix>/<device_id>/status``: the retained online/offline status."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/status"


def events_topic(prefix: str, device_id: str, monitor: str) -> str:
    """``<prefix>/<device_id>/events/<monitor>``: events of one monitor."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/events/{_check_level(monitor, 'monitor')}"


def telemetry_topic(prefix: str, device_id: str) -> str:
    """``<prefix>/<device_id>/telemetry``: periodic telemetry."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/telemetry"


def reload_topic(prefix: str, device_id: str) -> str:
    """``<prefix>/<device_id>/reload``: the retained result of the last hot reload."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/reload"


def source_topic(prefix: str, device_id: str, source: str) -> str:
    """``<prefix>/<device_id>/sources/<source>``: a camera source's retained state."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/sources/{_check_level(source, 'source')}"


def audio_request_topic(prefix: str, device_id: str) -> str:
    """``<prefix>/<device_id>/audio/request``: where audio feature requests are published."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/audio/request"


def audio_topic(prefix: str, device_id: str, source: str, kind: str) -> str:
    """``<prefix>/<device_id>/audio/<source>/<kind>``: an audio source's retained ``state`` or its
    ``events``."""
    if kind not in ("state", "events"):
        raise ValueError(f"audio topic kind must be 'state' or 'events', got {kind!r}")
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/audio/{_check_level(source, 'audio source')}/{kind}"


def response_topic(prefix: str, device_id: str, token: str) -> str:
    """``<prefix>/<device_id>/response/<token>``: a per-client response topic (the SDK's)."""
    return f"{check_prefix(prefix)}/{check_device_id(device_id)}/response/{_check_level(token, 'token')}"


def check_pool(pool: str, what: str = "pool") -> str:
    """Validate a pool name or group (one topic level of ``[A-Za-z0-9_.-]``; ``what`` names it in
    the error). Raises ``ValueError``."""
    return _check_level(pool, what)


def pool_request_topic(prefix: str, pool: str) -> str:
    """``<prefix>/pools/<pool>/request``: where requests to any member of a pool are published."""
    return f"{check_prefix(prefix)}/pools/{check_pool(pool)}/request"


def pool_subscription(prefix: str, pool: str, group: str) -> str:
    """``$share/<group>/<prefix>/pools/<pool>/request``: the MQTT v5 shared subscription (section
    4.8.2) through which the broker hands each pool request to one member of ``group``."""
    return f"$share/{_check_level(group, 'pool group')}/{pool_request_topic(prefix, pool)}"


def request_subscription(prefix: str, device_id: str, group: str) -> str:
    """``$share/<group>/<prefix>/<device_id>/request``: the MQTT v5 shared subscription (section
    4.8.2) through which a daemon's front processes (``mqtt.front_processes``) split its requests."""
    return f"$share/{_check_level(group, 'front group')}/{request_topic(prefix, device_id)}"


def pool_response_topic(prefix: str, pool: str, token: str) -> str:
    """``<prefix>/pools/<pool>/response/<token>``: a per-client response topic of a pool client."""
    return f"{check_prefix(prefix)}/pools/{check_pool(pool)}/response/{_check_level(token, 'token')}"


def status_filter(prefix: str) -> str:
    """``<prefix>/+/status``: every daemon's retained status (a pool's members carry ``pool``)."""
    return f"{check_prefix(prefix)}/+/status"


_UNPUBLISHABLE_TOPIC_RE = re.compile(
    "[+#\x00-\x1f\x7f-\x9f\ufdd0-\ufdef\ud800-\udfff"  # wildcards, controls (C0, DEL, C1), lone surrogates
    + "".join(chr(plane * 0x10000 + 0xFFFE) + chr(plane * 0x10000 + 0xFFFF) for plane in range(17))  # U+nFFFE/F
    + "]"
)


def is_valid_publish_topic(topic: str) -> bool:
    """True if ``topic`` may be published to: non-empty, no wildcard (``+``/``#``), at most 65535
    UTF-8 bytes (MQTT v5 sections 4.7.1 and 1.5.4), and none of the code points a broker may refuse
    in a UTF-8 string by closing the connection (MQTT v5 section 1.5.4: NUL, the control characters
    U+0001-U+001F and U+007F-U+009F, the non-characters; a lone surrogate is not UTF-8 at all).
    mosquitto does refuse them: publishing a response to such a topic got the daemon disconnected
    ("Malformed packet"), again at every reconnect as paho re-sent the unacknowledged publish."""
    return bool(topic) and _UNPUBLISHABLE_TOPIC_RE.search(topic) is None and len(topic.encode()) <= 65535


# ------------------------------------------------------------------------------------- payloads


class Request(BaseModel):
    """A question about a camera frame or an inline image.

    Exactly one of ``source`` (a configured camera name) and ``image_b64`` (a base64-encoded
    JPEG/PNG/BMP/WebP file) must be given. Integers are strict: ``1.0``, ``"1"`` and ``true`` are
    refused rather than coerced.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = Field(SCHEMA_VERSION, description="Payload schema version.")
    prompt: Annotated[StrictStr, AfterValidator(check_prompt)] = Field(
        max_length=MAX_PROMPT_CHARS,
        description="The question: not empty, not only whitespace (check_prompt).",
    )
    source: StrictStr | None = Field(
        None, min_length=1, max_length=128, description="Name of a configured camera source."
    )
    image_b64: StrictStr | None = Field(
        None, description="Inline image file (JPEG/PNG/BMP/WebP), standard base64 with padding."
    )
    max_new_tokens: StrictInt | None = Field(
        None, gt=0, le=MAX_NEW_TOKENS_LIMIT, description="Cap on generated tokens (None = daemon default)."
    )
    timeout_ms: StrictInt | None = Field(
        None,
        gt=0,
        le=INT64_MAX,
        description="Deadline in milliseconds from receipt, a signed 64-bit integer; "
        f"{NO_DEADLINE_MS} means no deadline; None = the daemon's default.",
    )
    budget_ms: StrictInt | None = Field(
        None,
        gt=0,
        le=INT64_MAX,
        description="Latency budget (ms), queue wait included: the daemon runs the most accurate operating "
        "point predicted to fit it, or answers DEADLINE_EXCEEDED at once when even the cheapest does not; "
        "None = the profile's default budget.",
    )
    # strict float (an int is a valid float; "1" and true are not): one type, so an error's path is the field's
    temperature: float | None = Field(
        None, ge=0, le=2, strict=True, description="Sampling temperature; 0 or None = greedy decoding."
    )
    top_p: float | None = Field(
        None, gt=0, le=1, strict=True, description="Nucleus sampling mass (with temperature > 0); None = 1."
    )
    stop: list[Annotated[StrictStr, Field(min_length=1)]] | None = Field(
        None, max_length=MAX_STOP_STRINGS, description="Non-empty strings that end the answer (not included in it)."
    )
    seed: StrictInt | None = Field(None, ge=0, le=INT64_MAX, description="Sampling seed (temperature > 0).")
    model: StrictStr | None = Field(
        None, min_length=1, max_length=256,
        description="The model to answer with (its folder name, 'edgevlm-demo' for the demo model); None = the "
        "daemon's. A daemon that does not serve it forwards the request to its offload pool, else refuses it.",
    )
    frames: StrictInt | None = Field(
        None, ge=1, le=MAX_REQUEST_FRAMES,
        description="Ask about the last N frames of ``source`` (oldest first; fewer if the source has not "
        "delivered N yet, or not since it last reconnected: a clip never joins frames from before an outage to "
        "new ones): a Qwen-family model sees them as one video with their capture times, other "
        "families as several images; a model that takes neither answers INVALID_REQUEST naming its limit.",
    )
    frames_s: float | None = Field(
        None, gt=0, le=MAX_REQUEST_FRAMES_S, strict=True,
        description="Ask about the frames of ``source`` captured in the last S seconds (up to the newest "
        f"frame; at most {MAX_REQUEST_FRAMES} frames, the newest kept), as ``frames``. A window holding more "
        "frames than the model takes in one request (a family without video: its max_images, e.g. 8) is "
        "sampled to that many, evenly spaced, the oldest and the newest kept; the response's "
        "stats.window_frames then says how many the window held (frame.frames: how many were sent).",
    )
    frame_seq: StrictInt | None = Field(
        None, ge=1, le=INT64_MAX,
        description="Ask about this frame of ``source`` (the ``frame.seq`` of an earlier answer) instead of the "
        "newest, while the source still holds it (its last 32 frames); an older or future one is refused "
        "INVALID_REQUEST (details: reason frame_gone, oldest_seq, newest_seq). Several questions about one frame "
        "then share its vision tokens (the daemon's vision cache).",
    )
    reply_to: StrictStr | None = Field(
        None,
        min_length=1,
        description="MQTT 3.1.1 fallback: topic to publish the response on when the request has "
        "no Response Topic property.",
    )
    correlation_id: StrictStr | None = Field(
        None,
        max_length=1024,
        description="MQTT 3.1.1 fallback: echoed in the response's correlation_id field.",
    )

    _image_bytes: bytes | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _check(self) -> Request:
        if (self.source is None) == (self.image_b64 is None):
            raise ValueError("source: give exactly one of 'source' and 'image_b64'")
        if self.frames is not None and self.frames_s is not None:
            raise ValueError("frames: give at most one of 'frames' and 'frames_s'")
        if (self.frames is not None or self.frames_s is not None) and self.source is None:
            raise ValueError("frames: 'frames' / 'frames_s' ask about recent frames of a 'source'")
        if self.frame_seq is not None and self.source is None:
            raise ValueError("frame_seq: asks about a frame of a 'source'")
        if self.frame_seq is not None and (self.frames is not None or self.frames_s is not None):
            raise ValueError("frame_seq: give at most one of 'frame_seq', 'frames' and 'frames_s'")
        if self.image_b64 is not None:
            try:
                self._image_bytes = base64.b64decode(self.image_b64, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("image_b64: not valid base64") from None
            if not self._image_bytes:
                raise ValueError("image_b64: empty image")
        if self.reply_to is not None and not is_valid_publish_topic(self.reply_to):
            raise ValueError("reply_to: not a valid topic to publish to (a wildcard, a control character, "
                             "a non-character or NUL)")
        return self

    @property
    def image_bytes(self) -> bytes | None:
        """The decoded inline image file, or None for a source request."""
        return self._image_bytes

    @property
    def has_deadline(self) -> bool:
        """False for ``timeout_ms == NO_DEADLINE_MS`` (and for an unset timeout)."""
        return deadline_s(self.timeout_ms) is not None


class Frame(BaseModel):
    """The camera frame an answer is about."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(description="Source name.")
    ts: float = Field(description="Capture timestamp, UNIX seconds.")
    pos_ms: float | None = Field(None, description="Media position in a video file (ms), else None.")
    index: int | None = Field(None, description="Frame index within the video file's current loop.")
    seq: int | None = Field(None, description="The source's frame number (1 for its first frame, increasing): "
                            "a later request's ``frame_seq`` asks about this frame again.")
    frames: int | None = Field(None, description="How many frames the answer is about, for a ``frames`` / "
                               "``frames_s`` request (ts / pos_ms / index are the newest one's); None = one frame.")
    first_ts: float | None = Field(None, description="Capture timestamp of the oldest of several frames, "
                                   "UNIX seconds (None for one frame).")


class ErrorBody(BaseModel):
    """A typed error on the wire."""

    model_config = ConfigDict(extra="forbid")

    code: ErrorCode = Field(description="Stable error code.")
    message: str = Field(description="One-line human-readable message.")
    details: dict[str, Any] = Field(default_factory=dict, description="Machine-readable details.")


class Response(BaseModel):
    """The daemon's answer to one :class:`Request` (``ok`` with text and stats, or an error)."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = Field(SCHEMA_VERSION, description="Payload schema version.")
    ok: bool = Field(description="True for an answer, False for an error.")
    text: str | None = Field(None, description="The answer text (ok responses).")
    stats: Stats | None = Field(None, description="Per-request measurements (ok responses).")
    frame: Frame | None = Field(None, description="The frame used, for source requests.")
    error: ErrorBody | None = Field(None, description="The error (failed responses).")
    correlation_id: str | None = Field(None, description="Echo of the request's correlation_id.")
    ts: float = Field(default_factory=time.time, description="When the response was made (UNIX s).")

    @classmethod
    def success(
        cls, answer: Answer, frame: Frame | None = None, correlation_id: str | None = None
    ) -> Response:
        return cls(ok=True, text=answer.text, stats=answer.stats, frame=frame, correlation_id=correlation_id)

    @classmethod
    def failure(cls, err: EdgeVLMError, correlation_id: str | None = None) -> Response:
        body = ErrorBody(code=err.code, message=err.message, details=_jsonable(err.details))
        return cls(ok=False, error=body, correlation_id=correlation_id)

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()

    def to_answer(self) -> Answer:
        """The :class:`Answer` of an ok response; raises the typed error of a failed one
        (:func:`edgevlm.errors.error_for_code`)."""
        if not self.ok or self.error is not None:
            err = self.error or ErrorBody(code=ErrorCode.INTERNAL, message="failed response without error")
            raise error_for_code(err.code, err.message, err.details)
        return Answer(
            text=self.text or "",
            stats=self.stats or Stats(),
            frame_ts=self.frame.ts if self.frame else None,
            source=self.frame.source if self.frame else None,
            frame_pos_ms=self.frame.pos_ms if self.frame else None,
            frame_seq=self.frame.seq if self.frame else None,
        )


class StatusMessage(BaseModel):
    """The retained status of a daemon (``<prefix>/<device_id>/status``)."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = Field(SCHEMA_VERSION, description="Payload schema version.")
    state: Literal["online", "offline"] = Field(description="Daemon state.")
    device_id: str = Field(description="Device id.")
    ts: float | None = Field(None, description="When the state was published (UNIX s); None in the will.")
    version: str | None = Field(None, description="edgevlm version.")
    sources: list[str] = Field(default_factory=list, description="Configured source names.")
    model: str | None = Field(None, description="Model folder served.")
    model_id: str | None = Field(None, description="The id a request's ``model`` names to be answered here "
                                 "(``http.model_name``, else the model folder's name).")
    pool: str | None = Field(None, description="The pool this daemon is a member of (mqtt.pool), if any.")

    def to_bytes(self) -> bytes:
        return self.model_dump_json(exclude_none=True).encode()


# -------------------------------------------------------------------------------------- parsing


def format_loc(loc: tuple[Any, ...] | list[Any]) -> str:
    """A pydantic error location as a field path: ``("sources", 0, "uri")`` -> ``sources[0].uri``;
    the empty location is ``$`` (the payload itself)."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "$"


def _error_message(err: dict[str, Any]) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field"
    if err["type"] == "missing":
        return "field required"
    msg = str(err["msg"])
    return msg.removeprefix("Value error, ")


def _validation_error(exc: ValidationError, what: str) -> InvalidRequestError:
    errors = []
    for e in exc.errors(include_url=False):
        path = format_loc(e["loc"])
        msg = _error_message(e)
        # Model-level checks name their field as "field: ..." in the message.
        if path == "$" and ": " in msg and _NAME_RE.match(msg.split(": ", 1)[0]):
            path, msg = msg.split(": ", 1)
        errors.append({"path": path, "message": msg})
    first = errors[0]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return InvalidRequestError(
        f"{first['path']}: {first['message']}{more}",
        details={"path": first["path"], "errors": errors, "what": what},
    )


class NonFiniteJSONError(ValueError):
    """``NaN``, ``Infinity`` or ``-Infinity`` in a JSON text: Python's ``json`` accepts them, RFC 8259 (section 6)
    does not, and no field of a request takes them."""


def reject_json_constant(name: str) -> Any:
    """``json.loads(..., parse_constant=reject_json_constant)``: raise :class:`NonFiniteJSONError` for ``name``."""
    raise NonFiniteJSONError(f"{name} is not a JSON number (RFC 8259 has no NaN or Infinity)")


class DuplicateKeyError(ValueError):
    """A name twice in one JSON object: Python's ``json`` keeps the last value, other readers may keep the first
    (RFC 8259 section 4: names SHOULD be unique; I-JSON, RFC 7493 section 2.3: MUST), so no field reads it.
    ``short`` is the message without the reason."""

    def __init__(self, key: str) -> None:
        self.short = f"duplicate key {json.dumps(key)}"  # quoted and escaped: one line, any key
        super().__init__(f"{self.short} (a name may appear only once in an object)")


def reject_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads(..., object_pairs_hook=reject_duplicate_keys)``: the object as a dict, or
    :class:`DuplicateKeyError` naming the first name that appears twice."""
    data = dict(pairs)
    if len(data) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise DuplicateKeyError(key)
            seen.add(key)
    return data


def parse_json_object(payload: bytes | str) -> dict[str, Any]:
    """Decode a UTF-8 JSON object. Raises :class:`InvalidRequestError` (path ``$``) for non-UTF-8,
    malformed JSON (``NaN`` / ``Infinity`` and a name twice in one object included) or a non-object top
    level. Integers keep full precision (Python ints)."""

    def whole_payload(msg: str, short: str | None = None, **extra: Any) -> InvalidRequestError:  # path "$"
        errors = [{"path": "$", "message": short or msg}]
        return InvalidRequestError(f"$: {msg}", details={"path": "$", "errors": errors, **extra})

    if isinstance(payload, (bytes, bytearray, memoryview)):
        try:
            text = bytes(payload).decode("utf-8")
        except UnicodeDecodeError as exc:
            raise whole_payload(f"payload is not UTF-8 ({exc.reason} at byte {exc.start})", "not UTF-8") from None
    else:
        text = payload
    try:
        data = json.loads(text, parse_constant=reject_json_constant, object_pairs_hook=reject_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise whole_payload(f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", pos=exc.pos) from None
    except NonFiniteJSONError as exc:
        raise whole_payload(f"malformed JSON: {exc}") from None
    except DuplicateKeyError as exc:
        raise whole_payload(f"malformed JSON: {exc}", exc.short) from None
    except RecursionError:
        raise whole_payload("malformed JSON: nested too deeply") from None
    except ValueError:  # Python refuses to convert an integer literal of more than 4300 digits
        raise whole_payload(f"a JSON integer has more than {MAX_INT_DIGITS} digits (no field takes a number that "
                            "large)") from None  # fmt: skip
    if not isinstance(data, dict):
        raise whole_payload(f"expected a JSON object, got {json_type_name(data)}")
    return data


def json_type_name(value: Any) -> str:
    """What ``value`` (as ``json.loads`` returns it) is in JSON's terms (RFC 8259 section 3), for error messages:
    ``null``, ``a boolean``, ``a number``, ``a string``, ``an array`` or ``an object``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return "an array" if isinstance(value, list) else "an object"


def parse_request(payload: bytes | str | dict[str, Any]) -> Request:
    """Parse and validate a request payload.

    Raises:
        InvalidRequestError: malformed JSON, wrong shape, bad values; the message starts with the
            field path (``timeout_ms: ...``, ``$: malformed JSON ...``) and ``details["path"]``
            holds it.
    """
    data = payload if isinstance(payload, dict) else parse_json_object(payload)
    bad = _lone_surrogate_path(data)
    if bad is not None:
        raise InvalidRequestError(
            f"{bad}: contains a lone UTF-16 surrogate (a \\udXXX escape without its pair): not valid Unicode",
            details={"path": bad, "errors": [{"path": bad, "message": "lone surrogate"}]},
        )
    version = data.get("schema_version", SCHEMA_VERSION)
    if type(version) is not int:  # strict, as every integer field: not true, 1.0 or "1" (True == 1.0 == 1)
        raise InvalidRequestError(
            f"schema_version: must be the integer {SCHEMA_VERSION}, got {json_type_name(version)} "
            f"({json.dumps(version)[:40]})",
            details={"path": "schema_version", "errors": [{"path": "schema_version", "message": "not an integer"}]},
        )
    if version != SCHEMA_VERSION:
        raise InvalidRequestError(
            f"schema_version: unsupported version {version!r} (this daemon speaks {SCHEMA_VERSION})",
            details={
                "path": "schema_version",
                "errors": [{"path": "schema_version", "message": "unsupported"}],
            },
        )
    try:
        return Request.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, "request") from None


def _is_unicode(text: str) -> bool:
    """False for a string holding a lone surrogate (JSON allows ``"\\udc00"``; UTF-8 cannot carry it)."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _lone_surrogate_path(value: Any, loc: tuple[Any, ...] = ()) -> str | None:
    """The field path of the first string (key or value) holding a lone surrogate, or None."""
    if isinstance(value, str):
        return None if _is_unicode(value) else format_loc(loc)
    if isinstance(value, dict):
        for k, v in value.items():
            if not _is_unicode(k):
                return format_loc(loc) if loc else "$"
            found = _lone_surrogate_path(v, (*loc, k))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate_path(v, (*loc, i))
            if found is not None:
                return found
    return None


def fallback_reply_address(data: dict[str, Any]) -> tuple[str | None, str | None]:
    """The MQTT 3.1.1 fallback ``(reply_to, correlation_id)`` of a raw request object, read
    leniently so that even a request that fails validation can be answered. Invalid values
    give None."""
    reply_to = data.get("reply_to")
    corr = data.get("correlation_id")
    if not isinstance(reply_to, str) or not is_valid_publish_topic(reply_to) or not _is_unicode(reply_to):
        reply_to = None
    if not isinstance(corr, str) or len(corr) > 1024 or not _is_unicode(corr):
        corr = None
    return reply_to, corr


def parse_response(payload: bytes | str) -> Response:
    """Parse a response payload (the SDK side). Raises :class:`InvalidRequestError` if it is not
    a valid response."""
    data = parse_json_object(payload)
    try:
        return Response.model_validate(data)
    except ValidationError as exc:
        raise _validation_error(exc, "response") from None


def _jsonable(value: Any) -> Any:
    """Details made JSON-safe (unknown objects become their str)."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
