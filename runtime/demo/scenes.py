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
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import numpy as np

SCENE_WIDTH_PX = 384
SCENE_HEIGHT_PX = 288

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
SHAPE_PLURALS: dict[str, str] = {
    "circle": "circles",
    "square": "squares",
    "triangle": "triangles",
    "cross": "crosses",
}
#: Colour name -> nominal RGB. The order is the description order.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (225, 40, 40),
    "green": (40, 190, 65),
    "blue": (55, 95, 240),
    "yellow": (240, 215, 40),
    "white": (240, 240, 240),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)
SIZES: tuple[str, ...] = ("large", "small")
#: Object extent (bounding-box side before rotation) in pixels at a 384 px wide scene.
SMALL_EXTENT_PX = (10.0, 14.0)
LARGE_EXTENT_PX = (36.0, 60.0)
BACKGROUNDS: tuple[str, ...] = ("flat", "gradient", "noise", "stripes", "checker")
KINDS: tuple[str, ...] = (
    "count_total",
    "count_colour",
    "count_shape",
    "colour",
    "shape",
    "presence",
    "position_lr",
    "position_tb",
    "describe",
)
MAX_OBJECTS = 4
GAP_PX = 8.0  # between objects, and between an object and a centre line (at 384 px width)
MARGIN_PX = 6.0  # between an object and the image border
P_SMALL = 0.4

# SeedSequence domains (second entropy word).
DOMAIN_TRAIN = 0
DOMAIN_EVAL = 1
DOMAIN_VIDEO = 2


@dataclass(frozen=True)
class SceneObject:
    """One drawn object. Coordinates in pixels of the scene image, ``(cx_px, cy_px)`` its centre."""

    shape: str
    colour: str
    size: str
    cx_px: float
    cy_px: float
    extent_px: float
    angle_deg: float
    rgb: tuple[int, int, int]

    @property
    def name(self) -> str:
        """``"<size> <colour> <shape>"``, the unit of a description."""
        return f"{self.size} {self.colour} {self.shape}"


@dataclass(frozen=True)
class Background:
    """Background recipe: ``kind`` in :data:`BACKGROUNDS`, two RGB tones, a direction (degrees),
    a period (pixels, stripes/checker) and the seed of its noise."""

    kind: str
    rgb0: tuple[int, int, int]
    rgb1: tuple[int, int, int]
    angle_deg: float
    period_px: float
    noise_seed: int


@dataclass(frozen=True)
class Scene:
    """A scene: image size, background and objects. :func:`render` draws it deterministically."""

    width_px: int
    height_px: int
    background: Background
    objects: tuple[SceneObject, ...]


@dataclass(frozen=True)
class QA:
    """A question about a scene and its exact answer."""

    kind: str
    question: str
    answer: str


@dataclass(frozen=True)
class EvalItem:
    """A held-out example: the rendered ``(H, W, 3)`` uint8 RGB image, its scene and one QA."""

    image: np.ndarray
    scene: Scene
    qa: QA


def rng_for(seed: int, domain: int, index: int) -> np.random.Generator:
    """The numpy generator of item ``index`` of a stream (``domain``: train 0, eval 1, video 2)."""
    return np.random.default_rng([int(seed), int(domain), int(index)])


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


# ----------------------------------------------------------------------------- questions


def describe(scene: Scene) -> str:
    """The canonical description: ``<size> <colour> <shape>`` items joined by ``and``, large
    before small, then by :data:`COLOURS` order, then by :data:`SHAPES` order."""
    key = [(SIZES.index(o.size), COLOUR_NAMES.index(o.colour), SHAPES.index(o.shape)) for o in scene.objects]
    order = sorted(range(len(scene.objects)), key=lambda i: key[i])
    return " and ".join(scene.objects[i].name for i in order)


def _unique_pairs(scene: Scene) -> list[SceneObject]:
    """Objects whose (colour, shape) pair occurs once in the scene."""
    pairs = [(o.colour, o.shape) for o in scene.objects]
    return [o for o in scene.objects if pairs.count((o.colour, o.shape)) == 1]


def _unique_shapes(scene: Scene) -> list[str]:
    shapes = [o.shape for o in scene.objects]
    return [s for s in SHAPES if shapes.count(s) == 1]


def _unique_colours(scene: Scene) -> list[str]:
    colours = [o.colour for o in scene.objects]
    return [c for c in COLOUR_NAMES if colours.count(c) == 1]


def valid_kinds(scene: Scene) -> list[str]:
    """Question kinds that have an exact answer for this scene (in :data:`KINDS` order)."""
    kinds = []
    for kind in KINDS:
        if kind == "colour" and not _unique_shapes(scene):
            continue
        if kind == "shape" and not _unique_colours(scene):
            continue
        if kind in ("position_lr", "position_tb") and not _unique_pairs(scene):
            continue
        kinds.append(kind)
    return kinds


def question_text(kind: str, *, colour: str = "", shape: str = "") -> str:
    """The canonical phrasing of a question kind (see the module docstring)."""
    if kind == "count_total":
        return "how many shapes are there?"
    if kind == "count_colour":
        return f"how many {colour} shapes are there?"
    if kind == "count_shape":
        return f"how many {SHAPE_PLURALS[shape]} are there?"
    if kind == "colour":
        return f"what color is the {shape}?"
    if kind == "shape":
        return f"what shape is the {colour} object?"
    if kind == "presence":
        return f"is there a {colour} {shape}?"
    if kind == "position_lr":
        return f"is the {colour} {shape} on the left or the right?"
    if kind == "position_tb":
        return f"is the {colour} {shape} at the top or the bottom?"
    if kind == "describe":
        return "describe the scene."
    raise ValueError(f"unknown question kind {kind!r}")


def answer(scene: Scene, kind: str, *, colour: str = "", shape: str = "") -> str:
    """The exact answer to a question of ``kind`` about ``colour``/``shape``.

    Raises:
        ValueError: the question has no exact answer for this scene (e.g. two triangles for
            ``colour``, or a non-unique object for a position question).
    """
    objs = scene.objects
    if kind == "count_total":
        return str(len(objs))
    if kind == "count_colour":
        return str(sum(o.colour == colour for o in objs))
    if kind == "count_shape":
        return str(sum(o.shape == shape for o in objs))
    if kind == "colour":
        hits = [o for o in objs if o.shape == shape]
        if len(hits) != 1:
            raise ValueError(f"{len(hits)} objects are {shape}s: no unique colour")
        return hits[0].colour
    if kind == "shape":
        hits = [o for o in objs if o.colour == colour]
        if len(hits) != 1:
            raise ValueError(f"{len(hits)} objects are {colour}: no unique shape")
        return hits[0].shape
    if kind == "presence":
        return "yes" if any(o.colour == colour and o.shape == shape for o in objs) else "no"
    if kind in ("position_lr", "position_tb"):
        hits = [o for o in objs if o.colour == colour and o.shape == shape]
        if len(hits) != 1:
            raise ValueError(f"{len(hits)} {colour} {shape}s: no unique object")
        o = hits[0]
        if kind == "position_lr":
            return "left" if o.cx_px < scene.width_px / 2.0 else "right"
        return "top" if o.cy_px < scene.height_px / 2.0 else "bottom"
    if kind == "describe":
        return describe(scene)
    raise ValueError(f"unknown question kind {kind!r}")


def _qa(scene: Scene, kind: str, colour: str = "", shape: str = "") -> QA:
    return QA(
        kind, question_text(kind, colour=colour, shape=shape), answer(scene, kind, colour=colour, shape=shape)
    )


def make_question(scene: Scene, kind: str, rng: np.random.Generator) -> QA:
    """A random question of ``kind`` about ``scene`` with its exact answer.

    Count questions ask about a present colour/shape 70% of the time (else any, so 0 occurs);
    presence is yes half the time, and 70% of the negatives are hard (the colour or the shape is
    present, not the pair). Raises ``ValueError`` if ``kind`` is not in :func:`valid_kinds`.
    """
    objs = scene.objects

    def pick(seq):
        return seq[int(rng.integers(len(seq)))]

    if kind == "count_total" or kind == "describe":
        return _qa(scene, kind)
    if kind == "count_colour":
        colour = pick([o.colour for o in objs]) if rng.random() < 0.7 else pick(COLOUR_NAMES)
        return _qa(scene, kind, colour=colour)
    if kind == "count_shape":
        shape = pick([o.shape for o in objs]) if rng.random() < 0.7 else pick(SHAPES)
        return _qa(scene, kind, shape=shape)
    if kind == "colour":
        shapes = _unique_shapes(scene)
        if not shapes:
            raise ValueError("no unique shape in this scene")
        return _qa(scene, kind, shape=pick(shapes))
    if kind == "shape":
        colours = _unique_colours(scene)
        if not colours:
            raise ValueError("no unique colour in this scene")
        return _qa(scene, kind, colour=pick(colours))
    if kind == "presence":
        present = {(o.colour, o.shape) for o in objs}
        absent = [(c, s) for c in COLOUR_NAMES for s in SHAPES if (c, s) not in present]
        if rng.random() < 0.5 or not absent:
            colour, shape = pick(sorted(present))
        else:
            colours = {o.colour for o in objs}
            shapes = {o.shape for o in objs}
            hard = [(c, s) for c, s in absent if c in colours or s in shapes]
            colour, shape = pick(hard) if hard and rng.random() < 0.7 else pick(absent)
        return _qa(scene, kind, colour=colour, shape=shape)
    if kind in ("position_lr", "position_tb"):
        cands = _unique_pairs(scene)
        if not cands:
            raise ValueError("no object with a unique colour and shape in this scene")
        o = pick(cands)
        return _qa(scene, kind, colour=o.colour, shape=o.shape)
    raise ValueError(f"unknown question kind {kind!r}")


def all_questions(scene: Scene) -> list[QA]:
    """Every distinct question with an exact answer for this scene (deterministic order)."""
    out = [_qa(scene, "count_total")]
    out += [_qa(scene, "count_colour", colour=c) for c in COLOUR_NAMES]
    out += [_qa(scene, "count_shape", shape=s) for s in SHAPES]
    out += [_qa(scene, "colour", shape=s) for s in _unique_shapes(scene)]
    out += [_qa(scene, "shape", colour=c) for c in _unique_colours(scene)]
    out += [_qa(scene, "presence", colour=c, shape=s) for c in COLOUR_NAMES for s in SHAPES]
    for o in _unique_pairs(scene):
        out.append(_qa(scene, "position_lr", colour=o.colour, shape=o.shape))
        out.append(_qa(scene, "position_tb", colour=o.colour, shape=o.shape))
    out.append(_qa(scene, "describe"))
    return out


def sample_questions(
    scene: Scene, rng: np.random.Generator, n: int, *, kind_weights: dict[str, float] | None = None
) -> list[QA]:
    """Up to ``n`` distinct random questions about a scene, kinds drawn by ``kind_weights``
    (default uniform) among :func:`valid_kinds`."""
    kinds = valid_kinds(scene)
    w = np.asarray([(kind_weights or {}).get(k, 1.0) for k in kinds], np.float64)
    out: list[QA] = []
    seen: set[str] = set()
    for _ in range(4 * n):
        if len(out) == n:
            break
        kind = kinds[int(rng.choice(len(kinds), p=w / w.sum()))]
        qa = make_question(scene, kind, rng)
        if qa.question not in seen:
            seen.add(qa.question)
            out.append(qa)
    return out


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
