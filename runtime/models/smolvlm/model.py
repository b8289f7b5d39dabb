"""SmolVLM / Idefics3 as a :class:`VLMModel`: SigLIP-style tower -> pixel-shuffle connector -> Llama decoder.

Marafioti et al., "SmolVLM: Redefining small and efficient multimodal models" (2025); Laurençon et
al., Idefics3 (2024). Each image arrives as tiles (``rows x cols`` crops plus one global image, see
:mod:`edgevlm.runtime.models.smolvlm.processor`); every tile becomes ``image_seq_len`` vision tokens
that replace, in order, the ``<image>`` placeholders of the prompt
(:class:`~edgevlm.runtime.models.blocks.image_tokens.ImageTokenVLM`). The decoder is the shared
:class:`~edgevlm.runtime.decoder.Decoder` (SmolLM2 / Llama, plain 1-D RoPE, tied embeddings when
the config says so), so quantization, KV-cache precisions and CUDA-graph decode reach it unchanged.

Parameter names (checkpoint -> ours, :data:`edgevlm.runtime.models.smolvlm.WEIGHT_RULES`): ``model.vision_model.*`` ->
``vision_model.*``, ``model.connector.*`` -> ``connector.*``, ``model.text_model.*`` ->
``language_model.*``, ``lm_head.*`` -> ``language_model.lm_head.*``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgevlm.runtime import adaptive
from edgevlm.runtime.decoder import Decoder
from edgevlm.runtime.models.blocks.image_tokens import ImageTokenVLM
from edgevlm.runtime.models.smolvlm.config import SmolVLMConfig
from edgevlm.runtime.models.smolvlm.vision import (
    Connector,
    SmolVLMExitRun,
    SmolVLMVisionTransformer,
    patch_attention_mask,
)

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import VisionInput

class SmolVLMModel(ImageTokenVLM):
    """The whole model; build under ``torch.device("meta")`` and let the loader fill the weights."""

    def __init__(self, cfg: SmolVLMConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_model = SmolVLMVisionTransformer(cfg.vision)
        self.connector = Connector(cfg)
        self.language_model = Decoder(cfg.text, tie_word_embeddings=cfg.tie_word_embeddings)
        self.exit_heads = None  # ExitHeads of `edgevlm calibrate` (attach_exit_heads)

    def attach_exit_heads(self, heads) -> None:
        """Use ``heads`` (:func:`edgevlm.runtime.exits.load_exit_heads`) for early exit; None detaches."""
        self.exit_heads = adaptive.attach(self, heads)

    def exit_run(self, vision: VisionInput) -> SmolVLMExitRun:
        """A block-by-block encode of ``vision``'s tiles (exit hooks, :mod:`edgevlm.runtime.adaptive`)."""
        w = self.vision_model.embeddings.patch_embedding.weight
        pixel_mask = vision.extras.get("pixel_attention_mask")
        patch_mask = None
        if pixel_mask is not None:
            patch_mask = patch_attention_mask(pixel_mask.to(w.device), self.cfg.vision.patch_size)
        return SmolVLMExitRun(self.vision_model, self.connector, vision.pixel_values.to(w.device, w.dtype), patch_mask)

    def encode_vision_adaptive(self, vision: VisionInput, operating_point=None, prompt_ids=None, trunk=None):
        """:meth:`encode_vision` with early exit and token pruning (:func:`edgevlm.runtime.adaptive.encode_adaptive`):
        ``((N', D_text) vision tokens, VisionInfo)``; each tile keeps its own share of tokens."""
        tokens, _, info = adaptive.encode_model_adaptive(self, vision, operating_point, prompt_ids, trunk)
        return tokens, info

    def encode_tiles(self, pixel_values: torch.Tensor, pixel_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Tiles ``(N, 3, T, T)`` float (``pixel_mask`` ``(N, T, T)``: nonzero = real pixel, None = all
        real) -> vision tokens ``(N, image_seq_len, D_text)`` in the model dtype."""
        w = self.vision_model.embeddings.patch_embedding.weight
        pixel_values = pixel_values.to(w.device, w.dtype)
        patch_mask = None
        if pixel_mask is not None:
            patch_mask = patch_attention_mask(pixel_mask.to(w.device), self.cfg.vision.patch_size)
        return self.connector(self.vision_model(pixel_values, patch_mask))

    def encode_vision(self, vision: VisionInput) -> torch.Tensor:
        """All tiles of all images -> ``(N_tiles * image_seq_len, D_text)`` in prompt order (each image's
        ``rows x cols`` tiles in raster order, then its global image)."""
        feats = self.encode_tiles(vision.pixel_values, vision.extras.get("pixel_attention_mask"))
        return feats.reshape(-1, feats.shape[-1])
