"""Audio sources: microphones (PortAudio through ``sounddevice``) and WAV files played like one.

Every source runs the same pipeline on a processing thread: capture blocks at the device's own
rate and channel count -> :func:`~edgevlm.daemon.audio_dsp.downmix` to mono ->
:class:`~edgevlm.daemon.audio_dsp.Resampler` to ``sample_rate_hz`` (16 kHz by default) -> a
:class:`~edgevlm.daemon.audio_dsp.RingBuffer` of the last ``buffer_s`` seconds, a level meter and
a :class:`~edgevlm.daemon.audio_dsp.VoiceActivity` detector whose events go to a listener (the
daemon publishes them on ``<prefix>/<device_id>/audio/<name>/events``).

Microphones are opened at their *native* rate (PortAudio's default sample rate of the device, or
``device_rate_hz``) and channel count, never at the wanted rate: many USB microphones only offer
48000 or 44100 Hz, and a driver-side conversion (ALSA ``plug``) is not always there. A stream that
fails to open, reports an error or stops delivering for ``STALL_S`` is reopened with capped
exponential backoff. A WAV file with ``loop: false`` is played once: at its end the source
publishes an ``end_of_file`` event and its state becomes ``ended`` (it is not reopened).
``sounddevice`` is the ``audio`` extra (``pip install 'edgevlm[audio]'``;
it needs the PortAudio library, ``apt-get install libportaudio2``).

:meth:`AudioSource.features` returns log-mel features (64 bins, 25 ms window, 10 ms hop) of the
last N seconds (:func:`~edgevlm.daemon.audio_dsp.log_mel`); the MQTT request for them is in
:mod:`edgevlm.daemon.audio_request` (re-exported here).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from edgevlm.config import AudioSourceConfig
from edgevlm.daemon.audio_dsp import (
    Resampler,
    RingBuffer,
    VoiceActivity,
    downmix,
    level_dbfs,
    log_mel,
    peak_dbfs,
)
from edgevlm.daemon.audio_request import FeaturesRequest, features_response, make_features_handler
from edgevlm.errors import InternalError, UnknownSourceError

logger = logging.getLogger(__name__)

__all__ = [
    "ENDED",
    "STALL_S",
    "AudioManager",
    "AudioSource",
    "FeaturesRequest",  # edgevlm.daemon.audio_request
    "features_response",
    "import_sounddevice",
    "make_features_handler",
    "native_input_settings",
]

STALL_S = 2.0
ENDED = "ended"  # state of a WAV source with loop: false after its one pass
_MAX_VIRTUAL_CHANNELS = 8  # ALSA/PulseAudio mixing devices report 32-128 "channels": open 2 of them

AudioListener = Callable[["AudioSource", dict[str, Any]], None]


def import_sounddevice() -> Any:
    """The ``sounddevice`` module (PortAudio), imported at the microphone boundary.

    Raises:
        ImportError: naming the fix: ``pip install 'edgevlm[audio]'`` when sounddevice is missing,
            ``apt-get install libportaudio2`` when the PortAudio library is (sounddevice raises
            OSError then).
    """
    try:
        import sounddevice as sd
    except ImportError as exc:
        raise ImportError("microphones need sounddevice: pip install 'edgevlm[audio]'") from exc
    except OSError as exc:  # the PortAudio library itself is missing
        raise ImportError(f"microphones need PortAudio ({exc}): apt-get install libportaudio2") from exc
    return sd


def native_input_settings(device_info: dict[str, Any], cfg: AudioSourceConfig) -> tuple[int, int]:
    """``(rate_hz, channels)`` to open a device at: its default (native) rate unless
    ``device_rate_hz`` is set, and its channel count (2 for mixing devices reporting more than 8)
    unless ``device_channels`` is set."""
    rate = cfg.device_rate_hz or int(round(float(device_info["default_samplerate"])))
    ch = int(device_info["max_input_channels"])
    if cfg.device_channels is not None:
        channels = cfg.device_channels
    else:
        channels = ch if ch <= _MAX_VIRTUAL_CHANNELS else 2
    return rate, max(1, channels)


class AudioSource:
    """One audio source (see the module doc). Thread-safe readers: :meth:`features`,
    :meth:`recent`, :meth:`info`."""

    def __init__(self, config: AudioSourceConfig, *, listener: AudioListener | None = None) -> None:
        self.config = config
        self.name = config.name
        self.listener = listener
        self.ring = RingBuffer(int(config.buffer_s * config.sample_rate_hz))
        self.state = "stopped"
        self.device_rate_hz: int | None = None
        self.device_channels: int | None = None
        self.device_name: str | None = None
        self.reconnects = 0
        self.last_error: str | None = None
        self.last_level_dbfs: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._blocks: queue.Queue[np.ndarray] = queue.Queue(maxsize=256)
        self.dropped_blocks = 0
        self._ended = False  # a WAV file with loop: false has been played once
        self._played_s = 0.0

    # ------------------------------------------------------------------ public
    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._ended = False
        self._thread = threading.Thread(target=self._run, name=f"edgevlm-audio-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        self._set_state("stopped")

    def recent(self, seconds: float) -> np.ndarray:
        """The last ``seconds`` of mono float32 audio at ``sample_rate_hz`` (less if not yet there)."""
        return self.ring.last(int(seconds * self.config.sample_rate_hz))

    def features(self, seconds: float) -> np.ndarray:
        """Log-mel features ``(frames, 64)`` float32 of the last ``seconds``.

        Raises:
            InternalError: no audio buffered yet (details ``reason: no_audio``).
        """
        x = self.recent(seconds)
        feats = log_mel(x, self.config.sample_rate_hz)
        if len(feats) == 0:
            raise InternalError(
                f"audio source {self.name!r} has no audio yet ({self.last_error or self.state})",
                details={"source": self.name, "reason": "no_audio", "state": self.state},
            )
        return feats

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "kind": "file" if self.config.file is not None else "microphone",
            "state": self.state,
            "device": self.device_name,
            "device_rate_hz": self.device_rate_hz,
            "device_channels": self.device_channels,
            "sample_rate_hz": self.config.sample_rate_hz,
            "buffered_s": round(min(self.ring.written, self.ring.capacity) / self.config.sample_rate_hz, 3),
            "level_dbfs": self.last_level_dbfs,
            "reconnects": self.reconnects,
            "last_error": self.last_error,
        }

    # ------------------------------------------------------------------ internals
    def _emit(self, event: dict[str, Any]) -> None:
        if self.listener is not None:
            try:
                self.listener(self, event)
            except Exception:  # noqa: BLE001 - publishing must not stop capture
                logger.exception("audio %s: listener failed", self.name)

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._emit({"type": "state", **self.info()})

    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                delivered = self._capture_once()
            except Exception as exc:  # noqa: BLE001 - a bad device must not kill the daemon
                self.last_error = f"{type(exc).__name__}: {exc}"
                delivered = False
            if self._stop.is_set():
                break
            if self._ended:  # a WAV file played once (loop: false): done, not an error
                logger.info("audio %s: end of file %s (loop: false); not replayed", self.name, self.config.file)
                self._emit({"type": "end_of_file", "ts": round(time.time(), 3), "file": str(self.config.file),
                            "played_s": self._played_s})  # fmt: skip
                self._set_state(ENDED)
                return
            failures = 0 if delivered else failures + 1
            delay = min(self.config.reconnect_max_delay_s, self.config.reopen_delay_s * 2 ** max(0, failures - 1))
            (logger.warning if failures <= 1 else logger.debug)(
                "audio %s: %s; reopening in %.2f s", self.name, self.last_error, delay)  # fmt: skip
            self._set_state("reconnecting")
            if self._stop.wait(delay):
                break
            self.reconnects += 1

    def _pipeline(self, rate_in_hz: int) -> Callable[[np.ndarray], None]:
        """A function taking ``(frames, channels)`` float32 device blocks through the pipeline."""
        cfg = self.config
        resampler = Resampler(rate_in_hz, cfg.sample_rate_hz)
        vad = VoiceActivity(cfg.sample_rate_hz, frame_ms=cfg.vad.frame_ms, threshold_db=cfg.vad.threshold_db,
                            min_level_dbfs=cfg.vad.min_level_dbfs, start_ms=cfg.vad.start_ms,
                            hangover_ms=cfg.vad.hangover_ms) if cfg.vad.enabled else None  # fmt: skip
        level_every = cfg.level_interval_s
        window: list[np.ndarray] = []
        last_level = [time.monotonic()]

        def feed(block: np.ndarray) -> None:
            mono = resampler.process(downmix(block))
            if mono.size == 0:
                return
            self.ring.write(mono)
            if vad is not None:
                for ev in vad.process(mono):
                    self._emit({"type": ev.kind, "ts": round(time.time(), 3), "offset_s": ev.offset_s,
                                "level_dbfs": ev.level_dbfs,
                                **({"duration_s": ev.duration_s} if ev.duration_s is not None else {})})  # fmt: skip
            window.append(mono)
            now = time.monotonic()
            if level_every is not None and now - last_level[0] >= level_every:
                x = np.concatenate(window)
                window.clear()
                last_level[0] = now
                self.last_level_dbfs = round(level_dbfs(x), 2)
                self._emit({"type": "level", "ts": round(time.time(), 3), "rms_dbfs": self.last_level_dbfs,
                            "peak_dbfs": round(peak_dbfs(x), 2), "voice": bool(vad and vad.active)})  # fmt: skip
            elif level_every is None:
                window.clear()

        return feed

    def _capture_once(self) -> bool:
        """Open, stream until stop/error/stall; returns whether any audio was delivered."""
        if self.config.file is not None:
            return self._play_wav()
        return self._record()

    def _play_wav(self) -> bool:
        from edgevlm.daemon.wav import read_wav

        cfg = self.config
        assert cfg.file is not None
        samples, info = read_wav(cfg.file)
        if len(samples) == 0:
            raise ValueError(f"{cfg.file}: no audio frames")
        self.device_name, self.device_rate_hz, self.device_channels = str(cfg.file), info.sample_rate_hz, info.channels
        feed = self._pipeline(info.sample_rate_hz)
        block = max(1, info.sample_rate_hz * cfg.block_ms // 1000)
        if cfg.loop and len(samples) < block:  # a file shorter than a block, looped: whole blocks of its loops,
            samples = np.tile(samples, (-(-block // len(samples)), 1))  # not one pass (a 1-sample file: 48000/s)
        self._set_state("streaming")
        t0, pos, sent = time.monotonic(), 0, 0
        while not self._stop.is_set():
            if pos >= len(samples):
                if not cfg.loop:
                    self._ended, self._played_s = True, round(sent / info.sample_rate_hz, 3)
                    return True
                pos = 0
            chunk = samples[pos : pos + block]
            pos += len(chunk)
            feed(chunk)
            sent += len(chunk)
            due = t0 + sent / info.sample_rate_hz
            if self._stop.wait(max(0.0, due - time.monotonic())):
                break
        return True

    def _record(self) -> bool:
        sd = import_sounddevice()
        cfg = self.config
        info = sd.query_devices(cfg.device, kind="input")
        rate, channels = native_input_settings(info, cfg)
        self.device_name, self.device_rate_hz, self.device_channels = str(info["name"]), rate, channels
        feed = self._pipeline(rate)
        errors: list[str] = []

        def callback(indata: np.ndarray, frames: int, time_info: Any, status: Any) -> None:
            if status.input_overflow:
                self.dropped_blocks += 1
            try:
                self._blocks.put_nowait(indata.copy())
            except queue.Full:
                self.dropped_blocks += 1

        def finished() -> None:
            errors.append("stream finished")

        block = max(1, rate * cfg.block_ms // 1000)
        while not self._blocks.empty():  # blocks of a previous stream
            self._blocks.get_nowait()
        stream = sd.InputStream(device=info["index"], samplerate=rate, channels=channels, dtype="float32",
                                blocksize=block, callback=callback, finished_callback=finished)  # fmt: skip
        delivered = False
        with stream:
            logger.info("audio %s: recording %s at %d Hz x %d ch (-> %d Hz mono)", self.name, info["name"],
                        rate, channels, cfg.sample_rate_hz)  # fmt: skip
            self._set_state("streaming")
            last = time.monotonic()
            while not self._stop.is_set():
                try:
                    data = self._blocks.get(timeout=0.1)
                except queue.Empty:
                    if errors or not stream.active:
                        self.last_error = f"stream stopped ({errors[0] if errors else 'inactive'})"
                        return delivered
                    if time.monotonic() - last > STALL_S:
                        self.last_error = f"no audio for {STALL_S} s"
                        return delivered
                    continue
                last = time.monotonic()
                delivered = True
                feed(data)
        return delivered


class AudioManager:
    """All configured audio sources by name."""

    def __init__(self, configs: list[AudioSourceConfig], *, listener: AudioListener | None = None) -> None:
        self.sources = {c.name: AudioSource(c, listener=listener) for c in configs}

    @property
    def names(self) -> list[str]:
        return list(self.sources)

    def get(self, name: str) -> AudioSource:
        try:
            return self.sources[name]
        except KeyError:
            known = sorted(self.sources)
            raise UnknownSourceError(
                f"unknown audio source {name!r} (known: {', '.join(known) or 'none configured'})",
                details={"source": name, "known": known},
            ) from None

    def start(self) -> None:
        for s in self.sources.values():
            s.start()

    def stop(self) -> None:
        for s in self.sources.values():
            s.stop()
