"""Edge-to-pool offload (issue 14 §2): answer through a pool what this daemon cannot serve itself.

When ``offload.pool`` is set, :class:`~edgevlm.daemon.scheduler.Scheduler.submit` hands a request to
the :class:`Offloader` instead of refusing or queueing it when

- ``offload.on_budget_miss`` and the latency controller predicts that even its cheapest operating
  point misses the request's budget (the refusal the request would get today), or
- ``offload.on_unknown_model`` and the request's ``model`` is not the model served here,

and the pool has a member online. The offloader is an SDK client in pool mode
(:class:`edgevlm.client.Client`), connected to ``offload.host:port`` (default: the daemon's own broker;
an edge broker bridged to a cloud broker works the same, the bridge forwarding
``<prefix>/pools/<pool>/request`` out and the pool's response topics and statuses in). It sends a new
request carrying the image inline (a camera's frame is encoded as JPEG: the pool has no cameras), the
budget and timeout left minus ``offload.margin_ms`` for the extra hop, with the SDK's delivery
(re-sends, Message Expiry, one answer). The pool's answer goes back on the ORIGINAL request's
Response Topic with its Correlation Data (the requester never knows), its stats gaining
``offloaded_to`` (the pool), ``offload_ms`` (round trip to the pool minus the pool's own ``e2e_ms``)
and the edge's ``queue_ms``. A pool that is unreachable or has no member online is not used: the
request is served or refused as without offload.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from edgevlm.config import DaemonConfig
from edgevlm.errors import DeadlineExceededError, EdgeVLMError, InternalError
from edgevlm.protocol import Frame, Request, Response, deadline_s

logger = logging.getLogger(__name__)


class Offloader:
    """Forwards requests to ``config.offload.pool`` (see the module doc). Thread-safe."""

    def __init__(self, config: DaemonConfig, sources: Any, counters: Any = None) -> None:
        self.config = config
        self.cfg = config.offload
        self.sources = sources
        self.counters = counters
        self._client: Any = None
        self._lock = threading.Lock()
        self._in_flight = 0
        self._pool = ThreadPoolExecutor(max_workers=min(self.cfg.max_in_flight, 32), thread_name_prefix="offload")
        self._connector: threading.Thread | None = None
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Connect to the pool's broker in the background (retried until :meth:`stop`)."""
        self._connector = threading.Thread(target=self._connect_loop, name="offload-connect", daemon=True)
        self._connector.start()

    def _connect_loop(self) -> None:
        from edgevlm.client import Client
        from edgevlm.errors import BrokerUnreachableError

        m = self.config.mqtt
        host, port = self.cfg.host or m.host, self.cfg.port or m.port
        while not self._stopping and self._client is None:
            try:
                client = Client(host, port, pool=self.cfg.pool, prefix=m.prefix, username=m.username,
                                password=m.password, connect_timeout_s=5.0, resend_interval_s=1.0)
            except EdgeVLMError as exc:
                if not isinstance(exc, BrokerUnreachableError):  # a setting no retry can fix: one line, stop
                    logger.error("offload: pool %r cannot be used: %s; offload is off", self.cfg.pool, exc.message)
                    return
                logger.warning("offload: cannot reach the broker of pool %r at %s:%d (%s); retrying",
                               self.cfg.pool, host, port, exc.message)
                time.sleep(2.0)
                continue
            except OSError as exc:
                logger.warning("offload: cannot reach the broker of pool %r at %s:%d (%s); retrying",
                               self.cfg.pool, host, port, getattr(exc, "message", exc))
                time.sleep(2.0)
                continue
            self._client = client
            logger.info("offload: connected to pool %r at %s:%d", self.cfg.pool, host, port)

    def stop(self) -> None:
        self._stopping = True
        self._pool.shutdown(wait=False, cancel_futures=False)
        if self._client is not None:
            self._client.close()

    # ------------------------------------------------------------------ decisions
    def available(self, model: str | None = None) -> bool:
        """Connected, a member of the pool online (with ``model``: one whose status says it serves that
        model, or says nothing of it), and room for one more forwarded request."""
        client = self._client
        if client is None or not client.connected:
            return False
        with self._lock:
            if self._in_flight >= self.cfg.max_in_flight:
                return False
        return any(s.state == "online" and (model is None or getattr(s, "model_id", None) in (None, model))
                   for s in client.pool_members.values())

    def submit(self, job: Any, reason: str) -> None:
        """Forward ``job`` (a :class:`~edgevlm.daemon.scheduler.Job`); answered via ``job.reply``."""
        with self._lock:
            self._in_flight += 1
        if self.counters is not None:
            self.counters.inc(f"offloaded_{reason}")
        logger.info("offload: request forwarded to pool %r (%s)", self.cfg.pool, reason)
        self._pool.submit(self._forward, job)

    # ------------------------------------------------------------------ forwarding
    def _forward(self, job: Any) -> None:
        try:
            response = self._roundtrip(job)
        except EdgeVLMError as err:
            response = Response.failure(err, job.request.correlation_id)
        except Exception as exc:  # noqa: BLE001 - the job is answered whatever happens
            logger.exception("offload: forwarding failed")
            response = Response.failure(InternalError(f"offload failed: {type(exc).__name__}: {exc}"),
                                        job.request.correlation_id)
        finally:
            with self._lock:
                self._in_flight -= 1
        try:
            job.reply(response)
        except Exception:  # noqa: BLE001 - a failed publish must not kill the offload thread
            logger.exception("offload: could not send the response")

    def _roundtrip(self, job: Any) -> Response:
        req: Request = job.request
        margin = self.cfg.margin_ms
        now = time.monotonic()
        elapsed_ms = (now - job.received_monotonic) * 1000.0
        frame: Frame | None = None
        if req.source is not None:
            captured = self.sources.get(req.source).frame_for_request(1.0, req.frame_seq)
            image_b64 = base64.b64encode(_jpeg(captured.image)).decode("ascii")
            frame = Frame(source=captured.source, ts=captured.ts, pos_ms=captured.pos_ms, index=captured.index,
                          seq=captured.seq)
        else:
            image_b64 = req.image_b64
        fields: dict[str, Any] = {"prompt": req.prompt, "image_b64": image_b64}
        for name in ("max_new_tokens", "temperature", "top_p", "stop", "seed", "model"):
            if getattr(req, name) is not None:
                fields[name] = getattr(req, name)
        timeout_s: float | None = None
        if deadline_s(job.timeout_ms) is not None:
            left_ms = job.timeout_ms - elapsed_ms - margin
            if left_ms <= 0:
                raise DeadlineExceededError(f"timeout_ms {job.timeout_ms} left no time for the offload hop "
                                            f"(offload.margin_ms={margin})", details={"timeout_ms": job.timeout_ms})
            fields["timeout_ms"] = max(1, int(left_ms))
            timeout_s = left_ms / 1000.0
        if req.budget_ms is not None:
            fields["budget_ms"] = max(1, int(req.budget_ms - elapsed_ms - margin))
        payload = Request.model_validate(fields).model_dump_json(exclude_none=True).encode()
        t0 = time.monotonic()
        answer = self._client.request(payload, timeout_s=timeout_s)
        hop_ms = (time.monotonic() - t0) * 1000.0 - answer.stats.e2e_ms
        answer.stats.offloaded_to = self.cfg.pool  # extra stats fields (Stats allows extras)
        answer.stats.offload_ms = round(hop_ms, 3)
        answer.stats.queue_ms = round(elapsed_ms, 3)
        return Response.success(answer, frame, req.correlation_id)


def _jpeg(rgb: Any) -> bytes:
    import cv2

    ok, buf = cv2.imencode(".jpg", rgb[:, :, ::-1], [cv2.IMWRITE_JPEG_QUALITY, 92])
    if not ok:
        raise InternalError("offload: cannot encode the camera frame as JPEG")
    return buf.tobytes()
