"""Audio signal processing for the daemon's audio sources (numpy only).

- :class:`Resampler`: streaming rational-ratio resampling by a polyphase FIR (Crochiere & Rabiner,
  "Multirate Digital Signal Processing", 1983, ch. 4). The prototype low-pass is a Kaiser-windowed
  sinc at the upsampled rate, cutoff at the lower of the two Nyquist frequencies, 10 zero
  crossings per side of the slower rate (the design ``scipy.signal.resample_poly`` uses), with
  Kaiser beta 8 (~80 dB stopband). Output is aligned with the input (the filter's group delay is
  compensated), so streaming in any chunking gives the same samples as one call.
- :func:`downmix`: channels -> mono by averaging.
- :class:`RingBuffer`: the last N seconds of mono audio.
- :func:`log_mel`: log-mel filterbank features (64 bins, 25 ms Hann window, 10 ms hop, 512-point
  FFT, HTK mel scale ``2595 log10(1 + f/700)``, triangular filters from 0 Hz to Nyquist, natural
  log of power with a 1e-10 floor; frames without padding, Kaldi ``snip-edges`` style).
- :class:`VoiceActivity`: an energy voice-activity detector with an adaptive noise floor,
  start confirmation and hangover; :func:`level_dbfs` (RMS, dB relative to full scale: a
  full-scale square wave is 0 dBFS, a full-scale sine -3.01 dBFS).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

KAISER_BETA = 8.0
ZERO_CROSSINGS = 10
N_MELS = 64
WIN_MS = 25.0
HOP_MS = 10.0
N_FFT = 512
LOG_FLOOR = 1e-10


class Resampler:
    """Streaming resampler from ``rate_in_hz`` to ``rate_out_hz`` (mono float32 blocks).

    :meth:`process` returns every output sample whose filter window is complete, so output lags
    input by the filter half-length (``delay_in_samples`` input samples); :meth:`flush` pads with
    zeros and returns the rest.

    Raises:
        ValueError: a rate that is not a positive integer.
    """

    def __init__(self, rate_in_hz: int, rate_out_hz: int) -> None:
        if rate_in_hz <= 0 or rate_out_hz <= 0:
            raise ValueError(f"rates must be > 0, got {rate_in_hz} -> {rate_out_hz}")
        g = math.gcd(int(rate_in_hz), int(rate_out_hz))
        self.up, self.down = int(rate_out_hz) // g, int(rate_in_hz) // g  # L, M
        self.rate_in_hz, self.rate_out_hz = int(rate_in_hz), int(rate_out_hz)
        L, M = self.up, self.down  # noqa: N806 - the textbook's names
        half = ZERO_CROSSINGS * max(L, M)
        k = np.arange(-half, half + 1, dtype=np.float64)
        cutoff = 0.5 / max(L, M)  # cycles per upsampled sample
        h = 2 * cutoff * np.sinc(2 * cutoff * k) * np.kaiser(2 * half + 1, KAISER_BETA) * L
        self.delay = half  # upsampled samples
        taps = -(-len(h) // L)
        padded = np.zeros(taps * L)
        padded[: len(h)] = h
        self._phases = padded.reshape(taps, L).T.astype(np.float32)  # (L, taps): P[p, j] = h[p + j*L]
        self._taps = taps
        self._buf = np.zeros(taps, np.float32)  # input history; global index of _buf[0] is _x0
        self._x0 = -taps
        self._n = 0  # next output sample (global index)
        self.identity = L == 1 and M == 1

    @property
    def delay_in_samples(self) -> float:
        return self.delay / self.up

    def process(self, x: np.ndarray) -> np.ndarray:
        """Feed ``(n,)`` float32 input; returns the output samples now complete."""
        x = np.asarray(x, np.float32).reshape(-1)
        if self.identity:
            return x.copy()
        self._buf = np.concatenate([self._buf, x])
        return self._emit(self._x0 + len(self._buf) - 1)

    def flush(self) -> np.ndarray:
        """Pad the input with zeros past the filter delay and return the remaining output."""
        if self.identity:
            return np.zeros(0, np.float32)
        last_real = self._x0 + len(self._buf) - 1
        pad = np.zeros(-(-self.delay // self.up) + 1, np.float32)
        self._buf = np.concatenate([self._buf, pad])
        # outputs up to the one aligned with the last real input sample
        end_n = (last_real * self.up) // self.down
        out = self._emit(self._x0 + len(self._buf) - 1)
        keep = max(0, end_n - (self._n - len(out)) + 1)
        return out[:keep]

    def _emit(self, last_index: int) -> np.ndarray:
        L, M, T = self.up, self.down, self._taps  # noqa: N806
        # output n needs input up to base = (n*M + delay) // L <= last_index
        n_end = (last_index * L + L - 1 - self.delay) // M + 1  # first n whose window is incomplete
        if n_end <= self._n:
            return np.zeros(0, np.float32)
        n = np.arange(self._n, n_end, dtype=np.int64)
        t = n * M + self.delay
        base, phase = t // L, t % L
        idx = (base - self._x0)[:, None] - np.arange(T)[None, :]  # (N, T) into _buf
        window = self._buf[idx]
        y = np.einsum("nt,nt->n", self._phases[phase], window)
        self._n = int(n_end)
        # drop history no future output needs
        next_base = (self._n * M + self.delay) // L
        drop = next_base - (T - 1) - self._x0
        if drop > 0:
            self._buf = self._buf[drop:]
            self._x0 += drop
        return y.astype(np.float32)


def resample(x: np.ndarray, rate_in_hz: int, rate_out_hz: int) -> np.ndarray:
    """One-shot :class:`Resampler` over a whole mono signal (same length ratio, delay removed)."""
    r = Resampler(rate_in_hz, rate_out_hz)
    return np.concatenate([r.process(x), r.flush()])


def downmix(x: np.ndarray) -> np.ndarray:
    """``(frames, channels)`` or ``(frames,)`` -> mono ``(frames,)`` float32 (channel mean)."""
    x = np.asarray(x, np.float32)
    return x if x.ndim == 1 else x.mean(axis=1, dtype=np.float32)


class RingBuffer:
    """The most recent ``capacity`` mono samples (thread-safe)."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError("capacity must be > 0")
        self.capacity = capacity
        self._data = np.zeros(capacity, np.float32)
        self._pos = 0
        self.written = 0  # samples ever written
        self._lock = threading.Lock()

    def write(self, x: np.ndarray) -> None:
        x = np.asarray(x, np.float32).reshape(-1)
        total = len(x)
        x = x[-self.capacity :]
        with self._lock:
            n = len(x)
            first = min(n, self.capacity - self._pos)
            self._data[self._pos : self._pos + first] = x[:first]
            self._data[: n - first] = x[first:]
            self._pos = (self._pos + n) % self.capacity
            self.written += total

    def last(self, n: int) -> np.ndarray:
        """The last ``n`` samples, oldest first (fewer if fewer were written)."""
        with self._lock:
            n = max(0, min(n, self.capacity, self.written))
            start = (self._pos - n) % self.capacity
            if start + n <= self.capacity:
                return self._data[start : start + n].copy()
            return np.concatenate([self._data[start:], self._data[: self._pos]])


def mel_filterbank(sample_rate_hz: int, n_fft: int = N_FFT, n_mels: int = N_MELS) -> np.ndarray:
    """``(n_mels, n_fft // 2 + 1)`` triangular filters on the HTK mel scale, 0 Hz to Nyquist."""

    def mel(f: np.ndarray) -> np.ndarray:
        return 2595.0 * np.log10(1.0 + f / 700.0)

    edges_mel = np.linspace(0.0, mel(np.array(sample_rate_hz / 2.0)), n_mels + 2)
    edges_hz = 700.0 * (10.0 ** (edges_mel / 2595.0) - 1.0)
    bins_hz = np.arange(n_fft // 2 + 1) * sample_rate_hz / n_fft
    lo, mid, hi = edges_hz[:-2, None], edges_hz[1:-1, None], edges_hz[2:, None]
    up = (bins_hz[None, :] - lo) / (mid - lo)
    down = (hi - bins_hz[None, :]) / (hi - mid)
    return np.clip(np.minimum(up, down), 0.0, None).astype(np.float32)


def log_mel(x: np.ndarray, sample_rate_hz: int, *, n_mels: int = N_MELS, win_ms: float = WIN_MS,
            hop_ms: float = HOP_MS, n_fft: int = N_FFT) -> np.ndarray:  # fmt: skip
    """Log-mel features of mono float32 audio.

    Returns:
        ``(frames, n_mels)`` float32, ``frames = 1 + (len(x) - win) // hop`` (0 when shorter
        than one window), win/hop in samples at ``sample_rate_hz``.
    """
    win = int(round(sample_rate_hz * win_ms / 1000.0))
    hop = int(round(sample_rate_hz * hop_ms / 1000.0))
    if win > n_fft:
        raise ValueError(f"window of {win} samples exceeds n_fft={n_fft}")
    x = np.asarray(x, np.float32).reshape(-1)
    if len(x) < win:
        return np.zeros((0, n_mels), np.float32)
    frames = 1 + (len(x) - win) // hop
    idx = np.arange(win)[None, :] + hop * np.arange(frames)[:, None]
    window = (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(win) / win)).astype(np.float32)  # periodic Hann
    spec = np.fft.rfft(x[idx] * window, n=n_fft, axis=1)  # (frames, n_fft/2+1)
    power = (spec.real**2 + spec.imag**2).astype(np.float32)
    mel = power @ mel_filterbank(sample_rate_hz, n_fft, n_mels).T
    return np.log(np.maximum(mel, LOG_FLOOR)).astype(np.float32)


def level_dbfs(x: np.ndarray) -> float:
    """RMS level in dBFS (a full-scale square wave = 0); -200 for silence."""
    x = np.asarray(x, np.float32)
    if x.size == 0:
        return -200.0
    rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
    return 20.0 * math.log10(rms) if rms > 1e-10 else -200.0


def peak_dbfs(x: np.ndarray) -> float:
    peak = float(np.max(np.abs(x))) if np.size(x) else 0.0
    return 20.0 * math.log10(peak) if peak > 1e-10 else -200.0


@dataclass(frozen=True)
class VadEvent:
    """``voice_start`` / ``voice_end`` at ``offset_s`` seconds of audio since the detector began."""

    kind: str
    offset_s: float
    level_dbfs: float
    duration_s: float | None = None


class VoiceActivity:
    """Energy VAD over ``frame_ms`` frames (see the module doc).

    A frame is loud when its level is at least ``min_level_dbfs`` and ``threshold_db`` above the
    noise floor; the floor follows quiet frames (down at once, up slowly) and freezes during speech.
    ``start_ms`` of loud frames in a row start a segment; ``hangover_ms`` of quiet frames end it.
    """

    def __init__(self, sample_rate_hz: int, *, frame_ms: int = 30, threshold_db: float = 12.0,
                 min_level_dbfs: float = -50.0, start_ms: int = 90, hangover_ms: int = 300) -> None:  # fmt: skip
        self.frame = max(1, sample_rate_hz * frame_ms // 1000)
        self.rate = sample_rate_hz
        self.threshold_db, self.min_level_dbfs = threshold_db, min_level_dbfs
        self.start_frames = max(1, -(-start_ms // frame_ms))
        self.hang_frames = max(1, -(-hangover_ms // frame_ms))
        self.floor_db: float | None = None
        self.active = False
        self._run = 0  # loud frames in a row (idle) / quiet frames in a row (active)
        self._pending = np.zeros(0, np.float32)
        self._frames_seen = 0
        self._started_frame = 0

    def process(self, x: np.ndarray) -> list[VadEvent]:
        """Feed mono samples; returns the events they complete."""
        buf = np.concatenate([self._pending, np.asarray(x, np.float32).reshape(-1)])
        n = len(buf) // self.frame
        self._pending = buf[n * self.frame :]
        events: list[VadEvent] = []
        for i in range(n):
            level = level_dbfs(buf[i * self.frame : (i + 1) * self.frame])
            self._frames_seen += 1
            floor = level if self.floor_db is None else self.floor_db
            loud = level >= self.min_level_dbfs and level >= floor + self.threshold_db
            if not self.active:
                self.floor_db = level if level < floor else floor + 0.02 * (level - floor)
                self._run = self._run + 1 if loud else 0
                if self._run >= self.start_frames:
                    self.active, self._run = True, 0
                    self._started_frame = self._frames_seen - self.start_frames
                    events.append(VadEvent("voice_start", self._offset(self._started_frame), round(level, 2)))
            else:
                self._run = 0 if loud else self._run + 1
                if self._run >= self.hang_frames:
                    end = self._frames_seen - self._run
                    self.active, self._run = False, 0
                    dur = (end - self._started_frame) * self.frame / self.rate
                    events.append(VadEvent("voice_end", self._offset(end), round(level, 2), round(dur, 3)))
        return events

    def _offset(self, frames: int) -> float:
        return round(frames * self.frame / self.rate, 3)
