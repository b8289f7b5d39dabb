"""The special token ids both Qwen-VL families read from ``config.json`` (torch-free)."""

from __future__ import annotations

from edgevlm.errors import ModelLoadError

#: config.json key -> the id Qwen2.5-VL and Qwen3-VL use when a config leaves it out
VISION_TOKEN_DEFAULTS: tuple[tuple[str, int], ...] = (
    ("image_token_id", 151655), ("video_token_id", 151656),
    ("vision_start_token_id", 151652), ("vision_end_token_id", 151653),
)


def parse_vision_token_ids(raw: dict, vocab_size: int) -> dict[str, int]:
    """``image_token_id``, ``video_token_id``, ``vision_start_token_id`` and ``vision_end_token_id``
    of a Qwen-VL ``config.json`` (defaults: :data:`VISION_TOKEN_DEFAULTS`).

    Raises:
        ModelLoadError: a value that is not an integer token id below ``vocab_size``, naming the key.
    """
    ids: dict[str, int] = {}
    for key, default in VISION_TOKEN_DEFAULTS:
        value = raw.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < vocab_size:
            raise ModelLoadError(f"config.json: {key} {value!r} is not a token id of the vocabulary "
                                 f"(vocab_size {vocab_size})")
        ids[key] = value
    return ids
