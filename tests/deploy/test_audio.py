"""Audio: WAV files in every sample format (written here, byte by byte), the polyphase resampler,
log-mel features, voice activity, a WAV source in the daemon with events and features over MQTT,
and a microphone captured through PortAudio from a fake ALSA device (the ``file`` plugin)."""

from __future__ import annotations

import base64
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from edgevlm.daemon.audio_dsp import (
    Resampler,
    RingBuffer,
    VoiceActivity,
    level_dbfs,
    log_mel,
    mel_filterbank,
    resample,
)
from edgevlm.daemon.wav import WavFormatError, read_wav

PCM, FLOAT, EXTENSIBLE = 1, 3, 0xFFFE
GUID_TAIL = bytes.fromhex("000000001000800000aa00389b71")


def write_wav(path: Path, x: np.ndarray, rate: int, *, tag: int = PCM, bits: int = 16, sub: int = PCM,
              valid_bits: int | None = None, extra_chunk: bytes | None = None) -> Path:  # fmt: skip
    """Write ``x`` (frames, channels) in [-1, 1] as a WAV file, encoding samples by hand."""
    frames, ch = x.shape
    fmt_code = sub if tag == EXTENSIBLE else tag
    if fmt_code == FLOAT:
        data = x.astype("<f4" if bits == 32 else "<f8").tobytes()
    elif bits == 8:
        data = np.clip(np.round(x * 128 + 128), 0, 255).astype(np.uint8).tobytes()
    elif bits == 16:
        data = np.clip(np.round(x * 32768), -32768, 32767).astype("<i2").tobytes()
    elif bits == 24:
        v = np.clip(np.round(x * 8388608), -8388608, 8388607).astype(np.int64).reshape(-1)
        v &= 0xFFFFFF
        data = np.stack([v & 0xFF, (v >> 8) & 0xFF, (v >> 16) & 0xFF], axis=1).astype(np.uint8).tobytes()
    else:  # 32-bit container; valid_bits 24 = left-justified 24-bit samples
        vb = valid_bits or 32
        v = np.clip(np.round(x * 2.0 ** (vb - 1)), -(2 ** (vb - 1)), 2 ** (vb - 1) - 1).astype(np.int64)
        data = (v << (32 - vb)).astype("<i4").tobytes()
    block = ch * bits // 8
    fmt = struct.pack("<HHIIHH", tag, ch, rate, rate * block, block, bits)
    if tag == EXTENSIBLE:
        fmt += struct.pack("<HHI", 22, valid_bits or bits, (1 << ch) - 1) + struct.pack("<H", sub) + GUID_TAIL
    chunks = b"fmt " + struct.pack("<I", len(fmt)) + fmt
    if extra_chunk is not None:  # e.g. an odd-sized LIST chunk, padded
        chunks += b"LIST" + struct.pack("<I", len(extra_chunk)) + extra_chunk + (b"\0" if len(extra_chunk) % 2 else b"")
    chunks += b"data" + struct.pack("<I", len(data)) + data
    path.write_bytes(b"RIFF" + struct.pack("<I", 4 + len(chunks)) + b"WAVE" + chunks)
    return path


def tone(freq: float, rate: int, seconds: float, amp: float = 0.5, channels: int = 1) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    x = np.zeros((len(t), channels))
    x[:, 0] = amp * np.sin(2 * np.pi * freq * t)
    if channels > 1:
        x[:, 1] = -0.25 * np.sin(2 * np.pi * freq * t)
    return x


FORMATS = [
    # (tag, bits, sub, valid_bits, tolerance)
    (PCM, 8, PCM, None, 1 / 128),
    (PCM, 16, PCM, None, 1 / 32768),
    (PCM, 24, PCM, None, 1 / 2**23),
    (PCM, 32, PCM, None, 1 / 2**31),
    (FLOAT, 32, FLOAT, None, 1e-7),
    (FLOAT, 64, FLOAT, None, 1e-7),
    (EXTENSIBLE, 16, PCM, None, 1 / 32768),
    (EXTENSIBLE, 32, PCM, 24, 1 / 2**23),
    (EXTENSIBLE, 32, FLOAT, None, 1e-7),
]


@pytest.mark.parametrize(("tag", "bits", "sub", "valid", "tol"), FORMATS)
def test_wav_every_format(tmp_path, tag, bits, sub, valid, tol) -> None:
    x = tone(440, 8000, 0.05, channels=2)
    x[0] = [-1.0, 0.999]  # extremes survive
    path = write_wav(tmp_path / "t.wav", x, 8000, tag=tag, bits=bits, sub=sub, valid_bits=valid,
                     extra_chunk=b"INFOodd")  # fmt: skip
    y, info = read_wav(path)
    assert info.sample_rate_hz == 8000 and info.channels == 2 and info.extensible == (tag == EXTENSIBLE)
    assert y.shape == x.shape and y.dtype == np.float32
    assert np.abs(y - x).max() <= tol * 1.01 + 1e-7


def test_wav_agrees_with_the_stdlib_for_16_bit(tmp_path) -> None:
    import wave

    pcm = (np.arange(-300, 300) * 100).astype("<i2")
    with wave.open(str(tmp_path / "s.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(pcm.tobytes())
    y, info = read_wav(tmp_path / "s.wav")
    assert info.bits_per_sample == 16 and (y[:, 0] * 32768).astype(np.int32).tolist() == pcm.tolist()


def test_wav_errors(tmp_path) -> None:
    def err(data: bytes) -> str:
        p = tmp_path / "bad.wav"
        p.write_bytes(data)
        with pytest.raises(WavFormatError) as info:
            read_wav(p)
        assert info.value.code.value == "INVALID_REQUEST"
        return str(info.value)

    good = write_wav(tmp_path / "g.wav", tone(440, 8000, 0.01), 8000).read_bytes()
    assert err(b"OggS" + good[4:]).endswith("not a RIFF/WAVE file")
    assert err(good[:36]).endswith("no data chunk")
    assert err(b"RF64" + good[4:]).endswith("RF64 (WAV over 4 GiB) is not supported")
    adpcm = bytearray(good)
    adpcm[20:22] = struct.pack("<H", 2)
    assert "unsupported format code 0x0002" in err(bytes(adpcm))
    twelve = bytearray(good)
    twelve[34:36] = struct.pack("<H", 12)
    assert "12-bit PCM samples are not supported" in err(bytes(twelve))
    # a file cut inside the data chunk keeps its whole frames
    p = tmp_path / "cut.wav"
    p.write_bytes(good[:-3])
    assert len(read_wav(p)[0]) == (len(good) - 44 - 3) // 2


def test_a_wav_cut_short_decodes_what_is_there_and_warns_once(tmp_path, caplog) -> None:
    import logging

    x = tone(440, 8000, 0.1)
    good = write_wav(tmp_path / "g.wav", x, 8000).read_bytes()  # 800 frames, 1600 data bytes
    cut = tmp_path / "cut.wav"
    cut.write_bytes(good[:-501])  # a recorder killed mid-write: 250 frames and half a sample gone
    caplog.set_level(logging.WARNING, logger="edgevlm.daemon.wav")
    y, _ = read_wav(cut)
    assert len(y) == 549 and np.abs(y[:, 0] - x[:549, 0]).max() <= 1 / 32768 * 1.01
    warnings = [r.getMessage() for r in caplog.records if r.name == "edgevlm.daemon.wav"]
    assert warnings == [f"{cut}: truncated WAV file: the data chunk declares 1600 bytes, 501 are missing; "
                        "decoding the 1099 bytes there"]  # fmt: skip
    caplog.clear()
    read_wav(tmp_path / "g.wav")  # a whole file: silent
    assert not [r for r in caplog.records if r.name == "edgevlm.daemon.wav"]


def test_a_wav_source_with_loop_false_plays_once_and_reports_the_end(tmp_path, wait_until) -> None:
    from edgevlm.config import AudioSourceConfig
    from edgevlm.daemon.audio import AudioSource

    wav = write_wav(tmp_path / "once.wav", tone(440, 16000, 0.4), 16000)
    events: list[dict] = []
    src = AudioSource(AudioSourceConfig(name="once", file=str(wav), loop=False, level_interval_s=None),
                      listener=lambda s, e: events.append(e))  # fmt: skip
    src.start()
    try:
        wait_until(lambda: src.state == "ended", timeout_s=10, what="the end of the file")
        written = src.ring.written
        import time

        time.sleep(1.0)  # the old behaviour replayed the file here: 0.4 s per pass
        assert src.ring.written == written and src.state == "ended" and src.reconnects == 0
    finally:
        src.stop()
    assert abs(written - 6400) <= 64  # one pass of 0.4 s at 16 kHz
    ends = [e for e in events if e["type"] == "end_of_file"]
    assert len(ends) == 1 and ends[0]["file"] == str(wav) and abs(ends[0]["played_s"] - 0.4) < 0.01
    states = [e["state"] for e in events if e["type"] == "state"]
    assert states == ["streaming", "ended", "stopped"]


def test_a_looped_wav_shorter_than_a_block_does_not_spin_a_core(tmp_path, wait_until) -> None:
    """A looped WAV of fewer samples than one block (``block_ms``) was fed one pass per iteration: a one-sample
    file at 48 kHz ran the pipeline 48000 times a second, a core busy for a click."""
    import time

    from edgevlm.config import AudioSourceConfig
    from edgevlm.daemon.audio import AudioSource

    wav = write_wav(tmp_path / "click.wav", np.full((1, 1), 0.25), 48000)
    src = AudioSource(AudioSourceConfig(name="click", file=str(wav), level_interval_s=None))
    src.start()
    try:
        wait_until(lambda: src.ring.written > 0, timeout_s=5, what="audio")
        written, cpu0, t0 = src.ring.written, time.process_time(), time.monotonic()
        time.sleep(1.0)
        cpu_s, wall_s, played = time.process_time() - cpu0, time.monotonic() - t0, src.ring.written - written
    finally:
        src.stop()
    assert cpu_s < 0.3 * wall_s, f"{cpu_s:.2f} s of CPU in {wall_s:.2f} s"
    assert abs(played - 16000 * wall_s) < 0.15 * 16000, played  # real time, at sample_rate_hz
    assert src.last_error is None and src.reconnects == 0


@pytest.mark.parametrize("rate_in", [48000, 44100, 22050, 8000])
def test_resampler_reproduces_a_tone_at_16k(rate_in) -> None:
    x = tone(1000, rate_in, 0.5)[:, 0].astype(np.float32)
    y = resample(x, rate_in, 16000)
    assert len(y) == (len(x) - 1) * 16000 // rate_in + 1
    ref = 0.5 * np.sin(2 * np.pi * 1000 * np.arange(len(y)) / 16000)
    inner = slice(300, len(y) - 300)  # away from the zero-padded edges
    assert np.abs(y[inner] - ref[inner]).max() < 2e-4


def test_resampler_removes_what_16k_cannot_carry() -> None:
    x = tone(10000, 48000, 0.5)[:, 0].astype(np.float32)  # above 8 kHz: would alias to 6 kHz
    y = resample(x, 48000, 16000)
    assert level_dbfs(y[300:-300]) - level_dbfs(x) < -60.0


def test_resampler_streaming_equals_one_shot() -> None:
    x = np.random.default_rng(0).standard_normal(44100).astype(np.float32) * 0.1
    whole = resample(x, 44100, 16000)
    r, parts, i = Resampler(44100, 16000), [], 0
    for size in [1, 7, 441, 1000, 3, 5000, 10000] * 10:
        parts.append(r.process(x[i : i + size]))
        i += size
        if i >= len(x):
            break
    parts.append(r.process(x[i:]))
    parts.append(r.flush())
    assert np.array_equal(np.concatenate(parts), whole)


def test_ring_buffer_keeps_the_newest_samples() -> None:
    rb = RingBuffer(5)
    rb.write(np.arange(3))
    assert rb.last(10).tolist() == [0, 1, 2]
    rb.write(np.arange(3, 9))
    assert rb.last(5).tolist() == [4, 5, 6, 7, 8] and rb.last(2).tolist() == [7, 8] and rb.written == 9


def test_log_mel_shape_and_tone_bin() -> None:
    x = tone(1000, 16000, 1.0)[:, 0].astype(np.float32)
    feats = log_mel(x, 16000)
    assert feats.shape == (1 + (16000 - 400) // 160, 64) == (98, 64) and feats.dtype == np.float32
    fb = mel_filterbank(16000)
    centres = (fb * (np.arange(257) * 16000 / 512)).sum(1) / fb.sum(1)
    peak = int(np.argmax(feats.mean(axis=0)))
    assert abs(centres[peak] - 1000) < 60  # the band around 1 kHz carries the tone
    assert log_mel(np.zeros(399, np.float32), 16000).shape == (0, 64)
    silent = log_mel(np.zeros(16000, np.float32), 16000)
    assert np.allclose(silent, np.log(1e-10))


def _burst(rate: int = 16000) -> np.ndarray:
    """1 s of quiet noise (-60 dBFS), 0.6 s of a -20 dBFS tone, 1 s of quiet noise."""
    rng = np.random.default_rng(1)
    noise = rng.standard_normal(int(2.6 * rate)) * 10 ** (-60 / 20)
    x = noise.copy()
    n0, n1 = rate, int(1.6 * rate)
    x[n0:n1] += np.sqrt(2) * 10 ** (-20 / 20) * np.sin(2 * np.pi * 440 * np.arange(n1 - n0) / rate)
    return x.astype(np.float32)


def test_voice_activity_finds_one_segment() -> None:
    vad = VoiceActivity(16000, frame_ms=30, threshold_db=12, start_ms=90, hangover_ms=300)
    x = _burst()
    events = []
    for i in range(0, len(x), 320):  # 20 ms blocks, as a capture stream delivers them
        events += vad.process(x[i : i + 320])
    assert [e.kind for e in events] == ["voice_start", "voice_end"]
    start, end = events
    assert abs(start.offset_s - 1.0) <= 0.06 and abs(end.offset_s - 1.6) <= 0.06
    assert abs(end.duration_s - 0.6) <= 0.1 and abs(start.level_dbfs + 20) < 1.0


def test_wav_source_in_the_daemon_publishes_events_and_answers_features(make_daemon, watcher, tmp_path,
                                                                        wait_until) -> None:  # fmt: skip
    burst = _burst(44100)[:, None] * np.array([[1.0, 1.0]])  # 44.1 kHz stereo, 24-bit
    wav = write_wav(tmp_path / "burst.wav", burst, 44100, bits=24)
    w = watcher()
    w.subscribe("edgevlm/dev1/audio/#")
    daemon = make_daemon({"audio": [{"name": "mic", "file": str(wav), "level_interval_s": 0.5,
                                     "buffer_s": 5}]})  # fmt: skip
    events_topic = "edgevlm/dev1/audio/mic/events"

    def kinds():
        return [e["type"] for e in w.json(events_topic)]

    wait_until(lambda: "voice_end" in kinds(), timeout_s=30, what="a voice segment")
    start = next(e for e in w.json(events_topic) if e["type"] == "voice_start")
    end = next(e for e in w.json(events_topic) if e["type"] == "voice_end")
    assert abs(start["offset_s"] - 1.0) <= 0.06 and abs(end["duration_s"] - 0.6) <= 0.1
    levels = [e for e in w.json(events_topic) if e["type"] == "level"]
    assert levels and all(-75 < e["rms_dbfs"] < -15 for e in levels) and start["source"] == "mic"
    state = w.json("edgevlm/dev1/audio/mic/state")[-1]
    assert state["state"] == "streaming" and state["device_rate_hz"] == 44100 and state["device_channels"] == 2

    src = daemon.audio.get("mic")
    wait_until(lambda: src.ring.written >= 16000, what="a second of audio")
    r = w_ask(w, {"source": "mic", "seconds": 1.0})
    assert r["ok"] is True and r["shape"] == [98, 64] and r["n_mels"] == 64 and r["hop_ms"] == 10.0
    feats = np.frombuffer(base64.b64decode(r["data_b64"]), "<f4").reshape(r["shape"])
    assert np.isfinite(feats).all() and feats.min() >= np.log(1e-10) - 1e-3
    # the answer's Message Expiry Interval is the request's (answered at once); none without one
    half = w_ask(w, {"source": "mic", "seconds": 0.5, "dtype": "float16"}, expiry_s=7)
    assert half["shape"] == [48, 64] and len(base64.b64decode(half["data_b64"])) == 48 * 64 * 2

    bad = w_ask(w, {"source": "nope", "seconds": 1})
    assert bad["ok"] is False and bad["error"]["code"] == "UNKNOWN_SOURCE" and bad["error"]["details"]["known"] == ["mic"]
    bad = w_ask(w, {"source": "mic", "seconds": -1})
    assert bad["error"]["code"] == "INVALID_REQUEST" and bad["error"]["message"].startswith("seconds: ")
    bad = w_ask(w, {"source": "mic", "seconds": 1, "colour": "red"})
    assert bad["error"]["message"] == "colour: unknown field"


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("seconds", "2", "seconds: Input should be a valid number"),  # a string is not a number (was 2 s)
        ("seconds", True, "seconds: Input should be a valid number"),  # nor a boolean (was 1 s)
        ("schema_version", True, "schema_version: Input should be a valid integer"),
        ("schema_version", 1.0, "schema_version: Input should be a valid integer"),
        ("dtype", 5, "dtype: Input should be a valid string"),
    ],
)
def test_features_request_values_are_strict_as_on_the_request_topic(make_daemon, watcher, tmp_path, field, value,
                                                                     fragment) -> None:  # fmt: skip
    """The audio request's values are strict like the main request's: a string or a boolean is not a number."""
    wav = write_wav(tmp_path / "tone.wav", tone(440.0, 16000, 2.0), 16000)
    w = watcher()
    make_daemon({"audio": [{"name": "mic", "file": str(wav), "buffer_s": 5}]})
    bad = w_ask(w, {"source": "mic", "seconds": 1, field: value})
    assert bad["ok"] is False and bad["error"]["code"] == "INVALID_REQUEST", bad
    assert bad["error"]["message"].startswith(fragment) and bad["error"]["details"]["path"] == field, bad


def test_features_request_without_audio_sources_is_answered_unknown_source(make_daemon, watcher) -> None:
    """A daemon with no microphone configured still answers its features topic (it was silent: the asker timed
    out): UNKNOWN_SOURCE naming that none is configured, the Correlation Data echoed."""
    w = watcher()
    daemon = make_daemon({})
    assert daemon.audio is not None and daemon.audio.names == []
    r = w_ask(w, {"source": "mic", "seconds": 2})
    assert r["ok"] is False and r["error"]["code"] == "UNKNOWN_SOURCE"
    assert r["error"]["message"] == "unknown audio source 'mic' (known: none configured)"
    assert r["error"]["details"] == {"source": "mic", "known": []}


def test_features_request_that_cannot_be_answered_is_dropped_and_counted(make_daemon, watcher, wait_until,
                                                                        caplog) -> None:  # fmt: skip
    """A features request whose Response Topic is a wildcard raised paho's ValueError in the handler (an ERROR
    with a traceback per request, counted as a handler error); one with no reply address was logged but not
    counted. Both are dropped and counted as on the request topic, and the daemon answers the next one."""
    import logging

    w = watcher()
    daemon = make_daemon({})
    w.subscribe("test/audio/#")
    with caplog.at_level(logging.WARNING):
        w.publish("edgevlm/dev1/audio/request", b'{"source": "mic", "seconds": 1}', response_topic="test/audio/+",
                  correlation=b"wild")  # fmt: skip
        w.publish("edgevlm/dev1/audio/request", b'{"source": "mic", "seconds": 1}')
        wait_until(lambda: daemon.counters.get("no_reply_address") == 1, timeout_s=5, what="no_reply_address")
    assert daemon.counters.get("invalid_response_topic") == 1 and daemon.counters.get("handler_errors") == 0
    assert "Traceback" not in caplog.text and not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert "Response Topic 'test/audio/+' cannot be published to" in caplog.text
    r = w_ask(w, {"source": "mic", "seconds": 2})
    assert r["error"]["code"] == "UNKNOWN_SOURCE"


def w_ask(w, payload: dict, corr: bytes = b"\x00corr", expiry_s: int | None = None) -> dict:
    import uuid

    topic = f"test/audio/{uuid.uuid4().hex}"
    w.subscribe(topic)
    w.publish("edgevlm/dev1/audio/request", json.dumps(payload).encode(), response_topic=topic, correlation=corr,
              expiry_s=expiry_s)  # fmt: skip
    msg = w.wait(topic)[0]
    assert msg.properties.CorrelationData == corr
    assert (msg.properties.ContentType, msg.properties.PayloadFormatIndicator) == ("application/json", 1)
    got = getattr(msg.properties, "MessageExpiryInterval", None)  # one less if the broker's second turns
    assert got is None if expiry_s is None else got in (expiry_s - 1, expiry_s)
    return json.loads(msg.payload)


ALSA_CHILD = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from edgevlm.config import AudioSourceConfig
    from edgevlm.daemon.audio import AudioSource
    from edgevlm.daemon.audio_dsp import level_dbfs
    src = AudioSource(AudioSourceConfig(name="mic", device="edgevlm_test_mic", sample_rate_hz=16000))
    src.start()
    deadline = time.monotonic() + 20
    while src.ring.written < 16000 and time.monotonic() < deadline:
        time.sleep(0.05)
    src.stop()
    x = src.recent(1.0)
    spec = np.abs(np.fft.rfft(x * np.hanning(len(x))))
    print(json.dumps({**src.info(), "n": len(x), "peak_hz": float(np.argmax(spec) * 16000 / len(x)),
                      "rms_dbfs": level_dbfs(x)}))
""")


def _sounddevice_or_skip() -> None:
    """Skip (never error) where sounddevice or the PortAudio library is missing: importing
    sounddevice without libportaudio2 raises OSError, which ``pytest.importorskip`` lets through."""
    try:
        import sounddevice  # noqa: F401
    except ImportError:
        pytest.skip("sounddevice missing: pip install 'edgevlm[audio]'")
    except OSError as exc:
        pytest.skip(f"PortAudio missing ({exc}): apt-get install libportaudio2 (make test installs it)")


def test_microphone_through_portaudio_and_a_fake_alsa_device(tmp_path) -> None:
    _sounddevice_or_skip()
    # The ALSA 'file' plugin over the 'null' device: capture reads the raw samples of 'infile'.
    # PortAudio opens it at its native (default) rate, 44100 Hz here, and 2 channels; the daemon
    # must resample to 16 kHz and downmix itself. Samples are float32 (what the stream asks for).
    rate = 44100
    x = tone(1000, rate, 3.0, amp=0.5, channels=2)  # left 0.5 sine, right -0.25 sine -> mono 0.125
    raw = tmp_path / "mic.raw"
    x.astype("<f4").tofile(raw)
    (tmp_path / ".asoundrc").write_text(textwrap.dedent(f"""
        pcm.edgevlm_test_mic {{
          type file
          slave.pcm "null"
          file "/dev/null"
          infile "{raw}"
          format "raw"
          hint {{ show on description "edgevlm test microphone" }}
        }}
    """))
    env = {**os.environ, "HOME": str(tmp_path)}
    env.pop("ALSA_CONFIG_PATH", None)
    out = subprocess.run([sys.executable, "-c", ALSA_CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["device"] == "edgevlm_test_mic"
    assert info["device_rate_hz"] == 44100 and info["device_channels"] == 2  # native, not 16000/mono
    assert info["n"] == 16000 and abs(info["peak_hz"] - 1000.0) <= 1.0
    assert abs(info["rms_dbfs"] - 20 * np.log10(0.125 / np.sqrt(2))) < 0.1  # -21.07 dBFS
