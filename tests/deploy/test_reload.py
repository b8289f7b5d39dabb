"""Hot reload under continuous load: new model folders and engine bundles (verified by their
manifest hashes) are switched in between requests with zero failed requests; bad ones are rejected
with the reason published while the old engine keeps serving; SIGHUP reloads a running process."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import yaml
from process_support import reaped, stop

PROMPT = "What is in the image?"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny checkpoints that answer differently and an INT4 bundle of the second."""
    from edgevlm.quantize.build import BuildOptions, build_bundle
    from edgevlm.runtime import Engine
    from edgevlm.runtime.testing import write_tiny_checkpoint

    root = tmp_path_factory.mktemp("reload_models")
    other = write_tiny_checkpoint(root / "other", seed=1)
    bundle = build_bundle(other, root / "bundle", BuildOptions(method="rtn", onnx=False, tensorrt=False,
                                                                 calib=None)).bundle_dir  # fmt: skip
    image = np.full((32, 32, 3), 90, np.uint8)
    expected = {name: Engine.load(path).ask(image, PROMPT, max_new_tokens=3).text
                for name, path in (("other", other), ("bundle", bundle))}  # fmt: skip
    return {"other": other, "bundle": bundle, "expected": expected, "root": root}


class Load:
    """Two clients asking continuously; every response is kept."""

    def __init__(self, watcher, image_b64) -> None:
        self.responses: list[dict] = []
        self.stop = threading.Event()
        self.payload = {"prompt": PROMPT, "image_b64": image_b64(90), "max_new_tokens": 3}
        self.threads = [threading.Thread(target=self._run, args=(watcher(),), daemon=True) for _ in range(2)]

    def _run(self, w) -> None:
        while not self.stop.is_set():
            self.responses.append(w.ask("dev1", self.payload))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def texts_since(self, n: int) -> list[str]:
        return [r.get("text") for r in self.responses[n:]]


def _corrupt(bundle: Path, dest: Path) -> Path:
    shutil.copytree(bundle, dest)
    weights = dest / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    weights.write_bytes(bytes(data))
    return dest


@pytest.mark.parametrize("strategy", ["side_by_side", "drain_and_swap"])
def test_reload_under_load_has_zero_failed_requests(strategy, models, make_daemon, watcher, image_b64, tmp_path,
                                                    tiny_engine, wait_until) -> None:  # fmt: skip
    watch = tmp_path / "bundles"
    watch.mkdir()
    status = watcher()
    status.subscribe("edgevlm/dev1/reload")
    daemon = make_daemon({"reload": {"watch_dir": str(watch), "poll_interval_s": 0.1, "settle_s": 0.2,
                                     "strategy": strategy}, "queue_max_size": 16})  # fmt: skip
    mgr = daemon.reload
    first = tiny_engine.ask(np.full((32, 32, 3), 90, np.uint8), PROMPT, max_new_tokens=3).text
    with Load(watcher, image_b64) as load:
        wait_until(lambda: len(load.responses) >= 3, what="load running")
        # 1. a corrupted bundle appears: rejected, the old engine keeps serving
        _corrupt(models["bundle"], watch / "a-corrupt")
        wait_until(lambda: len(mgr.results) >= 1, what="the rejection")
        bad = mgr.results[0]
        assert not bad.ok and bad.path == str((watch / "a-corrupt").resolve())
        assert "model.safetensors does not match its SHA-256" in bad.reason
        n = len(load.responses)
        wait_until(lambda: len(load.responses) >= n + 3, what="answers after the rejection")
        assert set(load.texts_since(n)) == {first}
        # 2. a new plain model folder: loaded beside (or after draining) the old one and switched to
        shutil.copytree(models["other"], watch / "b-other")
        wait_until(lambda: len(mgr.results) >= 2, what="the reload")
        assert mgr.results[1].ok and mgr.results[1].strategy == strategy
        n = len(load.responses)
        wait_until(lambda: len(load.responses) >= n + 3, what="answers from the new engine")
        assert load.texts_since(n + 1)[-2:] == [models["expected"]["other"]] * 2
        # 3. SIGHUP-style request with a good bundle given explicitly
        mgr.request("SIGHUP", models["bundle"])
        wait_until(lambda: len(mgr.results) >= 3, what="the bundle reload")
        assert mgr.results[2].ok, mgr.results[2].reason
        n = len(load.responses)
        wait_until(lambda: len(load.responses) >= n + 3, what="answers from the bundle")
    failed = [r for r in load.responses if not r.get("ok")]
    assert failed == [] and len(load.responses) >= 12
    assert load.responses[-1]["text"] == models["expected"]["bundle"]
    published = [json.loads(m.payload) for m in status.wait("edgevlm/dev1/reload", 3)]
    assert [p["ok"] for p in published] == [False, True, True]
    assert published[0]["reason"] == bad.reason and published[2]["path"] == str(models["bundle"].resolve())
    assert published[1]["previous"] == str(Path(tiny_engine.model_dir).resolve())


def test_rejected_folders_are_not_retried_until_they_change(models, make_daemon, tmp_path, wait_until) -> None:
    watch = tmp_path / "w"
    watch.mkdir()
    daemon = make_daemon({"reload": {"watch_dir": str(watch), "poll_interval_s": 0.05, "settle_s": 0}})
    pickled = watch / "pickled"
    pickled.mkdir()
    shutil.copy(models["other"] / "config.json", pickled / "config.json")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04 not loaded")  # a pickle checkpoint
    wait_until(lambda: len(daemon.reload.results) == 1, what="the rejection")
    reason = daemon.reload.results[0].reason
    assert "only safetensors weights are accepted" in reason
    assert daemon.reload.scan() is None  # unchanged: not retried
    (pickled / "model.safetensors").write_bytes((models["other"] / "model.safetensors").read_bytes())
    (pickled / "pytorch_model.bin").unlink()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(models["other"] / f, pickled / f)
    wait_until(lambda: len(daemon.reload.results) == 2, what="the retry after the change")
    assert daemon.reload.results[1].ok
    assert daemon.scheduler.engine.model_dir.resolve() == pickled.resolve()


def test_sighup_reloads_a_running_daemon(models, tmp_path, mosquitto, watcher, wait_until, tiny_model_dir) -> None:
    current = tmp_path / "current"
    current.symlink_to(tiny_model_dir)
    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "hup"},
           "model": {"path": str(current)}, "defaults": {"max_new_tokens": 3},
           "metrics": {"listen": None}, "tegrastats": {"enabled": False}}  # fmt: skip
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(cfg))
    run = ("import sys; from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; "
           "sys.exit(run(load_daemon_config(sys.argv[1])))")  # fmt: skip
    w = watcher()
    w.subscribe("edgevlm/hup/status")
    w.subscribe("edgevlm/hup/reload")
    proc = subprocess.Popen([sys.executable, "-c", run, str(path)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    with reaped(proc):
        w.wait("edgevlm/hup/status", 1, timeout_s=120)
        current.unlink()
        current.symlink_to(models["other"])  # re-point, then ask for a reload
        proc.send_signal(signal.SIGHUP)
        result = json.loads(w.wait("edgevlm/hup/reload", 1, timeout_s=60)[0].payload)
        assert result["ok"] is True and result["trigger"] == "SIGHUP"
        assert result["path"] == str(models["other"].resolve())
        assert result["previous"] == str(tiny_model_dir.resolve())
        status = wait_until(lambda: [s for s in w.json("edgevlm/hup/status") if s.get("model") == result["path"]],
                            what="the online status naming the new model")  # fmt: skip
        assert status[-1]["state"] == "online"
        image_b64 = __import__("base64").b64encode(_png()).decode()
        r = w.ask("hup", {"prompt": PROMPT, "image_b64": image_b64, "max_new_tokens": 3})
        assert r["text"] == models["expected"]["other"]
        # the served model id follows the reload: the new folder's name answers, the old one is refused
        r = w.ask("hup", {"prompt": PROMPT, "image_b64": image_b64, "max_new_tokens": 3, "model": models["other"].name})
        assert r["text"] == models["expected"]["other"]
        r = w.ask("hup", {"prompt": PROMPT, "image_b64": image_b64, "max_new_tokens": 3,
                          "model": tiny_model_dir.resolve().name})
        assert r["ok"] is False and r["error"]["code"] == "INVALID_REQUEST"
        out, _ = stop(proc)
    assert proc.returncode == 0, out.decode(errors="replace")[-3000:]
    assert b"received SIGHUP; reloading the engine" in out



def test_sighup_loads_a_changed_model_path_and_keeps_serving_on_a_bad_one(models, tmp_path, mosquitto, watcher,
                                                                       image_b64, wait_until,
                                                                       tiny_model_dir) -> None:  # fmt: skip
    """Found by a new user: ``systemctl reload`` after editing ``model.path`` in the config file reloaded the
    old path (the file was not read again; documented, only a re-pointed symlink worked). SIGHUP now reads the
    file's ``model.path``: a changed one is loaded beside the old engine, which serves until the new one is
    ready; a folder that does not load, or a file that no longer parses, is rejected in one line and the old
    engine keeps serving; other changed settings are named in a warning (they take a restart). A real daemon
    process, SIGHUP, two clients asking throughout: no request fails."""
    cfg = {"mqtt": {"host": mosquitto.host, "port": mosquitto.port, "device_id": "dev1"},
           "model": {"path": str(tiny_model_dir)}, "defaults": {"max_new_tokens": 3}, "queue_max_size": 16,
           "metrics": {"listen": None}, "tegrastats": {"enabled": False}}  # fmt: skip
    path = tmp_path / "d.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "daemon.log"
    run = ("import sys; from edgevlm.config import load_daemon_config; from edgevlm.daemon.app import run; "
           "sys.exit(run(load_daemon_config(sys.argv[1])))")  # fmt: skip
    w = watcher()
    w.subscribe("edgevlm/dev1/status")
    w.subscribe("edgevlm/dev1/reload")

    def reload(n: int) -> dict:
        proc.send_signal(signal.SIGHUP)
        return json.loads(w.wait("edgevlm/dev1/reload", n, timeout_s=60)[n - 1].payload)

    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", run, str(path)], stdout=out, stderr=subprocess.STDOUT)
    with reaped(proc):
        w.wait("edgevlm/dev1/status", 1, timeout_s=120)
        old = w.ask("dev1", {"prompt": PROMPT, "image_b64": image_b64(90), "max_new_tokens": 3})["text"]
        assert old != models["expected"]["other"]
        with Load(watcher, image_b64) as load:
            wait_until(lambda: len(load.responses) >= 3, what="load running")
            # 1. model.path names a folder that is not there: rejected, the old engine keeps serving
            missing = tmp_path / "missing"
            path.write_text(yaml.safe_dump({**cfg, "model": {"path": str(missing)}}))
            bad = reload(1)
            assert (bad["ok"], bad["path"], bad["reason"]) == (False, str(missing), f"{missing} is not a folder")
            n = len(load.responses)
            wait_until(lambda: len(load.responses) >= n + 3, what="answers after the rejection")
            assert set(load.texts_since(n)) == {old}
            # 2. another model folder (and a setting a reload does not apply): loaded, then switched to
            path.write_text(yaml.safe_dump({**cfg, "model": {"path": str(models["other"])}, "queue_max_size": 8}))
            good = reload(2)
            assert good["ok"] is True and good["path"] == str(models["other"].resolve())
            assert good["previous"] == str(tiny_model_dir.resolve())
            n = len(load.responses)
            wait_until(lambda: len(load.responses) >= n + 3, what="answers from the new engine")
            assert load.texts_since(n + 1)[-2:] == [models["expected"]["other"]] * 2
            # 3. a config file that no longer parses: rejected, the new engine keeps serving
            path.write_text("model: {path: [\n")
            broken = reload(3)
            assert broken["ok"] is False and broken["path"] == str(models["other"])
            assert broken["reason"].startswith(f"cannot re-read {path}: $: YAML syntax error")
            n = len(load.responses)
            wait_until(lambda: len(load.responses) >= n + 3, what="answers after the broken file")
            assert set(load.texts_since(n)) == {models["expected"]["other"]}
        status = wait_until(lambda: [s for s in w.json("edgevlm/dev1/status") if s.get("model") == good["path"]],
                            what="the online status naming the new model")  # fmt: skip
        assert status[-1]["state"] == "online"
        stop(proc)
    assert proc.returncode == 0
    assert [r for r in load.responses if not r.get("ok")] == [] and len(load.responses) >= 12
    lines = log.read_text(errors="replace").splitlines()
    rejected = [ln for ln in lines if "rejected:" in ln]
    assert len(rejected) == 2, lines[-40:]
    assert rejected[0].endswith(f"reload (SIGHUP) of {missing} rejected: {missing} is not a folder; still serving "
                                f"{tiny_model_dir.resolve()}")  # fmt: skip
    assert f"reload (SIGHUP): model.path changed in {path}: {tiny_model_dir} -> {models['other']}" in "\n".join(lines)
    assert any(ln.endswith(f"reload (SIGHUP): queue_max_size changed in {path}; a reload applies model.path only: "
                           "restart the service (systemctl restart edgevlm) to apply the rest") for ln in lines)

def _png() -> bytes:
    import cv2

    ok, buf = cv2.imencode(".png", np.full((32, 32, 3), 90, np.uint8))
    assert ok
    return buf.tobytes()
