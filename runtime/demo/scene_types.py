"""The demo scenes' vocabulary and data model: shapes, colours, sizes, question kinds, the
:class:`Scene` / :class:`QA` records and the seeded streams (:func:`rng_for`). See
:mod:`edgevlm.runtime.demo.scenes` for what they mean; that module re-exports every name here.
"""

from __future__ import annotations

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
