"""Gemma 3 as a :class:`~edgevlm.runtime.models.base.VLMModel`: SigLIP -> pool / norm / projection -> decoder.

Gemma Team, "Gemma 3 Technical Report" (2025); numerics of transformers' ``Gemma3ForConditionalGeneration``.
Each image (896 x 896 px) becomes ``mm_tokens_per_image`` vision tokens
(:mod:`edgevlm.runtime.models.gemma3.vision`) that replace, in order, the ``<image_soft_token>`` runs
of the prompt (:class:`~edgevlm.runtime.models.blocks.image_tokens.ImageTokenVLM`: the embeddings of
the run are scaled like every token's and then overwritten, as transformers' ``masked_scatter``).
The decoder is the shared :class:`~edgevlm.runtime.decoder.Decoder` configured for Gemma 3 (1-D
RoPE), so the INT4 bundles, KV-cache precisions and continuous batching reach it.

Attention is bidirectional among the tokens of one image during prefill (transformers'
``token_type_ids`` -> ``block_sequence_ids`` masks; causal elsewhere and in decode): :meth:`embed`
records the image runs of the prompt it embeds (:func:`image_block_ids`) and the prefill of those
same embeddings (:meth:`Gemma3Model.prefill_inputs`) hands them to the decoder as ``image_blocks``; in a batched prefill
(:meth:`batch_image_blocks`) they come from each row's ids, which the batcher passes because
:meth:`take_vision_state` reports a state after every vision encode.

Parameter names (checkpoint -> ours, :data:`edgevlm.runtime.models.gemma3.WEIGHT_RULES`):
``[model.]vision_tower[.vision_model].*`` -> ``vision_tower.*``, ``[model.]multi_modal_projector.*``
-> ``multi_modal_projector.*``, ``[model.]language_model[.model].*`` -> ``language_model.*``,
``lm_head.*`` -> ``language_model.lm_head.*`` (tied: usually absent).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from edgevlm.runtime import adaptive
from edgevlm.runtime.decoder import Decoder
from edgevlm.runtime.models.blocks.image_tokens import ImageTokenVLM
from edgevlm.runtime.models.gemma3.config import Gemma3Config
from edgevlm.runtime.models.gemma3.vision import Gemma3ExitRun, Gemma3Projector, make_tower

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import VisionInput

#: what :meth:`Gemma3Model.take_vision_state` hands the batcher: the image runs are re-derived from
#: each row's ids (see :meth:`Gemma3Model.batch_image_blocks`), nothing else is kept
IMAGE_BLOCKS = "image-blocks"


def image_block_ids(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """``(B, T)`` ids -> ``(B, T)`` int64: each maximal run of ``image_token_id`` numbered 0, 1, ...
    per row, -1 elsewhere (transformers' ``get_block_sequence_ids_for_mask`` of ``token_type_ids``)."""
    is_image = input_ids == image_token_id  # (B, T)
    starts = is_image & ~F.pad(is_image, (1, 0), value=False)[:, :-1]
    groups = torch.cumsum(starts.to(torch.int64), dim=1) - 1
    return torch.where(is_image, groups, torch.full_like(groups, -1))


class Gemma3Model(ImageTokenVLM):
    """The whole model; build under ``torch.device("meta")`` and let the loader fill the weights."""

    def __init__(self, cfg: Gemma3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.vision_tower = make_tower(cfg)
        self.multi_modal_projector = Gemma3Projector(cfg)
        self.language_model = Decoder(cfg.text, tie_word_embeddings=cfg.tie_word_embeddings)
        self.exit_heads = None  # ExitHeads of `edgevlm calibrate` (attach_exit_heads)
        self._pending: tuple[weakref.ref, torch.Tensor] | None = None  # (embeds, their image_blocks)
        self._vision_state: str | None = None

    # ---- vision --------------------------------------------------------------------------------
    def encode_images(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """Images ``(N, 3, P, P)`` float at the tower's ``image_size`` -> ``(N, mm_tokens_per_image,
        D_text)`` in the model dtype. Raises ``ValueError`` for another input size."""
        w = self.vision_tower.embeddings.patch_embedding.weight
        p = self.cfg.image_px
        if tuple(pixel_values.shape[-2:]) != (p, p):
            raise ValueError(f"Gemma 3's tower takes {p}x{p} px images, got {tuple(pixel_values.shape[-2:])}")
        hidden = self.vision_tower(pixel_values.to(w.device, w.dtype)).last_hidden_state  # (N, S*S, D_v)
        return self.multi_modal_projector(hidden)

    def encode_vision(self, vision: VisionInput) -> torch.Tensor:
        """All images -> ``(N_img * mm_tokens_per_image, D_text)`` in prompt order."""
        feats = self.encode_images(vision.pixel_values)
        self._vision_state = IMAGE_BLOCKS
        return feats.reshape(-1, feats.shape[-1])

    def attach_exit_heads(self, heads) -> None:
        """Use ``heads`` (:func:`edgevlm.runtime.exits.load_exit_heads`) for early exit; None detaches."""
        self.exit_heads = adaptive.attach(self, heads)

    def exit_run(self, vision: VisionInput) -> Gemma3ExitRun:
        """A block-by-block encode of ``vision``'s images (exit hooks, :mod:`edgevlm.runtime.adaptive`)."""
        w = self.vision_tower.embeddings.patch_embedding.weight
        return Gemma3ExitRun(self.vision_tower, self.multi_modal_projector, self.cfg,
                             vision.pixel_values.to(w.device, w.dtype))

    def encode_vision_adaptive(self, vision: VisionInput, operating_point=None, prompt_ids=None, trunk=None):
        """:meth:`encode_vision` with early exit and token pruning (:func:`edgevlm.runtime.adaptive.encode_model_adaptive`):
        ``((N', D_text) vision tokens, VisionInfo)``; each image keeps its own share of tokens."""
        tokens, _, info = adaptive.encode_model_adaptive(self, vision, operating_point, prompt_ids, trunk)
        self._vision_state = IMAGE_BLOCKS
        return tokens, info

    # ---- prompt --------------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, vision_features: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`ImageTokenVLM.embed` (``(1, T)`` -> ``(1, T, D)``, scaled token embeddings with the
        image runs replaced), remembering the prompt's image runs for the :meth:`prefill` of exactly
        this result."""
        embeds = super().embed(input_ids, vision_features)
        blocks = image_block_ids(input_ids, self.cfg.image_token_id) if vision_features is not None else None
        self._pending = (weakref.ref(embeds), blocks) if blocks is not None else None
        return embeds

    def prefill_inputs(self, embeds: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """:meth:`DecoderVLM.prefill_inputs`: ``image_blocks`` ``(1, T)`` (each image's tokens attend
        to each other) when ``embeds`` came from :meth:`embed` with vision features (handed over
        and forgotten, :meth:`image_blocks_for`), else no hooks (causal). Raises ``ValueError`` for
        ``position_ids`` (1-D RoPE)."""
        if position_ids is not None:
            raise ValueError("Gemma3Model uses 1-D RoPE: position_ids must be None")
        blocks = self.image_blocks_for(embeds)
        return {} if blocks is None else {"image_blocks": blocks}

    def image_blocks_for(self, embeds: torch.Tensor) -> torch.Tensor | None:
        """The image runs ``(1, T)`` int64 (:func:`image_block_ids`) of the prompt whose embeddings
        :meth:`embed` returned as ``embeds`` (that very tensor), handed over and forgotten; None for
        other embeddings or a prompt embedded without vision features."""
        blocks = None
        if self._pending is not None and self._pending[0]() is embeds:
            blocks = self._pending[1].to(embeds.device)
        self._pending = None
        return blocks

    # ---- batched prefill (continuous batching) -------------------------------------------------
    def take_vision_state(self):
        """:data:`IMAGE_BLOCKS` after a vision encode (so the batcher passes each row's ids to
        :meth:`prefill_batch`), handed over and forgotten; None when nothing was encoded."""
        state, self._vision_state = self._vision_state, None
        return state

    def batch_image_blocks(self, input_ids: torch.Tensor, vision_states: list) -> torch.Tensor:
        """``image_blocks`` ``(B, T)`` of a right-padded batch (padding -1, never an image token)."""
        return image_block_ids(input_ids, self.cfg.image_token_id)
