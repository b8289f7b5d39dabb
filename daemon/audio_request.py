"""Log-mel features of an audio source over MQTT request/response: :class:`FeaturesRequest` on
``<prefix>/<device_id>/audio/request``, answered on the request's Response Topic (or the
``reply_to``/``correlation_id`` fallback) by the handler of :func:`make_features_handler`.
"""

from __future__ import annotations

import base64
import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, ValidationError

from edgevlm.daemon.audio_dsp import HOP_MS, N_MELS, WIN_MS
from edgevlm.errors import EdgeVLMError, InvalidRequestError
from edgevlm.protocol import is_valid_publish_topic, parse_json_object, response_expiry_s
from edgevlm.validation import first_error_message

if TYPE_CHECKING:
    from edgevlm.daemon.audio import AudioManager

logger = logging.getLogger(__name__)

__all__ = ["FeaturesRequest", "features_response", "make_features_handler"]


class FeaturesRequest(BaseModel):
    """A request for log-mel features, published on ``<prefix>/<device_id>/audio/request`` with a
    Response Topic and Correlation Data (or the ``reply_to``/``correlation_id`` fallback)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # as the request topic: "2" and true are not numbers

    schema_version: int = Field(1, ge=1, le=1, description="Payload schema version.")
    source: StrictStr = Field(min_length=1, max_length=64, description="Audio source name.")
    seconds: float = Field(gt=0, le=3600, description="How much recent audio (s).")
    dtype: str = Field("float32", pattern="^(float32|float16)$", description="Sample type of data_b64.")
    reply_to: StrictStr | None = Field(None, description="MQTT 3.1.1 fallback response topic.")
    correlation_id: StrictStr | None = Field(None, max_length=1024, description="Echoed in the response.")


def features_response(manager: AudioManager, payload: bytes) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Answer one features request. Returns ``(response, raw_request_object_or_None)``; the
    response is ``{"ok": true, ..., "data_b64": ...}`` or ``{"ok": false, "error": {...}}``.

    The features are little-endian ``dtype`` values, row-major ``(frames, n_mels)`` (``shape``),
    the last frame ending at ``end_ts`` (UNIX s)."""
    data: dict[str, Any] | None = None
    try:
        data = parse_json_object(payload)
        try:
            req = FeaturesRequest.model_validate(data)
        except ValidationError as exc:
            msg = first_error_message(exc, unknown="unknown field", missing="field required")
            raise InvalidRequestError(msg, details={"path": msg.split(": ", 1)[0]}) from None
        src = manager.get(req.source)
        seconds = min(req.seconds, src.config.buffer_s)
        feats = src.features(seconds).astype("<f4" if req.dtype == "float32" else "<f2")
    except EdgeVLMError as err:
        corr = data.get("correlation_id") if isinstance(data, dict) else None
        body = {"code": err.code.value, "message": err.message, "details": err.details}
        return {"schema_version": 1, "ok": False, "error": body, "correlation_id": corr}, data
    return {
        "schema_version": 1,
        "ok": True,
        "source": req.source,
        "sample_rate_hz": src.config.sample_rate_hz,
        "n_mels": N_MELS,
        "win_ms": WIN_MS,
        "hop_ms": HOP_MS,
        "seconds": round(seconds, 3),
        "end_ts": round(time.time(), 3),
        "dtype": req.dtype,
        "shape": list(feats.shape),
        "data_b64": base64.b64encode(feats.tobytes()).decode(),
        "correlation_id": req.correlation_id,
    }, data


def make_features_handler(manager: AudioManager, bridge: Any) -> Callable[[Any], None]:
    """An :meth:`MqttBridge.add_handler` handler answering :class:`FeaturesRequest` messages. A
    response over the broker's maximum packet size is replaced by an error saying so."""
    from edgevlm.daemon.mqtt_bridge import PacketTooLargeError, message_deadline_ms, response_properties

    def handle(msg: Any) -> None:
        received = time.monotonic()
        if msg.retain:
            return
        props_in = getattr(msg, "properties", None)
        response_topic = getattr(props_in, "ResponseTopic", None) if props_in is not None else None
        if response_topic and not is_valid_publish_topic(response_topic):
            # as on the request topic: paho refuses a wildcard (ValueError), a broker closes the
            # connection over a control character or a non-character
            bridge.drop_request("invalid_response_topic",
                                "audio: dropping a features request whose Response Topic %r cannot be published to "
                                "(a wildcard, a control character, a non-character, NUL or too long)",
                                response_topic)  # fmt: skip
            return
        response, data = features_response(manager, msg.payload)
        topic, corr_data, _ = bridge.reply_address(msg, data)
        if topic is None:
            bridge.drop_request("no_reply_address",
                                "audio: dropping a features request without a Response Topic or reply_to")
            return
        # answered at once: its Message Expiry Interval (its only deadline), less the time taken here
        expiry_s = response_expiry_s(message_deadline_ms(msg), time.monotonic() - received)
        props = response_properties(corr_data, expiry_s)
        payload = json.dumps({k: v for k, v in response.items() if v is not None}).encode()
        try:
            bridge.publish(topic, payload, properties=props)
        except PacketTooLargeError as err:
            small = {"schema_version": 1, "ok": False, "error": {
                "code": "INVALID_REQUEST", "details": {**err.details, "reason": "response_too_large"},
                "message": f"{response.get('seconds')} s of features ({len(payload)} bytes) exceed the broker's "
                           f"maximum packet size ({err.details['max_packet_bytes']} bytes); ask for fewer seconds"}}  # fmt: skip
            if response.get("correlation_id") is not None:
                small["correlation_id"] = response["correlation_id"]
            bridge.publish(topic, json.dumps(small).encode(), properties=props)

    return handle

