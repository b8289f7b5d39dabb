"""Capture that survives: gst-launch subprocess frames, stalls and dead streams time out and
reconnect with capped backoff, stale frames are refused with a typed error, CSI pipelines are built
from config fields, V4L2 pixel formats are chosen from the device's capabilities."""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from process_support import reaped

from edgevlm.config import SourceConfig, parse_daemon_config
from edgevlm.daemon.capture import (
    DeviceCaps,
    FrameMode,
    capture_path,
    choose_pixel_format,
    csi_pipeline,
    fourcc_int,
    fourcc_str,
    opencv_has_gstreamer,
    opencv_pipeline,
    subprocess_pipeline,
)
from edgevlm.daemon.sources import FrameSource
from edgevlm.errors import InternalError

GST = shutil.which("gst-launch-1.0")
needs_gst = pytest.mark.skipif(GST is None, reason="gst-launch-1.0 missing: apt-get install gstreamer1.0-tools "
                               "gstreamer1.0-plugins-base")  # fmt: skip

# A stand-in for gst-launch-1.0: writes FAKE_GST_FRAMES raw BGR frames of the size named by the
# last width=/height= in its arguments, filled with FAKE_GST_BGR, then sleeps (a stalled camera)
# or exits (FAKE_GST_EXIT=1). Its arguments go to FAKE_GST_ARGV (one JSON list per run).
FAKE_GST = r'''
import json, os, re, sys, time
args = sys.argv[1:]
with open(os.environ["FAKE_GST_ARGV"], "a") as f:
    f.write(json.dumps(args) + "\n")
text = " ".join(args)
w = int(re.findall(r"width=(\d+)", text)[-1]); h = int(re.findall(r"height=(\d+)", text)[-1])
bgr = bytes(int(v) for v in os.environ.get("FAKE_GST_BGR", "0,0,255").split(","))
frame = bgr * (w * h)
for _ in range(int(os.environ.get("FAKE_GST_FRAMES", "1000000"))):
    sys.stdout.buffer.write(frame); sys.stdout.buffer.flush(); time.sleep(0.01)
if os.environ.get("FAKE_GST_EXIT") != "1":
    time.sleep(3600)
'''


@pytest.fixture
def fake_gst(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    script = tmp_path / "fake-gst-launch"
    script.write_text(f"#!{sys.executable}\n{FAKE_GST}")
    script.chmod(0o755)
    argv = tmp_path / "argv.jsonl"
    argv.write_text("")
    monkeypatch.setenv("FAKE_GST_ARGV", str(argv))

    return FakeGst(script, argv)


class FakeGst:
    def __init__(self, path: Path, argv: Path) -> None:
        self.path, self.argv = path, argv

    def __str__(self) -> str:
        return str(self.path)

    def runs(self) -> list[list[str]]:
        """The arguments of every run so far."""
        return [json.loads(ln) for ln in self.argv.read_text().splitlines()]


def _collect(src: FrameSource, n: int, after: int = 0) -> list:
    frames = []
    while len(frames) < n:
        f = src.wait_for_frame(20, after_seq=after)
        assert f is not None, f"no frame ({src.last_error})"
        frames.append(f)
        after = f.seq
    return frames


@needs_gst
def test_gst_launch_subprocess_delivers_rgb_frames() -> None:
    cfg = SourceConfig(name="test", capture="subprocess",
                       uri="videotestsrc pattern=red is-live=true ! video/x-raw,format=BGR,width=64,height=48,"
                           "framerate=30/1 ! appsink")  # fmt: skip
    assert capture_path(cfg) == "gst-launch-subprocess"
    src = FrameSource(cfg)
    src.start()
    try:
        frames = _collect(src, 3)
        assert src.state == "streaming"
    finally:
        src.stop()
    for f in frames:
        assert f.image.shape == (48, 64, 3) and f.image.dtype == np.uint8
        assert f.image.reshape(-1, 3).mean(axis=0).round().tolist() == [255.0, 0.0, 0.0]  # red in RGB
    assert src.negotiated["path"] == "gst-launch-subprocess" and src.negotiated["width"] == 64
    assert src.state == "stopped"


def _one_frame(cfg: SourceConfig):
    """The first frame the source ``cfg`` delivers (started and stopped here)."""
    src = FrameSource(cfg)
    src.start()
    try:
        (f,) = _collect(src, 1)
    finally:
        src.stop()
    return f


def assert_one_blue_frame_of_40x30(cfg: SourceConfig) -> None:
    """The source ``cfg`` (a blue ``videotestsrc`` scaled to 40 x 30) delivers such a frame."""
    f = _one_frame(cfg)
    assert f.image.shape == (30, 40, 3) and f.image[..., 2].min() > 200  # blue


@needs_gst
def test_gst_launch_subprocess_rescales_to_the_configured_size() -> None:
    cfg = SourceConfig(name="t", capture="subprocess", width=40, height=30,
                       uri="videotestsrc pattern=blue ! video/x-raw,width=320,height=240 ! appsink")  # fmt: skip
    pipeline, w, h = subprocess_pipeline(cfg)
    assert (w, h) == (40, 30) and pipeline.endswith(
        "videoconvert ! videoscale ! video/x-raw,format=BGR,width=40,height=30 ! fdsink fd=1 sync=true")
    assert_one_blue_frame_of_40x30(cfg)


def test_opencv_path_scales_a_pipeline_to_the_configured_size_as_gst_launch_does() -> None:
    """Found by a new user: with ``capture: auto`` on an OpenCV built with GStreamer (JetPack's), a
    pipeline's ``width`` / ``height`` were silently ignored (OpenCV opened the pipeline as written), while
    the same config on a host without it (gst-launch-1.0) scaled the frames to them. Both paths now append
    the same conversion; the user's appsink and its properties are kept; without a size the pipeline is
    opened as written; a size left out is the caps' own on both paths."""
    uri = "videotestsrc pattern=blue ! video/x-raw,width=320,height=240 ! appsink drop=true max-buffers=2"
    for capture in ("auto", "opencv"):
        cfg = SourceConfig(name="t", capture=capture, width=40, height=30, uri=uri)
        assert opencv_pipeline(cfg) == (
            "videotestsrc pattern=blue ! video/x-raw,width=320,height=240 ! videoconvert ! videoscale ! "
            "video/x-raw,format=BGR,width=40,height=30 ! appsink drop=true max-buffers=2")
        scaled = subprocess_pipeline(cfg)[0]
        assert scaled.endswith("video/x-raw,format=BGR,width=40,height=30 ! fdsink fd=1 sync=true")
    assert opencv_pipeline(SourceConfig(name="t", uri=uri)) == uri
    only_width = SourceConfig(name="t", width=40, uri=uri)
    tail = "video/x-raw,format=BGR,width=40,height=240 ! appsink drop=true max-buffers=2"
    assert opencv_pipeline(only_width).endswith(tail)
    assert subprocess_pipeline(only_width)[1:] == (40, 240)
    no_sink = SourceConfig(name="t", width=8, height=6, uri="videotestsrc ! videoconvert")
    assert opencv_pipeline(no_sink) == ("videotestsrc ! videoconvert ! videoconvert ! videoscale ! "
                                        "video/x-raw,format=BGR,width=8,height=6 ! appsink")  # fmt: skip
    csi = SourceConfig(name="c", csi={}, width=640, height=480)
    assert opencv_pipeline(csi) == csi_pipeline(csi)


@needs_gst
def test_the_pipeline_opencv_opens_delivers_the_configured_size() -> None:
    """The pipeline :func:`opencv_pipeline` builds, run by GStreamer itself (gst-launch-1.0 -v prints the caps
    every pad negotiated; an appsink nobody pulls from never lets the pipeline end, so it is stopped once
    they are printed): the appsink OpenCV reads from receives BGR frames of the configured size."""
    cfg = SourceConfig(name="t", width=40, height=30,
                       uri="videotestsrc ! video/x-raw,width=320,height=240 ! appsink")  # fmt: skip
    proc = subprocess.Popen([GST, "-v", *shlex.split(opencv_pipeline(cfg))], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    with reaped(proc):
        lines = []
        timer = threading.Timer(20, proc.kill)  # a pipeline that never negotiates ends the read below
        timer.start()
        try:
            for line in proc.stdout:
                lines.append(line.strip())
                if "GstAppSink" in line and "caps = " in line:
                    break
        finally:
            timer.cancel()
    sink_caps = [ln for ln in lines if "GstAppSink" in ln and "caps = " in ln]
    assert sink_caps, lines
    negotiated = sink_caps[0].split("caps = ")[1]
    assert negotiated.startswith("video/x-raw, format=(string)BGR, width=(int)40, height=(int)30,")


@needs_gst
def test_capture_auto_through_opencv_honours_width_and_height() -> None:
    """The real OpenCV path, on an OpenCV with GStreamer (JetPack's): frames come at the configured size."""
    if not opencv_has_gstreamer():
        pytest.skip("this OpenCV was built without GStreamer (the PyPI wheels are)")
    uri = "videotestsrc pattern=blue is-live=true ! video/x-raw,width=320,height=240 ! appsink"
    cfg = SourceConfig(name="t", width=40, height=30, uri=uri)
    assert capture_path(cfg) == "opencv-gstreamer"
    assert_one_blue_frame_of_40x30(cfg)


@needs_gst
def test_gst_launch_subprocess_paces_a_non_live_pipeline_to_its_framerate() -> None:
    # videotestsrc (not live) at 10/1: appsink, through OpenCV, renders on the clock (sync defaults to
    # true); the gst-launch path ended in 'fdsink sync=false' and delivered tens of thousands of frames a
    # second, a core busy converting frames nobody asked for
    cfg = SourceConfig(name="t", capture="subprocess",
                       uri="videotestsrc ! video/x-raw,width=32,height=24,framerate=10/1 ! appsink")  # fmt: skip
    assert subprocess_pipeline(cfg)[0].endswith("fdsink fd=1 sync=true")
    src = FrameSource(cfg)
    src.start()
    try:
        first = _collect(src, 1)[0]
        cpu0, t0 = time.process_time(), time.monotonic()
        time.sleep(1.5)
        frames = src.latest().seq - first.seq
        cpu_s, wall_s = time.process_time() - cpu0, time.monotonic() - t0
    finally:
        src.stop()
    assert 5 <= frames <= 1.5 * 10 * wall_s, f"{frames} frames in {wall_s:.2f} s at framerate=10/1"
    assert cpu_s < 0.5 * wall_s, f"capture took {cpu_s:.2f} s of CPU in {wall_s:.2f} s"


def test_appsink_sync_property_is_kept_on_the_gst_launch_path() -> None:
    def tail(uri: str) -> str:
        return subprocess_pipeline(SourceConfig(name="t", capture="subprocess", width=8, height=6, uri=uri))[0]

    assert tail("v4l2src ! appsink sync=false drop=true").endswith("fdsink fd=1 sync=false")
    assert tail("v4l2src ! appsink drop=true max-buffers=1").endswith("fdsink fd=1 sync=true")
    assert tail("v4l2src ! appsink sync=true").endswith("fdsink fd=1 sync=true")
    assert tail("v4l2src ! videoconvert").endswith("fdsink fd=1 sync=true")


@needs_gst
def test_a_pipeline_gst_launch_refuses_names_why_on_every_attempt(caplog, wait_until) -> None:
    # gst-launch-1.0 exits 1 with 'erroneous pipeline: no element "nosuchsrc"' on stderr; the reason was read
    # before the stderr thread had it on some attempts ('read failed (end of stream)' alone), and every
    # retry logged two INFO lines (the command, 'opened') on top of the one reconnect WARNING
    caplog.set_level(logging.DEBUG, logger="edgevlm.daemon")
    cfg = SourceConfig(name="typo", capture="subprocess", width=8, height=6,
                       uri="nosuchsrc ! video/x-raw,width=8,height=6 ! appsink", reopen_delay_s=0.02,
                       reconnect_max_delay_s=0.05)  # fmt: skip
    errors: list[str | None] = []
    src = FrameSource(cfg, listener=lambda s, info: errors.append(info["last_error"])
                      if info["event"] == "reconnecting" else None)  # fmt: skip
    src.start()
    try:
        wait_until(lambda: len(errors) >= 6, timeout_s=20, what="six failed attempts")
    finally:
        src.stop()
    for error in errors:
        assert error is not None and 'no element "nosuchsrc"' in error and "exited with status 1" in error, errors
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert len([m for m in info if "opened" in m]) == 1, info
    assert len([m for m in info if "reconnecting in" in m]) == 1, info


@needs_gst
def test_a_pipeline_that_ends_again_and_again_logs_its_outage_once(caplog, wait_until) -> None:
    caplog.set_level(logging.DEBUG, logger="edgevlm.daemon")
    cfg = SourceConfig(name="eos", capture="subprocess", reopen_delay_s=0.02, reconnect_max_delay_s=0.05,
                       uri="videotestsrc num-buffers=2 ! video/x-raw,width=8,height=6,framerate=50/1 ! appsink")  # fmt: skip
    src = FrameSource(cfg)
    src.start()
    try:
        wait_until(lambda: src.reconnects >= 4 and src.state == "streaming", timeout_s=20, what="four comebacks")
    finally:
        src.stop()
    info = [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO]
    assert [m for m in info if "streaming again" in m] == [
        "source eos: streaming again (gst-launch-subprocess; reconnect 1)"], info
    assert len([m for m in info if "reconnecting in" in m]) == 1, info
    debug = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert len([m for m in debug if "streaming again" in m]) >= 3


@needs_gst
def test_a_clip_after_a_reconnect_holds_only_frames_read_since(wait_until) -> None:
    """Found by a tester: after an outage and a reconnect, ``frames: N`` / ``frames_s`` mixed frames from
    before the outage (minutes old, only the newest frame's age is checked) with new ones. A real
    gst-launch-1.0 camera that ends after 6 frames (the stream drops) and is reopened after the backoff:
    a clip holds only the frames of the newest run, fewer than asked; ``frame_seq`` still pins an older one."""
    cfg = SourceConfig(name="cam", capture="subprocess", reopen_delay_s=0.6, reconnect_max_delay_s=5.0,
                       uri="videotestsrc num-buffers=6 is-live=true ! video/x-raw,format=BGR,width=8,height=6,"
                           "framerate=30/1 ! appsink")  # fmt: skip
    src = FrameSource(cfg)
    src.start()
    try:
        # the second run has delivered its 6 frames; the next reopen is 1.2 s away (doubled backoff)
        wait_until(lambda: (f := src.latest()) is not None and f.seq >= 12, 10, "two runs of 6 frames")
        assert src.reconnects == 1 and src.last_error == "read failed (end of stream)"
        clip = src.recent_frames(0.0, count=32)
        window = src.recent_frames(0.0, window_s=10.0)
        old = src.frame_by_seq(3)
    finally:
        src.stop()
    assert [f.seq for f in clip] == [7, 8, 9, 10, 11, 12] and {f.run for f in clip} == {2}
    assert [f.seq for f in window] == [7, 8, 9, 10, 11, 12]
    assert old.seq == 3 and old.run == 1


def test_unknown_raw_frame_size_is_a_clear_error() -> None:
    cfg = SourceConfig(name="t", capture="subprocess", uri="videotestsrc ! videoconvert ! appsink")
    with pytest.raises(ValueError, match="frame size .* is unknown; set width and height"):
        subprocess_pipeline(cfg)


def test_stalled_camera_is_abandoned_and_reopened(fake_gst, monkeypatch, wait_until) -> None:
    monkeypatch.setenv("FAKE_GST_FRAMES", "3")  # three frames, then silence with the process alive
    cfg = SourceConfig(name="stall", capture="subprocess", gst_launch=str(fake_gst), width=8, height=6,
                       uri="videotestsrc ! appsink", read_timeout_s=0.3, reopen_delay_s=0.05,
                       reconnect_max_delay_s=0.1)  # fmt: skip
    events: list[str] = []
    src = FrameSource(cfg, listener=lambda s, info: events.append(info["event"]))
    src.start()
    try:
        wait_until(lambda: src.stalls >= 2 and src.reconnects >= 2 and src._seq >= 6, what="two stalls and reopens")
    finally:
        src.stop()
    assert events[:4] == ["starting", "streaming", "stalled", "reconnecting"]
    assert src.last_error == "no frame for read_timeout_s=0.3 s" and src.reconnects >= 2
    runs = fake_gst.runs()
    assert len(runs) >= 2 and all(a[0] == "-q" for a in runs)  # one child process per attempt
    assert src.open_failures == 0  # every attempt delivered frames: not an open failure


def test_camera_that_exits_reconnects_with_capped_backoff(fake_gst, monkeypatch, wait_until) -> None:
    monkeypatch.setenv("FAKE_GST_FRAMES", "0")
    monkeypatch.setenv("FAKE_GST_EXIT", "1")  # a camera that is unplugged: every start fails at once
    cfg = SourceConfig(name="gone", capture="subprocess", gst_launch=str(fake_gst), width=8, height=6,
                       uri="videotestsrc ! appsink", reopen_delay_s=0.02, reconnect_max_delay_s=0.08)  # fmt: skip
    delays: list[float] = []
    src = FrameSource(cfg)
    original = src._stop.wait

    def record(timeout: float | None = None) -> bool:
        if timeout is not None and timeout >= 0.02:
            delays.append(round(timeout, 3))
        return original(timeout)

    src._stop.wait = record  # type: ignore[method-assign]  # observe the backoff the supervisor sleeps
    src.start()
    try:
        wait_until(lambda: len(delays) >= 5, what="five reconnect delays")
    finally:
        src.stop()
    assert delays[:5] == [0.02, 0.04, 0.08, 0.08, 0.08]
    assert src.state == "stopped" and src.open_failures >= 5
    assert src.last_error == "read failed (end of stream)"


def test_dead_rtsp_stream_times_out_instead_of_blocking(wait_until, capfd) -> None:
    # a server that accepts the TCP connection and never says a word
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    port = server.getsockname()[1]
    cfg = SourceConfig(name="dock", uri=f"rtsp://127.0.0.1:{port}/dead", open_timeout_s=0.5, read_timeout_s=0.5,
                       reopen_delay_s=0.05, reconnect_max_delay_s=0.1)  # fmt: skip
    src = FrameSource(cfg)
    src.start()
    try:
        wait_until(lambda: src.open_failures >= 2, timeout_s=30, what="two timed-out opens")
        with pytest.raises(InternalError) as info:
            src.frame_for_request(0.2)
    finally:
        src.stop()
        stop.set()
        t.join()
        for c in conns:
            c.close()
        server.close()
    assert conns  # the daemon really connected
    details = info.value.details
    assert details["source"] == "dock" and details["reason"] == "no_frame"
    assert details["state"] in ("starting", "reconnecting")
    # what happened, not "cannot open" (FFmpeg's own open timeout fires with the supervisor's)
    assert src.last_error.startswith("no frame within open_timeout_s=0.5 s"), src.last_error
    assert "no frame within open_timeout_s=0.5 s" in str(info.value)
    # OpenCV's "[ WARN:0@...] global cap_ffmpeg_impl.hpp ..." lines stay out of stderr
    err = capfd.readouterr().err
    assert "[ WARN" not in err and "cap_ffmpeg" not in err, err[-2000:]


def _ts_clip(tmp_path: Path, n_frames: int = 40) -> bytes:
    """An MPEG-TS clip of changing frames (FFmpeg reads TS from a non-seekable HTTP stream)."""
    import cv2

    path = tmp_path / "cam.ts"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 25.0, (64, 48))
    assert writer.isOpened()
    for i in range(n_frames):
        writer.write(np.full((48, 64, 3), (i * 6) % 256, np.uint8))
    writer.release()
    return path.read_bytes()


def test_a_stream_that_goes_silent_reports_the_read_timeout(tmp_path, wait_until, capfd) -> None:
    # An HTTP camera that sends half of a clip and then keeps the connection open, silent: FFmpeg's
    # read timeout ends the read, which must be reported as a stall, not as the end of the stream.
    clip = _ts_clip(tmp_path)
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn = server.accept()[0]
            except OSError:
                continue
            conns.append(conn)
            try:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.0 200 OK\r\nContent-Type: video/mp2t\r\n\r\n" + clip[: len(clip) // 2])
            except OSError:
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    cfg = SourceConfig(name="door", uri=f"http://127.0.0.1:{server.getsockname()[1]}/cam.ts", open_timeout_s=5,
                       read_timeout_s=0.6, reopen_delay_s=0.05, reconnect_max_delay_s=0.1)  # fmt: skip
    events: list[str] = []
    src = FrameSource(cfg, listener=lambda s, info: events.append(info["event"]))
    src.start()
    try:
        wait_until(lambda: src.stalls >= 2, timeout_s=30, what="two stalls")
    finally:
        src.stop()
        stop.set()
        t.join()
        for c in conns:
            c.close()
        server.close()
    assert src._seq > 0 and src.open_failures == 0  # frames came, then silence
    assert src.last_error == "no frame for read_timeout_s=0.6 s"  # was "read failed (end of stream)"
    assert events[:4] == ["starting", "streaming", "stalled", "reconnecting"]
    err = capfd.readouterr().err
    assert "[ WARN" not in err, err[-2000:]


@needs_gst
def test_a_camera_repeating_one_frame_is_frozen_and_refused(make_daemon, watcher, wait_until) -> None:
    # A real GStreamer pipeline stuck on one picture (videotestsrc solid colour: every buffer the
    # same bytes), next to one with sensor-like noise (pattern=snow) that must never freeze.
    caps = "video/x-raw,format=BGR,width=32,height=24,framerate=30/1"
    daemon = make_daemon({"sources": [
        {"name": "stuck", "capture": "subprocess", "frozen_after_s": 0.5,
         "uri": f"videotestsrc pattern=solid-color foreground-color=0xff20a040 is-live=true ! {caps} ! appsink"},
        {"name": "noisy", "capture": "subprocess", "frozen_after_s": 0.5,
         "uri": f"videotestsrc pattern=snow is-live=true ! {caps} ! appsink"},
        {"name": "off", "capture": "subprocess", "frozen_after_s": None,
         "uri": f"videotestsrc pattern=solid-color is-live=true ! {caps} ! appsink"},
    ]})  # fmt: skip
    stuck, noisy, off = (daemon.sources.get(n) for n in ("stuck", "noisy", "off"))
    w = watcher()
    w.subscribe("edgevlm/dev1/sources/stuck")
    wait_until(lambda: stuck.state == "frozen", timeout_s=20, what="the stuck camera frozen")
    r = w.ask("dev1", {"prompt": "what colour?", "source": "stuck", "timeout_ms": 5000})
    err = r["error"]
    assert r["ok"] is False and err["code"] == "INTERNAL"
    assert err["details"]["reason"] == "frozen_frame" and err["details"]["state"] == "frozen"
    assert err["details"]["frozen_after_s"] == 0.5 and err["details"]["frozen_for_s"] > 0.5
    assert err["message"].startswith("source 'stuck': camera frozen: the same frame for ")
    states = [m["state"] for m in w.json("edgevlm/dev1/sources/stuck")]
    assert "frozen" in states
    assert noisy.state == "streaming" and off.state == "streaming"
    assert w.ask("dev1", {"prompt": "what colour?", "source": "noisy", "timeout_ms": 20000})["ok"] is True
    assert w.ask("dev1", {"prompt": "what colour?", "source": "off", "timeout_ms": 20000})["ok"] is True


def test_stale_frame_is_refused_with_a_typed_error(fake_gst, monkeypatch, make_daemon, watcher,
                                                   wait_until) -> None:  # fmt: skip
    monkeypatch.setenv("FAKE_GST_FRAMES", "2")
    daemon = make_daemon({"sources": [{
        "name": "cam", "capture": "subprocess", "gst_launch": str(fake_gst), "width": 8, "height": 6,
        "uri": "videotestsrc ! appsink", "read_timeout_s": 600, "max_frame_age_s": 0.2}]})  # fmt: skip
    src = daemon.sources.get("cam")
    wait_until(lambda: src.latest() is not None and src.latest().age_s() > 0.3, what="an old frame")
    r = watcher().ask("dev1", {"prompt": "what?", "source": "cam", "timeout_ms": 400})
    err = r["error"]
    assert r["ok"] is False and err["code"] == "INTERNAL"
    assert err["details"]["reason"] == "stale_frame" and err["details"]["max_frame_age_s"] == 0.2
    assert err["details"]["frame_age_s"] > 0.2 and err["details"]["state"] == "streaming"
    assert err["message"].startswith("source 'cam': newest frame is ") and "max_frame_age_s=0.2" in err["message"]


def test_csi_pipeline_is_built_from_fields() -> None:
    cfg = parse_daemon_config({"sources": [{"name": "csi0", "csi": {"sensor_id": 1, "flip_method": 2},
                                            "width": 1920, "height": 1080, "fps": 29.97}]}).sources[0]  # fmt: skip
    assert cfg.kind == "csi"
    assert csi_pipeline(cfg) == (
        "nvarguscamerasrc sensor-id=1 ! video/x-raw(memory:NVMM),width=1920,height=1080,framerate=30000/1001,"
        "format=NV12 ! nvvidconv flip-method=2 ! video/x-raw,format=BGRx ! videoconvert ! video/x-raw,format=BGR"
        " ! appsink drop=true max-buffers=1 sync=false"
    )
    rotated = SourceConfig(name="r", csi={"sensor_id": 0, "flip_method": 1, "sensor_mode": 3})
    pipeline, w, h = subprocess_pipeline(rotated)
    assert (w, h) == (720, 1280)  # 90-degree rotation swaps the delivered size
    assert pipeline.startswith("nvarguscamerasrc sensor-id=0 sensor-mode=3 ! video/x-raw(memory:NVMM),width=1280,"
                               "height=720,framerate=30/1,format=NV12 ! nvvidconv flip-method=1 !")  # fmt: skip
    assert pipeline.endswith("video/x-raw,format=BGR ! fdsink fd=1 sync=false")


def test_csi_source_reads_through_the_subprocess_path(fake_gst, wait_until) -> None:
    cfg = SourceConfig(name="csi0", csi={"sensor_id": 2}, width=16, height=12, fps=15, capture="subprocess",
                       gst_launch=str(fake_gst))  # fmt: skip
    f = _one_frame(cfg)
    assert f.image.shape == (12, 16, 3) and f.image[0, 0].tolist() == [255, 0, 0]  # BGR (0,0,255) -> red
    args = fake_gst.runs()[0]
    assert args[:3] == ["-q", "nvarguscamerasrc", "sensor-id=2"]
    assert "video/x-raw(memory:NVMM),width=16,height=12,framerate=15/1,format=NV12" in args
    assert args[-3:] == ["fdsink", "fd=1", "sync=false"]


def test_config_rejects_bad_source_fields() -> None:
    from edgevlm.errors import ConfigError

    cases = [
        ({"name": "a"}, "sources[0].uri: required key missing"),
        ({"name": "a", "uri": 0, "csi": {}}, "sources[0].csi: give either uri or csi, not both"),
        ({"name": "a", "uri": 0, "pixel_format": "MJPEG"}, "sources[0].pixel_format: expected 'auto' or a four"),
        ({"name": "a", "csi": {"flip_method": 9}}, "sources[0].csi.flip_method: "),
        ({"name": "a", "uri": 0, "reopen_delay_s": 5, "reconnect_max_delay_s": 1},
         "sources[0].reconnect_max_delay_s: must be >= reopen_delay_s"),
    ]  # fmt: skip
    for src, message in cases:
        with pytest.raises(ConfigError) as info:
            parse_daemon_config({"sources": [src]})
        assert str(info.value).startswith(message), str(info.value)


# A USB 2.0 webcam's capabilities (as VIDIOC_ENUM_FMT/FRAMESIZES/FRAMEINTERVALS list them): YUYV
# carries 1280x720 at 10 fps at most, MJPG at 30.
WEBCAM = DeviceCaps({
    "YUYV": [FrameMode(640, 480, (30.0, 15.0)), FrameMode(1280, 720, (10.0, 5.0)), FrameMode(1920, 1080, (5.0,))],
    "MJPG": [FrameMode(640, 480, (30.0,)), FrameMode(1280, 720, (30.0, 15.0)), FrameMode(1920, 1080, (30.0,))],
})  # fmt: skip


def test_pixel_format_is_chosen_from_capabilities() -> None:
    assert choose_pixel_format(WEBCAM, 1280, 720, 30) == "MJPG"  # YUYV cannot do 720p30
    assert choose_pixel_format(WEBCAM, 1280, 720, 10) == "YUYV"  # raw when it delivers: no decode cost
    assert choose_pixel_format(WEBCAM, 640, 480, 30) == "YUYV"
    assert choose_pixel_format(WEBCAM, 1920, 1080, 60) == "MJPG"  # nothing reaches 60: the fastest at that size
    assert choose_pixel_format(WEBCAM, 800, 600, 30) is None  # size not offered: the driver decides
    assert choose_pixel_format(WEBCAM, None, None, 30) is None
    assert fourcc_str(fourcc_int("MJPG")) == "MJPG" and fourcc_int("YUYV") == 0x56595559


def test_v4l2_query_of_something_that_is_not_a_camera_is_empty() -> None:
    from edgevlm.daemon.capture import query_v4l2_caps

    assert query_v4l2_caps("/nonexistent/video9") is None
    caps = query_v4l2_caps(os.devnull)  # opens, but the ioctls fail: no formats
    assert caps is not None and caps.formats == {}


def test_doctor_says_which_capture_path_a_source_uses(fake_gst) -> None:
    from edgevlm.daemon.doctor import _check_source, _Host

    cfg = parse_daemon_config({"sources": [
        {"name": "csi0", "csi": {}, "capture": "subprocess", "gst_launch": str(fake_gst)},
        {"name": "pipe", "uri": "videotestsrc ! appsink", "capture": "subprocess", "gst_launch": str(fake_gst)},
        {"name": "nogst", "csi": {}, "capture": "subprocess", "gst_launch": "/nonexistent/gst-launch-1.0"},
    ]})  # fmt: skip
    host = _Host(Path("/"), cfg)
    rows = [_check_source(host, s) for s in cfg.sources]
    assert rows[0].verdict.value == "OK"
    assert rows[0].detail == f"csi source read as 1280x720 BGR from a {fake_gst} subprocess (OpenCV lacks GStreamer)"
    assert rows[1].verdict.value == "FAIL" and "set width and height" in rows[1].detail
    assert rows[2].verdict.value == "FAIL" and "apt-get install gstreamer1.0-tools" in rows[2].detail
