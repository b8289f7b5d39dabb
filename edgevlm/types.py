"""Result and knob types shared by the runtime, the daemon and the SDK (torch-free).

``Answer`` and ``Stats`` are what :meth:`edgevlm.runtime.Engine.ask` returns and what the daemon
puts on the wire; ``OperatingPoint`` is the set of knobs one inference call runs with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from edgevlm.errors import InvalidRequestError


def plain_scalar(value: Any) -> Any:
    """A NumPy scalar (``np.int64``, ``np.float32``, ``np.bool_``, ...) as the Python ``int`` / ``float`` /
    ``bool`` it holds; any other value unchanged. Robotics code computes knobs (token caps, seeds,
    budgets, sampling temperature) with NumPy, while the wire's schema and the runtime's checks take
    Python numbers (``np.int64`` is not an ``int``, ``np.float32`` not a ``float``): the SDK and
    :meth:`edgevlm.runtime.Engine.ask` pass every numeric argument through this first."""
    item = getattr(value, "item", None)
    if item is not None and type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 \
            and getattr(getattr(value, "dtype", None), "kind", "") in "biuf":
        return item()
    return value


MAX_RESOLUTION_PX = 8192
"""The largest input resolution (longer side, px) an operating point may ask for; a larger one would
allocate gigabytes for one image before any other check could refuse it."""


class OperatingPoint(BaseModel):
    """The knobs of one inference call. ``None`` means "the engine's default".

    Later work (early exit, token pruning) adds fields here; every inference entry point takes one.

    Raises:
        InvalidRequestError: (a ``ValueError``) a knob out of its range, of the wrong type, or unknown; one
            line naming the field and the rule, e.g. ``operating point: exit_layer: Input should be greater
            than or equal to 1`` (:func:`edgevlm.validation.first_error_message`, as every schema's error).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __init__(self, /, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            # imported here: edgevlm.validation imports edgevlm.protocol, which imports this module
            from edgevlm.validation import first_error_message

            raise InvalidRequestError(
                f"operating point: {first_error_message(exc, unknown='unknown field')}"
            ) from None

    name: str = Field("default", description="Name of the operating point, echoed in the stats.")
    resolution_px: int | None = Field(
        None,
        gt=0,
        le=MAX_RESOLUTION_PX,
        description="Target input resolution: the longer image side after resizing, in pixels, "
        "rounded to the vision encoder's patch size. None = the model's native image size.",
    )
    max_new_tokens: int | None = Field(
        None, gt=0, description="Cap on generated tokens for this operating point."
    )
    exit_layer: int | None = Field(
        None, ge=1, description="Vision encoder block after which to exit early (None = full depth)."
    )
    exit_threshold: float | None = Field(
        None, ge=0.0, le=1.0, description="Confidence an exit head needs to stop the encoder there."
    )
    keep_ratio: float | None = Field(
        None, gt=0.0, le=1.0, description="Fraction of vision tokens kept before the projector."
    )


def asks_adaptive_vision(point: Any) -> bool:
    """Whether ``point`` (an :class:`OperatingPoint`, a profile's ``FrontierPoint``, or None) encodes its
    image with early exit (``exit_layer`` / ``exit_threshold``) or token pruning (``keep_ratio`` < 1):
    then the image is encoded one request at a time, outside the batched vision encoder."""
    return point is not None and (point.exit_layer is not None or point.exit_threshold is not None
                                  or (point.keep_ratio is not None and point.keep_ratio < 1.0))


def vision_items_error(point: Any, kinds: Sequence[str]) -> str | None:
    """Why ``point`` (as in :func:`asks_adaptive_vision`) cannot encode the vision items ``kinds`` of a
    request (``"image"`` / ``"video"`` per item, as the engine makes them: ``Engine.vision_kinds``), or
    None when it can: early exit and token pruning take one item, and token pruning an image (a video's
    frames are merged in time before the projector; early exit takes one decision for the clip). The one
    rule for the engine (its refusal) and the daemon's latency controller (the points it considers for a
    request: ``edgevlm.daemon.budget.runnable``)."""
    if not asks_adaptive_vision(point):
        return None
    if len(kinds) > 1:
        return "early exit and token pruning take one image"
    if "video" in kinds and point.keep_ratio is not None and point.keep_ratio < 1.0:
        return "token pruning takes an image, not a video"
    return None


def exit_depth_error(exit_layer: int | None, vision_blocks: int) -> str | None:
    """Why ``exit_layer`` names no block of a vision encoder ``vision_blocks`` deep, or None when it does
    (or is None). ``exit_layer`` counts blocks from 1; ``vision_blocks`` itself is full depth. The one rule
    for a request's operating point (:func:`edgevlm.runtime.vision.exit_plan`) and a frontier's points
    (``edgevlm.daemon.budget.check_frontier_depth``)."""
    if exit_layer is None or exit_layer <= vision_blocks:
        return None
    return (f"exit_layer {exit_layer} is past the vision encoder's depth "
            f"({vision_blocks} blocks: exit_layer 1..{vision_blocks})")


class Stats(BaseModel):
    """Per-request measurements. Times in milliseconds, measured on the host clock
    (``time.perf_counter``) around synchronised device work."""

    model_config = ConfigDict(extra="allow")

    preprocess_ms: float = Field(0.0, description="Image decode/resize/normalise time.")
    vision_ms: float = Field(0.0, description="Vision encoder + projector time.")
    vision_cached: bool = Field(
        False, description="The vision tokens came from the engine's vision cache: another question about the same "
        "frame encoded it (at the same operating point; for an early exit, the frame's encoder walk, of which this "
        "request ran at most the deeper blocks it needed). vision_ms is what this request still ran, no measure of "
        "the encoder.",
    )
    prefill_ms: float = Field(0.0, description="Decoder prefill time (prompt + vision tokens).")
    ttft_ms: float = Field(0.0, description="Time to first token, from the start of the call.")
    tpot_ms: float = Field(0.0, description="Mean time per output token after the first.")
    decode_ms: float = Field(0.0, description="Total decode time after the first token.")
    e2e_ms: float = Field(0.0, description="End-to-end time of the call.")
    queue_ms: float = Field(0.0, description="Time spent waiting in the daemon's queue.")
    window_frames: int | None = Field(
        None, description="A frames_s request whose window held more frames than the model takes in one request "
        "(families without video: their max_images, e.g. 8): the frames in the window, of which the answer is "
        "about frame.frames, evenly spaced, the oldest and the newest included. None: every frame was sent.",
    )
    prompt_tokens: int = Field(0, description="Text tokens in the prompt (without vision tokens).")
    vision_tokens: int = Field(0, description="Vision tokens fed to the decoder.")
    new_tokens: int = Field(0, description="Generated tokens (including a final stop token).")
    input_width_px: int = Field(0, description="Width of the image fed to the vision encoder.")
    input_height_px: int = Field(0, description="Height of the image fed to the vision encoder.")
    operating_point: str = Field("default", description="Name of the operating point used.")
    exit_layer: int | None = Field(None, description="Vision block the encoder stopped after.")
    exit_confidence: float | None = Field(
        None, description="Confidence of the last exit head consulted (0..1); None if none was."
    )
    budget_ms: float | None = Field(None, description="Latency budget the daemon's controller worked to.")
    predicted_ms: float | None = Field(
        None, description="The controller's predicted e2e latency (queue wait included) for the chosen point."
    )
    backend: str = Field("", description="Inference backend that ran the request.")
    finish_reason: str = Field("", description="'stop' (EOS or a stop string) or 'length'.")


class Answer(BaseModel):
    """A generated answer with its measurements."""

    model_config = ConfigDict(extra="forbid")

    text: str = Field(description="The generated text, stripped of the stop token/string.")
    stats: Stats = Field(default_factory=Stats)
    frame_ts: float | None = Field(
        None, description="Capture timestamp (UNIX seconds) of the camera frame used, if any."
    )
    source: str | None = Field(None, description="Name of the source the frame came from, if any.")
    frame_pos_ms: float | None = Field(
        None, description="Media position (ms) of the frame used when the source is a video file."
    )
    frame_seq: int | None = Field(
        None, description="The source's number of the frame used (``Client.ask(frame_seq=...)`` asks about it again)."
    )
