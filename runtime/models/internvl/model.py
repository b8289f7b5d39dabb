"""InternVL as a :class:`~edgevlm.runtime.models.base.VLMModel`: InternViT -> pixel shuffle + MLP -> decoder.

Each image arrives as tiles (a grid of ``T x T`` crops plus a thumbnail, see
:mod:`edgevlm.runtime.models.internvl.processor`); every tile becomes ``image_seq_len`` vision tokens
(:mod:`edgevlm.runtime.models.internvl.vision`) that replace, in order, the ``<IMG_CONTEXT>`` tokens
of the prompt (:class:`~edgevlm.runtime.models.blocks.image_tokens.ImageTokenVLM`: ``embed``,
``prefill``, ``decode``). The decoder is the shared :class:`~edgevlm.runtime.decoder.Decoder` (Qwen2 with q/k/v
bias in InternVL3, Qwen3 with q/k norm in InternVL3.5; plain 1-D RoPE), so quantization, KV-cache
precisions, CUDA-graph decode and continuous batching reach it unchanged.

Parameter names (checkpoint -> ours, :data:`edgevlm.runtime.models.internvl.WEIGHT_RULES`):
``model.vision_tower.*`` -> ``vision_tower.*``, ``model.multi_modal_projector.*`` ->
``multi_modal_projector.*``, ``model.language_model.*`` -> ``language_model.*``, ``lm_head.*`` ->
``language_model.lm_head.*``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgevlm.runtime import adaptive
from edgevlm.runtime.decoder import Decoder
from edgevlm.runtime.models.blocks.image_tokens import ImageTokenVLM
from edgevlm.runtime.models.internvl.config import InternVLConfig
from edgevlm.runtime.models.internvl.vision import (
    InternVisionModel,
    InternVLExitRun,
    InternVLProjector,
    tiles_to_tokens,
)

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import VisionInput


class InternVLModel(ImageTokenVLM):
    """The whole model; build under ``torch.device("meta")`` and let the loader fill the weights."""

    def __init__(self, cfg: InternVLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = InternVisionModel(cfg.vision)
        self.multi_modal_projector = InternVLProjector(cfg)
        self.language_model = Decoder(cfg.text, tie_word_embeddings=cfg.tie_word_embeddings)
        self.exit_heads = None  # ExitHeads of `edgevlm calibrate` (attach_exit_heads)

    def attach_exit_heads(self, heads) -> None:
        """Use ``heads`` (:func:`edgevlm.runtime.exits.load_exit_heads`) for early exit; None detaches."""
        self.exit_heads = adaptive.attach(self, heads)

    def exit_run(self, vision: VisionInput) -> InternVLExitRun:
        """A block-by-block encode of ``vision``'s tiles (exit hooks, :mod:`edgevlm.runtime.adaptive`)."""
        w = self.vision_tower.embeddings.patch_embeddings.projection.weight
        return InternVLExitRun(self.vision_tower, self.multi_modal_projector, self.cfg,
                               vision.pixel_values.to(w.device, w.dtype))

    def encode_vision_adaptive(self, vision: VisionInput, operating_point=None, prompt_ids=None, trunk=None):
        """:meth:`encode_vision` with early exit and token pruning (:func:`edgevlm.runtime.adaptive.encode_adaptive`):
        ``((N', D_text) vision tokens, VisionInfo)``; each tile keeps its own share of tokens."""
        tokens, _, info = adaptive.encode_model_adaptive(self, vision, operating_point, prompt_ids, trunk)
        return tokens, info

    def encode_tiles(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Tiles ``(N, 3, T, T)`` float -> vision tokens ``(N, image_seq_len, D_text)`` in the model dtype."""
        w = self.vision_tower.embeddings.patch_embeddings.projection.weight
        hidden = self.vision_tower(pixel_values.to(w.device, w.dtype), self.cfg.feature_index)
        return tiles_to_tokens(hidden, self.multi_modal_projector, self.cfg.scale_factor)

    def encode_vision(self, vision: VisionInput) -> torch.Tensor:
        """All tiles of all images -> ``(N_tiles * image_seq_len, D_text)`` in prompt order (each
        image's tiles in raster order, then its thumbnail)."""
        feats = self.encode_tiles(vision.pixel_values)
        return feats.reshape(-1, feats.shape[-1])
