"""Scene generator: determinism, layout invariants, and exact answers on hand-built scenes."""

from __future__ import annotations

import numpy as np
import pytest

from edgevlm.runtime.demo import scenes
from edgevlm.runtime.demo.scenes import Background, Scene, SceneObject

FLAT = Background("flat", (40, 40, 40), (40, 40, 40), 0.0, 20.0, 7)


def _obj(shape, colour, size, cx, cy, extent):
    return SceneObject(shape, colour, size, cx, cy, extent, 0.0, scenes.COLOURS[colour])


@pytest.fixture
def built() -> Scene:
    """Large red circle top-left, large blue triangle top-right, small blue square bottom-right."""
    return Scene(
        384,
        288,
        FLAT,
        (
            _obj("circle", "red", "large", 80.0, 60.0, 50.0),
            _obj("square", "blue", "small", 300.0, 220.0, 12.0),
            _obj("triangle", "blue", "large", 300.0, 60.0, 44.0),
        ),
    )


def test_same_seed_same_scene_and_pixels():
    a = scenes.generate_scene(scenes.rng_for(3, scenes.DOMAIN_TRAIN, 11))
    b = scenes.generate_scene(scenes.rng_for(3, scenes.DOMAIN_TRAIN, 11))
    c = scenes.generate_scene(scenes.rng_for(3, scenes.DOMAIN_TRAIN, 12))
    assert a == b
    assert a != c
    img_a = scenes.render(a, noise_rng=np.random.default_rng(5), noise_sigma=2.0)
    img_b = scenes.render(b, noise_rng=np.random.default_rng(5), noise_sigma=2.0)
    assert img_a.shape == (288, 384, 3) and img_a.dtype == np.uint8
    assert np.array_equal(img_a, img_b)
    assert not np.array_equal(scenes.render(a), scenes.render(c))


def test_train_and_eval_streams_differ():
    train = scenes.generate_scene(scenes.rng_for(1000, scenes.DOMAIN_TRAIN, 0))
    held_out = scenes.eval_set(1, seed=1000)[0].scene
    assert train != held_out


def test_layout_invariants_over_many_scenes():
    for i in range(300):
        scene = scenes.generate_scene(scenes.rng_for(0, scenes.DOMAIN_TRAIN, i))
        assert 1 <= len(scene.objects) <= scenes.MAX_OBJECTS
        boxes = [scenes.object_bbox(o) for o in scene.objects]
        for o, (x0, y0, x1, y1) in zip(scene.objects, boxes, strict=True):
            lo, hi = scenes.SMALL_EXTENT_PX if o.size == "small" else scenes.LARGE_EXTENT_PX
            assert lo <= o.extent_px <= hi
            assert x0 >= scenes.MARGIN_PX and x1 <= 384 - scenes.MARGIN_PX
            assert y0 >= scenes.MARGIN_PX and y1 <= 288 - scenes.MARGIN_PX
            # wholly on one side of both centre lines, with the gap
            assert x1 <= 192 - scenes.GAP_PX or x0 >= 192 + scenes.GAP_PX
            assert y1 <= 144 - scenes.GAP_PX or y0 >= 144 + scenes.GAP_PX
        for j in range(len(boxes)):
            for k in range(j + 1, len(boxes)):
                a, b = boxes[j], boxes[k]
                apart_x = a[2] + scenes.GAP_PX <= b[0] or b[2] + scenes.GAP_PX <= a[0]
                apart_y = a[3] + scenes.GAP_PX <= b[1] or b[3] + scenes.GAP_PX <= a[1]
                assert apart_x or apart_y


def test_answers_on_built_scene(built):
    a = scenes.answer
    assert a(built, "count_total") == "3"
    assert a(built, "count_colour", colour="blue") == "2"
    assert a(built, "count_colour", colour="green") == "0"
    assert a(built, "count_shape", shape="circle") == "1"
    assert a(built, "count_shape", shape="cross") == "0"
    assert a(built, "colour", shape="circle") == "red"
    assert a(built, "colour", shape="square") == "blue"
    assert a(built, "shape", colour="red") == "circle"
    assert a(built, "presence", colour="blue", shape="square") == "yes"
    assert a(built, "presence", colour="red", shape="square") == "no"  # hard negative
    assert a(built, "position_lr", colour="red", shape="circle") == "left"
    assert a(built, "position_lr", colour="blue", shape="square") == "right"
    assert a(built, "position_tb", colour="blue", shape="triangle") == "top"
    assert a(built, "position_tb", colour="blue", shape="square") == "bottom"
    # large first, then colour order (red before blue), then shape order
    assert a(built, "describe") == "large red circle and large blue triangle and small blue square"
    assert scenes.question_text("count_shape", shape="cross") == "how many crosses are there?"


def test_questions_without_exact_answer_are_refused(built):
    with pytest.raises(ValueError, match="2 objects are blue"):
        scenes.answer(built, "shape", colour="blue")
    twins = Scene(384, 288, FLAT, (built.objects[0], _obj("circle", "red", "large", 300.0, 220.0, 40.0)))
    assert "position_lr" not in scenes.valid_kinds(twins) and "colour" not in scenes.valid_kinds(twins)
    with pytest.raises(ValueError, match="no unique object"):
        scenes.answer(twins, "position_lr", colour="red", shape="circle")
    with pytest.raises(ValueError, match="no object with a unique colour and shape"):
        scenes.make_question(twins, "position_tb", np.random.default_rng(0))
    with pytest.raises(ValueError, match="unknown question kind"):
        scenes.question_text("weather")
    with pytest.raises(ValueError, match="n_objects"):
        scenes.generate_scene(np.random.default_rng(0), n_objects=5)
    with pytest.raises(ValueError, match="noise_rng"):
        scenes.render(built, noise_sigma=2.0)


def test_pixels_agree_with_the_answers(built):
    img = scenes.render(built).astype(int)
    r, g, b = img[60, 80]  # centre of the red circle (row = y, column = x)
    assert r > 180 and g < 90 and b < 90
    r, g, b = img[220, 300]  # centre of the small blue square
    assert b > 180 and r < 100
    assert np.abs(img[144, 192] - 40).max() <= 8  # background at the centre: 40 +- grain


def test_make_question_answers_match_all_questions():
    for i in range(60):
        rng = scenes.rng_for(0, scenes.DOMAIN_TRAIN, i)
        scene = scenes.generate_scene(rng)
        truth = {qa.question: qa.answer for qa in scenes.all_questions(scene)}
        for kind in scenes.valid_kinds(scene):
            qa = scenes.make_question(scene, kind, rng)
            assert qa.kind == kind and truth[qa.question] == qa.answer


def test_eval_set_is_deterministic_round_robin():
    a = scenes.eval_set(18, seed=7)
    b = scenes.eval_set(18, seed=7)
    assert [x.qa for x in a] == [x.qa for x in b]
    assert all(np.array_equal(x.image, y.image) for x, y in zip(a, b, strict=True))
    assert [x.qa.kind for x in a] == list(scenes.KINDS) * 2
    assert {x.qa.answer for x in a if x.qa.kind == "presence"} <= {"yes", "no"}
