"""Training and eval batches of the demo VLM (:mod:`edgevlm.runtime.demo.train`), built from
:mod:`edgevlm.runtime.demo.scenes`: images at one random rung of the resolution ladder per batch,
preprocessed by :func:`edgevlm.runtime.preprocess.preprocess` (CLIP mean/std), each with a 2-6
turn conversation (:class:`edgevlm.runtime.demo.vocab.SequenceBuilder`), plus the dense per-patch
targets of the auxiliary vision loss (:func:`aux_labels`). Batch ``i`` is a pure function of
``(seed, i)``. Re-exported by :mod:`edgevlm.runtime.demo.train`.
"""

from __future__ import annotations

import numpy as np

from edgevlm.runtime.demo import scenes, vocab
from edgevlm.runtime.preprocess import preprocess

__all__ = [
    "KIND_WEIGHTS",
    "MAX_TURNS",
    "MIN_TURNS",
    "N_AUX_CLASSES",
    "PATCH_PX",
    "P_JPEG",
    "RESOLUTION_LADDER_PX",
    "RUNG_PROBS",
    "TrainBatches",
    "aux_labels",
    "eval_batches",
]

RESOLUTION_LADDER_PX = (384, 256, 192, 128)
RUNG_PROBS = (0.4, 0.25, 0.2, 0.15)
PATCH_PX = 16
KIND_WEIGHTS = {"describe": 2.0, "count_total": 0.7}
MIN_TURNS, MAX_TURNS = 2, 6
P_JPEG = 0.2


def _jpeg(img: np.ndarray, quality: int) -> np.ndarray:
    import cv2

    ok, buf = cv2.imencode(".jpg", img[..., ::-1], [cv2.IMWRITE_JPEG_QUALITY, quality])
    return np.ascontiguousarray(cv2.imdecode(buf, cv2.IMREAD_COLOR)[..., ::-1])


N_AUX_CLASSES = 1 + len(scenes.SIZES) * len(scenes.COLOURS) * len(scenes.SHAPES)


def aux_labels(scene: scenes.Scene, grid_h: int, grid_w: int) -> np.ndarray:
    """Dense per-patch targets of the auxiliary vision loss, ``(4, grid_h * grid_w)`` int64.

    Row 0, coverage: ``1 + (size, colour, shape)`` index of the object whose disc of radius
    0.6 × extent holds the patch centre (0 = background); row 1, centre: 1 on the patch that holds
    an object's centre; rows 2 and 3: the patch lies right of / below the image's centre lines
    (the decoder reads raster-ordered tokens with 1-D RoPE, so it cannot tell left from right
    unless the features say so). They teach the from-scratch ViT, in a few hundred steps, per-patch features
    that the decoder can count and describe from (the decoder's answer loss alone takes thousands
    of steps to reach the image); the head is dropped when the model is saved.
    """
    colours = list(scenes.COLOURS)
    out = np.zeros((4, grid_h, grid_w), np.int64)
    sx, sy = grid_w / scene.width_px, grid_h / scene.height_px
    cols = (np.arange(grid_w) + 0.5) / sx  # patch centres in scene px
    rows = (np.arange(grid_h) + 0.5) / sy
    for obj in scene.objects:
        cls = 1 + (scenes.SIZES.index(obj.size) * len(colours) + colours.index(obj.colour)) * len(
            scenes.SHAPES
        ) + scenes.SHAPES.index(obj.shape)
        inside = (cols[None, :] - obj.cx_px) ** 2 + (rows[:, None] - obj.cy_px) ** 2 <= (0.6 * obj.extent_px) ** 2
        out[0][inside] = cls
        r, c = min(grid_h - 1, int(obj.cy_px * sy)), min(grid_w - 1, int(obj.cx_px * sx))
        out[0, r, c] = cls
        out[1, r, c] = 1
    out[2] = (cols[None, :] > scene.width_px / 2).astype(np.int64)
    out[3] = (rows[:, None] > scene.height_px / 2).astype(np.int64)
    return out.reshape(4, -1)


def _collate(
    seqs: list[tuple[list[int], list[bool]]], pixels: list[np.ndarray], rung: int, aux: list | None = None
) -> dict:
    import torch

    t_max = max(len(ids) for ids, _ in seqs)
    ids = np.full((len(seqs), t_max), vocab.PAD_ID, np.int64)
    target = np.zeros((len(seqs), t_max), np.bool_)
    for b, (s, m) in enumerate(seqs):
        ids[b, : len(s)] = s
        target[b, : len(m)] = m
    return {
        "pixel_values": torch.from_numpy(np.stack(pixels)),  # (B, 3, H, W) float16
        "input_ids": torch.from_numpy(ids),  # (B, T)
        "target": torch.from_numpy(target),  # (B, T) token is supervised
        "rung": rung,
        **({"aux": torch.from_numpy(np.stack(aux))} if aux else {}),  # (B, 4, Np)
    }


class TrainBatches:
    """Map-style dataset: item ``i`` is training batch ``i`` (a dict of tensors), a pure function
    of ``(seed, i)`` drawn from ``scenes.rng_for(seed, DOMAIN_TRAIN, i)``."""

    def __init__(self, seed: int, batch_size: int) -> None:
        self.seed, self.batch_size = seed, batch_size
        self.builder: vocab.SequenceBuilder | None = None

    def __len__(self) -> int:
        return 1 << 40

    def __getitem__(self, index: int) -> dict:
        if self.builder is None:
            self.builder = vocab.SequenceBuilder()
        rng = scenes.rng_for(self.seed, scenes.DOMAIN_TRAIN, index)
        rung = int(rng.choice(RESOLUTION_LADDER_PX, p=RUNG_PROBS))
        seqs, pixels, aux = [], [], []
        for _ in range(self.batch_size):
            scene = scenes.generate_scene(rng)
            sigma = float(rng.uniform(0.0, 4.0)) if rng.random() < 0.8 else 0.0
            img = scenes.render(scene, noise_rng=rng, noise_sigma=sigma)
            if rng.random() < P_JPEG:
                img = _jpeg(img, int(rng.integers(35, 96)))
            x = preprocess(img, rung, PATCH_PX)  # (3, H', W') float32
            n_img = (x.shape[1] // PATCH_PX) * (x.shape[2] // PATCH_PX)
            turns = int(rng.integers(MIN_TURNS, MAX_TURNS + 1))
            qas = scenes.sample_questions(scene, rng, turns, kind_weights=KIND_WEIGHTS)
            seqs.append(self.builder.build(n_img, [(qa.question, qa.answer) for qa in qas]))
            pixels.append(x.astype(np.float16))
            aux.append(aux_labels(scene, x.shape[1] // PATCH_PX, x.shape[2] // PATCH_PX))
        return _collate(seqs, pixels, rung, aux)


def _eval_item(args: tuple[int, int]) -> scenes.EvalItem:
    seed, i = args
    return scenes.eval_set_item(seed, i)


def eval_batches(items: list[scenes.EvalItem], rung: int, batch_size: int) -> list[tuple[dict, list[str]]]:
    """Single-turn eval batches of ``items`` at one rung, with the kind of each row."""
    builder = vocab.SequenceBuilder()
    out = []
    for start in range(0, len(items), batch_size):
        chunk = items[start : start + batch_size]
        seqs, pixels = [], []
        for it in chunk:
            x = preprocess(it.image, rung, PATCH_PX)
            n_img = (x.shape[1] // PATCH_PX) * (x.shape[2] // PATCH_PX)
            seqs.append(builder.build(n_img, [(it.qa.question, it.qa.answer)]))
            pixels.append(x.astype(np.float16))
        out.append((_collate(seqs, pixels, rung), [it.qa.kind for it in chunk]))
    return out

