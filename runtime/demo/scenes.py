"""Seeded procedural scenes with exact question/answer pairs: the demo model's training and eval data.

A scene is 1-4 flat-coloured shapes drawn with OpenCV on a dark or neutral background (flat,
gradient, smooth noise, stripes or checker, always with fine grain), at a 4:3 camera size of
384x288 pixels (the top rung of the demo model's resolution ladder). Every object is

- a shape: ``circle``, ``square``, ``triangle`` or ``cross`` (squares, triangles and crosses are
  rotated by up to 12 degrees),
- a colour: ``red``, ``green``, ``blue``, ``yellow`` or ``white`` (backgrounds stay below grey
  level 135 with little tint, so colour names are unambiguous),
- a size: ``small`` (10-14 px across at 384 px width: 3-5 px at the 128 px rung, where shapes can
  no longer be told apart) or ``large`` (36-60 px).

Objects never overlap (8 px gap) and never straddle a centre line (each lies wholly in one
quadrant with an 8 px gap to both centre lines), so left/right and top/bottom are exact.

Questions (one canonical phrasing per kind, answers lowercase words or digits):

============  ==========================================  =====================================
kind          question                                    answer
============  ==========================================  =====================================
count_total   how many shapes are there?                  ``1``-``4``
count_colour  how many red shapes are there?              ``0``-``4``
count_shape   how many circles are there?                 ``0``-``4``
colour        what color is the triangle?                 colour (only if exactly one triangle)
shape         what shape is the blue object?              shape (only if exactly one blue object)
presence      is there a green circle?                    ``yes``/``no`` (negatives are mostly
                                                          hard: colour or shape present)
position_lr   is the red circle on the left or the right? ``left``/``right`` (unique pair)
position_tb   is the red circle at the top or the bottom? ``top``/``bottom`` (unique pair)
describe      describe the scene.                         e.g. ``large blue square and small
                                                          red circle``
============  ==========================================  =====================================

The description lists every object as ``<size> <colour> <shape>`` joined by ``and``, in a fixed
order that does not depend on position: large before small, then colours in the order of
:data:`COLOURS`, then shapes in the order of :data:`SHAPES` (identical objects are repeated).

Randomness is numpy's ``Generator`` (PCG64) seeded through ``SeedSequence`` entropy lists: the
training stream uses ``[seed, 0, batch_index]``, :func:`eval_set` ``[seed, 1, item_index]`` and the
bundled video ``[seed, 2, segment_index]``, so train and eval never share a stream. Torch-free.

The vocabulary and records are in :mod:`edgevlm.runtime.demo.scene_types`, the questions and
answers in :mod:`edgevlm.runtime.demo.questions`; this module generates and renders scenes and
re-exports both.
"""

from __future__ import annotations

import functools
import math
import statistics

import numpy as np

from edgevlm.runtime.demo.questions import (
    all_questions,
    answer,
    describe,
    make_question,
    question_text,
    sample_questions,
    valid_kinds,
)
from edgevlm.runtime.demo.scene_types import (
    BACKGROUNDS,
    COLOUR_NAMES,
    COLOURS,
    DOMAIN_EVAL,
    DOMAIN_TRAIN,
    DOMAIN_VIDEO,
    GAP_PX,
    KINDS,
    LARGE_EXTENT_PX,
    MARGIN_PX,
    MAX_OBJECTS,
    P_SMALL,
    QA,
    SCENE_HEIGHT_PX,
    SCENE_WIDTH_PX,
    SHAPE_PLURALS,
    SHAPES,
    SIZES,
    SMALL_EXTENT_PX,
    Background,
    EvalItem,
    Scene,
    SceneObject,
    rng_for,
)

__all__ = [
    "SCENE_WIDTH_PX",
    "SCENE_HEIGHT_PX",
    "SHAPES",
    "SHAPE_PLURALS",
    "COLOURS",
    "COLOUR_NAMES",
    "SIZES",
    "SMALL_EXTENT_PX",
    "LARGE_EXTENT_PX",
    "BACKGROUNDS",
    "KINDS",
    "MAX_OBJECTS",
    "GAP_PX",
    "MARGIN_PX",
    "P_SMALL",
    "DOMAIN_TRAIN",
    "DOMAIN_EVAL",
    "DOMAIN_VIDEO",
    "SceneObject",
    "Background",
    "Scene",
    "QA",
    "EvalItem",
    "rng_for",
    "describe",
    "valid_kinds",
    "question_text",
    "answer",
    "make_question",
    "all_questions",
    "sample_questions",
    "object_bbox",
    "generate_scene",
    "render",
    "eval_set_item",
    "eval_set",
    "vocabulary",
]




# ----------------------------------------------------------------------------- geometry


def _polygon(shape: str, cx: float, cy: float, extent: float, angle_deg: float) -> np.ndarray:
    """Outline of a square/triangle/cross, ``(N, 2)`` float pixel coordinates."""
    h = extent / 2.0
    if shape == "square":
        pts = [(-h, -h), (h, -h), (h, h), (-h, h)]
    elif shape == "triangle":
        th = extent * math.sqrt(3.0) / 2.0  # equilateral, apex up, centred on its bounding box
        pts = [(0.0, -th / 2.0), (h, th / 2.0), (-h, th / 2.0)]
    elif shape == "cross":
        a = extent / 6.0  # arm half-width: arms one third of the extent
        pts = [
            (-a, -h),
            (a, -h),
            (a, -a),
            (h, -a),
            (h, a),
            (a, a),
            (a, h),
            (-a, h),
            (-a, a),
            (-h, a),
            (-h, -a),
            (-a, -a),
        ]
    else:
        raise ValueError(f"not a polygon shape: {shape!r}")
    t = math.radians(angle_deg)
    c, s = math.cos(t), math.sin(t)
    p = np.asarray(pts, dtype=np.float64)
    return np.stack([cx + c * p[:, 0] - s * p[:, 1], cy + s * p[:, 0] + c * p[:, 1]], axis=1)


def object_bbox(obj: SceneObject) -> tuple[float, float, float, float]:
    """``(x0, y0, x1, y1)`` pixel bounding box of an object as drawn."""
    if obj.shape == "circle":
        r = obj.extent_px / 2.0
        return obj.cx_px - r, obj.cy_px - r, obj.cx_px + r, obj.cy_px + r
    p = _polygon(obj.shape, obj.cx_px, obj.cy_px, obj.extent_px, obj.angle_deg)
    return float(p[:, 0].min()), float(p[:, 1].min()), float(p[:, 0].max()), float(p[:, 1].max())


def _fits(box, placed, width: int, height: int, scale: float) -> bool:
    x0, y0, x1, y1 = box
    margin, gap = MARGIN_PX * scale, GAP_PX * scale
    if x0 < margin or y0 < margin or x1 > width - margin or y1 > height - margin:
        return False
    mx, my = width / 2.0, height / 2.0
    if x0 < mx + gap and x1 > mx - gap:  # straddles (or touches) the vertical centre line
        return False
    if y0 < my + gap and y1 > my - gap:
        return False
    for bx0, by0, bx1, by1 in placed:
        if x0 < bx1 + gap and bx0 < x1 + gap and y0 < by1 + gap and by0 < y1 + gap:
            return False
    return True


# ----------------------------------------------------------------------------- generation


def _background(rng: np.random.Generator) -> Background:
    kind = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    grey = float(rng.uniform(20.0, 105.0))
    tint = rng.uniform(-8.0, 8.0, size=3)
    rgb0 = np.clip(grey + tint, 8, 130)
    delta = float(rng.uniform(10.0, 30.0)) * (1.0 if rng.random() < 0.5 else -1.0)
    rgb1 = np.clip(rgb0 + delta + rng.uniform(-5.0, 5.0, size=3), 8, 130)
    return Background(
        kind=kind,
        rgb0=tuple(int(v) for v in rgb0),
        rgb1=tuple(int(v) for v in rgb1),
        angle_deg=float(rng.uniform(0.0, 180.0)),
        period_px=float(rng.uniform(10.0, 40.0)),
        noise_seed=int(rng.integers(2**31 - 1)),
    )


def generate_scene(
    rng: np.random.Generator,
    *,
    width_px: int = SCENE_WIDTH_PX,
    height_px: int = SCENE_HEIGHT_PX,
    n_objects: int | None = None,
) -> Scene:
    """Draw a random scene description (no pixels; see :func:`render`).

    Args:
        rng: numpy generator; the scene is a deterministic function of its state.
        width_px, height_px: image size; object sizes scale with ``width_px / 384``.
        n_objects: 1..4, or None for uniform in 1..4.

    Raises:
        ValueError: ``n_objects`` outside 1..4 or an image too small to place the objects.
    """
    if n_objects is None:
        n_objects = int(rng.integers(1, MAX_OBJECTS + 1))
    if not 1 <= n_objects <= MAX_OBJECTS:
        raise ValueError(f"n_objects must be in 1..{MAX_OBJECTS}, got {n_objects}")
    scale = width_px / SCENE_WIDTH_PX
    background = _background(rng)
    objects: list[SceneObject] = []
    boxes: list[tuple[float, float, float, float]] = []
    for _ in range(n_objects):
        size = "small" if rng.random() < P_SMALL else "large"
        lo, hi = SMALL_EXTENT_PX if size == "small" else LARGE_EXTENT_PX
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))]
        extent = float(rng.uniform(lo, hi)) * scale
        angle = 0.0 if shape == "circle" else float(rng.uniform(-12.0, 12.0))
        jitter = rng.integers(-15, 16, size=3)
        rgb = tuple(int(v) for v in np.clip(np.asarray(COLOURS[colour]) + jitter, 0, 255))
        for _attempt in range(500):
            cx = float(rng.uniform(0.0, width_px))
            cy = float(rng.uniform(0.0, height_px))
            obj = SceneObject(shape, colour, size, cx, cy, extent, angle, rgb)
            box = object_bbox(obj)
            if _fits(box, boxes, width_px, height_px, scale):
                objects.append(obj)
                boxes.append(box)
                break
        else:
            raise ValueError(f"could not place {n_objects} objects in {width_px}x{height_px}")
    return Scene(width_px, height_px, background, tuple(objects))


# ----------------------------------------------------------------------------- rendering


def _render_background(bg: Background, width: int, height: int) -> np.ndarray:
    """``(H, W, 3)`` uint8 RGB background: tone ramp ``rgb0 -> rgb1`` plus uniform 0..7 grain."""
    import cv2

    rng = np.random.default_rng(bg.noise_seed)
    c0 = np.asarray(bg.rgb0, np.float32)
    c1 = np.asarray(bg.rgb1, np.float32)
    xs = np.arange(width, dtype=np.float32)[None, :]  # (1, W)
    ys = np.arange(height, dtype=np.float32)[:, None]  # (H, 1)
    t = math.radians(bg.angle_deg)
    along = xs * math.cos(t) + ys * math.sin(t)  # (H, W) pixels along the direction
    if bg.kind == "flat":
        w = np.zeros((height, width), np.float32)  # (H, W)
    elif bg.kind == "gradient":
        w = (along - along.min()) / max(float(along.max() - along.min()), 1.0)
    elif bg.kind == "noise":
        cell = max(2, int(bg.period_px))
        small = rng.random((height // cell + 2, width // cell + 2), dtype=np.float32)
        w = cv2.resize(small, (width, height), interpolation=cv2.INTER_CUBIC).clip(0.0, 1.0)
    elif bg.kind == "stripes":
        w = 0.5 + 0.5 * np.sin(along * (2.0 * math.pi / bg.period_px))
    elif bg.kind == "checker":
        p = int(bg.period_px)
        w = (((np.arange(width) // p)[None, :] + (np.arange(height) // p)[:, None]) % 2).astype(np.float32)
    else:
        raise ValueError(f"unknown background kind {bg.kind!r}")
    # Tone ramp as a per-channel lookup table (both tones lie in 8..130, so the 0..7 grain
    # added below cannot overflow uint8), indexed by the quantised weight.
    wq = (w * 255.0 + 0.5).astype(np.uint8)  # (H, W)
    ramp = np.arange(256, dtype=np.float32)[:, None] / 255.0  # (256, 1)
    lut = np.clip(np.round(c0 + ramp * (c1 - c0)) - 4.0, 0, 255).astype(np.uint8)  # (256, 3)
    import cv2

    img = cv2.LUT(cv2.merge([wq, wq, wq]), lut.reshape(256, 1, 3))  # (H, W, 3)
    grain = (np.frombuffer(rng.bytes(height * width), np.uint8) & 7).reshape(height, width)
    return cv2.add(img, cv2.merge([grain, grain, grain]))


@functools.lru_cache(maxsize=1)
def _gauss_table() -> np.ndarray:
    """Standard normal quantiles at (k + 0.5) / 256, k = 0..255, float32."""
    nd = statistics.NormalDist()
    return np.asarray([nd.inv_cdf((k + 0.5) / 256.0) for k in range(256)], np.float32)


def render(
    scene: Scene,
    *,
    noise_rng: np.random.Generator | None = None,
    noise_sigma: float = 0.0,
) -> np.ndarray:
    """Draw a scene: ``(H, W, 3)`` uint8 RGB, deterministic given the scene.

    ``noise_sigma`` > 0 adds Gaussian sensor noise (grey levels) drawn from ``noise_rng``.
    Shapes are drawn anti-aliased with 4 bits of sub-pixel precision (``cv2.fillPoly(shift=4)``).
    """
    import cv2

    img = _render_background(scene.background, scene.width_px, scene.height_px)
    frac = 16.0  # shift=4
    for obj in scene.objects:
        colour = tuple(int(v) for v in obj.rgb)
        if obj.shape == "circle":
            centre = (int(round(obj.cx_px * frac)), int(round(obj.cy_px * frac)))
            radius = int(round(obj.extent_px / 2.0 * frac))
            cv2.circle(img, centre, radius, colour, thickness=-1, lineType=cv2.LINE_AA, shift=4)
        else:
            pts = np.round(_polygon(obj.shape, obj.cx_px, obj.cy_px, obj.extent_px, obj.angle_deg) * frac)
            cv2.fillPoly(img, [pts.astype(np.int32)], colour, lineType=cv2.LINE_AA, shift=4)
    if noise_sigma > 0.0:
        if noise_rng is None:
            raise ValueError("noise_sigma > 0 needs a noise_rng")
        # Gaussian noise, rounded to integers, through a 256-entry inverse-CDF table indexed by
        # random bytes (much faster than drawing normals).
        table = np.round(_gauss_table() * noise_sigma).astype(np.int16)  # (256,)
        out = img.astype(np.int16)
        out += table[np.frombuffer(noise_rng.bytes(img.size), np.uint8)].reshape(img.shape)
        img = np.clip(out, 0, 255).astype(np.uint8)
    return img




def eval_set_item(seed: int, index: int, *, noise_sigma: float = 2.0) -> EvalItem:
    """Item ``index`` of the held-out set of ``seed`` (see :func:`eval_set`)."""
    rng = rng_for(seed, DOMAIN_EVAL, index)
    kind = KINDS[index % len(KINDS)]
    while True:
        scene = generate_scene(rng)
        if kind in valid_kinds(scene):
            break
    qa = make_question(scene, kind, rng)
    image = render(scene, noise_rng=rng, noise_sigma=noise_sigma)
    return EvalItem(image=image, scene=scene, qa=qa)


def eval_set(n: int, seed: int = 1000, *, noise_sigma: float = 2.0) -> list[EvalItem]:
    """The held-out evaluation set: ``n`` items, kinds in round-robin over :data:`KINDS`.

    Item ``i`` comes from ``rng_for(seed, DOMAIN_EVAL, i)`` (a scene is redrawn until the kind is
    valid for it), rendered with Gaussian sensor noise of ``noise_sigma`` grey levels. Training
    uses the DOMAIN_TRAIN stream, so no training example is drawn from these streams.
    """
    return [eval_set_item(seed, i, noise_sigma=noise_sigma) for i in range(n)]


def vocabulary() -> list[str]:
    """Every word and punctuation token the generator's questions and answers use."""
    words = {"how", "many", "shapes", "are", "there", "what", "color", "is", "the", "shape", "object"}
    words |= {"a", "on", "left", "or", "right", "at", "top", "bottom", "describe", "scene", "and"}
    words |= {"yes", "no", "?", "."}
    words |= set(SHAPES) | set(SHAPE_PLURALS.values()) | set(COLOUR_NAMES) | set(SIZES)
    words |= {str(d) for d in range(10)}
    return sorted(words)


def demo_labels() -> list[str]:
    """Closed-set labels of the demo scenes: colours, shapes, sizes, halves with any object, halves
    with a large object, and colour-shape pairs (each true when such an object is present)."""
    halves = ["left", "right", "top", "bottom"]
    return [*COLOUR_NAMES, *SHAPES, *SIZES, *halves, *[f"large {h}" for h in halves],
            *[f"{c} {s}" for c in COLOUR_NAMES for s in SHAPES]]
