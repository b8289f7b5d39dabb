"""The daemon's continuous batching (edgevlm.daemon.batching.BatchWorker) for the Qwen2.5-VL,
Qwen3-VL and SmolVLM families over a real mosquitto broker: three requests with different images,
prompts and token budgets, two KV-cache rows (the third request joins the running batch), each ok
answer equal to one-at-a-time ``Engine.ask`` (greedy) on the same image, prompt and budget."""

from __future__ import annotations

import base64
import json
import uuid

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import family_support as fs  # noqa: E402

from edgevlm.config import DaemonConfig  # noqa: E402

REQUEST_TOPIC = "edgevlm/dev1/request"


@pytest.fixture(scope="module", params=fs.FAMILIES)
def family_dir(request, tmp_path_factory):
    return fs.write_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def test_batched_daemon_answers_like_engine_ask(family_dir, mosquitto, raw_client, encode_image, wait_until):
    from edgevlm.daemon.app import Daemon
    from edgevlm.runtime import Engine

    single = Engine.load(family_dir)
    cases = [(im if not isinstance(im, list) else fs.image(90, 150, 7), p, n)
             for im, p, n in fs.requests(single.family.name)]
    cfg = DaemonConfig.model_validate({
        "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1"},
        "model": {"path": str(family_dir), "max_batch_size": 2, "continuous_batching": True, "cpu_threads": 1},
        "queue_max_size": 8,
        "defaults": {"max_new_tokens": 4, "timeout_ms": 60000},
        "controller": {"enabled": False},
    })
    daemon = Daemon(cfg)
    daemon.start()
    try:
        assert daemon.wait_ready(20.0)
        raw = raw_client()
        reply = f"test/batch/{single.family.name}"
        raw.subscribe(reply)
        corrs = [uuid.uuid4().bytes for _ in cases]
        with daemon.scheduler.paused():  # all three wait, then the worker takes two at once
            for (im, p, n), corr in zip(cases, corrs, strict=True):
                body = {"prompt": p, "image_b64": base64.b64encode(encode_image(im)).decode(), "max_new_tokens": n}
                raw.publish(REQUEST_TOPIC, json.dumps(body).encode(), response_topic=reply, correlation=corr)
            wait_until(lambda: daemon.scheduler.queue_size() == 3, what="3 queued requests")
        msgs = raw.wait_messages(reply, 3, timeout_s=60)
        by_corr = {m.properties.CorrelationData: json.loads(m.payload) for m in msgs}
        assert set(by_corr) == set(corrs)
        for (im, p, n), corr in zip(cases, corrs, strict=True):
            resp, ref = by_corr[corr], single.ask(im, p, max_new_tokens=n)
            assert resp["ok"] is True, resp
            assert resp["text"] == ref.text
            s = resp["stats"]
            assert (s["new_tokens"], s["finish_reason"]) == (ref.stats.new_tokens, ref.stats.finish_reason)
            assert (s["vision_tokens"], s["prompt_tokens"]) == (ref.stats.vision_tokens, ref.stats.prompt_tokens)
            assert (s["input_height_px"], s["input_width_px"]) == (ref.stats.input_height_px,
                                                                   ref.stats.input_width_px)
        assert max(r["stats"]["batch_size"] for r in by_corr.values()) == 2
        c = daemon.counters
        assert c.get("batched_requests") == 3 and c.get("responses_ok") == 3 and c.get("batch_joins") >= 1
    finally:
        daemon.stop()
