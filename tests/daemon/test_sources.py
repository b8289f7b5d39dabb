"""Camera sources: the newest-frame slot, RGB conversion, looping video files with pos_ms."""

from __future__ import annotations

import numpy as np

from edgevlm.config import SourceConfig
from edgevlm.daemon.sources import FrameSource, SourceManager, to_rgb
from edgevlm.errors import UnknownSourceError


def _collect(src: FrameSource, n: int, timeout_s: float = 20.0) -> list:
    frames, seq = [], 0
    while len(frames) < n:
        frame = src.wait_for_frame(timeout_s, after_seq=seq)
        assert frame is not None, f"source stopped delivering after {len(frames)} frames ({src.last_error})"
        frames.append(frame)
        seq = frame.seq
    return frames


def test_video_file_loops_with_positions_and_rgb(make_video, colour_index) -> None:
    path = make_video(n_frames=6, fps=10.0)
    # Paced at 200 fps so the test is fast; positions still come from the file (10 fps -> 100 ms).
    src = FrameSource(SourceConfig(name="sim", uri=str(path), fps=200.0))
    src.start()
    try:
        frames = _collect(src, 14)
    finally:
        src.stop()
    assert src.loops >= 2
    for f in frames:
        assert f.source == "sim"
        assert f.image.shape == (48, 64, 3) and f.image.dtype == np.uint8
        # The slot may skip a frame when the test thread is slow, but content, index and
        # media position always belong together.
        assert colour_index(f.image) == f.index
        assert abs(f.pos_ms - 100.0 * f.index) < 1.0
    assert [f.seq for f in frames] == sorted({f.seq for f in frames})
    ts = [f.ts for f in frames]
    assert ts == sorted(ts)
    # Looping: after frame 5 the index starts again at 0.
    indices = [f.index for f in frames]
    assert any(b < a for a, b in zip(indices, indices[1:], strict=False))
    # The first frame is pure red in RGB order (BGR would put 255 in channel 2).
    first = next(f for f in frames if f.index == 0)
    r, g, b = first.image.reshape(-1, 3).mean(axis=0)
    assert r > 200 and g < 50 and b < 50


def test_latest_is_the_newest_frame(make_video) -> None:
    src = FrameSource(SourceConfig(name="sim", uri=str(make_video()), fps=200.0))
    assert src.latest() is None
    src.start()
    try:
        frame = _collect(src, 3)[-1]
        newest = src.latest()
        assert newest is not None and newest.seq >= frame.seq
    finally:
        src.stop()


def test_unopenable_source_keeps_retrying_without_frames(tmp_path, wait_until) -> None:
    bogus = tmp_path / "not_a_video.mp4"
    bogus.write_bytes(b"this is not a video file")
    src = FrameSource(SourceConfig(name="bad", uri=str(bogus), reopen_delay_s=0.05))
    src.start()
    try:
        wait_until(lambda: src.open_failures >= 2, what="two failed opens")
        assert src.wait_for_frame(0.1) is None
        assert src.latest() is None and src.opens == 0
        assert src.last_error == f"cannot open {str(bogus)!r}"
    finally:
        src.stop()


def test_to_rgb_handles_bgr_bgra_and_grey() -> None:
    bgr = np.zeros((2, 3, 3), np.uint8)
    bgr[..., 0] = 10  # blue
    assert to_rgb(bgr)[0, 0].tolist() == [0, 0, 10]
    bgra = np.concatenate([bgr, np.full((2, 3, 1), 7, np.uint8)], axis=2)
    assert to_rgb(bgra)[0, 0].tolist() == [0, 0, 10]
    grey = np.full((2, 3), 99, np.uint8)
    assert to_rgb(grey).shape == (2, 3, 3) and to_rgb(grey)[1, 2].tolist() == [99, 99, 99]


def test_manager_unknown_source_names_the_known_ones(make_video) -> None:
    manager = SourceManager([SourceConfig(name="front", uri=str(make_video()))])
    try:
        manager.get("rear")
    except UnknownSourceError as err:
        assert "rear" in str(err) and "front" in str(err)
        assert err.details == {"source": "rear", "known": ["front"]}
    else:
        raise AssertionError("expected UnknownSourceError")


def test_a_looping_video_logs_opened_once(make_video, caplog, wait_until) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="edgevlm.daemon.sources")
    src = FrameSource(SourceConfig(name="sim", uri=str(make_video(n_frames=3)), fps=200.0))
    src.start()
    try:
        wait_until(lambda: src.loops >= 3, what="three loops")
    finally:
        src.stop()
    opened = [r for r in caplog.records if "opened" in r.getMessage() and r.levelno >= logging.INFO]
    assert len(opened) == 1, [r.getMessage() for r in opened]
    assert src.state == "stopped" and src.frozen_checked is False  # files may hold stills: never frozen
