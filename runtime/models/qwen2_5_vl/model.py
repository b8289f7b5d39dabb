"""The Qwen2.5-VL model: vision tower + merger, and the shared decoder as Qwen2 with M-RoPE.

The decoder is :class:`edgevlm.runtime.decoder.Decoder` (q/k/v bias, no o_proj bias: ``qwen2_5_vl_text``
in :func:`edgevlm.runtime.config.parse_text_config`). Prefill passes per-token ``(cos, sin)`` tables
built from the 3-row M-RoPE positions (:mod:`edgevlm.runtime.models.qwen_vl.rope`); decode reads the
decoder's 1-D tables at ``slot + rope_delta`` (the decoder's ``rope_offset``): after the prompt the
three rows are equal, as in transformers' ``Qwen2_5_VLModel`` (``rope_deltas``).

Weight names: transformers 5 saves the hub's layout (``visual.*``, ``model.layers.*``, ``lm_head``);
checkpoints converted by newer code use ``model.visual.*`` / ``model.language_model.*``. Both map
through :data:`WEIGHT_RULES`.
"""

from __future__ import annotations

import torch

from edgevlm.runtime import adaptive
from edgevlm.runtime.decoder import Decoder, DecoderVLM
from edgevlm.runtime.models.qwen2_5_vl.config import Qwen25VLConfig
from edgevlm.runtime.models.qwen2_5_vl.vision import Qwen25ExitRun, Qwen25VisionTower
from edgevlm.runtime.models.qwen_vl.rope import VisionSpan, mrope_cos_sin, mrope_position_ids


class Qwen25VLModel(DecoderVLM):
    """Qwen2.5-VL for generation: ``encode_vision`` -> ``embed`` -> ``position_ids`` -> ``prefill`` ->
    ``decode`` (the model-family interface of ``runtime/models``)."""

    def __init__(self, cfg: Qwen25VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = Qwen25VisionTower(cfg.vision)
        self.language_model = Decoder(cfg.text, tie_word_embeddings=cfg.tie_word_embeddings)
        self.exit_heads = None  # ExitHeads of `edgevlm calibrate` (attach_exit_heads)
        self.vision_graphs = None  # VisionGraphs of the tower (enable_vision_graphs), CUDA only

    def attach_exit_heads(self, heads) -> None:
        """Use ``heads`` (:func:`edgevlm.runtime.exits.load_exit_heads`) for early exit; None detaches."""
        self.exit_heads = adaptive.attach(self, heads)

    def exit_run(self, vision) -> Qwen25ExitRun:
        """A block-by-block encode of ``vision`` (exit hooks, :mod:`edgevlm.runtime.adaptive`)."""
        w = self.visual.patch_embed.proj.weight
        if vision.grid_thw is None:
            raise ValueError("Qwen2.5-VL vision input needs grid_thw")
        return Qwen25ExitRun(self.visual, vision.pixel_values.to(w.device, w.dtype), vision.grid_thw.cpu())

    def encode_vision_adaptive(self, vision, operating_point=None, prompt_ids=None, trunk=None):
        """:meth:`encode_vision` with early exit and token pruning (:func:`edgevlm.runtime.adaptive.encode_adaptive`):
        ``((N', D_text) vision tokens, VisionInfo)``."""
        tokens, _, info = adaptive.encode_model_adaptive(self, vision, operating_point, prompt_ids, trunk)
        return tokens, info

    def encode_vision(self, vision) -> torch.Tensor:
        """``vision`` (a ``VisionInput`` with ``pixel_values (N_patches, C*tp*p*p)`` and ``grid_thw``
        ``(N_items, 3)``) -> vision tokens ``(sum(tokens_per_item), D_text)`` in item order, in the
        model's dtype."""
        w = self.visual.patch_embed.proj.weight
        if vision.grid_thw is None:
            raise ValueError("Qwen2.5-VL vision input needs grid_thw")
        pixels = vision.pixel_values.to(w.device, w.dtype)
        tower = self.vision_graphs if self.vision_graphs is not None and pixels.is_cuda else self.visual
        return tower(pixels, vision.grid_thw.cpu())

    def enable_vision_graphs(self, enabled: bool = True, max_graphs: int = 4) -> bool:
        """Replay the vision tower from CUDA graphs, one per input geometry
        (:class:`~edgevlm.runtime.vision_graphs.VisionGraphs`). Only on CUDA; returns whether it is on."""
        from edgevlm.runtime.vision_graphs import vision_graphs_for

        self.vision_graphs = vision_graphs_for(self.visual, self.device, enabled, max_graphs)
        return self.vision_graphs is not None

    def embed(self, input_ids: torch.Tensor, vision_features: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``(1, T)`` -> embeddings ``(1, T, D)``; the image placeholder tokens take the
        first rows of ``vision_features`` ``(N, D)`` in order, the video placeholders the rest (the
        processor's item order: images, then the video), wherever they sit in the prompt.

        Raises ValueError when the placeholder count differs from N."""
        x = self.language_model.embed_tokens(input_ids)  # (1, T, D)
        image_mask = input_ids == self.cfg.image_token_id
        video_mask = input_ids == self.cfg.video_token_id if self.cfg.video_token_id is not None \
            else torch.zeros_like(image_mask)
        n_image, n_video = int(image_mask.sum()), int(video_mask.sum())
        n_feats = 0 if vision_features is None else vision_features.shape[0]
        if n_image + n_video != n_feats:
            raise ValueError(f"the prompt has {n_image + n_video} vision placeholder tokens for {n_feats} "
                             "vision tokens")
        if n_feats:
            feats = vision_features.to(x.dtype)
            x = x.masked_scatter(image_mask[..., None], feats[:n_image])
            x = x.masked_scatter(video_mask[..., None], feats[n_image:])
        return x

    def position_ids(self, input_ids: torch.Tensor, vision=None) -> tuple[torch.Tensor | None, int]:
        """``((3, 1, T) int64 M-RoPE positions, rope_delta)``; ``(None, 0)`` without vision (the three
        rows would be equal: plain RoPE). Video temporal positions step by ``tokens_per_second *
        second_per_grid_t`` (``vision.extras["second_per_grid_ts"]``, one per item, None for images)."""
        if vision is None or not vision.kinds:
            return None, 0
        per_item = vision.extras.get("second_per_grid_ts") or [None] * len(vision.kinds)
        spans = []
        for kind, grid, seconds in zip(vision.kinds, vision.grid_thw.tolist(), per_item, strict=True):
            if kind == "video":
                # float32 product like transformers' (tokens_per_second * second_per_grid_ts tensor)
                interval = float(torch.tensor(1.0 if seconds is None else seconds, dtype=torch.float32)
                                 * self.cfg.vision.tokens_per_second)
                spans.append(VisionSpan(self.cfg.video_token_id, tuple(grid), interval))
            else:
                spans.append(VisionSpan(self.cfg.image_token_id, tuple(grid), 1.0))
        positions, delta = mrope_position_ids(input_ids.cpu(), spans, self.cfg.vision.spatial_merge_size)
        return positions[:, None].to(input_ids.device), delta

    def rope_tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(cos, sin)`` ``(T, head_dim)`` float32 of M-RoPE positions ``(3, 1, T)``."""
        lm = self.language_model
        if lm.inv_freq is None:
            raise RuntimeError("caches not set up: call setup_caches() first")
        cos, sin = mrope_cos_sin(position_ids[:, 0].cpu(), lm.inv_freq, self.cfg.text.mrope_section,
                                 self.cfg.text.mrope_interleaved)
        device = lm.embed_tokens.weight.device
        return cos.to(device), sin.to(device)

    def decode(self, token_ids: torch.Tensor, input_pos: torch.Tensor,
               rope_offset: int | torch.Tensor = 0) -> torch.Tensor:
        """One step: ``token_ids`` ``(B, 1)`` at cache slot ``input_pos`` ``(1,)`` (or ``(B,)``) ->
        logits ``(B, V)``; RoPE position = slot + ``rope_offset`` (the prompt's ``rope_delta``; a
        ``(B,)`` tensor: per row)."""
        b = token_ids.shape[0]
        pos = input_pos.reshape(-1).expand(b) if input_pos.numel() == 1 else input_pos.reshape(b)
        kv_len = int(pos.max()) + 1
        return self.language_model.decode_step(token_ids, pos, kv_len, rope_offset=rope_offset)

    def forward(self, input_ids: torch.Tensor, vision=None) -> torch.Tensor:
        """All logits ``(1, T, V)`` of a prompt (parity tests; caches must be set up)."""
        feats = self.encode_vision(vision) if vision is not None and vision.kinds else None
        positions, _ = self.position_ids(input_ids, vision)
        return self.prefill(self.embed(input_ids, feats), position_ids=positions, all_logits=True)
