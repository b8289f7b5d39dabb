"""The bundled scene video and its sidecar ground truth (the demo daemon's camera).

    python -m edgevlm.runtime.demo.video [--out-dir DIR] [--seed 0] [--check-model]

Writes ``scenes.mp4`` (MPEG-4 Part 2, fourcc ``mp4v``, which the pip OpenCV wheel both writes and
reads; 384x288 at 10 fps): 8 seeded static scenes of 3 s each, every frame with fresh Gaussian
sensor noise (2 grey levels). Segment ``k`` covers frames ``[30k, 30k + 30)``, i.e.
``[3000k, 3000(k+1))`` ms of media time, and shows ``k % 4 + 1`` objects. The sidecar
``scenes.json`` gives per segment ``start_ms``/``end_ms``, ``start_frame``/``end_frame``, the
objects and one question per valid kind with its exact answer; :func:`segment_for_ms` maps a
frame position (ms, e.g. OpenCV's ``CAP_PROP_POS_MSEC``) to its segment. ``--check-model`` decodes
a middle frame of every segment and asks the shipped model each question through the runtime.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import numpy as np

from edgevlm.runtime.demo import scenes, scenes_json_path, video_path

logger = logging.getLogger(__name__)

FPS = 10
SEGMENT_S = 3.0
N_SEGMENTS = 8
NOISE_SIGMA = 2.0
FOURCC = "mp4v"


def segment_scene(seed: int, index: int) -> tuple[scenes.Scene, list[scenes.QA], np.random.Generator]:
    """Scene ``index`` of the video of ``seed``, one question per valid kind, and the generator
    (positioned after them) that draws the frames' noise."""
    rng = scenes.rng_for(seed, scenes.DOMAIN_VIDEO, index)
    scene = scenes.generate_scene(rng, n_objects=index % scenes.MAX_OBJECTS + 1)
    qas = [scenes.make_question(scene, kind, rng) for kind in scenes.valid_kinds(scene)]
    return scene, qas, rng


def write_video(out_dir: str | Path | None = None, *, seed: int = 0) -> tuple[Path, Path]:
    """Write ``scenes.mp4`` and ``scenes.json`` into ``out_dir`` (default: the package's media
    folder) and check that OpenCV decodes every frame. Returns both paths.

    Raises:
        RuntimeError: OpenCV cannot open the writer or decodes a different frame count.
    """
    import cv2

    out = Path(out_dir) if out_dir is not None else video_path().parent
    out.mkdir(parents=True, exist_ok=True)
    mp4, sidecar = out / "scenes.mp4", out / "scenes.json"
    width, height = scenes.SCENE_WIDTH_PX, scenes.SCENE_HEIGHT_PX
    frames_per_segment = int(round(SEGMENT_S * FPS))
    writer = cv2.VideoWriter(str(mp4), cv2.VideoWriter_fourcc(*FOURCC), float(FPS), (width, height))
    if not writer.isOpened():
        raise RuntimeError(f"OpenCV cannot write {FOURCC} video to {mp4}")
    segments = []
    try:
        for k in range(N_SEGMENTS):
            scene, qas, rng = segment_scene(seed, k)
            for _ in range(frames_per_segment):
                frame = scenes.render(scene, noise_rng=rng, noise_sigma=NOISE_SIGMA)
                writer.write(np.ascontiguousarray(frame[..., ::-1]))  # RGB -> BGR
            f0 = k * frames_per_segment
            segments.append(
                {
                    "index": k,
                    "start_ms": round(f0 * 1000 / FPS),
                    "end_ms": round((f0 + frames_per_segment) * 1000 / FPS),
                    "start_frame": f0,
                    "end_frame": f0 + frames_per_segment,
                    "description": scenes.describe(scene),
                    "objects": [
                        {
                            "shape": o.shape,
                            "colour": o.colour,
                            "size": o.size,
                            "cx_px": round(o.cx_px, 1),
                            "cy_px": round(o.cy_px, 1),
                        }
                        for o in scene.objects
                    ],
                    "questions": [{"kind": q.kind, "question": q.question, "answer": q.answer} for q in qas],
                }
            )
    finally:
        writer.release()
    meta = {
        "video": mp4.name,
        "fourcc": FOURCC,
        "fps": FPS,
        "width_px": width,
        "height_px": height,
        "frame_count": N_SEGMENTS * frames_per_segment,
        "segment_ms": round(SEGMENT_S * 1000),
        "seed": seed,
        "generator": "edgevlm.runtime.demo.scenes (DOMAIN_VIDEO stream)",
        "segments": segments,
    }
    sidecar.write_text(json.dumps(meta, indent=1) + "\n")
    n = len(read_frames(mp4))
    if n != meta["frame_count"]:
        raise RuntimeError(f"{mp4}: decoded {n} frames, wrote {meta['frame_count']}")
    return mp4, sidecar


def read_frames(path: str | Path | None = None) -> list[np.ndarray]:
    """All frames of a video as ``(H, W, 3)`` uint8 RGB arrays (OpenCV ``VideoCapture``).

    Raises:
        FileNotFoundError: the file does not exist. RuntimeError: OpenCV cannot open it.
    """
    import cv2

    p = Path(path) if path is not None else video_path()
    if not p.is_file():
        raise FileNotFoundError(p)
    cap = cv2.VideoCapture(str(p))
    if not cap.isOpened():
        raise RuntimeError(f"OpenCV cannot open {p}")
    frames = []
    try:
        while True:
            ok, frame = cap.read()
            if not ok:
                break
            frames.append(np.ascontiguousarray(frame[..., ::-1]))
    finally:
        cap.release()
    return frames


def load_sidecar(path: str | Path | None = None) -> dict:
    """The parsed ``scenes.json`` (default: the bundled one)."""
    return json.loads(Path(path or scenes_json_path()).read_text())


def segment_for_ms(sidecar: dict, pos_ms: float) -> dict | None:
    """The segment showing media time ``pos_ms`` (``start_ms <= pos_ms < end_ms``), else None.

    A looping source passes its position within the current loop.
    """
    for seg in sidecar["segments"]:
        if seg["start_ms"] <= pos_ms < seg["end_ms"]:
            return seg
    return None


def check_model(mp4: Path, sidecar_path: Path, model: str | None = None) -> tuple[int, int]:
    """Ask the model every sidecar question on the middle frame of its segment; prints each and
    returns ``(right, total)``."""
    from edgevlm.runtime import Engine

    engine = Engine.load(model)
    frames = read_frames(mp4)
    meta = load_sidecar(sidecar_path)
    right = total = 0
    for seg in meta["segments"]:
        frame = frames[(seg["start_frame"] + seg["end_frame"]) // 2]
        for q in seg["questions"]:
            got = engine.ask(frame, q["question"], max_new_tokens=24).text.strip()
            ok = got == q["answer"]
            right, total = right + ok, total + 1
            print(
                f"[{seg['index']}] {q['question']!r}: {got!r} (expected {q['answer']!r}) {'ok' if ok else 'WRONG'}"
            )
    return right, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out-dir", default=None, help="output folder (default: the package's media folder)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check-model", action="store_true", help="ask the shipped model every question")
    args = ap.parse_args(argv)
    mp4, sidecar = write_video(args.out_dir, seed=args.seed)
    meta = load_sidecar(sidecar)
    print(f"wrote {mp4} ({mp4.stat().st_size / 1e6:.2f} MB, {meta['frame_count']} frames) and {sidecar}")
    if args.check_model:
        right, total = check_model(mp4, sidecar)
        print(f"model answers on the video: {right}/{total} right")
        return 0 if right == total else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
