"""Bundled scene video: decodes with OpenCV, matches its sidecar and the seeded scenes."""

from __future__ import annotations

import numpy as np
import pytest

from edgevlm.runtime.demo import scenes, scenes_json_path, video, video_path


@pytest.fixture(scope="module")
def frames():
    return video.read_frames()


@pytest.fixture(scope="module")
def sidecar():
    return video.load_sidecar()


def test_video_decodes_with_the_sidecar_frame_count(frames, sidecar):
    assert video_path().stat().st_size < 3_000_000
    assert scenes_json_path().is_file()
    assert len(frames) == sidecar["frame_count"] == video.N_SEGMENTS * 30
    assert frames[0].shape == (sidecar["height_px"], sidecar["width_px"], 3) and frames[0].dtype == np.uint8
    assert sidecar["segments"][-1]["end_frame"] == len(frames)


def test_frames_show_the_seeded_scene_of_their_segment(frames, sidecar):
    renders = [scenes.render(video.segment_scene(sidecar["seed"], k)[0]) for k in range(video.N_SEGMENTS)]
    for seg in sidecar["segments"]:
        scene, qas, _ = video.segment_scene(sidecar["seed"], seg["index"])
        assert seg["description"] == scenes.describe(scene)
        assert seg["questions"] == [{"kind": q.kind, "question": q.question, "answer": q.answer} for q in qas]
        frame = frames[(seg["start_frame"] + seg["end_frame"]) // 2].astype(np.float32)
        diffs = [float(np.abs(frame - r.astype(np.float32)).mean()) for r in renders]
        assert int(np.argmin(diffs)) == seg["index"]
        assert diffs[seg["index"]] < 5.0  # sensor noise + mp4v coding error (~3), in grey levels


def test_position_ms_maps_to_segments(sidecar):
    import cv2

    assert video.segment_for_ms(sidecar, 0.0)["index"] == 0
    assert video.segment_for_ms(sidecar, 2999.9)["index"] == 0
    assert video.segment_for_ms(sidecar, 3000.0)["index"] == 1
    assert video.segment_for_ms(sidecar, 23_999.0)["index"] == 7
    assert video.segment_for_ms(sidecar, 24_000.0) is None
    # OpenCV's CAP_PROP_POS_MSEC after reading frame i is frame i's own timestamp
    cap = cv2.VideoCapture(str(video_path()))
    try:
        for i in range(sidecar["frame_count"]):
            assert cap.read()[0]
            seg = video.segment_for_ms(sidecar, cap.get(cv2.CAP_PROP_POS_MSEC))
            assert seg["start_frame"] <= i < seg["end_frame"]
    finally:
        cap.release()


def test_write_video_is_reproducible(tmp_path):
    mp4, side = video.write_video(tmp_path, seed=0)
    assert side.read_text() == scenes_json_path().read_text()
    assert len(video.read_frames(mp4)) == 240


def test_missing_or_broken_video_is_reported(tmp_path):
    with pytest.raises(FileNotFoundError):
        video.read_frames(tmp_path / "nope.mp4")
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"not a video")
    with pytest.raises(RuntimeError, match="cannot open"):
        video.read_frames(bad)
