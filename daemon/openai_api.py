"""OpenAI-compatible HTTP API of the daemon (``http:`` config section, off by default).

Endpoints, in the shape of OpenAI's Chat Completions API
(https://platform.openai.com/docs/api-reference/chat/create) so that the ``openai`` client, Frigate's
GenAI provider, live-vlm-webui and agent frameworks can call the robot's model:

- ``POST /v1/chat/completions``: one user turn whose content holds text parts and at most one image
  (``image_url`` with a ``data:image/...;base64,`` URI, or ``edgevlm://sources/<name>`` for the newest
  frame of a configured camera; nothing is ever fetched from the network). ``max_tokens`` /
  ``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``stream`` (server-sent
  events, ``stream_options.include_usage``) and the edgevlm extensions ``budget_ms`` / ``timeout_ms`` /
  ``frames`` / ``frames_s`` / ``frame_seq``
  (the MQTT request fields of the same names). System messages are prepended to the question.
- ``GET /v1/models``: the one model served (``GET /v1/models/{id}``: that model). ``GET /health``: liveness + queue depth, no token needed.

A request becomes the same :class:`~edgevlm.protocol.Request` an MQTT client would send and goes
through the same admission check (:mod:`edgevlm.daemon.admission`), scheduler, latency controller,
deadlines and metrics. Errors are OpenAI error objects ``{"error": {"message", "type", "param",
"code", "details"}}`` whose ``code`` is edgevlm's wire code (``INVALID_REQUEST``, ``DEADLINE_EXCEEDED``, ...)
and whose ``details`` carry the wire error's details (``{}`` where it has none, as on MQTT); a body is parsed
by the MQTT wire's rule (:func:`~edgevlm.protocol.parse_json_object`). HTTP statuses: 400 invalid request /
image, 401 bad token, 404 unknown model or source, 413 body too large, 503 busy (``Retry-After``), 504 deadline
exceeded, 500 internal. ``x-should-retry`` tells the ``openai`` client whether its automatic retry
makes sense (only for 503).

Served by uvicorn (an ASGI server) on a thread of its own, the app built with Starlette; both come
with ``pip install 'edgevlm[http]'``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import json
import logging
import re
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from edgevlm.config import DaemonConfig, HttpConfig
from edgevlm.daemon.admission import check_inline_image
from edgevlm.daemon.scheduler import Job, Scheduler, request_timeout_ms
from edgevlm.errors import (
    EdgeVLMError,
    ErrorCode,
    InternalError,
    InvalidImageError,
    InvalidRequestError,
    shutting_down_error,
)
from edgevlm.protocol import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_STRINGS,
    Request,
    Response,
    json_type_name,
    parse_json_object,
    parse_request,
)

logger = logging.getLogger(__name__)

SOURCE_URI_PREFIX = "edgevlm://sources/"
"""``image_url.url`` prefix naming a configured camera: ``edgevlm://sources/front``."""

_DATA_URI = re.compile(r"^data:(image/[A-Za-z0-9.+-]+)?(;[^,;]*)*;base64,", re.IGNORECASE)

#: wire error code -> (HTTP status, OpenAI error type)
HTTP_STATUS: dict[ErrorCode, tuple[int, str]] = {
    ErrorCode.INVALID_REQUEST: (400, "invalid_request_error"),
    ErrorCode.INVALID_IMAGE: (400, "invalid_request_error"),
    ErrorCode.UNKNOWN_SOURCE: (404, "invalid_request_error"),
    ErrorCode.BUSY: (503, "server_error"),
    ErrorCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    ErrorCode.INTERNAL: (500, "server_error"),
}

#: OpenAI request fields accepted only at their no-op value: (field, allowed values)
_UNSUPPORTED: tuple[tuple[str, tuple[Any, ...]], ...] = (
    ("n", (None, 1)),
    ("tools", (None, [])),
    ("functions", (None, [])),
    ("tool_choice", (None, "none", "auto")),
    ("logprobs", (None, False)),
    ("top_logprobs", (None, 0)),
    ("frequency_penalty", (None, 0, 0.0)),
    ("presence_penalty", (None, 0, 0.0)),
    ("logit_bias", (None, {})),
    ("audio", (None,)),
)


def _http_error(status: int, message: str, *, type_: str = "invalid_request_error", param: str | None = None,
                code: str | None = None, details: dict | None = None, retry: bool = False) -> Any:
    from starlette.responses import JSONResponse

    body: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code, "details": details or {}}
    headers = {"x-should-retry": "true" if retry else "false"}
    if retry:
        headers["Retry-After"] = "1"
    return JSONResponse({"error": body}, status_code=status, headers=headers)


async def _not_found(request: Any, exc: Any) -> Any:
    return _http_error(404, f"no route {request.url.path} (POST /v1/chat/completions, GET /v1/models, GET /health)",
                       code="not_found")


async def _not_allowed(request: Any, exc: Any) -> Any:
    return _http_error(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")


def error_response(err: EdgeVLMError) -> Any:
    """The HTTP response (OpenAI error object) for a wire error, status from :data:`HTTP_STATUS`."""
    status, type_ = HTTP_STATUS.get(err.code, (500, "server_error"))
    param = err.details.get("path") if isinstance(err.details, dict) else None
    return _http_error(status, err.message, type_=type_, param=param if isinstance(param, str) else None,
                       code=err.code.value, details=_jsonable(err.details), retry=err.code == ErrorCode.BUSY)


def _jsonable(details: Any) -> dict:
    try:
        return json.loads(json.dumps(details, default=str)) if details else {}
    except (TypeError, ValueError):
        return {}


def _invalid(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", details={"path": param})


def _number(body: dict, name: str, lo: float, hi: float, *, lo_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(f"must be a number, got {json_type_name(value)}", name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise _invalid(f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", name)
    return float(value)


def _integer(body: dict, name: str) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(f"must be an integer, got {json_type_name(value) if not isinstance(value, float) else value}",
                       name)  # fmt: skip
    return value


def _text_of(content: Any, param: str) -> tuple[list[str], list[tuple[str, str]]]:
    """Text pieces and ``(image url, its param path)`` pairs of one message's ``content``."""
    if isinstance(content, str):
        return [content], []
    if not isinstance(content, list):
        raise _invalid("must be a string or a list of content parts", param)
    texts: list[str] = []
    images: list[tuple[str, str]] = []
    for i, part in enumerate(content):
        where = f"{param}[{i}]"
        if not isinstance(part, dict):
            raise _invalid("must be an object", where)
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise _invalid("must be a string", f"{where}.text")
            texts.append(text)
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else image_url
            if not isinstance(url, str):
                raise _invalid("must be an object with a string 'url'", f"{where}.image_url")
            images.append((url, f"{where}.image_url.url"))
        else:
            raise _invalid(f"content part type {kind!r} is not supported (text, image_url)", f"{where}.type")
    return texts, images


def _image_fields(url: str, param: str) -> dict[str, str]:
    """``{"source": name}`` or ``{"image_b64": ...}`` for one ``image_url.url``."""
    if url.startswith("edgevlm://") and not url.startswith(SOURCE_URI_PREFIX):
        raise _invalid(f"{url!r}: edgevlm:// URIs name a camera: {SOURCE_URI_PREFIX}<name>", param)
    if url.startswith("data:") and _DATA_URI.match(url) is None:
        raise _invalid("data URIs must be base64 images: data:image/<type>;base64,<data>", param)
    if url.startswith(SOURCE_URI_PREFIX):
        name = url[len(SOURCE_URI_PREFIX):]
        if not name or "/" in name:
            raise _invalid(f"{url!r} does not name a source ({SOURCE_URI_PREFIX}<name>)", param)
        return {"source": name}
    match = _DATA_URI.match(url)
    if match is None:
        scheme = url.split(":", 1)[0] if ":" in url else url[:16]
        raise _invalid(f"only data:image/...;base64, URIs and {SOURCE_URI_PREFIX}<name> are accepted "
                       f"(got {scheme!r}: the daemon never fetches from the network)", param)
    data = url[match.end():]
    try:
        base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise _invalid("the data URI is not valid base64", param) from None
    return {"image_b64": data}


def to_request(body: Any, *, model_id: str, multiple_images: str = "refuse") -> tuple[Request, bool, bool]:
    """Translate a Chat Completions request body into the wire :class:`Request`.

    Returns ``(request, stream, include_usage)``.

    Raises:
        InvalidRequestError: not a JSON object, an unsupported field or value, no user text, no or
            several images (unless ``multiple_images == "last"``), a URL that is not a data URI or
            an ``edgevlm://sources/`` name; ``details["path"]`` names the field.
        LookupError: ``model`` is not ``model_id`` (answered 404 ``model_not_found``).
    """
    if not isinstance(body, dict):
        raise _invalid("the request body must be a JSON object", "$")
    model = body.get("model")
    if not isinstance(model, str):
        raise _invalid("must be a string (see GET /v1/models)", "model")
    if model != model_id:
        raise LookupError(model)
    for name, allowed in _UNSUPPORTED:
        value = body.get(name)
        if not any(type(value) is type(a) and value == a for a in allowed):  # strict: True is not 1, 0 not False
            raise _invalid(f"{value!r} is not supported by edgevlm", name)
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _invalid("only {'type': 'text'} is supported", "response_format")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _invalid("must be a non-empty list of messages", "messages")
    system: list[str] = []
    user: list[str] = []
    images: list[tuple[str, str]] = []
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise _invalid("must be an object", where)
        role = msg.get("role")
        if role not in ("system", "developer", "user"):
            raise _invalid(f"role {role!r} is not supported: edgevlm answers one user turn about one image "
                           "(system/developer messages are prepended to it)", f"{where}.role")
        texts, found = _text_of(msg.get("content"), f"{where}.content")
        if role == "user":
            user.extend(texts)
            images.extend(found)
        elif found:
            raise _invalid("images belong in the user message", f"{where}.content")
        else:
            system.extend(texts)
    prompt = "\n".join(t.strip() for t in (*system, *user) if t.strip())
    if not user or not prompt:
        raise _invalid("no user text: ask a question in a user message", "messages")
    if not images:
        raise _invalid("no image: add an image_url part (data: URI or edgevlm://sources/<name>)", "messages")
    if len(images) > 1 and multiple_images != "last":
        raise _invalid(f"{len(images)} images, but the model answers about one (set http.multiple_images: last "
                       "to use the last one)", images[1][1])
    url, param = images[-1]
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS
                             or not all(isinstance(s, str) and s for s in stop)):
        raise _invalid(f"must be a non-empty string or a list of at most {MAX_STOP_STRINGS} non-empty strings", "stop")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, name)
    if max_tokens is not None and not 1 <= max_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise _invalid(f"must be between 1 and {MAX_NEW_TOKENS_LIMIT}, got {max_tokens}", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise _invalid("must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _invalid("must be an object", "stream_options")
    if options.get("include_usage") is not None and not isinstance(options["include_usage"], bool):  # not "yes"
        raise _invalid("must be a boolean", "stream_options.include_usage")
    fields: dict[str, Any] = {
        "prompt": prompt,
        **_image_fields(url, param),
        "max_new_tokens": max_tokens,
        "temperature": _number(body, "temperature", 0.0, 2.0),
        "top_p": _number(body, "top_p", 0.0, 1.0, lo_open=True),
        "stop": stop,
        "seed": _integer(body, "seed"),
        "timeout_ms": _integer(body, "timeout_ms"),
        "budget_ms": _integer(body, "budget_ms"),
        # several recent frames of a camera (edgevlm://sources/<name>), validated as on the MQTT wire
        "frames": body.get("frames"),
        "frames_s": body.get("frames_s"),
        "frame_seq": body.get("frame_seq"),  # that frame again (an earlier answer's edgevlm.frame.seq)
    }
    request = parse_request({k: v for k, v in fields.items() if v is not None})
    return request, bool(stream), options.get("include_usage") is True


class _Pending:
    """Outstanding HTTP requests (for the bounded shutdown): id -> reply function."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = 0
        self._replies: dict[int, Callable[[Response], None]] = {}

    def add(self, reply: Callable[[Response], None]) -> int:
        with self._lock:
            self._next += 1
            self._replies[self._next] = reply
            return self._next

    def pop(self, key: int) -> None:
        with self._lock:
            self._replies.pop(key, None)

    def fail_all(self, err: EdgeVLMError) -> int:
        with self._lock:
            replies, self._replies = list(self._replies.values()), {}
        for reply in replies:
            reply(Response.failure(err))
        return len(replies)


def authorised(request: Any, api_key: str | None) -> bool:
    """Whether ``request`` carries ``Authorization: Bearer <api_key>`` (always True without a key);
    compared in constant time."""
    if api_key is None:
        return True
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), api_key.encode())


def unauthorised() -> Any:
    """The 401 answer to a missing or wrong bearer token."""
    return _http_error(401, "missing or wrong bearer token (Authorization: Bearer <key>)",
                       type_="authentication_error", code="invalid_api_key")


def model_object(model_id: str, created: int) -> dict[str, Any]:
    """``GET /v1/models/{id}``: the model served (an OpenAI model object)."""
    return {"id": model_id, "object": "model", "created": created, "owned_by": "edgevlm"}


def model_response(asked: str, model_id: str, created: int) -> Any:
    """The answer to ``GET /v1/models/{asked}``: the model object of ``model_id`` (:func:`model_object`), or 404
    ``model_not_found`` naming the model served when ``asked`` is another id."""
    from starlette.responses import JSONResponse

    if asked != model_id:
        return _http_error(404, f"model {asked!r} is not served here; this server serves {model_id!r}",
                           param="model", code="model_not_found")
    return JSONResponse(model_object(model_id, created))


def models_body(model_id: str, created: int) -> dict[str, Any]:
    """``GET /v1/models``: the one model served."""
    return {"object": "list", "data": [model_object(model_id, created)]}


async def read_chat_request(request: Any, config: HttpConfig, model_id: str, limits: Any,
                            api_key: str | None) -> tuple[Request, bool, bool] | EdgeVLMError | Any:
    """Authorise, read and translate a ``POST /v1/chat/completions``: ``(request, stream,
    include_usage)``, or the wire error to answer (counted by the caller), or a ready HTTP response
    (401, 404 ``model_not_found``, 413). The inline image passes the one admission check
    (:func:`edgevlm.daemon.admission.check_inline_image`)."""
    if not authorised(request, api_key):
        return unauthorised()
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > config.max_body_bytes:
        return _http_error(413, f"request body of {length} bytes exceeds http.max_body_bytes={config.max_body_bytes}",
                           code=ErrorCode.INVALID_REQUEST.value)
    from starlette.requests import ClientDisconnect

    try:
        raw = await request.body()
    except ClientDisconnect:  # the client went away mid-body: nobody to answer, nothing to log twice
        logger.info("HTTP: client disconnected before sending the whole request body")
        return _http_error(400, "the client disconnected before sending the whole body", code="INVALID_REQUEST")
    if len(raw) > config.max_body_bytes:
        return _http_error(413, f"request body exceeds http.max_body_bytes={config.max_body_bytes}",
                           code=ErrorCode.INVALID_REQUEST.value)
    try:
        body = parse_json_object(raw)  # the wire's rule: UTF-8, no NaN / Infinity, nesting, an object
    except InvalidRequestError as err:
        return err
    try:
        req, stream, include_usage = to_request(body, model_id=model_id, multiple_images=config.multiple_images)
        check_inline_image(req, limits)
    except LookupError as exc:
        return _http_error(404, f"model {exc.args[0]!r} is not served here; this server serves {model_id!r}",
                           param="model", code="model_not_found")
    except (InvalidRequestError, InvalidImageError) as err:
        return err
    return req, stream, include_usage


class OpenAIServer:
    """The HTTP API on its own thread (uvicorn), feeding the daemon's scheduler.

    Args:
        config: the ``http:`` section.
        scheduler: the daemon's :class:`~edgevlm.daemon.scheduler.Scheduler`.
        daemon_config: the whole config (limits, defaults).
        model_id: the id served in ``/v1/models`` and required in requests.
        metrics: the daemon's :class:`~edgevlm.daemon.metrics.Metrics` (or None).
    """

    def __init__(self, config: HttpConfig, scheduler: Scheduler, daemon_config: DaemonConfig, *, model_id: str,
                 metrics: Any = None) -> None:
        self.config = config
        self.scheduler = scheduler
        self.limits = daemon_config.limits
        self.default_timeout_ms = daemon_config.defaults.timeout_ms
        self.model_id = model_id
        self.metrics = metrics
        self.api_key = config.api_key()
        self.created = int(time.time())
        self.port: int | None = None
        self._pending = _Pending()
        self._accepting = True
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Bind ``host:port`` and serve on a thread.

        Raises:
            ModelLoadError: starlette/uvicorn are not installed (the ``http`` extra).
            OSError: the address cannot be bound (port in use, no permission).
        """
        try:
            import uvicorn
        except ImportError as exc:
            from edgevlm.errors import ModelLoadError

            raise ModelLoadError(f"http.enabled needs uvicorn and starlette: pip install 'edgevlm[http]' ({exc})") from exc
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        self.port = sock.getsockname()[1]
        cfg = uvicorn.Config(self.app(), log_level="warning", access_log=False, lifespan="off",
                             timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(cfg)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="edgevlm-http", daemon=True)
        self._thread.start()
        logger.info("HTTP API (OpenAI-compatible) on http://%s:%d/v1, model %r%s", self.config.host, self.port,
                    self.model_id, "" if self.api_key is None else ", bearer token required")
        warning = self.config.open_access_warning()
        if warning is not None:
            logger.warning("%s", warning)

    def stop_accepting(self) -> None:
        """New chat requests are answered 503 BUSY (shutdown)."""
        self._accepting = False

    def fail_outstanding(self, err: EdgeVLMError) -> int:
        """Answer every request still waiting with ``err``; returns how many."""
        return self._pending.fail_all(err)

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop serving (open responses are finished first, up to ``timeout_s``)."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._server = self._thread = None

    # ------------------------------------------------------------------ the app
    def app(self) -> Any:
        """The Starlette application (routes of the module doc)."""
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[
            Route("/v1/chat/completions", self._chat, methods=["POST"]),
            Route("/v1/models", self._models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self._model, methods=["GET"]),
            Route("/health", self._health, methods=["GET"]),
        ], exception_handlers={404: _not_found, 405: _not_allowed})

    async def _health(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        return JSONResponse({"status": "ok" if self._accepting else "stopping", "model": self.model_id,
                             "queue_depth": self.scheduler.queue_size()})

    async def _models(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        if not authorised(request, self.api_key):
            return unauthorised()
        return JSONResponse(models_body(self.model_id, self.created))

    async def _model(self, request: Any) -> Any:
        if not authorised(request, self.api_key):
            return unauthorised()
        return model_response(request.path_params["model_id"], self.model_id, self.created)

    async def _chat(self, request: Any) -> Any:
        parsed = await read_chat_request(request, self.config, self.model_id, self.limits, self.api_key)
        if not isinstance(parsed, tuple):
            if isinstance(parsed, EdgeVLMError):
                self._count(parsed.code)
                return error_response(parsed)
            return parsed
        req, stream, include_usage = parsed
        if not self._accepting:
            self._count(ErrorCode.BUSY)
            return error_response(shutting_down_error())
        return await (self._stream(req, include_usage) if stream else self._complete(req))

    def _submit(self, req: Request, on_event: Callable[[str, Any], None], streaming: bool) -> None:
        """Queue ``req``; ``on_event("delta", text)`` for streamed text, then ``on_event("done",
        response)`` once (from the worker or the network thread)."""
        timeout_ms = request_timeout_ms(req.timeout_ms, self.default_timeout_ms)  # the one deadline rule
        received = time.monotonic()
        done = threading.Event()
        key = 0

        def reply(response: Response) -> None:
            if done.is_set():
                return
            done.set()
            self._pending.pop(key)
            self._observe(response, received, timeout_ms)
            on_event("done", response)

        key = self._pending.add(reply)
        job = Job(request=req, reply=reply, received_monotonic=received, timeout_ms=timeout_ms,
                  on_delta=(lambda d: on_event("delta", d)) if streaming else None)
        self.scheduler.submit(job)

    def _observe(self, response: Response, received: float, timeout_ms: int) -> None:
        if self.metrics is not None:
            self.metrics.observe_response(response, received, timeout_ms, self.scheduler.queue_size())

    def _count(self, code: ErrorCode) -> None:
        """A request refused here, before the scheduler: counted as the MQTT bridge counts its own refusals
        (the events ``requests_received`` and ``errors_<code>``, and the answer in the metrics)."""
        self.scheduler.counters.inc("requests_received")
        self.scheduler.counters.inc(f"errors_{code.value}")
        if self.metrics is not None:
            self.metrics.observe_answer(None, code)

    async def _events(self, req: Request, streaming: bool) -> asyncio.Queue:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def on_event(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, value))

        self._submit(req, on_event, streaming)
        return queue

    async def _complete(self, req: Request) -> Any:
        from starlette.responses import JSONResponse

        queue = await self._events(req, streaming=False)
        _, response = await queue.get()
        if not response.ok:
            return error_response(wire_error(response))
        return JSONResponse(completion_body(response, self.model_id))

    async def _stream(self, req: Request, include_usage: bool) -> Any:
        from starlette.responses import StreamingResponse

        queue = await self._events(req, streaming=True)
        first = await queue.get()  # an error before the first token is a plain HTTP error
        if first[0] == "done" and not first[1].ok:
            return error_response(wire_error(first[1]))

        async def items() -> AsyncIterator[tuple[str, Any]]:
            item = first
            while True:
                yield item
                if item[0] == "done":
                    return
                item = await queue.get()

        return StreamingResponse(sse_events(items(), self.model_id, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def completion_body(response: Response, model_id: str) -> dict[str, Any]:
    """The ``chat.completion`` object of an ok wire :class:`Response`."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
        "model": model_id,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": response.text or ""},
                     "finish_reason": _finish_reason(response), "logprobs": None}],
        "usage": _usage(response), "edgevlm": _extension(response),
    }


async def sse_events(items: AsyncIterator[tuple[str, Any]], model_id: str, include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events of a streamed completion from ``("delta", text)`` items and one final
    ``("done", Response)``: a role chunk, one chunk per delta, the finish chunk (with edgevlm's stats),
    the usage chunk when asked, then ``[DONE]``; a failed Response ends the stream with an
    ``{"error": ...}`` event (OpenAI's shape) before ``[DONE]``."""
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(delta: dict, finish: str | None = None, **extra: Any) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_id,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        body.update(extra)
        return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    async for kind, value in items:
        if kind == "delta":
            yield chunk({"content": value})
            continue
        if value.ok:
            yield chunk({}, _finish_reason(value), edgevlm=_extension(value))
            if include_usage:  # OpenAI's usage chunk: no choices
                yield chunk({}, choices=[], usage=_usage(value))
        else:
            err = wire_error(value)
            _, type_ = HTTP_STATUS.get(err.code, (500, "server_error"))
            body = {"error": {"message": err.message, "type": type_, "param": None, "code": err.code.value,
                              "details": _jsonable(err.details)}}
            yield f"data: {json.dumps(body)}\n\n"
        break
    yield "data: [DONE]\n\n"


def wire_error(response: Response) -> EdgeVLMError:
    from edgevlm.errors import error_for_code

    body = response.error
    if body is None:
        return InternalError("failed response without an error")
    return error_for_code(body.code, body.message, body.details)


def _finish_reason(response: Response) -> str:
    reason = response.stats.finish_reason if response.stats is not None else ""
    return "length" if reason == "length" else "stop"


def _usage(response: Response) -> dict[str, int]:
    stats = response.stats
    prompt = (stats.prompt_tokens + stats.vision_tokens) if stats is not None else 0
    completion = stats.new_tokens if stats is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _extension(response: Response) -> dict[str, Any]:
    """edgevlm's own fields of a completion: the wire stats (ms) and the frame answered about."""
    out: dict[str, Any] = {}
    if response.stats is not None:
        out["stats"] = response.stats.model_dump(exclude_none=True)
    if response.frame is not None:
        out["frame"] = response.frame.model_dump(exclude_none=True)
    return out
