"""The LLaVA model: vision tower (CLIP ViT + projector) feeding vision tokens into a Llama decoder.

Reference: Liu et al., "Visual Instruction Tuning" (LLaVA, 2023) and transformers'
``LlavaForConditionalGeneration``: the prompt holds one image placeholder token per vision token;
their embeddings are replaced, in order, by the projected vision features, and the decoder runs on
the merged sequence. Here the model is split into the three calls an inference backend needs:
:meth:`LlavaModel.encode_image`, :meth:`LlavaModel.embed` and the decoder's prefill/decode.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from edgevlm.runtime.config import LlavaConfig
from edgevlm.runtime.decoder import Decoder
from edgevlm.runtime.vision import VisionTower

logger = logging.getLogger(__name__)


class LlavaModel(nn.Module):
    """Vision tower + decoder. Canonical parameter names (what :mod:`edgevlm.runtime.loader` maps
    every checkpoint layout to)::

        vision_tower.encoder.{embeddings,pre_layrnorm,layers.N}.*
        vision_tower.projector.{linear_1,linear_2}.*
        language_model.{embed_tokens,layers.N,norm,lm_head}.*
    """

    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = VisionTower(cfg)
        self.language_model = Decoder(cfg.text, cfg.tie_word_embeddings)

    @property
    def dtype(self) -> torch.dtype:
        return self.language_model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.language_model.embed_tokens.weight.device

    def setup_caches(self, max_batch_size: int, max_seq_len: int) -> None:
        """Allocate the decoder's static KV caches (see :meth:`Decoder.setup_caches`)."""
        self.language_model.setup_caches(max_batch_size, max_seq_len)

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` normalised pixels -> ``(B, N, D_text)`` vision tokens (model dtype)."""
        return self.vision_tower(pixel_values.to(self.device, self.dtype))

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings ``(B, T, D)`` for ``input_ids`` ``(B, T)``, with the image placeholder
        positions replaced in order by ``image_features`` ``(B, N, D)`` (``masked_scatter``, as in
        transformers). Raises ``ValueError`` when the placeholder count is not ``B * N``."""
        embeds = self.language_model.embed_tokens(input_ids)  # (B, T, D)
        if image_features is None:
            return embeds
        is_image = input_ids == self.cfg.image_token_id  # (B, T)
        n_slots = int(is_image.sum())
        if n_slots * embeds.shape[-1] != image_features.numel():
            raise ValueError(
                f"{n_slots} image placeholder tokens but {image_features.shape[:-1].numel()} vision tokens"
            )
        feats = image_features.to(embeds.device, embeds.dtype)
        return embeds.masked_scatter(is_image[..., None], feats)

    def prefill(self, embeds: torch.Tensor, *, all_logits: bool = False) -> torch.Tensor:
        """Run the prompt ``embeds`` ``(B, T, D)`` from position 0 into the KV cache; returns the
        last logits ``(B, V)`` (or ``(B, T, V)`` with ``all_logits``)."""
        t = embeds.shape[1]
        input_pos = torch.arange(t, device=embeds.device)
        return self.language_model(embeds, input_pos, prefill=True, all_logits=all_logits)

    def decode(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode step: ``token_ids`` ``(B, 1)`` int64 at ``input_pos`` ``(1,)`` -> logits ``(B, V)``."""
        embeds = self.language_model.embed_tokens(token_ids)  # (B, 1, D)
        return self.language_model(embeds, input_pos, prefill=False)

    def forward(self, input_ids: torch.Tensor, pixel_values: torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence logits ``(B, T, V)`` for a prompt (prefill path; used by reference tests).
        Requires caches set up with ``max_seq_len >= T``."""
        feats = self.encode_image(pixel_values) if pixel_values is not None else None
        return self.prefill(self.embed(input_ids, feats), all_logits=True)
