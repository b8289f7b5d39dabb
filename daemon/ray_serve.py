"""The engine under Ray Serve, for cloud GPUs (``pip install 'edgevlm[ray]'``).

    edgevlm serve-ray --config daemon.yaml          # local Ray, or ray.address from the config
    serve run edgevlm.daemon.ray_serve:app_builder config=daemon.yaml   # Ray's own CLI, same application

Two deployments (Ray Serve's model composition, https://docs.ray.io/en/latest/serve/):

- ``engine`` (:class:`EngineReplica`): one :class:`edgevlm.runtime.Engine` per replica, loaded from the
  config's ``model:`` section; one GPU per replica for a CUDA model (``ray.num_gpus_per_replica``),
  fractional CPUs on a CPU. Autoscaling on queue depth: Ray adds replicas while the requests in
  flight per replica exceed ``ray.target_ongoing_requests``, between ``ray.min_replicas`` and
  ``ray.max_replicas`` (default: the cluster's GPUs). A replica speaks the wire protocol: a
  :class:`~edgevlm.protocol.Request` JSON object in, a :class:`~edgevlm.protocol.Response` out, so any
  front end (HTTP here, an MQTT pool member later) can dispatch to it.
- ``openai`` (:class:`OpenAIIngress`): the OpenAI-compatible HTTP API of :mod:`edgevlm.daemon.openai_api`
  (same translation, admission check, error objects and token) on Ray's HTTP proxy at
  ``http.host:http.port``. A request whose replica dies (a killed process, a lost node) is sent to
  another replica, at most ``ray.request_retries`` times and never past its deadline (Ray Serve does
  not retry a failed call by itself; requests are idempotent, so a retry is safe); the deadline
  (``timeout_ms``, else ``defaults.timeout_ms``) ends a request with ``DEADLINE_EXCEEDED``.

Replicas have no cameras: a request naming a ``source`` is ``UNKNOWN_SOURCE``; images come inline.

Settings: the config's ``model``, ``profile``, ``http``, ``defaults``, ``limits``, ``ray`` and ``log_level``
are read (:data:`READ_SECTIONS`); everything else configures ``edgevlm serve`` (MQTT and its pools,
cameras, audio, monitors, metrics, the worker's queue and batching, the latency controller, offload,
hot reload, the watchdog). One config file may serve both commands, so those are not refused: the
ones the file sets are named in one warning at start (:func:`ignored_settings`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from edgevlm.config import DaemonConfig
from edgevlm.errors import (
    DeadlineExceededError,
    EdgeVLMError,
    InternalError,
    ModelLoadError,
    UnknownSourceError,
)
from edgevlm.protocol import Request, Response, deadline_s, parse_request, request_timeout_ms

logger = logging.getLogger(__name__)


READ_SECTIONS = ("model", "profile", "http", "defaults", "limits", "ray", "log_level")
"""The top-level config keys ``serve-ray`` reads (less :data:`IGNORED_MODEL_KEYS` and ``http.enabled``)."""
IGNORED_MODEL_KEYS = ("continuous_batching", "prefill_token_budget")
"""``model`` keys of the daemon's inference worker: a replica answers one request at a time."""


def ignored_settings(config: DaemonConfig) -> list[str]:
    """The settings ``config`` sets that ``serve-ray`` ignores, as key paths in the config's order
    (``mqtt.pool``, ``sources``, ``model.continuous_batching``, ``http.enabled`` when false: the HTTP API
    is what serve-ray serves). Only keys the file sets count, not defaults; a section set to nothing
    (``sources: []``, ``mqtt: {}``) sets nothing."""
    from pydantic import BaseModel

    names: list[str] = []
    for key in type(config).model_fields:
        if key not in config.model_fields_set:
            continue
        value = getattr(config, key)
        if key == "model":
            names += [f"model.{k}" for k in IGNORED_MODEL_KEYS if k in value.model_fields_set]
        elif key == "http":
            if "enabled" in value.model_fields_set and not value.enabled:
                names.append("http.enabled")
        elif key in READ_SECTIONS:
            continue
        elif isinstance(value, BaseModel):
            names += [f"{key}.{k}" for k in type(value).model_fields if k in value.model_fields_set]
        elif value != []:
            names.append(key)
    return names


def warn_ignored_settings(config: DaemonConfig) -> list[str]:
    """Log one warning naming :func:`ignored_settings` (nothing when there are none); returns them."""
    names = ignored_settings(config)
    if names:
        source = config.source_file
        logger.warning("serve-ray: ignoring %s%s: they configure edgevlm serve (serve-ray serves the HTTP API "
                       "from model, profile, http, defaults, limits and ray only)", ", ".join(names),
                       f" set in {source}" if source else "")  # fmt: skip
    return names


def _ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401 - checks the serve extra too
    except ImportError as exc:
        raise ModelLoadError(f"edgevlm serve-ray needs Ray Serve: pip install 'edgevlm[ray]' ({exc})") from exc
    return ray


def _replica_died(exc: BaseException) -> bool:
    """Whether a failed call means its replica is gone (worth sending the request elsewhere)."""
    import ray.exceptions as rex

    kinds = tuple(getattr(rex, n) for n in ("RayActorError", "ActorDiedError", "ActorUnavailableError",
                                            "NodeDiedError", "WorkerCrashedError") if hasattr(rex, n))
    return isinstance(exc, kinds)


class EngineReplica:
    """One engine (see the module doc). ``config``: the daemon config as a JSON-able dict."""

    def __init__(self, config: dict[str, Any]) -> None:
        from edgevlm.daemon.app import engine_loader

        self.config = DaemonConfig.model_validate(config)
        self.engine = engine_loader(self.config)()
        self._lock = threading.Lock()  # Ray may run sync methods on several threads: one request at a time
        self.served_by = f"{socket.gethostname()}:{os.getpid()}"

    def pid(self) -> int:
        """This replica's process id (operations and tests)."""
        return os.getpid()

    def _prepare(self, payload: dict[str, Any]) -> tuple[Request, Any]:
        req = parse_request(payload)
        if req.source is not None:
            raise UnknownSourceError(f"unknown source {req.source!r}: Ray replicas have no cameras (send the image)",
                                     details={"source": req.source})
        from edgevlm.runtime.image import decode_image

        return req, decode_image(req.image_bytes)

    def _kwargs(self, req: Request) -> dict[str, Any]:
        from edgevlm.daemon.scheduler import sampling_kwargs

        return {"max_new_tokens": req.max_new_tokens or self.config.defaults.max_new_tokens, **sampling_kwargs(req)}

    def ask(self, payload: dict[str, Any]) -> dict[str, Any]:
        """Answer one wire request (a :class:`Request` JSON object): a :class:`Response` JSON object,
        ok or with the typed error (never raises for bad input)."""
        try:
            req, image = self._prepare(payload)
            with self._lock:
                answer = self.engine.ask(image, req.prompt, **self._kwargs(req))
            answer.stats.served_by = self.served_by  # extra stats field: which replica answered
            return Response.success(answer, None, req.correlation_id).model_dump(mode="json", exclude_none=True)
        except EdgeVLMError as err:
            return Response.failure(err, payload.get("correlation_id")).model_dump(mode="json", exclude_none=True)
        except Exception as exc:  # noqa: BLE001 - a bad request must not kill the replica
            logger.exception("replica: request failed")
            err = InternalError(f"internal error: {type(exc).__name__}: {exc}")
            return Response.failure(err).model_dump(mode="json", exclude_none=True)

    def stream(self, payload: dict[str, Any]) -> Any:
        """Like :meth:`ask`, yielding ``["delta", text]`` items, then ``["done", response JSON]``."""
        try:
            req, image = self._prepare(payload)
            with self._lock:
                stream = self.engine.stream(image, req.prompt, **self._kwargs(req))
                for delta in stream:
                    yield ["delta", delta]
                answer = stream.answer
            answer.stats.served_by = self.served_by
            yield ["done", Response.success(answer).model_dump(mode="json", exclude_none=True)]
        except EdgeVLMError as err:
            yield ["done", Response.failure(err).model_dump(mode="json", exclude_none=True)]
        except Exception as exc:  # noqa: BLE001
            logger.exception("replica: streamed request failed")
            err = InternalError(f"internal error: {type(exc).__name__}: {exc}")
            yield ["done", Response.failure(err).model_dump(mode="json", exclude_none=True)]


class OpenAIIngress:
    """The OpenAI-compatible HTTP API in front of the ``engine`` replicas (see the module doc)."""

    def __init__(self, engine: Any, config: dict[str, Any], model_id: str) -> None:
        self.engine = engine
        self.config = DaemonConfig.model_validate(config)
        self.model_id = model_id
        self.api_key = self.config.http.api_key()
        self.created = int(time.time())
        self.retries = 0  # requests sent to another replica after theirs died (reported by /health)

    async def __call__(self, request: Any) -> Any:
        from starlette.responses import JSONResponse

        from edgevlm.daemon.openai_api import (
            _http_error,
            authorised,
            model_response,
            models_body,
            unauthorised,
        )

        path, method = request.url.path.rstrip("/"), request.method
        if path == "/health" and method == "GET":
            return JSONResponse({"status": "ok", "model": self.model_id, "replica_retries": self.retries})
        if path == "/v1/models" and method == "GET":
            return JSONResponse(models_body(self.model_id, self.created)) if authorised(
                request, self.api_key) else unauthorised()
        if path.startswith("/v1/models/") and method == "GET":  # the openai client's models.retrieve
            return model_response(path[len("/v1/models/"):], self.model_id, self.created) if authorised(
                request, self.api_key) else unauthorised()
        if path == "/v1/chat/completions" and method == "POST":
            return await self._chat(request)
        return _http_error(404, f"no route {method} {path}", code="not_found")

    async def _chat(self, request: Any) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        from edgevlm.daemon.openai_api import (
            completion_body,
            error_response,
            read_chat_request,
            sse_events,
            wire_error,
        )

        parsed = await read_chat_request(request, self.config.http, self.model_id, self.config.limits, self.api_key)
        if isinstance(parsed, EdgeVLMError):
            return error_response(parsed)
        if not isinstance(parsed, tuple):
            return parsed
        req, stream, include_usage = parsed
        timeout_ms = request_timeout_ms(req.timeout_ms, self.config.defaults.timeout_ms)  # the one deadline rule
        limit_s = deadline_s(timeout_ms)
        deadline = None if limit_s is None else time.monotonic() + limit_s
        payload = req.model_dump(mode="json", exclude_none=True)
        if not stream:
            response = await self._ask(payload, deadline, timeout_ms)
            if not response.ok:
                return error_response(wire_error(response))
            return JSONResponse(completion_body(response, self.model_id))
        items = self._stream(payload, deadline, timeout_ms)
        first = await items.__anext__()
        if first[0] == "done" and not first[1].ok:
            return error_response(wire_error(first[1]))

        async def replay() -> AsyncIterator[tuple[str, Any]]:
            yield first
            async for item in items:
                yield item

        return StreamingResponse(sse_events(replay(), self.model_id, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _left_s(self, deadline: float | None, timeout_ms: int) -> float | None:
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DeadlineExceededError(f"deadline of {timeout_ms} ms passed", details={"timeout_ms": timeout_ms})
        return left

    async def _ask(self, payload: dict[str, Any], deadline: float | None, timeout_ms: int) -> Response:
        retries = self.config.ray.request_retries
        attempt = 0
        while True:
            try:
                left = self._left_s(deadline, timeout_ms)
                result = await asyncio.wait_for(self.engine.ask.remote(payload), left)
                return Response.model_validate(result)
            except EdgeVLMError as err:
                return Response.failure(err)
            except asyncio.TimeoutError:
                return Response.failure(DeadlineExceededError(
                    f"deadline of {timeout_ms} ms passed before a replica answered", details={"timeout_ms": timeout_ms}))
            except Exception as exc:  # noqa: BLE001 - a dead replica is retried, anything else is INTERNAL
                if _replica_died(exc) and attempt < retries:
                    attempt += 1
                    self.retries += 1
                    logger.warning("replica died mid-request (%s); retry %d/%d on another replica",
                                   type(exc).__name__, attempt, retries)
                    continue
                return Response.failure(InternalError(f"replica call failed: {type(exc).__name__}: {exc}"))

    async def _stream(self, payload: dict[str, Any], deadline: float | None,
                      timeout_ms: int) -> AsyncIterator[tuple[str, Any]]:
        retries, attempt, sent = self.config.ray.request_retries, 0, False
        while True:
            try:
                gen = self.engine.options(stream=True).stream.remote(payload)
                while True:
                    left = self._left_s(deadline, timeout_ms)
                    kind, value = await asyncio.wait_for(gen.__anext__(), left)
                    if kind == "delta":
                        sent = True
                        yield "delta", value
                    else:
                        yield "done", Response.model_validate(value)
                        return
            except StopAsyncIteration:
                yield "done", Response.failure(InternalError("the replica ended the stream without an answer"))
                return
            except EdgeVLMError as err:
                yield "done", Response.failure(err)
                return
            except asyncio.TimeoutError:
                yield "done", Response.failure(DeadlineExceededError(
                    f"deadline of {timeout_ms} ms passed before the answer ended", details={"timeout_ms": timeout_ms}))
                return
            except Exception as exc:  # noqa: BLE001
                if _replica_died(exc) and attempt < retries and not sent:  # text already sent cannot be retried
                    attempt += 1
                    self.retries += 1
                    logger.warning("replica died before streaming (%s); retry %d/%d", type(exc).__name__, attempt,
                                   retries)
                    continue
                yield "done", Response.failure(InternalError(f"replica call failed: {type(exc).__name__}: {exc}"))
                return


def build_app(config: DaemonConfig, *, cluster_gpus: float = 0.0) -> Any:
    """The Ray Serve application (``openai`` ingress bound to ``engine`` replicas) for ``config``.

    ``cluster_gpus``: GPUs in the Ray cluster (the default ``max_replicas`` of a CUDA model).
    Raises ModelLoadError without Ray Serve installed.
    """
    _ray()
    from ray import serve

    r = config.ray
    cuda = config.model.device.startswith("cuda")
    gpus = r.num_gpus_per_replica if r.num_gpus_per_replica is not None else (1 if cuda else 0)
    max_replicas = r.max_replicas or (max(1, int(cluster_gpus // max(gpus, 1e-9))) if cuda and gpus else
                                      max(1, r.min_replicas))
    max_replicas = max(max_replicas, r.min_replicas, 1)
    engine = serve.deployment(EngineReplica, name="engine", max_ongoing_requests=r.max_ongoing_requests,
                              ray_actor_options={"num_cpus": r.num_cpus_per_replica, "num_gpus": gpus},
                              autoscaling_config={"min_replicas": r.min_replicas, "max_replicas": max_replicas,
                                                  "initial_replicas": max(r.min_replicas, 1),
                                                  "target_ongoing_requests": r.target_ongoing_requests})
    ingress = serve.deployment(OpenAIIngress, name="openai", ray_actor_options={"num_cpus": 0})
    payload = config.model_dump(mode="json")
    from edgevlm.daemon.app import served_model_id

    return ingress.bind(engine.bind(payload), payload, served_model_id(config))


def app_builder(args: dict[str, str]) -> Any:
    """Ray Serve application builder: ``serve run edgevlm.daemon.ray_serve:app_builder config=FILE``."""
    from edgevlm.config import load_daemon_config

    if "config" not in args:
        raise ValueError("pass config=PATH (the daemon YAML)")
    ray = _ray()
    config = load_daemon_config(args["config"])
    warn_ignored_settings(config)
    gpus = float(ray.cluster_resources().get("GPU", 0)) if ray.is_initialized() else 0.0
    return build_app(config, cluster_gpus=gpus)


def run(config: DaemonConfig, *, stop_event: threading.Event | None = None, ready: threading.Event | None = None) -> int:
    """``edgevlm serve-ray``: start (or join) Ray, deploy the application on ``http.host:http.port``,
    serve until SIGTERM/SIGINT or ``stop_event``, then shut Serve down. Returns the exit status."""
    ray = _ray()
    from ray import serve

    warn_ignored_settings(config)
    if not ray.is_initialized():
        ray.init(address=config.ray.address, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    gpus = float(ray.cluster_resources().get("GPU", 0))
    serve.start(http_options={"host": config.http.host, "port": config.http.port})
    serve.run(build_app(config, cluster_gpus=gpus), name="edgevlm", route_prefix="/")
    logger.info("serve-ray: OpenAI-compatible API on http://%s:%d/v1 (Ray Serve)", config.http.host, config.http.port)
    stop = stop_event or threading.Event()
    if stop_event is None and threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
    if ready is not None:
        ready.set()
    try:
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0
