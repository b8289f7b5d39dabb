"""What the Qwen2.5-VL and Qwen3-VL family configs share (torch-free): :class:`QwenVLConfig`, and the
two checks of their ViTs' 2-D rotary attention (:func:`vision_rope_theta`, :func:`check_rotary_heads`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.config import TextConfig
from edgevlm.runtime.models.qwen_vl.tokens import QwenVisionTokens


@dataclass(frozen=True)
class QwenVLConfig:
    """A Qwen-VL checkpoint: a ViT (``vision``, the family's own config class, with ``depth``), a
    patch merger and a Qwen decoder with M-RoPE (``text``); the special token ids in ``tokens``,
    also read as ``.image_token_id``, ``.video_token_id``, ``.vision_start_token_id`` and
    ``.vision_end_token_id`` (the family contract's names)."""

    vision: Any
    text: TextConfig
    tokens: QwenVisionTokens = QwenVisionTokens()
    tie_word_embeddings: bool = False
    resolution_ladder: tuple[int, ...] = ()

    @property
    def image_token_id(self) -> int:
        return self.tokens.image_token_id

    @property
    def video_token_id(self) -> int | None:
        return self.tokens.video_token_id

    @property
    def vision_start_token_id(self) -> int:
        return self.tokens.vision_start_token_id

    @property
    def vision_end_token_id(self) -> int:
        return self.tokens.vision_end_token_id

    @property
    def vision_blocks_needed(self) -> int:
        """ViT blocks one encoding runs (all of them: the merger reads the last block)."""
        return self.vision.depth


def vision_rope_theta(vc: dict, default: float, where: str = "vision_config.") -> float:
    """``rope_parameters.rope_theta`` of a Qwen-VL ``vision_config`` (``default`` when left out), whose
    ``rope_type`` must be ``axial`` (the 2-D rotary embedding both towers implement).

    Raises:
        ModelLoadError: ``rope_parameters`` not an object, another ``rope_type``, or a ``rope_theta``
            that is not a positive number; the message names the key.
    """
    rope = vc.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise ModelLoadError(f"config.json: {where}rope_parameters must be an object")
    if rope.get("rope_type", "axial") != "axial":
        raise ModelLoadError(f"config.json: {where}rope_parameters.rope_type {rope.get('rope_type')!r} is not "
                             "supported (axial)")
    theta = rope.get("rope_theta")
    theta = default if theta is None else theta
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ModelLoadError(f"config.json: {where}rope_parameters.rope_theta must be a positive number, got {theta!r}")
    return float(theta)


def check_rotary_heads(hidden_size: int, num_heads: int, where: str = "vision_config.") -> None:
    """The 2-D rotary attention splits each head in 4 (``(row, col)`` x ``(cos, sin)`` halves).

    Raises:
        ModelLoadError: ``hidden_size / num_heads`` is not an integer multiple of 4.
    """
    if hidden_size % num_heads or (hidden_size // num_heads) % 4:
        raise ModelLoadError(f"config.json: {where}hidden_size / num_heads must be a multiple of 4 "
                             "(2-D rotary embeddings)")
