"""Hot reload of the engine: SIGHUP, or a new engine bundle / model folder in ``reload.watch_dir``.

A reload runs on its own thread while the daemon keeps serving:

1. **Pick** the candidate: with ``watch_dir``, its newest complete entry (a folder holding
   ``manifest.json`` or ``config.json`` whose files have not changed for ``settle_s``); without
   it, ``model.path`` as the config file says now (SIGHUP reads the file again: a changed
   ``model.path`` is loaded, an unchanged one again, e.g. a ``current`` symlink that was
   re-pointed; a file that no longer loads rejects the reload; other changed settings are named in
   a warning, they take a restart). A folder that was rejected is not retried until its files change.
2. **Verify**: a bundle's manifest hashes (:func:`edgevlm.runtime.bundle.verify_bundle`: every
   file's SHA-256 and size); a plain model folder is checked by loading it. Only safetensors and
   JSON are read (the loader refuses pickle checkpoints and never runs remote code).
3. **Load** with the configured device/dtype/backend. ``side_by_side`` loads while the old engine
   serves; ``drain_and_swap`` (``auto`` picks it when the free memory is below ``memory_factor``
   x the new weights) pauses the worker, frees the old engine, loads the new one, and reloads the
   old one if that fails.
4. **Load test** (``load_test``): one question on a small test image must be answered.
5. **Switch between requests**: the worker is paused only until the request in progress ends,
   the engine and its latency controller are swapped, the worker resumes. Queued requests wait,
   none fails.

The outcome is published retained on ``<prefix>/<device_id>/reload`` (``ok``, ``path``,
``strategy``, ``reason`` of a rejection, ``duration_s``) and, when it succeeded, the "online"
status names the new model. systemd is told ``RELOADING=1`` and then ``READY=1``.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgevlm.config import DaemonConfig
from edgevlm.profile import jetson_host

logger = logging.getLogger(__name__)

LOAD_TEST_PROMPT = "What is in the image?"
WAIT_IDLE_S = 600.0


@dataclass
class ReloadResult:
    """The outcome of one reload attempt (published as JSON)."""

    ok: bool
    path: str
    trigger: str
    strategy: str = ""
    reason: str | None = None
    duration_s: float = 0.0
    previous: str | None = None
    ts: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, Any]:
        out = {"schema_version": 1, **self.__dict__}
        out["duration_s"] = round(self.duration_s, 3)
        out["ts"] = round(self.ts, 3)
        return {k: v for k, v in out.items() if v is not None}


def weights_bytes(path: Path) -> int:
    """Bytes of the weight/engine files in a model folder or bundle."""
    exts = {".safetensors", ".onnx", ".data", ".engine", ".plan"}
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix in exts)


def available_bytes(device: str) -> int | None:
    """Free memory for a new engine: CUDA free memory on a discrete GPU, else ``MemAvailable``
    (CPU, and Jetson's unified memory). None when unknown."""
    if device.startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_available() and jetson_host() == (None, None):
                return int(torch.cuda.mem_get_info(torch.device(device))[0])
        except Exception:  # noqa: BLE001 - fall back to the system's view
            logger.debug("cuda memory query failed", exc_info=True)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _fingerprint(path: Path) -> tuple[int, int, int]:
    """(newest mtime_ns, total bytes, file count) of a folder: changes while it is being copied."""
    newest = size = count = 0
    for p in path.rglob("*"):
        try:
            st = p.stat()
        except OSError:
            continue
        if p.is_file():
            newest, size, count = max(newest, st.st_mtime_ns), size + st.st_size, count + 1
    return newest, size, count


class ReloadManager:
    """Runs reloads (see the module doc).

    Args:
        config: the daemon config (``model``, ``reload``).
        scheduler: the :class:`~edgevlm.daemon.scheduler.Scheduler` whose engine is swapped.
        current_path: the folder the serving engine was loaded from (None = the demo model).
        publish: called with each :class:`ReloadResult`.
        controller_factory: builds the latency controller for a new engine (or returns None).
        loader: ``loader(path) -> engine``: loads a candidate exactly as the serving engine was
            loaded (the daemon passes :func:`edgevlm.daemon.app.load_engine`: device, dtype, backend,
            KV-cache rows, the profile's runtime options).
        notifier: a :class:`~edgevlm.daemon.sdnotify.SystemdNotifier`.
    """

    def __init__(
        self,
        config: DaemonConfig,
        scheduler: Any,
        *,
        current_path: Path | None,
        loader: Callable[[Path | None], Any],
        publish: Callable[[ReloadResult], None] | None = None,
        controller_factory: Callable[[Any], Any] | None = None,
        notifier: Any = None,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.current_path = current_path.resolve() if current_path is not None else None
        self.publish = publish
        self.controller_factory = controller_factory
        self.notifier = notifier
        self.loader = loader
        self.results: list[ReloadResult] = []
        self._requests: queue.Queue[tuple[str, Path | None]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._rejected: dict[Path, tuple[int, int, int]] = {}
        self._loaded: dict[Path, tuple[int, int, int]] = {}  # folders already switched to, as they were
        self._seen: dict[Path, tuple[tuple[int, int, int], float]] = {}
        self._lock = threading.Lock()  # one reload at a time

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="edgevlm-reload", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._requests.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def request(self, trigger: str = "SIGHUP", path: Path | None = None) -> None:
        """Queue a reload (returns at once; safe from a signal handler)."""
        self._requests.put((trigger, path))

    def scan(self, *, force: bool = False) -> Path | None:
        """The newest settled candidate in ``watch_dir`` that is new or changed since it was last
        loaded or rejected (``force``: the newest settled one, for SIGHUP); None if there is none."""
        watch = self.config.reload.watch_dir
        if watch is None or not watch.is_dir():
            return None
        now = time.monotonic()
        best: tuple[int, Path] | None = None
        for entry in watch.iterdir():
            if not entry.is_dir() or not ((entry / "manifest.json").is_file() or (entry / "config.json").is_file()):
                continue
            path = entry.resolve()
            fp = _fingerprint(path)
            first = self._seen.get(path)
            if first is None or first[0] != fp:
                self._seen[path] = (fp, now)
                if self.config.reload.settle_s > 0:
                    continue
            elif now - first[1] < self.config.reload.settle_s:
                continue
            if not force and (path == self.current_path or fp in (self._rejected.get(path), self._loaded.get(path))):
                continue
            if best is None or fp[0] > best[0]:
                best = (fp[0], path)
        return best[1] if best else None

    def reload_now(self, path: Path | None, trigger: str = "manual", *, reread: bool = False) -> ReloadResult:
        """Verify, load, test and switch to the engine at ``path`` (None = the demo model); ``reread``:
        at ``model.path`` as the config file (:attr:`DaemonConfig.source_file`) says now instead. Returns
        the result (also published). Never raises for a bad candidate or config file."""
        with self._lock:
            result = self._reload(path, trigger, reread=reread)
        self.results.append(result)
        if self.publish is not None:
            try:
                self.publish(result)
            except Exception:  # noqa: BLE001 - the reload itself is done
                logger.exception("reload: cannot publish the result")
        return result

    # ------------------------------------------------------------------ internals
    def _run(self) -> None:
        poll = self.config.reload.poll_interval_s
        while not self._stop.is_set():
            try:
                trigger, path = self._requests.get(timeout=poll)
            except queue.Empty:
                trigger, path = "watch", None
            if self._stop.is_set():
                return
            if trigger == "watch" or (path is None and self.config.reload.watch_dir is not None):
                settled = self.scan(force=trigger != "watch")
                if settled is None:
                    if trigger != "watch":
                        logger.info("reload (%s): no new bundle in %s", trigger, self.config.reload.watch_dir)
                    continue
                path = settled
            try:
                if path is None:  # SIGHUP without watch_dir: model.path as the config file says now
                    self.reload_now(self.config.model.path, trigger, reread=True)
                else:
                    self.reload_now(path, trigger)
            except Exception:  # noqa: BLE001 - the reload thread must survive anything
                logger.exception("reload failed unexpectedly")

    def _verify(self, path: Path | None) -> None:
        if path is None:
            return
        from edgevlm.errors import ModelLoadError
        from edgevlm.runtime.bundle import is_bundle, verify_bundle

        if not path.is_dir():
            raise ModelLoadError(f"{path} is not a folder")
        if is_bundle(path):
            verify_bundle(path)

    def _load_test(self, engine: Any) -> None:
        if not self.config.reload.load_test:
            return
        size = int(getattr(engine, "image_size_px", 64) or 64)
        image = np.full((size, size, 3), 127, np.uint8)
        answer = engine.ask(image, LOAD_TEST_PROMPT, max_new_tokens=2)
        if not isinstance(getattr(answer, "text", None), str):
            raise RuntimeError("the load test returned no answer text")

    def _strategy(self, path: Path | None) -> str:
        strategy = self.config.reload.strategy
        if strategy != "auto":
            return strategy
        if path is None:
            return "side_by_side"
        need = weights_bytes(path) * self.config.reload.memory_factor
        free = available_bytes(self.config.model.device)
        return "side_by_side" if free is None or need <= free else "drain_and_swap"

    def _reread_model_path(self, trigger: str) -> Path | None:
        """``model.path`` as the config file says now (the config's own without a file). A changed one is
        logged; settings other than ``model.path`` that changed are named in one warning (a reload does not
        apply them).

        Raises:
            ConfigError: the file no longer loads (``cannot re-read <file>: <key>: <why>``).
        """
        from edgevlm.config import load_daemon_config
        from edgevlm.errors import ConfigError

        file = self.config.source_file
        if file is None:
            return self.config.model.path
        try:
            new = load_daemon_config(file, warn=False)  # its warnings were logged at start
        except ConfigError as exc:
            raise ConfigError(f"cannot re-read {file}: {exc.message}") from None
        old, now = self.config.model_dump(), new.model_dump()
        changed = [f"model.{k}" for k in now["model"] if k != "path" and now["model"][k] != old["model"][k]]
        changed += [k for k in now if k != "model" and now[k] != old[k]]
        if changed:
            logger.warning(
                "reload (%s): %s changed in %s; a reload applies model.path only: restart the service "
                "(systemctl restart edgevlm) to apply the rest", trigger, ", ".join(changed), file,
            )  # fmt: skip
        if new.model.path != self.config.model.path:
            logger.info("reload (%s): model.path changed in %s: %s -> %s", trigger, file,
                        self.config.model.path or "demo", new.model.path or "demo")  # fmt: skip
        return new.model.path

    def _reload(self, path: Path | None, trigger: str, *, reread: bool = False) -> ReloadResult:
        t0 = time.monotonic()
        configured = path
        previous = str(self.current_path) if self.current_path is not None else "demo"
        if reread:
            try:
                configured = path = self._reread_model_path(trigger)
            except Exception as exc:  # noqa: BLE001 - a config file that no longer loads keeps the engine
                reason = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
                shown = str(path) if path is not None else "demo"
                return self._rejected_result(shown, trigger, "", reason, t0, previous)
        path = path.resolve() if path is not None else None
        shown = str(path) if path is not None else "demo"
        if self.notifier is not None:
            self.notifier.reloading(f"reloading the engine from {shown} ({trigger})")
        strategy = ""
        try:
            self._verify(path)
            strategy = self._strategy(path)
            logger.info("reload (%s): %s -> %s (%s)", trigger, previous, shown, strategy)
            if strategy == "side_by_side":
                new = self.loader(path)
                self._load_test(new)
                controller = self.controller_factory(new) if self.controller_factory else None
                self._swap(new, controller)
            else:
                self._drain_and_swap(path)
        except Exception as exc:  # noqa: BLE001 - a bad bundle must leave the old engine serving
            reason = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
            if path is not None and path.exists():
                self._rejected[path] = _fingerprint(path)
            return self._rejected_result(shown, trigger, strategy, reason, t0, previous)
        self.current_path = path
        if reread:
            self.config.model.path = configured  # as the file says (a symlink stays a symlink)
        if path is not None:
            self._loaded[path] = _fingerprint(path)
        logger.info("reload (%s): now serving %s (%.1f s)", trigger, shown, time.monotonic() - t0)
        if self.notifier is not None:
            self.notifier.ready(f"serving {shown} (reloaded)")
        return ReloadResult(True, shown, trigger, strategy, None, time.monotonic() - t0, previous)

    def _rejected_result(
        self, shown: str, trigger: str, strategy: str, reason: str, t0: float, previous: str
    ) -> ReloadResult:
        logger.error("reload (%s) of %s rejected: %s; still serving %s", trigger, shown, reason, previous)
        if self.notifier is not None:
            self.notifier.ready(f"reload of {shown} rejected ({reason}); serving {previous}")
        return ReloadResult(False, shown, trigger, strategy, reason, time.monotonic() - t0, previous)

    def _swap(self, new: Any, controller: Any) -> Any:
        with self.scheduler.paused():
            if not self.scheduler.wait_idle(WAIT_IDLE_S):
                raise RuntimeError(f"the request in progress did not finish within {WAIT_IDLE_S} s")
            old = self.scheduler.replace_engine(new, controller)
        del old
        _free_memory()

    def _drain_and_swap(self, path: Path | None) -> None:
        with self.scheduler.paused():
            if not self.scheduler.wait_idle(WAIT_IDLE_S):
                raise RuntimeError(f"the request in progress did not finish within {WAIT_IDLE_S} s")
            old_path, old_controller = self.current_path, self.scheduler.controller
            old = self.scheduler.replace_engine(None, None)
            del old
            _free_memory()
            try:
                new = self.loader(path)
                self._load_test(new)
                controller = self.controller_factory(new) if self.controller_factory else None
                self.scheduler.replace_engine(new, controller)
            except Exception:
                logger.warning("reload: the new engine failed; reloading %s", old_path or "demo")
                self.scheduler.replace_engine(self.loader(old_path), old_controller)
                raise


def _free_memory() -> None:
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001
        pass
