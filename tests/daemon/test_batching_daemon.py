"""Continuous batching in the daemon (edgevlm.daemon.batching) over a real mosquitto broker.

The daemon loads the tiny random checkpoint itself, with ``model.max_batch_size`` KV-cache rows and
``model.continuous_batching: true`` (the CPU override of the cloud profiles' ``runtime`` keys).
Every ok answer is checked against ``engine.ask`` (the single-request path, greedy) on the same
image, prompt and token budget.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from edgevlm.config import DaemonConfig, parse_daemon_config
from edgevlm.errors import ConfigError

REQUEST_TOPIC = "edgevlm/dev1/request"
PROMPTS = ["what colour is the circle ?", "how many shapes are there ?", "describe the scene .", "is it red ?"]


def _image(seed: int, h: int = 48, w: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


@pytest.fixture
def batch_daemon(mosquitto, tiny_model_dir) -> Iterator[Callable[..., Any]]:
    """``batch_daemon(rows=4, **model_keys)``: a started Daemon that loads the tiny checkpoint with
    ``rows`` KV-cache rows and continuous batching on (controller off unless ``controller=True``)."""
    from edgevlm.daemon.app import Daemon

    started: list[Any] = []

    def _start(rows: int = 4, controller: bool = False, **model: Any) -> Any:
        cfg = DaemonConfig.model_validate({
            "mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1"},
            "model": {"path": str(tiny_model_dir), "max_batch_size": rows, "continuous_batching": True,
                      "cpu_threads": 1, **model},
            "queue_max_size": 16,
            "defaults": {"max_new_tokens": 4, "timeout_ms": 60000},
            "controller": {"enabled": controller},
        })
        daemon = Daemon(cfg)
        daemon.start()
        started.append(daemon)
        assert daemon.wait_ready(10.0)
        return daemon

    yield _start
    for d in reversed(started):
        d.stop()


def _body(encode_image, image: np.ndarray, prompt: str, **extra: Any) -> bytes:
    return json.dumps({"prompt": prompt, "image_b64": base64.b64encode(encode_image(image)).decode(), **extra}).encode()


def _send(raw, reply: str, bodies: list[bytes]) -> list[bytes]:
    """Publish each body with its own Correlation Data; returns them in order."""
    corrs = [uuid.uuid4().bytes + bytes([i]) for i in range(len(bodies))]
    for body, corr in zip(bodies, corrs, strict=True):
        raw.publish(REQUEST_TOPIC, body, response_topic=reply, correlation=corr)
    return corrs


def _responses(raw, reply: str, corrs: list[bytes], n_before: int = 0) -> list[dict]:
    """The responses to ``corrs``, matched by Correlation Data (each exactly once)."""
    msgs = raw.wait_messages(reply, n_before + len(corrs), timeout_s=60)[n_before:]
    by_corr: dict[bytes, dict] = {}
    for m in msgs:
        corr = m.properties.CorrelationData
        assert corr not in by_corr, "a Correlation Data answered twice"
        by_corr[corr] = json.loads(m.payload)
    assert set(by_corr) == set(corrs)
    return [by_corr[c] for c in corrs]


def _queued(daemon, n: int, wait_until) -> None:
    wait_until(lambda: daemon.scheduler.queue_size() == n, what=f"{n} queued requests")


# ------------------------------------------------------------------------------ answers


def test_concurrent_requests_answered_like_single_requests(batch_daemon, tiny_engine, raw_client, encode_image,
                                                           wait_until) -> None:
    daemon = batch_daemon(rows=4)
    raw = raw_client()
    reply = "test/batch/replies"
    raw.subscribe(reply)
    cases = [(_image(i, 48 if i % 2 else 64, 64), PROMPTS[i % 4], 3 + i) for i in range(6)]
    bodies = [_body(encode_image, im, p, max_new_tokens=n) for im, p, n in cases]
    with daemon.scheduler.paused():  # all six wait, then the worker takes four at once
        corrs = _send(raw, reply, bodies)
        _queued(daemon, 6, wait_until)
    responses = _responses(raw, reply, corrs)
    for (im, p, n), resp in zip(cases, responses, strict=True):
        ref = tiny_engine.ask(im, p, max_new_tokens=n)
        assert resp["ok"] is True, resp
        assert resp["text"] == ref.text
        s = resp["stats"]
        assert s["new_tokens"] == ref.stats.new_tokens and s["finish_reason"] == ref.stats.finish_reason
        assert (s["vision_tokens"], s["prompt_tokens"]) == (ref.stats.vision_tokens, ref.stats.prompt_tokens)
        assert (s["input_height_px"], s["input_width_px"]) == (ref.stats.input_height_px, ref.stats.input_width_px)
        assert s["queue_ms"] > 0 and s["e2e_ms"] >= s["ttft_ms"] > 0 and s["backend"] == "torch"
    for resp in responses:  # where the time went, ms after receipt, stage by stage (no prepare threads on CPU)
        stages = resp["stats"]["stages_ms"]
        assert list(stages) == ["queued", "dequeued", "admitted", "first_token", "done", "replied"], stages
        values = list(stages.values())
        assert all(0 <= a <= b for a, b in zip(values, values[1:], strict=False)), stages
        assert stages["dequeued"] == round(resp["stats"]["queue_ms"], 3)
    assert max(r["stats"]["batch_size"] for r in responses) == 4  # four rows decoded together
    assert all(r["stats"]["batch_size"] >= 2 for r in responses)
    c = daemon.counters
    assert c.get("batched_requests") == 6 and c.get("responses_ok") == 6
    assert c.get("batch_joins") >= 2  # the last two were admitted into a running batch


def test_engine_swapped_while_the_worker_waits_loses_no_request(batch_daemon, tiny_model_dir, tiny_engine,
                                                                 raw_client, encode_image, wait_until) -> None:
    """A hot reload swaps the engine while the batched worker waits with the old engine's batch: the
    queued requests are batched on the new engine and every one is answered (they were admitted into
    the old batch, which was then dropped: one request per row never answered)."""
    from edgevlm.runtime import Engine

    daemon = batch_daemon(rows=4)
    new = Engine.load(tiny_model_dir, backend_options={"max_batch_size": 4})
    raw = raw_client()
    reply = "test/batch/swap"
    raw.subscribe(reply)
    cases = [(_image(20 + i), PROMPTS[i % 4], 3) for i in range(6)]
    with daemon.scheduler.paused():
        corrs = _send(raw, reply, [_body(encode_image, im, p, max_new_tokens=n) for im, p, n in cases])
        _queued(daemon, 6, wait_until)
        assert daemon.scheduler.wait_idle(10.0)
        old = daemon.scheduler.replace_engine(new)
    assert old is not new
    responses = _responses(raw, reply, corrs)
    for (im, p, n), resp in zip(cases, responses, strict=True):
        assert resp["ok"] is True, resp
        assert resp["text"] == tiny_engine.ask(im, p, max_new_tokens=n).text
    assert max(r["stats"]["batch_size"] for r in responses) == 4
    assert daemon.scheduler._batch.engine is new


def test_hot_reload_keeps_the_configured_kv_cache_rows(batch_daemon, tiny_model_dir, raw_client, encode_image,
                                                       wait_until) -> None:
    """A reload loads the new engine with the start-up options (model.max_batch_size rows here), so
    batching goes on after it (it used to load 1 row: batching silently off until a restart)."""
    from edgevlm.daemon.batching import batch_rows

    daemon = batch_daemon(rows=3)
    before = daemon.scheduler.engine
    result = daemon.reload.reload_now(tiny_model_dir, "test")
    assert result.ok, result
    assert daemon.scheduler.engine is not before and batch_rows(daemon.scheduler.engine) == 3
    raw = raw_client()
    reply = "test/batch/reloaded"
    raw.subscribe(reply)
    with daemon.scheduler.paused():
        corrs = _send(raw, reply, [_body(encode_image, _image(40 + i), PROMPTS[i], max_new_tokens=3) for i in range(3)])
        _queued(daemon, 3, wait_until)
    responses = _responses(raw, reply, corrs)
    assert all(r["ok"] for r in responses) and max(r["stats"]["batch_size"] for r in responses) >= 2


def test_batched_requests_do_not_hash_their_pixels_for_the_vision_cache(batch_daemon, tiny_engine, raw_client,
                                                                         encode_image, wait_until, monkeypatch) -> None:
    """model.vision_cache_mb is on by default, but the batched path encodes each group's images itself
    and never reads the cache: it must not hash every request's full-size pixels for a key it drops
    (BLAKE2b ~1 ms for 640x480, ~7 ms for a 1080p frame, on the inference thread for a source request)."""
    import edgevlm.runtime.engine as engine_module

    hashed: list[int] = []
    content_key = engine_module.content_key
    monkeypatch.setattr(engine_module, "content_key", lambda *a, **k: hashed.append(1) or content_key(*a, **k))
    daemon = batch_daemon(rows=2)
    assert daemon.scheduler.engine.vision_cache.budget_bytes == 64 * 2**20  # the default: on
    raw = raw_client()
    reply = "test/batch/nohash"
    raw.subscribe(reply)
    image = _image(50)
    with daemon.scheduler.paused():  # the same frame asked twice, batched together
        corrs = _send(raw, reply, [_body(encode_image, image, p, max_new_tokens=3) for p in PROMPTS[:2]])
        _queued(daemon, 2, wait_until)
    responses = _responses(raw, reply, corrs)
    for prompt, resp in zip(PROMPTS[:2], responses, strict=True):
        assert resp["ok"] is True and resp["text"] == tiny_engine.ask(image, prompt, max_new_tokens=3).text
        assert resp["stats"]["batch_size"] == 2
    assert hashed == [] and len(daemon.scheduler.engine.vision_cache) == 0


def test_request_arriving_during_decode_joins_the_batch(batch_daemon, tiny_engine, raw_client, encode_image,
                                                        wait_until) -> None:
    daemon = batch_daemon(rows=4)
    raw = raw_client()
    reply = "test/batch/join"
    raw.subscribe(reply)
    long_img, short_img = _image(10), _image(11)
    long_tokens = 400  # the tiny model's cache holds 512 positions
    ref_long = tiny_engine.ask(long_img, PROMPTS[0], max_new_tokens=long_tokens)
    assert ref_long.stats.finish_reason == "length"  # no EOS: it decodes for all 400 steps
    corrs = _send(raw, reply, [_body(encode_image, long_img, PROMPTS[0], max_new_tokens=long_tokens)])
    batch = wait_until(lambda: daemon.scheduler._batch, what="the batch worker")
    wait_until(lambda: batch.batcher.n_running == 1, what="the long request decoding")
    corrs += _send(raw, reply, [_body(encode_image, short_img, PROMPTS[1], max_new_tokens=3)])
    long_resp, short_resp = _responses(raw, reply, corrs)
    assert long_resp["text"] == ref_long.text and long_resp["stats"]["new_tokens"] == long_tokens
    assert short_resp["text"] == tiny_engine.ask(short_img, PROMPTS[1], max_new_tokens=3).text
    assert short_resp["stats"]["batch_size"] == 2 and long_resp["stats"]["batch_size"] == 2
    assert daemon.counters.get("batch_joins") == 1


# ------------------------------------------------------------------------------ deadlines and errors


def test_deadline_passing_while_waiting_is_answered_without_disturbing_the_batch(
        batch_daemon, tiny_engine, raw_client, encode_image, wait_until) -> None:
    daemon = batch_daemon(rows=2)
    raw = raw_client()
    reply = "test/batch/deadline"
    raw.subscribe(reply)
    imgs = [_image(20), _image(21), _image(22)]
    bodies = [_body(encode_image, imgs[0], PROMPTS[0], max_new_tokens=6),
              _body(encode_image, imgs[1], PROMPTS[1], max_new_tokens=5),
              _body(encode_image, imgs[2], PROMPTS[2], max_new_tokens=5, timeout_ms=100)]
    with daemon.scheduler.paused():
        corrs = _send(raw, reply, bodies)
        _queued(daemon, 3, wait_until)
        time.sleep(0.3)  # the third request's 100 ms deadline passes while it waits
    a, b, late = _responses(raw, reply, corrs)
    assert late["ok"] is False and late["error"]["code"] == "DEADLINE_EXCEEDED"
    assert late["error"]["details"]["timeout_ms"] == 100 and late["error"]["details"]["queue_ms"] >= 100
    assert a["text"] == tiny_engine.ask(imgs[0], PROMPTS[0], max_new_tokens=6).text
    assert b["text"] == tiny_engine.ask(imgs[1], PROMPTS[1], max_new_tokens=5).text
    assert a["stats"]["batch_size"] == 2
    assert daemon.counters.get("errors_DEADLINE_EXCEEDED") == 1


def test_bad_inputs_get_typed_errors_and_the_batch_still_answers(batch_daemon, tiny_engine, raw_client, encode_image,
                                                                 wait_until) -> None:
    daemon = batch_daemon(rows=4)
    raw = raw_client()
    reply = "test/batch/bad"
    raw.subscribe(reply)
    good = [_image(30), _image(31)]
    corrupt = json.dumps({"prompt": "hi", "image_b64": base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png").decode()})
    too_long = _body(encode_image, _image(32), "what " * 600)  # more tokens than the 512-position cache
    bodies = [_body(encode_image, good[0], PROMPTS[0], max_new_tokens=5), corrupt.encode(), too_long,
              _body(encode_image, good[1], PROMPTS[3], max_new_tokens=4)]
    with daemon.scheduler.paused():
        corrs = _send(raw, reply, bodies)
        # the bridge checks the image header on receipt: the corrupt one is answered at once
        wait_until(lambda: daemon.scheduler.queue_size() + raw.count(reply) == 4, what="3 queued + 1 answered")
    ok0, bad_image, bad_prompt, ok1 = _responses(raw, reply, corrs)
    assert bad_image["error"]["code"] == "INVALID_IMAGE"
    assert bad_prompt["error"]["code"] == "INVALID_REQUEST" and "KV cache" in bad_prompt["error"]["message"]
    assert ok0["text"] == tiny_engine.ask(good[0], PROMPTS[0], max_new_tokens=5).text
    assert ok1["text"] == tiny_engine.ask(good[1], PROMPTS[3], max_new_tokens=4).text
    assert ok0["stats"]["batch_size"] == 2  # the two good ones decoded together
    # and the daemon keeps serving
    corrs = _send(raw, reply, [_body(encode_image, good[1], PROMPTS[2], max_new_tokens=3)])
    (again,) = _responses(raw, reply, corrs, n_before=4)
    assert again["text"] == tiny_engine.ask(good[1], PROMPTS[2], max_new_tokens=3).text


def test_controller_points_run_batched_with_budget_stats(batch_daemon, raw_client, encode_image, wait_until) -> None:
    daemon = batch_daemon(rows=4, controller=True)
    raw = raw_client()
    reply = "test/batch/budget"
    raw.subscribe(reply)
    with daemon.scheduler.paused():
        corrs = _send(raw, reply, [_body(encode_image, _image(40 + i), PROMPTS[i], max_new_tokens=3, budget_ms=20000)
                                   for i in range(3)])
        _queued(daemon, 3, wait_until)
    responses = _responses(raw, reply, corrs)
    names = {p.name for p in daemon.scheduler.controller.points}
    for r in responses:
        assert r["ok"] is True, r
        assert r["stats"]["budget_ms"] == 20000 and r["stats"]["operating_point"] in names
        assert r["stats"]["predicted_ms"] > 0
    assert daemon.counters.get("batched_requests") == 3


def test_one_row_engine_falls_back_to_single_requests(mosquitto, raw_client, encode_image, tiny_engine) -> None:
    # continuous batching asked for, but the adopted engine has one KV-cache row: engine.ask per request
    from edgevlm.daemon.app import Daemon

    cfg = DaemonConfig.model_validate({"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1"},
                                       "model": {"continuous_batching": True}, "controller": {"enabled": False}})
    daemon = Daemon(cfg, engine=tiny_engine)
    daemon.start()
    try:
        assert daemon.wait_ready(10.0)
        raw = raw_client()
        raw.subscribe("test/batch/one")
        img = _image(50)
        corrs = _send(raw, "test/batch/one", [_body(encode_image, img, PROMPTS[0], max_new_tokens=3)])
        (resp,) = _responses(raw, "test/batch/one", corrs)
        assert resp["text"] == tiny_engine.ask(img, PROMPTS[0], max_new_tokens=3).text
        assert "batch_size" not in resp["stats"] and daemon.counters.get("batched_requests") == 0
    finally:
        daemon.stop()


# ------------------------------------------------------------------------------ configuration


def test_batching_settings_from_profile_and_overrides() -> None:
    from edgevlm.daemon.app import batching_settings

    assert batching_settings(parse_daemon_config({})) == (False, 1024)
    assert batching_settings(parse_daemon_config({"profile": "h100", "model": {"device": "cuda"}})) == (True, 1024)
    assert batching_settings(parse_daemon_config({"profile": "a100", "model": {"device": "cuda"}})) == (True, 1024)
    cfg = parse_daemon_config({"profile": "h100", "model": {"device": "cuda", "continuous_batching": False,
                                                            "prefill_token_budget": 256}})
    assert batching_settings(cfg) == (False, 256)
    cpu = parse_daemon_config({"model": {"continuous_batching": True, "max_batch_size": 8, "prefill_token_budget": 512}})
    assert batching_settings(cpu) == (True, 512)


@pytest.mark.parametrize(("model", "message"), [
    ({"backend": "onnx", "continuous_batching": True}, "model.continuous_batching: needs backend 'torch'"),
    ({"backend": "tensorrt", "max_batch_size": 4}, "model.max_batch_size: needs backend 'torch'"),
    ({"continuous_batching": True, "max_batch_size": 1}, "model.continuous_batching: needs max_batch_size >= 2"),
    ({"max_batch_size": 0}, "model.max_batch_size: Input should be greater than or equal to 1"),
    ({"prefill_token_budget": 0}, "model.prefill_token_budget: Input should be greater than or equal to 1"),
    ({"continuous_batching": "often"}, "model.continuous_batching: Input should be a valid boolean"),
])
def test_bad_batching_config_names_the_key(model, message) -> None:
    with pytest.raises(ConfigError) as err:
        parse_daemon_config({"model": model})
    assert err.value.message.startswith(message)


def test_profile_runtime_batching_keys(tmp_path) -> None:
    from edgevlm.profile import load_profile

    for name in ("a100", "h100"):
        r = load_profile(name).runtime
        assert r.continuous_batching is True and r.prefill_token_budget == 1024 and r.max_batch_size >= 2
    assert load_profile("cpu").runtime.continuous_batching is False
    src = load_profile("h100").model_dump(mode="json")  # with one row and batching on: refused
    src["runtime"].update(max_batch_size=1, continuous_batching=True)
    import yaml

    bad = tmp_path / "h100.yaml"
    bad.write_text(yaml.safe_dump(src))
    with pytest.raises(ConfigError, match="runtime.continuous_batching: needs max_batch_size >= 2"):
        load_profile(bad)
    src["runtime"].update(max_batch_size=2, prefill_token_budget=0)
    bad.write_text(yaml.safe_dump(src))
    with pytest.raises(ConfigError, match="runtime.prefill_token_budget"):
        load_profile(bad)


def test_warm_up_runs_one_group_per_rows_bucket_and_leaves_the_worker_as_it_was(tiny_model_dir, tiny_engine) -> None:
    """BatchWorker.warm_up (run at start-up on a CUDA backend, to capture the CUDA graphs of every rows
    bucket): groups of 1, 2, 4 ... rows, the worker idle afterwards with its budgets restored and no
    admission cost learnt from the warm-up; requests after it answer as engine.ask does."""
    from edgevlm.daemon.batching import BatchWorker
    from edgevlm.daemon.scheduler import WARM_UP_IMAGE_PX, WARM_UP_PROMPT
    from edgevlm.runtime import Engine

    engine = Engine.load(tiny_model_dir, device="cpu", backend_options={"max_batch_size": 6})
    batch = BatchWorker(engine, token_budget=64, prefill_budget_ms=30.0)
    image = np.full((*WARM_UP_IMAGE_PX, 3), 128, dtype=np.uint8)
    b = batch.batcher
    submitted = []
    real_submit = b.submit
    b.submit = lambda req: (submitted.append(req.params.greedy), real_submit(req))[1]
    assert batch.warm_up(image, WARM_UP_PROMPT) == [1, 2, 4, 6]
    del b.submit
    # each size greedy (the decode step fed on the device) and sampled (the host-fed step): both graphs captured
    assert submitted == [g for n in (1, 2, 4, 6) for g in [True] * n + [False] * n]
    assert batch.idle and batch.free_slots() == 6
    assert (b.token_budget, b.prefill_budget_ms, b.s_per_token) == (64, 30.0, None)
    assert b.steps >= 8
    img = _image(5, 48, 64)
    batch.add("after", img, PROMPTS[0], max_new_tokens=4, operating_point=None, deadline_s=None)
    out = []
    while not batch.idle:
        out += batch.step()
    assert [(tag, a.text) for tag, a in out] == [("after", tiny_engine.ask(img, PROMPTS[0], max_new_tokens=4).text)]
    batch.add("busy", img, PROMPTS[0], max_new_tokens=4, operating_point=None, deadline_s=None)
    with pytest.raises(RuntimeError, match="idle"):
        batch.warm_up(image, WARM_UP_PROMPT)


def test_a_cpu_daemon_runs_no_warm_up(batch_daemon) -> None:
    """No CUDA graphs to capture on the CPU: the batching daemon starts without the warm-up."""
    daemon = batch_daemon(rows=4)
    assert daemon.scheduler._batch is not None and daemon.scheduler.warm_up_groups == []


def test_batching_bench_passes_its_rows_in_the_config(tmp_path) -> None:
    """``bench/batching_daemon.py`` builds its engine itself; its config asks for continuous batching, so it
    must name the rows too (``model.continuous_batching`` without ``model.max_batch_size`` on CPU is refused)."""
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "bench" / "batching_daemon.py"
    proc = subprocess.run([sys.executable, str(bench), "--clients", "2", "--per-client", "2", "--rows", "2",
                           "--max-new-tokens", "3", "--budget-ms", "20000"],
                          capture_output=True, text=True, timeout=170, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [(r["mode"], r["rows"], r["answered"]) for r in result["results"]] == [("off", 1, 4), ("on", 2, 4)]
