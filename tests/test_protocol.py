"""Wire protocol: request parsing (field paths, strict 64-bit timeout_ms), responses, topics."""

from __future__ import annotations

import base64
import json

import pytest

from edgevlm.errors import (
    BusyError,
    DeadlineExceededError,
    ErrorCode,
    InvalidRequestError,
    UnknownSourceError,
)
from edgevlm.protocol import (
    INT64_MAX,
    NO_DEADLINE_MS,
    SCHEMA_VERSION,
    Frame,
    Response,
    StatusMessage,
    audio_request_topic,
    audio_topic,
    deadline_s,
    events_topic,
    fallback_reply_address,
    format_loc,
    is_valid_publish_topic,
    parse_json_object,
    parse_request,
    parse_response,
    reload_topic,
    request_timeout_ms,
    request_topic,
    response_topic,
    source_topic,
    status_topic,
    telemetry_topic,
)
from edgevlm.types import Answer, Stats


def _err(payload: bytes | str | dict) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        parse_request(payload)
    assert info.value.code is ErrorCode.INVALID_REQUEST
    return info.value


def test_valid_source_request() -> None:
    req = parse_request(b'{"prompt": "how many?", "source": "front", "max_new_tokens": 8, "timeout_ms": 1500}')
    assert (req.prompt, req.source, req.max_new_tokens, req.timeout_ms) == ("how many?", "front", 8, 1500)
    assert req.image_bytes is None and req.has_deadline
    assert req.schema_version == SCHEMA_VERSION


def test_inline_image_is_decoded_once() -> None:
    raw = b"\x89PNG\r\n\x1a\n\x00\x01binary"
    req = parse_request({"prompt": "what?", "image_b64": base64.b64encode(raw).decode()})
    assert req.image_bytes == raw and req.source is None


def test_timeout_ms_int64_max_is_no_deadline_and_not_truncated() -> None:
    req = parse_request(b'{"prompt": "p", "source": "s", "timeout_ms": 9223372036854775807}')
    assert req.timeout_ms == 9223372036854775807 == NO_DEADLINE_MS == INT64_MAX
    assert type(req.timeout_ms) is int
    assert not req.has_deadline
    # and it survives serialisation (the SDK sends it this way)
    assert '"timeout_ms":9223372036854775807' in req.model_dump_json()


@pytest.mark.parametrize(
    "value",
    ["-1", "0", "1.5", "1.0", "1e3", '"1000"', "true", "null ", "9223372036854775808", "[1]", "-9223372036854775808"],
)
def test_timeout_ms_bad_values_are_invalid_request(value: str) -> None:
    if value.strip() == "null":  # null means "use the daemon default": valid
        assert parse_request(f'{{"prompt": "p", "source": "s", "timeout_ms": {value}}}').timeout_ms is None
        return
    err = _err(f'{{"prompt": "p", "source": "s", "timeout_ms": {value}}}')
    assert err.details["path"] == "timeout_ms"
    assert str(err).startswith("timeout_ms: ")


def test_malformed_json_has_root_path_and_position() -> None:
    err = _err(b'{"prompt": "p", "source": ')
    assert err.details["path"] == "$"
    assert str(err).startswith("$: malformed JSON")
    assert "line 1 column" in str(err)


def test_non_utf8_payload() -> None:
    err = _err(b"\xff\xfe{}")
    assert err.details["path"] == "$" and "not UTF-8" in str(err)


@pytest.mark.parametrize(("payload", "key"), [
    (b'{"prompt": "p", "source": "s", "prompt": "q"}', '"prompt"'),
    (b'{"prompt": "p", "source": "s", "source": "s"}', '"source"'),  # the same value twice too
    (b'{"prompt": "p", "image_b64": "AAAA", "x": {"a": 1, "a": 2}}', '"a"'),  # in a nested object
    ('{"prompt": "p", "source": "s", "\u00e9t\u00e9": 1, "\u00e9t\u00e9": 2}'.encode(), '"\\u00e9t\\u00e9"'),
])
def test_duplicate_key_is_malformed_json_naming_the_key(payload: bytes, key: str) -> None:
    # was: accepted, the last value silently winning (Python's json), so two readers of one payload
    # could see two different requests
    err = _err(payload)
    assert err.details == {"path": "$", "errors": [{"path": "$", "message": f"duplicate key {key}"}]}
    assert str(err) == f"$: malformed JSON: duplicate key {key} (a name may appear only once in an object)"
    with pytest.raises(InvalidRequestError) as info:
        parse_json_object(payload)  # what the MQTT bridge, the HTTP API and audio requests decode with
    assert str(info.value) == str(err)


def test_same_key_in_sibling_objects_is_not_a_duplicate() -> None:
    assert parse_json_object(b'{"a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 3}, {"k": 4}]}') == {
        "a": {"k": 1}, "b": {"k": 2}, "c": [{"k": 3}, {"k": 4}]}


def test_huge_integer_literal_is_invalid_request_not_a_crash() -> None:
    err = _err('{"prompt": "p", "source": "s", "timeout_ms": ' + "9" * 5000 + "}")
    assert err.details["path"] == "$"
    assert str(err) == "$: a JSON integer has more than 4300 digits (no field takes a number that large)"


@pytest.mark.parametrize("field", ["correlation_id", "prompt", "reply_to", "source"])
def test_lone_surrogate_is_invalid_request_naming_the_field(field: str) -> None:
    body = {"prompt": "p", "source": "s", field: "x\udc00"}
    err = _err(json.dumps(body))
    assert err.details["path"] == field and "lone UTF-16 surrogate" in str(err)
    # a surrogate *pair* is a valid character
    assert parse_request(json.dumps({"prompt": "\ud83d\ude00", "source": "s"})).prompt == "\U0001f600"


@pytest.mark.parametrize(
    ("payload", "path", "fragment"),
    [
        (b"[1, 2]", "$", "expected a JSON object, got an array"),
        (b'"just a string"', "$", "expected a JSON object, got a string"),
        (b"null", "$", "expected a JSON object, got null"),
        (b"true", "$", "expected a JSON object, got a boolean"),
        (b"4.5", "$", "expected a JSON object, got a number"),
        (b'{"prompt": "a", "source": "s", "temperature": NaN}', "$", "NaN is not a JSON number (RFC 8259"),
        (b'{"prompt": "a", "source": "s", "timeout_ms": Infinity}', "$", "Infinity is not a JSON number"),
        (b'{"prompt": 5, "source": "s"}', "prompt", "valid string"),
        (b'{"source": "s"}', "prompt", "field required"),
        (b'{"prompt": "", "source": "s"}', "prompt", "must hold a question (it is empty or only whitespace)"),
        (
            b'{"prompt": " \\n\\t", "source": "s"}',
            "prompt",
            "must hold a question (it is empty or only whitespace)",
        ),
        (b'{"prompt": "p"}', "source", "exactly one of"),
        (b'{"prompt": "p", "source": "s", "image_b64": "AAAA"}', "source", "exactly one of"),
        (b'{"prompt": "p", "image_b64": "not base64!"}', "image_b64", "not valid base64"),
        (b'{"prompt": "p", "source": "s", "prmpt": "typo"}', "prmpt", "unknown field"),
        (b'{"prompt": "p", "source": {"name": "s"}}', "source", "valid string"),
        (b'{"prompt": "p", "source": "s", "max_new_tokens": 0}', "max_new_tokens", "greater than 0"),
        (b'{"prompt": "p", "source": "s", "reply_to": "a/+/b"}', "reply_to", "not a valid topic"),
        (b'{"prompt": "p", "source": "s", "schema_version": 2}', "schema_version", "unsupported"),
        # a number field's path is the field, not pydantic's union member ("temperature.float: ... (and 1 more)")
        (b'{"prompt": "p", "source": "s", "temperature": "hot"}', "temperature", "Input should be a valid number"),
        (b'{"prompt": "p", "source": "s", "top_p": true}', "top_p", "Input should be a valid number"),
        (b'{"prompt": "p", "source": "s", "frames_s": [1]}', "frames_s", "Input should be a valid number"),
        # strict as every integer: True == 1.0 == 1 in Python, and these used to pass as version 1
        (b'{"prompt": "p", "source": "s", "schema_version": true}', "schema_version",
         "must be the integer 1, got a boolean (true)"),
        (b'{"prompt": "p", "source": "s", "schema_version": 1.0}', "schema_version",
         "must be the integer 1, got a number (1.0)"),
        (b'{"prompt": "p", "source": "s", "schema_version": "1"}', "schema_version",
         'must be the integer 1, got a string ("1")'),
    ],
)
def test_wrong_shape_names_the_field(payload: bytes, path: str, fragment: str) -> None:
    err = _err(payload)
    assert err.details["path"] == path
    assert str(err).startswith(f"{path}: ")
    assert fragment in str(err)


def test_all_errors_are_listed() -> None:
    err = _err(b'{"prompt": 1, "source": "s", "timeout_ms": -5}')
    paths = [e["path"] for e in err.details["errors"]]
    assert paths == ["prompt", "timeout_ms"]
    assert "(and 1 more)" in str(err)


def test_fallback_reply_address_is_lenient() -> None:
    assert fallback_reply_address({"reply_to": "r/t", "correlation_id": "c1", "prompt": 5}) == ("r/t", "c1")
    assert fallback_reply_address({"reply_to": "r/#", "correlation_id": 7}) == (None, None)


def test_response_roundtrip_ok() -> None:
    answer = Answer(text="two red circles", stats=Stats(e2e_ms=12.5, new_tokens=3))
    frame = Frame(source="front", ts=1700000000.25, pos_ms=1240.0, index=31)
    resp = Response.success(answer, frame, correlation_id="abc")
    wire = json.loads(resp.to_bytes())
    assert wire["ok"] is True and wire["text"] == "two red circles"
    assert wire["frame"] == {"source": "front", "ts": 1700000000.25, "pos_ms": 1240.0, "index": 31}
    assert wire["correlation_id"] == "abc" and wire["schema_version"] == SCHEMA_VERSION
    assert "error" not in wire
    back = parse_response(resp.to_bytes()).to_answer()
    assert back.text == "two red circles" and back.stats.e2e_ms == 12.5
    assert (back.source, back.frame_ts, back.frame_pos_ms) == ("front", 1700000000.25, 1240.0)


@pytest.mark.parametrize(
    ("err", "cls"),
    [
        (BusyError("queue full", details={"queue_max_size": 2}), BusyError),
        (DeadlineExceededError("late"), DeadlineExceededError),
        (UnknownSourceError("no such camera"), UnknownSourceError),
    ],
)
def test_response_error_raises_typed_exception(err, cls) -> None:
    wire = Response.failure(err).to_bytes()
    body = json.loads(wire)
    assert body["ok"] is False and body["error"]["code"] == err.code.value
    with pytest.raises(cls) as info:
        parse_response(wire).to_answer()
    assert info.value.message == err.message
    assert info.value.details == err.details


def test_response_unknown_error_code_is_rejected_as_malformed() -> None:
    wire = b'{"schema_version": 1, "ok": false, "error": {"code": "NEW_CODE", "message": "m"}}'
    with pytest.raises(InvalidRequestError) as info:
        parse_response(wire)
    assert info.value.details["path"] == "error.code"


def test_topics() -> None:
    assert request_topic("edgevlm", "robot-1") == "edgevlm/robot-1/request"
    assert status_topic("fleet/a", "robot-1") == "fleet/a/robot-1/status"
    assert events_topic("edgevlm", "r", "door") == "edgevlm/r/events/door"
    assert telemetry_topic("edgevlm", "r") == "edgevlm/r/telemetry"
    assert response_topic("edgevlm", "r", "ab12") == "edgevlm/r/response/ab12"
    for bad in ("a/b", "+", "#", "", "x y"):
        with pytest.raises(ValueError):
            request_topic("edgevlm", bad)
    for bad_prefix in ("", "a//b", "a/#", "/a"):
        with pytest.raises(ValueError):
            status_topic(bad_prefix, "r")
    assert reload_topic("edgevlm", "r") == "edgevlm/r/reload"
    assert source_topic("fleet/a", "r", "front") == "fleet/a/r/sources/front"
    assert audio_request_topic("edgevlm", "r") == "edgevlm/r/audio/request"
    assert audio_topic("edgevlm", "r", "mic", "state") == "edgevlm/r/audio/mic/state"
    assert audio_topic("edgevlm", "r", "mic", "events") == "edgevlm/r/audio/mic/events"
    with pytest.raises(ValueError, match="'state' or 'events'"):
        audio_topic("edgevlm", "r", "mic", "other")
    with pytest.raises(ValueError, match="source"):
        source_topic("edgevlm", "r", "a/b")


def test_the_deadline_rule() -> None:
    assert deadline_s(250) == 0.25 and deadline_s(None) is None and deadline_s(NO_DEADLINE_MS) is None
    assert request_timeout_ms(None, 30000) == 30000 and request_timeout_ms(500, 30000) == 500
    assert request_timeout_ms(NO_DEADLINE_MS, 30000) == NO_DEADLINE_MS
    # capped by the MQTT v5 Message Expiry Interval the request arrived with (whole seconds)
    assert request_timeout_ms(5000, 30000, message_expiry_s=2) == 2000
    assert request_timeout_ms(NO_DEADLINE_MS, 30000, message_expiry_s=0) == 1  # expired in the broker: 1 ms
    assert request_timeout_ms(500, 30000, message_expiry_s=9) == 500


def test_is_valid_publish_topic() -> None:
    assert is_valid_publish_topic("a/b/c")
    assert not is_valid_publish_topic("a/+/c")
    assert not is_valid_publish_topic("a/#")
    assert not is_valid_publish_topic("")
    assert not is_valid_publish_topic("a\x00b")
    # what a broker may refuse by closing the connection (MQTT v5 section 1.5.4; mosquitto does)
    for bad in ("a\x01b", "a\x1f", "a\x7f", "a\x85", "a\ufdd0", "a\ufffe", "a\U0010ffff", "a\udc00"):
        assert not is_valid_publish_topic(bad), repr(bad)
    assert is_valid_publish_topic("caf\u00e9/\U0001f600/\ufffd")


def test_status_message() -> None:
    wire = StatusMessage(state="online", device_id="r1", ts=1.5, sources=["front"]).to_bytes()
    assert json.loads(wire) == {
        "schema_version": 1,
        "state": "online",
        "device_id": "r1",
        "ts": 1.5,
        "sources": ["front"],
    }


def test_format_loc() -> None:
    assert format_loc(("sources", 0, "uri")) == "sources[0].uri"
    assert format_loc(()) == "$"
