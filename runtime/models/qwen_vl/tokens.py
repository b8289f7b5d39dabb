"""The special token ids both Qwen-VL families read from ``config.json`` (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from edgevlm.runtime.config import token_id


@dataclass(frozen=True)
class QwenVisionTokens:
    """The four special token ids of a Qwen2.5-VL / Qwen3-VL vocabulary; the defaults are those
    the two families use when a ``config.json`` leaves a key out (``<|image_pad|>``,
    ``<|video_pad|>``, ``<|vision_start|>``, ``<|vision_end|>``)."""

    image_token_id: int = 151655
    video_token_id: int | None = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653


def parse_vision_token_ids(raw: dict, vocab_size: int) -> QwenVisionTokens:
    """``image_token_id``, ``video_token_id``, ``vision_start_token_id`` and ``vision_end_token_id``
    of a Qwen-VL ``config.json`` (defaults: :class:`QwenVisionTokens`'s).

    Raises:
        ModelLoadError: a value that is not an integer token id below ``vocab_size``, naming the key.
    """
    return QwenVisionTokens(**{f.name: token_id(raw, f.name, f.default, vocab_size) for f in fields(QwenVisionTokens)})
