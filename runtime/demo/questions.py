"""Questions about a demo scene and their exact answers (the table in
:mod:`edgevlm.runtime.demo.scenes`' docstring), and the canonical scene description. Re-exported
by :mod:`edgevlm.runtime.demo.scenes`.
"""

from __future__ import annotations

import numpy as np

from edgevlm.runtime.demo.scene_types import (
    COLOUR_NAMES,
    KINDS,
    QA,
    SHAPE_PLURALS,
    SHAPES,
    SIZES,
    Scene,
    SceneObject,
)


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
