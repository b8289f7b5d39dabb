"""Calibration data of ``edgevlm calibrate`` (:mod:`edgevlm.quantize.calibrate`): demo scenes, their
closed-set labels, batches rendered by a worker pool, and the encoder states the exit heads read.

The calibration stream is the demo scene generator (:mod:`edgevlm.runtime.demo.scenes`) seeded
with ``rng_for(seed, 3, index)`` — domain 3, disjoint from training (0), evaluation (1) and video
(2) — rendered at 384x288 with Gaussian noise of sigma 2 (8-bit levels), like the evaluation set.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

CALIB_DOMAIN = 3  # SeedSequence domain of the calibration stream (train 0, eval 1, video 2)
NOISE_SIGMA = 2.0



def scene_labels(scene, labels: list[str]) -> np.ndarray:
    """``(L,)`` float32 0/1 vector: which of ``labels`` hold for a demo ``scene``."""
    present: set[str] = set()
    for o in scene.objects:
        halves = ["left" if o.cx_px < scene.width_px / 2 else "right",
                  "top" if o.cy_px < scene.height_px / 2 else "bottom"]
        present |= {o.colour, o.shape, o.size, f"{o.colour} {o.shape}", *halves}
        if o.size == "large":
            present |= {f"large {h}" for h in halves}
    return np.asarray([lab in present for lab in labels], np.float32)


def calibration_scene(seed: int, index: int):
    """Scene ``index`` of the calibration stream: ``(image (288, 384, 3) uint8, scene, rng)``."""
    from edgevlm.runtime.demo import scenes

    rng = scenes.rng_for(seed, CALIB_DOMAIN, index)
    scene = scenes.generate_scene(rng)
    return scenes.render(scene, noise_rng=rng, noise_sigma=NOISE_SIGMA), scene, rng


def make_batch(job: tuple) -> dict:
    """One calibration batch (runs in a worker process; numpy/OpenCV only).

    ``job = (seed, first_index, n, rung_px, patch_px, mean, std, labels, questions)`` ->
    ``{"pixels": (n, 3, H, W) float32, "labels": (n, L) float32, "qas": n lists of (question,
    answer, kind)}`` for images ``first_index .. first_index + n - 1`` of the calibration stream.
    """
    import cv2

    from edgevlm.runtime.demo import scenes
    from edgevlm.runtime.preprocess import preprocess

    cv2.setNumThreads(1)  # one process per core already
    seed, first, n, rung, patch, mean, std, labels, questions = job
    px, ys, qas = [], [], []
    for i in range(first, first + n):
        image, scene, rng = calibration_scene(seed, i)
        px.append(preprocess(image, rung, patch, mean, std))
        ys.append(scene_labels(scene, labels))
        qs = scenes.sample_questions(scene, rng, questions) if questions else []
        qas.append([(q.question, q.answer, q.kind) for q in qs])
    return {"pixels": np.stack(px), "labels": np.stack(ys), "qas": qas}


class BatchStream:
    """Calibration batches ``make_batch`` for steps ``0..steps-1`` (step ``s``: images
    ``offset + s * batch_size ...`` at rung ``rungs[s % len(rungs)]``; ``total`` images in all,
    default ``steps * batch_size``), rendered ahead by a
    process pool of ``workers`` (forked; 0 or 1 = in this process). Iterate once."""

    def __init__(self, engine, *, seed: int, offset: int, steps: int, batch_size: int, rungs: list[int],
                 labels: list[str], questions: int = 0, workers: int = 0, total: int | None = None) -> None:
        total = steps * batch_size if total is None else total  # the last batch may be shorter
        self.jobs = [(seed, offset + s * batch_size, min(batch_size, total - s * batch_size), rungs[s % len(rungs)],
                      engine.patch_size_px, tuple(engine.image_mean), tuple(engine.image_std), list(labels), questions)
                     for s in range(steps) if total > s * batch_size]
        self.workers = workers

    def __len__(self) -> int:
        return len(self.jobs)

    def __iter__(self) -> Iterator[dict]:
        if self.workers <= 1:
            yield from map(make_batch, self.jobs)
            return
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(self.workers, mp_context=mp.get_context("fork")) as ex:
            ahead = 2 * self.workers
            futures = [ex.submit(make_batch, j) for j in self.jobs[:ahead]]
            for i in range(len(self.jobs)):
                if i + ahead < len(self.jobs):
                    futures.append(ex.submit(make_batch, self.jobs[i + ahead]))
                yield futures[i].result()
                futures[i] = None


def _pixels(engine, images: list[np.ndarray], rung: int):
    import torch

    from edgevlm.runtime.preprocess import preprocess

    px = [preprocess(im, rung, engine.patch_size_px, engine.image_mean, engine.image_std) for im in images]
    return torch.from_numpy(np.stack(px)).to(engine.backend.device, engine.backend.dtype)  # (B, 3, H, W)


def grid_of(model, pixel_values) -> tuple[int, int]:
    """The patch grid ``(h, w)`` of a ``(B, 3, H, W)`` pixel batch."""
    p = model.cfg.vision.patch_size
    return pixel_values.shape[-2] // p, pixel_values.shape[-1] // p


def encoder_states(model, pixel_values, blocks: set[int]) -> dict:
    """Hidden states ``{i: (B, 1 + N, D)}`` after the blocks in ``blocks`` (0 = after pre-LN)."""
    enc = model.vision_tower.encoder
    x = enc.stem(pixel_values)
    out = {0: x} if 0 in blocks else {}
    for i, layer in enumerate(enc.layers, start=1):
        if i > max(blocks):
            break
        x = layer(x)
        if i in blocks:
            out[i] = x
    return out


def selected_features(model, states: dict):
    """The features the projector reads, ``(B, N, F)`` ('default' strategy drops CLS)."""
    import torch

    cfg = model.cfg
    f = torch.cat([states[i] for i in cfg.vision_feature_indices], dim=-1)
    return f[:, 1:] if cfg.vision_feature_select_strategy == "default" else f
