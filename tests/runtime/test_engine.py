"""Engine behaviour: answers, streaming, stop strings, sampling, operating points, KV cache, bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from edgevlm.errors import EdgeVLMError, InvalidImageError, InvalidRequestError, StreamNotEndedError  # noqa: E402
from edgevlm.types import OperatingPoint  # noqa: E402

PROMPT = "what colour is the small circle ?"


def test_ask_is_deterministic_and_fills_stats(engine, image):
    a = engine.ask(image, PROMPT, max_new_tokens=8)
    b = engine.ask(image, PROMPT, max_new_tokens=8)
    assert a.text == b.text and a.text
    s = a.stats
    assert s.new_tokens == 8 and s.finish_reason == "length"
    assert s.backend == "torch" and s.operating_point == "default"
    # Native image_size 64: the 100x60 frame becomes 64x32 (4x2 patches of 16 px) -> 8 vision tokens.
    assert (s.input_width_px, s.input_height_px) == (64, 32)
    assert s.vision_tokens == 8
    assert s.prompt_tokens == len(engine.tokenizer.encode_prompt(PROMPT, 0))
    assert s.e2e_ms >= s.ttft_ms >= s.prefill_ms > 0 and s.vision_ms > 0 and s.tpot_ms > 0
    assert engine.resolution_ladder == [32, 64] and engine.patch_size_px == 16
    assert engine.device == "cpu" and engine.dtype == torch.float32 and engine.backend_name == "torch"


def test_stream_deltas_concatenate_to_the_answer(engine, image):
    stream = engine.stream(image, PROMPT, max_new_tokens=10)
    with pytest.raises(StreamNotEndedError, match=r"^the stream has not ended: iterate it to the end"):
        _ = stream.answer
    deltas = list(stream)
    assert len(deltas) >= 2
    assert "".join(deltas) == stream.answer.text == engine.ask(image, PROMPT, max_new_tokens=10).text


def test_stream_answer_before_the_end_is_a_typed_error_that_consumes_nothing(engine, image):
    """stream.answer read mid-stream raised a bare RuntimeError('the stream has not finished yet'); a closed
    stream said the same. Now StreamNotEndedError (edgevlm.errors; still a RuntimeError) says which, and
    reading it consumes no delta."""
    full = engine.ask(image, PROMPT, max_new_tokens=6).text
    stream = engine.stream(image, PROMPT, max_new_tokens=6)
    first = next(stream)
    with pytest.raises(StreamNotEndedError) as info:
        _ = stream.answer
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, EdgeVLMError)
    assert str(info.value) == (
        "the stream has not ended: iterate it to the end before reading .answer "
        "(Engine.ask returns the answer at once)"
    )
    assert first + "".join(stream) == stream.answer.text == full  # nothing was lost to the early read
    closed = engine.stream(image, PROMPT, max_new_tokens=6)
    next(closed)
    failed = engine.stream(image, PROMPT, max_new_tokens=2)  # a second open stream of this thread: refused
    with pytest.raises(InvalidRequestError, match="still open"):
        next(failed)
    with pytest.raises(StreamNotEndedError, match=r"^the stream has no answer: its iteration raised Invalid"):
        _ = failed.answer
    closed.close()
    with pytest.raises(StreamNotEndedError, match=r"^the stream has no answer: it was closed before it"):
        _ = closed.answer


def test_open_stream_blocks_a_second_request_in_the_same_thread(engine, image):
    stream = engine.stream(image, PROMPT, max_new_tokens=6)
    assert next(stream)
    with pytest.raises(InvalidRequestError, match="still open"):
        engine.ask(image, PROMPT, max_new_tokens=2)
    stream.close()
    assert engine.ask(image, PROMPT, max_new_tokens=2).stats.new_tokens == 2


def test_stop_string_truncates_and_finishes(engine, image):
    full = engine.ask(image, PROMPT, max_new_tokens=10)
    words = full.text.split(" ")
    assert len(words) >= 3
    stop = " " + words[2]
    cut = full.text[: full.text.index(stop)]
    stream = engine.stream(image, PROMPT, max_new_tokens=10, stop=[stop, "never-generated"])
    deltas = list(stream)
    assert stream.answer.text == "".join(deltas) == cut
    assert stream.answer.stats.finish_reason == "stop"
    assert stream.answer.stats.new_tokens < full.stats.new_tokens


def _greedy_ids(engine, image, prompt: str, n: int) -> list[int]:
    """Greedy token ids through the backend boundary (the engine's answer only has text)."""
    from edgevlm.runtime.preprocess import preprocess

    pixels = torch.from_numpy(preprocess(image, engine.image_size_px, engine.patch_size_px))[None]
    ids = engine.tokenizer.encode_prompt(prompt, engine.num_vision_tokens(*pixels.shape[-2:]))
    be = engine.backend
    logits = be.prefill(be.embed(torch.tensor([ids]), be.encode_image(pixels)))
    out = []
    for pos in range(len(ids), len(ids) + n):
        out.append(int(logits[0].argmax()))
        logits = be.decode(out[-1], pos)
    return out


def test_eos_from_generation_config_stops(copy_dir, tiny_dir, engine, image):
    from edgevlm.runtime import Engine

    ids = _greedy_ids(engine, image, PROMPT, 8)
    k = next(i for i in range(1, 8) if ids[i] not in ids[:i])  # first token not generated before
    ckpt = copy_dir(tiny_dir)
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, ids[k]]}))
    answer = Engine.load(ckpt).ask(image, PROMPT, max_new_tokens=8)
    assert answer.text == engine.tokenizer.decode(ids[:k]).strip()
    assert answer.stats.finish_reason == "stop" and answer.stats.new_tokens == k + 1


def test_sampling_is_reproducible_with_a_seed(engine, image):
    runs = [engine.ask(image, PROMPT, max_new_tokens=12, temperature=1.5, top_p=0.95, seed=s).text
            for s in (1, 1, 2, 3)]
    assert runs[0] == runs[1]
    assert len(set(runs)) >= 2
    greedy = engine.ask(image, PROMPT, max_new_tokens=12).text
    assert any(r != greedy for r in runs)
    # top_p so small that only the most likely token survives: identical to greedy whatever the seed.
    assert engine.ask(image, PROMPT, max_new_tokens=12, temperature=1.0, top_p=1e-6, seed=5).text == greedy


def test_operating_point_picks_resolution_and_caps_tokens(engine, image):
    a = engine.ask(image, PROMPT, max_new_tokens=20, operating_point=OperatingPoint(
        name="low", resolution_px=32, max_new_tokens=3))
    assert (a.stats.input_width_px, a.stats.input_height_px) == (32, 16)
    assert a.stats.vision_tokens == 2 and a.stats.new_tokens == 3 and a.stats.operating_point == "low"
    big = engine.ask(image, PROMPT, max_new_tokens=2, operating_point=OperatingPoint(resolution_px=128))
    assert (big.stats.input_width_px, big.stats.input_height_px) == (128, 80)
    assert big.stats.vision_tokens == 40


@pytest.mark.parametrize(
    ("knobs", "message"),
    [
        (dict(exit_layer=0), "operating point: exit_layer: Input should be greater than or equal to 1"),
        (dict(keep_ratio=1.5), "operating point: keep_ratio: Input should be less than or equal to 1"),
        (
            dict(resolution_px=-8, exit_threshold=2.0),
            "operating point: resolution_px: Input should be greater than 0 (and 1 more)",
        ),
        (dict(exit_layr=2), "operating point: exit_layr: unknown field"),
    ],
)
def test_bad_operating_point_is_one_line_invalid_request(engine, image, knobs, message):
    """OperatingPoint(exit_layer=0) raised pydantic's ValidationError over 3 lines (type, input, URL): now the
    typed InvalidRequestError (a ValueError) of one line naming the field and the rule, as every schema's."""
    with pytest.raises(InvalidRequestError) as info:
        OperatingPoint(name="bad", **knobs)
    assert str(info.value) == message and isinstance(info.value, ValueError)
    good = OperatingPoint(name="ok", resolution_px=32)  # a good point still runs
    assert engine.ask(image, PROMPT, max_new_tokens=2, operating_point=good).stats.input_width_px == 32


def test_stale_cache_entries_never_leak_into_a_shorter_request(engine, image):
    before = engine.ask(image, PROMPT, max_new_tokens=6)
    engine.warmup()
    long = engine.ask(image, PROMPT, max_new_tokens=30, operating_point=OperatingPoint(resolution_px=128))
    assert long.stats.vision_tokens + long.stats.prompt_tokens + long.stats.new_tokens > 60
    after = engine.ask(image, PROMPT, max_new_tokens=6)  # its positions end well before the long one's
    assert after.text == before.text


def test_kv_cache_is_static_and_preallocated(engine, image):
    caches = [layer.self_attn.kv_cache for layer in engine.backend.model.language_model.layers]
    cfg = engine.config.text
    shape = (1, cfg.num_key_value_heads, engine.max_seq_len, cfg.head_dim)
    before = [(c.k.data_ptr(), c.v.data_ptr()) for c in caches]
    assert all(tuple(c.k.shape) == shape and tuple(c.v.shape) == shape for c in caches)
    engine.ask(image, PROMPT, max_new_tokens=5, operating_point=OperatingPoint(resolution_px=32))
    engine.ask(image, PROMPT, max_new_tokens=9)
    assert [(c.k.data_ptr(), c.v.data_ptr()) for c in caches] == before
    assert all(tuple(c.k.shape) == shape for c in caches)


def test_generation_is_capped_by_the_cache(tiny_dir, image):
    from edgevlm.runtime import Engine

    engine = Engine.load(tiny_dir, max_seq_len=40)
    n_prompt = len(engine.tokenizer.encode_prompt(PROMPT, 8))
    answer = engine.ask(image, PROMPT, max_new_tokens=500)
    assert answer.stats.finish_reason == "length"
    assert answer.stats.new_tokens == 40 - n_prompt + 1
    with pytest.raises(InvalidRequestError, match="KV cache holds 40"):
        engine.ask(image, PROMPT, operating_point=OperatingPoint(resolution_px=128))


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((60, 100, 3), np.float32),
        np.zeros((60, 100), np.uint8),
        np.zeros((60, 100, 4), np.uint8),
        np.zeros((0, 100, 3), np.uint8),
        [[0, 0, 0]],
        b"\xff\xd8\xff",
    ],
    ids=["float32", "grey-2d", "rgba", "empty", "list", "bytes"],
)
def test_bad_image_raises_invalid_image(engine, bad):
    with pytest.raises(InvalidImageError):
        engine.ask(bad, PROMPT)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(prompt=123), "prompt must be a string"),
        (dict(prompt="what is <image> here ?"), "image token"),
        (dict(prompt="what " * 600), "KV cache holds"),
        (dict(max_new_tokens=0), "max_new_tokens"),
        (dict(max_new_tokens=2.5), "max_new_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(stop=["ok", ""]), "stop"),
        (dict(seed="x"), "seed"),
        (dict(operating_point={"resolution_px": 32}), "OperatingPoint"),
    ],
)
def test_bad_request_raises_invalid_request(engine, image, kwargs, message):
    args = dict(prompt=PROMPT) | kwargs
    prompt = args.pop("prompt")
    with pytest.raises(InvalidRequestError, match=message):
        engine.ask(image, prompt, **args)


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t \u3000"])
def test_empty_or_blank_prompt_is_refused_as_the_wire_refuses_it(engine, image, prompt):
    """Engine.ask("") and ask("   ") answered (a made-up answer about the image) while the wire refused the empty
    prompt and answered the blank one: now both refuse both, with one rule (protocol.check_prompt) and message."""
    from edgevlm.protocol import parse_request

    with pytest.raises(InvalidRequestError) as wire:
        parse_request({"prompt": prompt, "source": "front"})
    with pytest.raises(InvalidRequestError) as local:
        engine.ask(image, prompt, max_new_tokens=2)
    message = "prompt: must hold a question (it is empty or only whitespace)"
    assert str(local.value) == str(wire.value) == message
    assert local.value.details["path"] == wire.value.details["path"] == "prompt"
    with pytest.raises(InvalidRequestError, match="^prompt: must hold a question"):
        engine.stream(image, prompt)  # refused before the first delta
    assert engine.ask(image, " " + PROMPT, max_new_tokens=2).stats.new_tokens == 2


def test_cpu_bf16_engine_answers(tiny_dir, image):
    from edgevlm.runtime import Engine

    engine = Engine.load(tiny_dir, dtype="bf16")
    assert engine.dtype == torch.bfloat16
    answer = engine.ask(image, PROMPT, max_new_tokens=4)
    assert answer.stats.new_tokens == 4 and answer.text


def test_write_tiny_checkpoint_is_deterministic(tmp_path):
    from edgevlm.runtime.testing import write_tiny_checkpoint

    a = write_tiny_checkpoint(tmp_path / "a", seed=3)
    b = write_tiny_checkpoint(tmp_path / "b", seed=3)
    c = write_tiny_checkpoint(tmp_path / "c", seed=4)
    names = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
             "preprocessor_config.json"}
    assert {p.name for p in a.iterdir()} == names
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").stat().st_size < 2_000_000


def test_several_frames_to_a_single_image_model_is_invalid_request_naming_the_limit(engine, image):
    """LLaVA (max_images 1, no video): two frames are refused, naming the limit; one frame in a list is
    the same request as the bare image."""
    with pytest.raises(InvalidRequestError, match="llava family takes one image per request: neither video "
                                                  "nor several images, at most 1 frame"):
        engine.ask([image, image], PROMPT, max_new_tokens=2)
    assert engine.ask([image], PROMPT, max_new_tokens=6).text == engine.ask(image, PROMPT, max_new_tokens=6).text


@pytest.mark.parametrize("bad", [-5, 0, 100_000, "256", 128.0, True])
def test_classify_refuses_a_bad_resolution_px_by_name(bad):
    """On the demo model (it has an exit classifier) classify(resolution_px=-5) raised a bare ValueError from
    the resize ("sizes must be positive"), 100000 an OpenCV out-of-memory error (30 GB asked for) and "256" a
    TypeError ("'<=' not supported"): now InvalidRequestError naming the argument and its range, and the
    engine answers the next call."""
    from edgevlm.runtime import Engine

    engine = _demo_engine(Engine)
    frame = np.full((48, 64, 3), 90, np.uint8)
    with pytest.raises(InvalidRequestError, match=r"^resolution_px must be an integer in 1\.\.8192 \(px\) or None, "
                                                  rf"got {re.escape(repr(bad))}$"):
        engine.classify(frame, resolution_px=bad)
    probs = engine.classify(frame, resolution_px=128)
    assert set(probs) == set(engine.labels) and all(0.0 <= p <= 1.0 for p in probs.values())


_DEMO: list = []


def _demo_engine(engine_cls):
    if not _DEMO:
        _DEMO.append(engine_cls.load())
    return _DEMO[0]


def test_load_arguments_that_cannot_work_are_one_line_typed_errors(tiny_dir, image):
    """Engine.load(max_seq_len=10**12) raised torch's bare RuntimeError ("[enforce fail at alloc_cpu.cpp] ...
    DefaultCPUAllocator: can't allocate memory: you tried to allocate ... bytes"); device=None an
    InvalidRequestError over 6 lines of torch's overload listing, device="gpu" one listing 20 device types.
    Now ModelLoadError naming max_seq_len, and one line naming the devices that run."""
    from edgevlm.errors import ModelLoadError
    from edgevlm.runtime import Engine

    with pytest.raises(ModelLoadError, match=r"not enough memory on cpu for the weights and a KV cache of "
                                             r"max_seq_len=1000000000000 positions \(give a smaller max_seq_len\)$"):
        Engine.load(tiny_dir, max_seq_len=10**12)
    for bad in (None, "gpu", 0):
        with pytest.raises(InvalidRequestError) as info:
            Engine.load(tiny_dir, device=bad)
        assert str(info.value) == f"bad device {bad!r}: expected 'cpu', 'cuda' or 'cuda:N'"
    assert Engine.load(tiny_dir, max_seq_len=256).ask(image, PROMPT, max_new_tokens=2).stats.new_tokens >= 1


def test_numpy_scalar_knobs_answer_as_python_numbers(engine, image) -> None:
    # was: max_new_tokens=np.int64(6) -> "max_new_tokens must be a positive integer, got np.int64(6)";
    # np.float32 temperature refused the same way (np.float32 is not a float)
    plain = engine.ask(image, "what is here?", max_new_tokens=6, temperature=0.8, top_p=0.95, seed=11)
    numpy_ = engine.ask(image, "what is here?", max_new_tokens=np.int64(6), temperature=np.float32(0.8),
                        top_p=np.float64(0.95), seed=np.uint8(11))
    assert (numpy_.text, numpy_.stats.new_tokens) == (plain.text, plain.stats.new_tokens)
    with pytest.raises(InvalidRequestError, match="max_new_tokens must be a positive integer"):
        engine.ask(image, "hi", max_new_tokens=np.float64(6.0))  # a float is not a token count, NumPy or not


@pytest.mark.parametrize("threshold", [None, 0.5])
def test_exit_layer_past_the_encoder_depth_is_refused_by_name(threshold):
    """The demo model's encoder has 6 blocks (exits after 2 and 3). An operating point with exit_layer 9 ran
    silently at full depth (no threshold) or consulting every exit (with one), i.e. another point than the
    one asked for; now InvalidRequestError naming the depth, the rule frontier points get at start-up.
    exit_layer 6 (the last block: full depth) still answers."""
    from edgevlm.runtime import Engine

    engine = _demo_engine(Engine)
    frame = np.full((48, 64, 3), 90, np.uint8)
    op = OperatingPoint(name="deep", exit_layer=9, exit_threshold=threshold)
    with pytest.raises(InvalidRequestError) as err:
        engine.ask(frame, "what color is it?", max_new_tokens=2, operating_point=op)
    assert str(err.value) == ("operating point 'deep': exit_layer 9 is past the vision encoder's depth "
                              "(6 blocks: exit_layer 1..6)")
    full = OperatingPoint(name="full", exit_layer=6)
    assert engine.ask(frame, "what color is it?", max_new_tokens=2, operating_point=full).stats.new_tokens >= 1
