"""The LLaVA model: vision tower (CLIP or SigLIP ViT + projector) feeding vision tokens into the
shared decoder (Llama, Mistral, Qwen2, ...).

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

from edgevlm.runtime.decoder import Decoder, DecoderVLM, rope_cos_sin
from edgevlm.runtime.exits import ExitHeads
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.models.blocks.siglip import SiglipVisionConfig, SiglipVisionEmbeddings
from edgevlm.runtime.models.llava.config import LlavaConfig
from edgevlm.runtime.vision import VisionBlock, VisionInfo, VisionTower, encode_adaptive
from edgevlm.runtime.vision_cache import VisionTrunk
from edgevlm.types import OperatingPoint

logger = logging.getLogger(__name__)


#: the model builds the vision blocks up to the deepest feature layer only: deeper ones are skipped



class SiglipFeatureEncoder(nn.Module):
    """A SigLIP tower (:mod:`edgevlm.runtime.models.blocks.siglip`) behind the CLIP encoder's
    interface (:class:`~edgevlm.runtime.vision.VisionTower`): no CLS token, no pre-LN, position
    embeddings interpolated to the input's patch grid (unchanged at the trained grid, as
    transformers' ``SiglipVisionEmbeddings``), blocks up to the deepest feature layer only."""

    has_cls_token = False

    def __init__(self, cfg: SiglipVisionConfig, num_blocks: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embeddings = SiglipVisionEmbeddings(cfg)
        self.layers = nn.ModuleList([VisionBlock(cfg) for _ in range(num_blocks)])
        self.fused_stem: nn.Module | None = None  # the Triton stem is CLIP's (CLS + pre-LN): not used

    def stem(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, C, H, W)`` -> ``(B, N, D)`` patch embeddings + positions (extra border pixels dropped)."""
        return self.embeddings(pixel_values, interpolate_pos_encoding=True)

    def forward(self, pixel_values: torch.Tensor, feature_indices: tuple[int, ...]) -> list[torch.Tensor]:
        """Hidden states ``(B, N, D)`` at ``feature_indices`` (0 = embeddings, i = after block i)."""
        x = self.stem(pixel_values)
        states = {0: x}
        for i, block in enumerate(self.layers, start=1):
            x = block(x)
            states[i] = x
        return [states[i] for i in feature_indices]


class LlavaModel(DecoderVLM):
    """Vision tower + decoder. Canonical parameter names (what :data:`WEIGHT_RULES` maps every
    checkpoint layout to)::

        vision_tower.encoder.{embeddings,pre_layrnorm,layers.N}.*   (CLIP; SigLIP: no pre_layrnorm)
        vision_tower.projector.{linear_1,linear_2}.*
        language_model.{embed_tokens,layers.N,norm,lm_head}.*
    """

    def __init__(self, cfg: LlavaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        encoder = None
        if not cfg.vision_has_cls:
            encoder = SiglipFeatureEncoder(cfg.vision, cfg.vision_blocks_needed)
        self.vision_tower = VisionTower(cfg, encoder)
        self.language_model = Decoder(cfg.text, cfg.tie_word_embeddings)
        self.exit_heads: ExitHeads | None = None  # set by attach_exit_heads (edgevlm calibrate output)
        # token-pruning score, see edgevlm.runtime.pruning (a tower without CLS: feature norms)
        self.prune_score = "cls_attention" if cfg.vision_has_cls else "feature_norm"
        # "original": pruned vision tokens keep their unpruned RoPE distances (see prefill);
        # "compact": they take consecutive positions like any prompt
        self.prune_positions = "original"
        self._pruned: tuple[list[int], int, int] | None = None  # (kept patches, N patches, CLS kept)
        self._rope_positions: torch.Tensor | None = None  # (T,) positions for the next prefill

    def encode_image(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(B, 3, H, W)`` normalised pixels -> ``(B, N, D_text)`` vision tokens (model dtype)."""
        self._pruned = self._rope_positions = None
        return self.vision_tower(pixel_values.to(self.device, self.dtype))

    def attach_exit_heads(self, heads: ExitHeads | None) -> None:
        """Use ``heads`` (:func:`edgevlm.runtime.exits.load_exit_heads`) for early exit and labels;
        moved to the model's device and dtype. None detaches them."""
        self.exit_heads = heads.to(self.device, self.dtype).eval() if heads is not None else None

    def encode_image_adaptive(
        self, pixel_values: torch.Tensor, operating_point: OperatingPoint | None = None,
        prompt_ids: torch.Tensor | None = None, trunk: VisionTrunk | None = None,
    ) -> tuple[torch.Tensor, VisionInfo]:
        """Like :meth:`encode_image` with the operating point's early exit (``exit_layer``,
        ``exit_threshold``) and token pruning (``keep_ratio``); see
        :func:`edgevlm.runtime.vision.encode_adaptive`. Returns ``(B, N', D_text)`` vision tokens
        and what was done. ``prompt_ids`` ``(B, T)``: the prompts, read by question-conditioned
        exit confidence heads; ``trunk``: the frame's kept encoder walk (one image, no pruning; see
        :mod:`edgevlm.runtime.vision_cache`). Raises ValueError for an exit the heads cannot serve."""
        op = operating_point
        query = None
        if prompt_ids is not None and self.exit_heads is not None and self.exit_heads.needs_query:
            from edgevlm.runtime.exits import query_embedding

            query = query_embedding(self.language_model.embed_tokens, prompt_ids.to(self.device),
                                    self.cfg.image_token_id)  # (B, Q)
        feats, info = encode_adaptive(
            self.vision_tower,
            pixel_values.to(self.device, self.dtype),
            exit_heads=self.exit_heads,
            exit_layer=op.exit_layer if op is not None else None,
            exit_threshold=op.exit_threshold if op is not None else None,
            keep_ratio=op.keep_ratio if op is not None else None,
            prune_score=self.prune_score,
            exit_query=query,
            trunk=trunk,
        )
        has_cls = int(self.cfg.cls_feature)
        self._rope_positions = None
        self._pruned = None
        if info.kept_index is not None and len(info.kept_index) == 1 and self.prune_positions == "original":
            self._pruned = (info.kept_index[0], info.tokens_total - has_cls, has_cls)
        return feats, info

    def encode_vision_adaptive(self, vision: VisionInput, operating_point: OperatingPoint | None = None,
                               prompt_ids: torch.Tensor | None = None, trunk: VisionTrunk | None = None
                               ) -> tuple[torch.Tensor, VisionInfo]:
        """The family interface's adaptive encode: :meth:`encode_image_adaptive` of ``vision``'s
        pixels, flattened to ``(N_img * N', D_text)``."""
        feats, info = self.encode_image_adaptive(vision.pixel_values, operating_point, prompt_ids, trunk)
        return feats.flatten(0, 1), info

    def classify_image(self, pixel_values: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Closed-set label probabilities ``(B, L)`` float32 from the exit classifier at ``block``
        (None = the earliest classifier), running the encoder only up to that block.
        Raises ValueError without exit heads/labels or for a block without a classifier."""
        heads = self.exit_heads
        if heads is None or not heads.labels:
            raise ValueError("this model has no exit classifier (run `edgevlm calibrate` on it)")
        blocks = heads.spec.classifier_blocks
        block = blocks[0] if block is None else block
        if block not in blocks:
            raise ValueError(f"no classifier after block {block} (classifier blocks: {blocks})")
        enc = self.vision_tower.encoder
        x = enc.stem(pixel_values.to(self.device, self.dtype))  # (B, 1 + N, D)
        for layer in enc.layers[:block]:
            x = layer(x)
        p = self.cfg.vision.patch_size
        return heads.classify(block, x, (pixel_values.shape[-2] // p, pixel_values.shape[-1] // p))  # (B, L)

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
        if self._pruned is not None and input_ids.shape[0] == 1:
            self._rope_positions = self._pruned_positions(is_image[0], self._pruned)
        self._pruned = None
        return embeds.masked_scatter(is_image[..., None], feats)

    def _pruned_positions(self, is_image: torch.Tensor, pruned: tuple[list[int], int, int]) -> torch.Tensor | None:
        """RoPE positions ``(T,)`` for a prompt whose vision tokens were pruned: every token keeps
        its slot as position except the vision tokens, which get ``slot_of_first + original index -
        pruned`` — so the distance from each text token (and every generated token) to each vision
        token is exactly what it would be without pruning, which is how a decoder trained on full
        grids reads rows (top/bottom) off the image. Vision tokens may get positions below the
        prefix (even negative): RoPE only sees differences."""
        kept, n_patches, has_cls = pruned
        slots = is_image.nonzero()[:, 0]
        if len(slots) != len(kept) + has_cls:
            return None
        start = int(slots[0])
        pruned = n_patches - len(kept)
        pos = torch.arange(is_image.shape[0], device=is_image.device)
        original = torch.tensor([0] * has_cls + [i + has_cls for i in kept], device=is_image.device)
        pos[slots] = start + original - pruned
        return pos

    def prefill_inputs(self, embeds: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """:meth:`DecoderVLM.prefill_inputs` of a prefill of ``embeds`` ``(B, T, D)`` from slot 0:
        ``rope`` ``(1, T, Dh)`` float32 at ``position_ids`` ``(T,)`` when given, else at the unpruned
        positions that the last pruned :meth:`embed` left (handed over and forgotten): pruned
        vision tokens keep their unpruned RoPE distances (keys are cached already rotated, and
        decoding resumes at slot T with the normal tables); no hooks otherwise (the slots)."""
        t = embeds.shape[1]
        positions, self._rope_positions = self._rope_positions, None
        if position_ids is not None:
            positions = position_ids.reshape(-1).to(embeds.device)
        if positions is None or positions.shape[0] != t:
            return {}
        cos, sin = rope_cos_sin(self.language_model.inv_freq, positions)  # (T, Dh) float32 each
        return {"rope": (cos[None], sin[None])}

    # ---- batched prefill (edgevlm.runtime.batching) ---------------------------------------------
    def take_vision_state(self) -> tuple[list[int], int, int] | None:
        """What the last pruned :meth:`encode_image_adaptive` kept (``(kept patches, N patches,
        CLS kept)``, for its unpruned RoPE positions), handed over for a batched prefill and
        forgotten here; None when the last encode pruned nothing (or ``prune_positions`` is
        "compact")."""
        state, self._pruned = self._pruned, None
        return state

    def row_rope(self, input_ids: torch.Tensor | None, position_ids: torch.Tensor | None,
                 vision_state) -> tuple[torch.Tensor, torch.Tensor] | None:
        """One row of a batched prefill: the unpruned-distance RoPE tables ``(T, Dh)`` float32 of a
        pruned request (``vision_state`` from :meth:`take_vision_state`, ``input_ids`` ``(1, T)``),
        as :meth:`prefill` uses them; None = the slots."""
        if vision_state is None or input_ids is None:
            return None
        ids = input_ids.reshape(-1)
        positions = self._pruned_positions(ids[ids >= 0] == self.cfg.image_token_id, vision_state)
        return None if positions is None else rope_cos_sin(self.language_model.inv_freq, positions)

    # ---- the family interface (edgevlm.runtime.models.base.VLMModel) -------------------------
    def encode_vision(self, vision: VisionInput) -> torch.Tensor:
        """Every image of ``vision`` -> ``(N_total, D_text)`` vision tokens in prompt order."""
        return self.encode_image(vision.pixel_values).flatten(0, 1)  # (N_img * N, D)

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None = None) -> tuple[None, int]:
        """1-D RoPE: positions are the cache slots (``(None, 0)``)."""
        return None, 0

    def decode(self, token_ids: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """One decode step: ``token_ids`` ``(B, 1)`` int64 at ``input_pos`` ``(1,)`` -> logits ``(B, V)``."""
        embeds = self.language_model.embed_tokens(token_ids)  # (B, 1, D)
        return self.language_model(embeds, input_pos, prefill=False)

    def forward(self, input_ids: torch.Tensor, vision: VisionInput | torch.Tensor | None = None) -> torch.Tensor:
        """Full-sequence logits ``(B, T, V)`` for a prompt (prefill path; used by reference tests):
        ``vision`` a :class:`VisionInput` or ``(B, 3, H, W)`` pixels. Requires caches set up with
        ``max_seq_len >= T``."""
        if isinstance(vision, VisionInput):
            feats = self.encode_vision(vision)
        else:
            feats = self.encode_image(vision) if vision is not None else None
        return self.prefill(self.embed(input_ids, feats), all_logits=True)
