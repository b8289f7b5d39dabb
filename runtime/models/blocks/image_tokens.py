"""The prompt side shared by the families whose vision tokens take the places of one image token
and whose decoder uses plain 1-D RoPE (SmolVLM / Idefics3, InternVL): :class:`ImageTokenVLM`.

The prompt holds one ``cfg.image_token_id`` per vision token (the family's processor expands each
image's placeholder into its run, see ``Processor.expand_prompt``); :meth:`ImageTokenVLM.embed`
replaces those embeddings in order by the vision tokens (transformers' ``masked_scatter``), and the
RoPE positions are the KV-cache slots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from edgevlm.runtime.decoder import DecoderVLM

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import VisionInput


class ImageTokenVLM(DecoderVLM):
    """A :class:`~edgevlm.runtime.models.base.VLMModel` base: ``embed``, ``position_ids``,
    ``decode`` and ``forward`` for a model with ``cfg.image_token_id``, ``language_model`` (the
    shared decoder) and its own ``encode_vision``; ``prefill`` is :meth:`DecoderVLM.prefill` (no
    hooks: ``position_ids`` must be None, 1-D RoPE)."""

    def embed(self, input_ids: torch.Tensor, vision_features: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings ``(1, T, D)`` for ``input_ids`` ``(1, T)`` with the image-token
        positions replaced in order by ``vision_features`` ``(N, D)``. Raises ``ValueError`` when
        the placeholder count differs from N."""
        embeds = self.language_model.embed_tokens(input_ids)  # (B, T, D)
        if vision_features is None:
            return embeds
        is_image = input_ids == self.cfg.image_token_id  # (B, T)
        n_slots = int(is_image.sum())
        if n_slots * embeds.shape[-1] != vision_features.numel():
            raise ValueError(f"{n_slots} image placeholder tokens but {vision_features.numel() // embeds.shape[-1]} "
                             "vision tokens")
        return embeds.masked_scatter(is_image[..., None], vision_features.to(embeds.device, embeds.dtype))

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None = None) -> tuple[None, int]:
        """Plain 1-D RoPE: positions are the cache slots, ``(None, 0)``."""
        return None, 0

    def decode(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode step: ``token_ids`` ``(B, 1)`` int64 at cache slot ``input_pos`` ``(1,)`` -> ``(B, V)``."""
        embeds = self.language_model.embed_tokens(token_ids)  # (B, 1, D)
        return self.language_model(embeds, input_pos, prefill=False)

    def forward(self, input_ids: torch.Tensor, vision: VisionInput | None = None) -> torch.Tensor:
        """All logits ``(1, T, V)`` of a prompt (prefill path; parity tests). Needs caches of at least T."""
        feats = self.encode_vision(vision) if vision is not None else None
        return self.prefill(self.embed(input_ids, feats), all_logits=True)
