"""What the Qwen2.5-VL and Qwen3-VL family configs share (torch-free): :class:`QwenVLConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
