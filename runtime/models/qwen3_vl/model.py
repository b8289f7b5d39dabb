"""The Qwen3-VL model: ViT with DeepStack feeding a Qwen3 decoder with interleaved multimodal RoPE.

Reference: Qwen Team, "Qwen3-VL Technical Report" (2025); transformers'
``Qwen3VLForConditionalGeneration`` is the numerical reference (facts only, the code is ours):

* the prompt holds one ``<|image_pad|>`` / ``<|video_pad|>`` per vision token; their embeddings are
  replaced, in prompt order, by the tower's merged tokens (:meth:`Qwen3VLModel.embed`);
* DeepStack: after decoder layer ``i`` (``i < len(deepstack_visual_indexes)``), the ``i``-th DeepStack
  feature is added to the hidden states at every vision position (the shared decoder's
  ``layer_adds`` hook);
* positions (:meth:`Qwen3VLModel.position_ids`): text tokens advance one position on all three M-RoPE
  axes; a vision run of a ``(h, w)`` merged grid (each video frame is its own run: Qwen3-VL
  separates frames with text timestamps) takes ``t = start``, ``h = start + row``,
  ``w = start + col`` and advances the next start by ``max(h, w)``. Decode then uses
  RoPE position = cache slot + ``rope_delta`` (the same on all axes);
* interleaved M-RoPE (:func:`edgevlm.runtime.models.qwen_vl.rope.mrope_cos_sin`, ``interleaved=True``).
"""

from __future__ import annotations

import logging

import torch

from edgevlm.runtime import adaptive
from edgevlm.runtime.decoder import Decoder, DecoderVLM, rope_inv_freq
from edgevlm.runtime.models.qwen3_vl.config import Qwen3VLConfig
from edgevlm.runtime.models.qwen3_vl.vision import Qwen3ExitRun, Qwen3VLVisionTower
from edgevlm.runtime.models.qwen_vl.rope import VisionSpan, mrope_cos_sin, mrope_position_ids

logger = logging.getLogger(__name__)


class Qwen3VLModel(DecoderVLM):
    """Vision tower + shared decoder. Parameter names (what the family's ``weight_rules`` map a
    checkpoint to)::

        visual.{patch_embed,pos_embed,blocks.N,merger,deepstack_merger_list.K}.*
        language_model.{embed_tokens,layers.N,norm,lm_head}.*
    """

    def __init__(self, cfg: Qwen3VLConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.visual = Qwen3VLVisionTower(cfg.vision)
        self.vision_graphs = None  # VisionGraphs of the tower (enable_vision_graphs), CUDA only
        self.language_model = Decoder(cfg.text, cfg.tie_word_embeddings)
        self._deepstack: list[torch.Tensor] = []  # from the last encode_vision, for the next prefill
        self._vision_mask: torch.Tensor | None = None  # (1, T) bool, from the last embed with vision
        self._vision_count = 0  # True positions of _vision_mask (counted by embed, no sync at prefill)
        self.exit_heads = None  # ExitHeads of `edgevlm calibrate` (attach_exit_heads)

    def attach_exit_heads(self, heads) -> None:
        """Use ``heads`` (:func:`edgevlm.runtime.exits.load_exit_heads`) for early exit; None detaches."""
        self.exit_heads = adaptive.attach(self, heads)

    def exit_run(self, vision) -> Qwen3ExitRun:
        """A block-by-block encode of ``vision`` (exit hooks, :mod:`edgevlm.runtime.adaptive`)."""
        return Qwen3ExitRun(self.visual, vision.pixel_values.to(self.device, self.dtype),
                            vision.grid_thw.to(self.device))

    def encode_vision_adaptive(self, vision, operating_point=None, prompt_ids=None, trunk=None):
        """:meth:`encode_vision` with early exit and token pruning (:func:`edgevlm.runtime.adaptive.encode_adaptive`):
        ``((N', D_text) vision tokens, VisionInfo)``; the DeepStack features (those past an exit
        from the adapter's output, pruned like the tokens) are kept for the next :meth:`prefill`."""
        tokens, self._deepstack, info = adaptive.encode_model_adaptive(self, vision, operating_point, prompt_ids, trunk)
        return tokens, info

    # ---- vision ---------------------------------------------------------------------------------
    def encode_vision(self, vision) -> torch.Tensor:
        """Main vision tokens ``(N_tokens, D_text)`` in prompt order, model dtype, for a
        ``VisionInput`` (``pixel_values`` ``(N_patches, C*T*p*p)``, ``grid_thw`` ``(N_items, 3)``).
        The DeepStack features of the same call are kept for the next :meth:`prefill`."""
        pixels = vision.pixel_values.to(self.device, self.dtype)
        grid = vision.grid_thw.cpu()  # indices are built on the device from the grid's ints: no syncs
        tower = self.vision_graphs if self.vision_graphs is not None and pixels.is_cuda else self.visual
        main, deepstack = tower(pixels, grid)
        self._deepstack = list(deepstack)
        return main

    def enable_vision_graphs(self, enabled: bool = True, max_graphs: int = 4) -> bool:
        """Replay the vision tower from CUDA graphs, one per input geometry
        (:class:`~edgevlm.runtime.vision_graphs.VisionGraphs`; same results, ~600 launches become
        one). Only on CUDA; returns whether it is on."""
        from edgevlm.runtime.vision_graphs import vision_graphs_for

        self.vision_graphs = vision_graphs_for(self.visual, self.device, enabled, max_graphs)
        return self.vision_graphs is not None

    def _vision_token_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        mask = input_ids == self.cfg.image_token_id
        if self.cfg.video_token_id is not None:
            mask |= input_ids == self.cfg.video_token_id
        return mask

    def embed(self, input_ids: torch.Tensor, vision_features: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``(1, T)`` int64 -> embeddings ``(1, T, D)``; the vision placeholders are
        replaced in order by ``vision_features`` ``(N, D)``.

        Raises ``ValueError`` when the placeholder count differs from ``N``."""
        x = self.language_model.embed_tokens(input_ids)
        self._vision_mask = None
        if vision_features is None:
            return x
        mask = self._vision_token_mask(input_ids)
        n = int(mask.sum())
        if n != vision_features.shape[0]:
            raise ValueError(f"prompt has {n} vision placeholder tokens but the vision tower produced "
                             f"{vision_features.shape[0]} vision tokens")
        x = x.clone()
        x[mask] = vision_features.to(x.dtype)
        self._vision_mask, self._vision_count = mask, n
        return x

    # ---- positions ------------------------------------------------------------------------------
    def position_ids(self, input_ids: torch.Tensor, vision=None) -> tuple[torch.Tensor | None, int]:
        """M-RoPE positions ``((3, 1, T) int64, rope_delta)`` for ``input_ids`` ``(1, T)``; the
        decode RoPE position of cache slot ``s`` is ``s + rope_delta``. Without vision: 1-D
        positions, ``(None, 0)``.

        Raises ``ValueError`` when the vision placeholder runs do not match ``vision.grid_thw``."""
        if vision is None or vision.grid_thw is None:
            return None, 0
        # Qwen3-VL separates video frames with text timestamps: each temporal patch is its own span
        spans = []
        for kind, (t, h, w) in zip(vision.kinds, vision.grid_thw.tolist(), strict=True):
            if kind == "video":
                spans += [VisionSpan(self.cfg.video_token_id, (1, h, w))] * t
            else:
                spans.append(VisionSpan(self.cfg.image_token_id, (t, h, w)))
        pos, rope_delta = mrope_position_ids(input_ids, spans, self.cfg.vision.spatial_merge_size)
        return pos[:, None].to(input_ids.device), rope_delta

    # ---- decoder --------------------------------------------------------------------------------
    def prefill_inputs(self, embeds: torch.Tensor, position_ids: torch.Tensor | None = None) -> dict:
        """:meth:`DecoderVLM.prefill_inputs` of a prefill from cache slot 0 of ``embeds`` ``(1, T, D)``:
        ``rope`` of the M-RoPE ``position_ids`` ``(3, 1, T)`` (None = 1-D positions), and
        ``layer_adds``: the DeepStack features of the last :meth:`encode_vision` added at the
        vision positions of the last :meth:`embed` (consumed: a later text-only prefill gets none).
        Raises ``ValueError`` when ``embeds`` does not match the last :meth:`embed`, or the DeepStack
        features do not match its vision tokens in number (another encode's: :func:`add_at_mask`
        does not check); the side state is dropped either way."""
        t = embeds.shape[1]
        mask, count, deepstack = self._vision_mask, self._vision_count, self._deepstack
        self._vision_mask, self._deepstack = None, []
        hooks = super().prefill_inputs(embeds, position_ids)
        if mask is not None and deepstack:
            if mask.shape[1] != t:
                raise ValueError("prefill embeddings do not match the last embed() call")
            if any(feats.shape[0] != count for feats in deepstack):
                raise ValueError(f"{count} vision tokens in the last embed() but DeepStack features of "
                                 f"{[feats.shape[0] for feats in deepstack]} tokens (of another encode_vision)")
            hooks["layer_adds"] = [(mask, feats) for feats in deepstack]
        return hooks

    def rope_tables(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token interleaved M-RoPE ``(cos, sin)`` ``(T, head_dim)`` float32 of positions
        ``(3, 1, T)``, on the model's device."""
        return mrope_cos_sin(position_ids[:, 0].to(self.device), rope_inv_freq(self.cfg.text),
                             self.cfg.text.mrope_section, interleaved=True)

    def take_vision_state(self) -> list[torch.Tensor] | None:
        """The DeepStack features ``(N_tokens, D_text)`` per DeepStack layer of the last
        :meth:`encode_vision`, handed over for a batched prefill (:meth:`batch_layer_adds`) and
        forgotten here; None when there are none."""
        state, self._deepstack = self._deepstack, []
        return state or None

    def batch_layer_adds(self, input_ids: torch.Tensor, vision_states: list) -> list | None:
        """DeepStack for a right-padded batch: after decoder layer ``i`` every vision position of
        ``input_ids`` ``(B, T)`` (padding -1) of a row with DeepStack features gets its row's
        ``i``-th feature, rows in order (the decoder's ``layer_adds``). Raises ``ValueError`` when
        the placeholders and features disagree in number."""
        has = torch.tensor([s is not None for s in vision_states], device=input_ids.device)
        mask = self._vision_token_mask(input_ids) & has[:, None]  # (B, T)
        states = [s for s in vision_states if s is not None]
        if not states:
            return None
        adds = []
        for i in range(max(len(s) for s in states)):
            feats = torch.cat([s[i] for s in states])  # (N, D), rows in order
            if feats.shape[0] != int(mask.sum()):
                raise ValueError(f"{int(mask.sum())} vision placeholders for {feats.shape[0]} DeepStack features")
            adds.append((mask, feats))
        return adds

    def prefill_batch_inputs(self, embeds, rows, **kwargs):
        """:meth:`DecoderVLM.prefill_batch_inputs` (DeepStack through ``vision_states``); the
        single-request state of the last :meth:`embed` is dropped (it belongs to one of the batched
        rows)."""
        self._vision_mask = None
        return super().prefill_batch_inputs(embeds, rows, **kwargs)

    def decode(self, token_ids: torch.Tensor, input_pos: torch.Tensor,
               rope_offset: int | torch.Tensor = 0) -> torch.Tensor:
        """One step: ``token_ids`` ``(B, 1)`` at cache slot ``input_pos`` ``(1,)`` (or ``(B,)``, per
        row) -> logits ``(B, V)``; RoPE position = slot + ``rope_offset`` (int or ``(B,)``: each
        row's ``rope_delta``)."""
        b = token_ids.shape[0]
        pos = input_pos.reshape(-1).expand(b) if input_pos.numel() == 1 else input_pos.reshape(b)
        kv_len = int(pos.max()) + 1
        return self.language_model.decode_step(token_ids, pos, kv_len, rope_offset)

    def forward(self, input_ids: torch.Tensor, vision=None) -> torch.Tensor:
        """All logits ``(1, T, V)`` of one prompt (parity tests): encode, embed, prefill."""
        feats = self.encode_vision(vision) if vision is not None else None
        embeds = self.embed(input_ids, feats)
        pos, _ = self.position_ids(input_ids, vision)
        return self.prefill(embeds, position_ids=pos, all_logits=True)


