"""PyTorch backend: any registered model family's model (:mod:`edgevlm.runtime.models`; LLaVA's
:class:`~edgevlm.runtime.models.llava.model.LlavaModel` with early exit and pruning) on CPU fp32/bf16
or CUDA fp16/bf16, with
its static KV cache, CUDA-graph decode, a choice of KV cache precision, and batched entry points
for several concurrent requests (used by :mod:`edgevlm.runtime.batching`).

Options (``load(..., **options)`` / :class:`TorchBackend` keyword arguments; profile keys of the
cloud profiles):

* ``cuda_graphs`` (default: True on CUDA): decode steps replay CUDA graphs
  (:mod:`edgevlm.runtime.cuda_graphs`); ignored on CPU (eager).
* ``kv_cache_dtype``: ``bf16``/``fp16``/``fp32``/``int4``/``fp8_e4m3`` (default: the model dtype),
  see :mod:`edgevlm.runtime.kv_cache`.
* ``max_batch_size`` (default 1): KV cache rows, i.e. requests decoded together (every
  registered family: 1-D RoPE or M-RoPE with a per-row ``rope_delta``, DeepStack per row).
* ``fused_vision_stem`` (default False): the Triton patch-embedding + LayerNorm kernel
  (:mod:`edgevlm.runtime.kernels.patch_embed_ln`); needs triton and CUDA.
* ``min_kv_bucket`` (default 256): smallest attended KV length on CUDA (see ``kv_bucket``).
* ``fuse_projections`` (default: True on CUDA): q/k/v and gate/up of each decoder layer as single
  matmuls (``Decoder.fuse_projections``; exact, no extra memory).
* ``int4_kernel`` (default "auto"): the INT4 matmul kernels of W4A16 layers
  (:func:`edgevlm.runtime.int4.set_int4_kernel`).
* ``fused_decode`` (default: True on CUDA with triton and fused projections): the fused Triton
  decode-step kernels (``Decoder.enable_fused_decode``: residual add + RMSNorm, RoPE + KV write,
  SiLU x up), for 16-bit KV caches.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from edgevlm.errors import InvalidRequestError, ModelLoadError
from edgevlm.runtime.backends import Backend
from edgevlm.runtime.kv_cache import DEFAULT_INT4_GROUP_SIZE, KV_CACHE_DTYPES, kv_bucket
from edgevlm.runtime.loader import ModelFiles, load_model
from edgevlm.runtime.models.base import VisionInput
from edgevlm.types import OperatingPoint

logger = logging.getLogger(__name__)


class TorchBackend(Backend):
    """Runs the model with plain PyTorch modules (SDPA attention).

    Raises:
        InvalidRequestError: a bad option value.
        ModelLoadError: ``fused_vision_stem`` asked for where triton or CUDA is missing.
    """

    name = "torch"
    supports_pruning = True  # encode_image honours operating_point.keep_ratio
    last_vision_info = None  # VisionInfo of the last adaptive encode_image (exit layer, tokens kept)

    def __init__(self, model: nn.Module, *, cuda_graphs: bool | None = None, kv_cache_dtype: str | None = None,
                 max_batch_size: int = 1, fused_vision_stem: bool = False, min_kv_bucket: int = 256,
                 kv_int4_group_size: int = DEFAULT_INT4_GROUP_SIZE, fuse_projections: bool | None = None,
                 fused_decode: bool | None = None, int4_kernel: str = "auto") -> None:
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        dec = model.language_model
        if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                                      f"got {kv_cache_dtype!r}")
        if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise InvalidRequestError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
        if isinstance(min_kv_bucket, bool) or not isinstance(min_kv_bucket, int) or min_kv_bucket < 1:
            raise InvalidRequestError(f"min_kv_bucket must be a positive integer, got {min_kv_bucket!r}")
        if kv_cache_dtype is not None or max_batch_size != dec.max_batch_size:
            try:
                dec.setup_caches(max_batch_size, dec.max_seq_len, kv_cache_dtype, kv_int4_group_size)
            except ValueError as exc:
                raise InvalidRequestError(str(exc)) from exc
        self.kv_cache_dtype = kv_cache_dtype or str(self.dtype).removeprefix("torch.")
        self.min_kv_bucket = min_kv_bucket
        if self.device.type == "cuda" if fuse_projections is None else fuse_projections:
            dec.fuse_projections()
        from edgevlm.runtime.int4 import INT4_KERNELS, set_int4_kernel

        if int4_kernel not in INT4_KERNELS:
            raise InvalidRequestError(f"int4_kernel must be one of {', '.join(INT4_KERNELS)}, got {int4_kernel!r}")
        set_int4_kernel(model, int4_kernel)
        # the Triton decode kernels where they apply (stays off without triton or fused projections)
        dec.enable_fused_decode(self.device.type == "cuda" if fused_decode is None else bool(fused_decode))
        want_graphs = self.device.type == "cuda" if cuda_graphs is None else bool(cuda_graphs)
        if want_graphs and self.device.type != "cuda":
            logger.info("cuda_graphs requested on %s: decoding eagerly", self.device)
        self.graphs = None
        if want_graphs and self.device.type == "cuda":
            from edgevlm.runtime.cuda_graphs import DecodeGraphs

            self.graphs = DecodeGraphs(dec)
        if fused_vision_stem:
            self.enable_fused_vision_stem()
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)  # eager decode input buffers
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)

    # ---- configuration -------------------------------------------------------------------------
    @property
    def max_seq_len(self) -> int:
        return self.model.language_model.max_seq_len

    @property
    def max_batch_size(self) -> int:
        return self.model.language_model.max_batch_size

    @property
    def cuda_graphs(self) -> bool:
        return self.graphs is not None

    def enable_fused_vision_stem(self) -> None:
        """Use the Triton patch-embedding + LayerNorm kernel in the vision encoder.

        Raises ModelLoadError when triton or a CUDA device is missing."""
        from edgevlm.runtime.kernels import kernels_usable

        if not kernels_usable(self.device):
            raise ModelLoadError("fused_vision_stem needs triton and a CUDA device "
                                 f"(device {self.device}); install triton or turn the option off")
        from edgevlm.runtime.kernels.patch_embed_ln import FusedVisionStem

        tower = getattr(self.model, "vision_tower", None)
        enc = getattr(tower, "encoder", None)
        if enc is None or not getattr(enc, "has_cls_token", False):
            raise ModelLoadError("fused_vision_stem is the CLIP tower's stem (patches + CLS + pre-LN): "
                                 "this model's tower has none; turn the option off")
        enc.fused_stem = FusedVisionStem(enc.embeddings, enc.pre_layrnorm)

    def kv_len_for(self, n_positions: int) -> int:
        """Attended KV length for ``n_positions`` live positions: exact on CPU (eager, shapes may
        change freely), a power-of-two bucket on CUDA (one graph per bucket)."""
        if self.device.type != "cuda":
            return n_positions
        return kv_bucket(n_positions, self.max_seq_len, self.min_kv_bucket)

    # ---- single request (the Backend interface) ------------------------------------------------
    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                     prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        op = operating_point  # early exit / token pruning (edgevlm.runtime.exits, .pruning) when asked
        if op is not None and (op.exit_layer, op.exit_threshold, op.keep_ratio) != (None, None, None):
            # prompt_ids (1, T): read by question-conditioned exit confidence heads
            feats, self.last_vision_info = self.model.encode_image_adaptive(pixel_values.to(self.device), op,
                                                                            prompt_ids)
            return feats  # (1, N', D_text)
        self.last_vision_info = None
        return self.model.encode_image(pixel_values.to(self.device))  # (1, N, D_text)

    @torch.inference_mode()
    def encode_vision(self, vision: VisionInput, *, operating_point: OperatingPoint | None = None,
                      prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The family model's ``encode_vision``: ``(N_total, D_text)`` vision tokens (with LLaVA's
        early exit / token pruning when ``operating_point`` asks for them)."""
        op = operating_point
        if op is not None and (op.exit_layer, op.exit_threshold, op.keep_ratio) != (None, None, None):
            return self.encode_image(vision.pixel_values, operating_point=op, prompt_ids=prompt_ids).flatten(0, 1)
        self.last_vision_info = None
        return self.model.encode_vision(vision)  # (N_total, D_text)

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None) -> tuple[torch.Tensor | None, int]:
        return self.model.position_ids(input_ids.to(self.device), vision)

    @torch.inference_mode()
    def classify_image(self, pixel_values: torch.Tensor, block: int | None = None) -> torch.Tensor:
        """Exit-classifier label probabilities ``(1, L)`` (see :meth:`LlavaModel.classify_image`)."""
        return self.model.classify_image(pixel_values.to(self.device), block)

    @property
    def exit_heads(self):
        """The model's :class:`~edgevlm.runtime.exits.ExitHeads` (early exit, labels), or None."""
        return getattr(self.model, "exit_heads", None)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        return self.model.embed(input_ids.to(self.device), image_features)  # (1, T, D_text)

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if embeds.shape[1] > self.max_seq_len:
            raise ValueError(f"prefill of {embeds.shape[1]} positions exceeds the KV cache ({self.max_seq_len})")
        if position_ids is None:
            return self.model.prefill(embeds)  # (1, V)
        return self.model.prefill(embeds, position_ids=position_ids)

    @torch.inference_mode()
    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"decode position {pos} outside the KV cache (0..{self.max_seq_len - 1})")
        kv_len = self.kv_len_for(pos + 1)
        if self.graphs is not None:
            self.graphs.tokens[:1].fill_(token_id)
            self.graphs.positions[:1].fill_(pos)
            self.graphs.rope_offsets[:1].fill_(rope_offset)
            return self.graphs.replay(1, kv_len)  # (1, V), overwritten by the next step
        self._tok.fill_(token_id)
        self._pos.fill_(pos)
        return self.model.language_model.decode_step(self._tok, self._pos, kv_len, rope_offset)  # (1, V)

    # ---- several requests ----------------------------------------------------------------------
    @torch.inference_mode()
    def encode_images(self, pixel_values: list[torch.Tensor]) -> list[torch.Tensor]:
        """Vision-encode several requests' images, one encoder batch per distinct input size:
        ``(1, 3, H_i, W_i)`` float32 each -> ``(1, N_i, D_text)`` each, in the input order."""
        out: list[torch.Tensor | None] = [None] * len(pixel_values)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixel_values):
            by_shape.setdefault(tuple(px.shape[1:]), []).append(i)
        for idx in by_shape.values():
            batch = torch.cat([pixel_values[i] for i in idx]).to(self.device)  # (n, 3, H, W)
            feats = self.model.encode_image(batch)  # (n, N, D)
            for j, i in enumerate(idx):
                out[i] = feats[j : j + 1]
        return out  # type: ignore[return-value]

    @torch.inference_mode()
    def encode_vision_state(self, vision: VisionInput) -> tuple[torch.Tensor, object]:
        """One request's vision for a batched prefill: ``(vision tokens (N, D_text), side state)``,
        the state being the model's :meth:`~edgevlm.runtime.decoder.DecoderVLM.take_vision_state`
        (Qwen3-VL's DeepStack features; None for other families), handed to :meth:`prefill_batch`."""
        self.last_vision_info = None
        feats = self.model.encode_vision(vision)  # (N_total, D_text)
        return feats, self.model.take_vision_state()

    @torch.inference_mode()
    def prefill_batch(self, embeds: list[torch.Tensor], rows: list[int], *,
                      input_ids: list[torch.Tensor] | None = None,
                      position_ids: list[torch.Tensor | None] | None = None,
                      vision_states: list | None = None) -> torch.Tensor:
        """Prefill several prompts ``(1, T_i, D)`` into cache rows ``rows`` (right-padded to the
        longest); returns each prompt's last logits ``(n, V)``. Per prompt, optionally: its ids
        ``(1, T_i)``, its :meth:`position_ids` (M-RoPE ``(3, 1, T_i)`` or None) and its
        :meth:`encode_vision_state` state (see the model's ``prefill_batch``).

        Raises ValueError: counts that disagree, a prompt past the KV cache, rows outside it."""
        if len(embeds) != len(rows) or not embeds:
            raise ValueError(f"{len(embeds)} prompts for {len(rows)} cache rows")
        for name, per_row in (("input_ids", input_ids), ("position_ids", position_ids),
                              ("vision_states", vision_states)):
            if per_row is not None and len(per_row) != len(rows):
                raise ValueError(f"{len(per_row)} {name} for {len(rows)} prompts")
        if vision_states is not None and any(s is not None for s in vision_states) and input_ids is None:
            raise ValueError("vision_states need the prompts' input_ids")
        t = max(e.shape[1] for e in embeds)
        if t > self.max_seq_len:
            raise ValueError(f"prefill of {t} positions exceeds the KV cache ({self.max_seq_len})")
        if max(rows) >= self.max_batch_size or min(rows) < 0:
            raise ValueError(f"cache rows {rows} outside 0..{self.max_batch_size - 1}")
        return self.model.prefill_batch(embeds, torch.tensor(rows, device=self.device), input_ids=input_ids,
                                        position_ids=position_ids, vision_states=vision_states)

    @torch.inference_mode()
    def decode_batch(self, token_ids: list[int], positions: list[int],
                     rope_offsets: list[int] | None = None) -> torch.Tensor:
        """One decode step for cache rows ``0..n-1``: row ``i`` feeds ``token_ids[i]`` at
        ``positions[i]`` (RoPE position ``positions[i] + rope_offsets[i]``, M-RoPE). Rows from
        ``n`` up to the captured batch size must be free (they compute
        garbage at position 0). Returns logits ``(n, V)``; with CUDA graphs a static tensor that
        the next step overwrites."""
        n = len(token_ids)
        if n != len(positions) or not 1 <= n <= self.max_batch_size:
            raise ValueError(f"decode_batch: {n} tokens, {len(positions)} positions, "
                             f"cache of {self.max_batch_size} rows")
        if max(positions) >= self.max_seq_len or min(positions) < 0:
            raise ValueError(f"decode positions {positions} outside the KV cache (0..{self.max_seq_len - 1})")
        kv_len = self.kv_len_for(max(positions) + 1)
        if self.graphs is None:
            tok = torch.tensor(token_ids, device=self.device)[:, None]
            pos = torch.tensor(positions, device=self.device)
            off = torch.tensor(rope_offsets, device=self.device) if rope_offsets and any(rope_offsets) else 0
            return self.model.language_model.decode_step(tok, pos, kv_len, off)
        from edgevlm.runtime.cuda_graphs import graph_batch_size

        b = graph_batch_size(n, self.max_batch_size)
        tok = torch.zeros(b, dtype=torch.long)
        pos = torch.zeros(b, dtype=torch.long)
        tok[:n] = torch.tensor(token_ids)
        pos[:n] = torch.tensor(positions)
        self.graphs.tokens[:b, 0].copy_(tok, non_blocking=True)
        self.graphs.positions[:b].copy_(pos, non_blocking=True)
        off = torch.zeros(b, dtype=torch.long)
        if rope_offsets:
            off[:n] = torch.tensor(rope_offsets)
        self.graphs.rope_offsets[:b].copy_(off, non_blocking=True)
        return self.graphs.replay(b, kv_len)[:n]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def load(files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_seq_len: int,
         **options) -> TorchBackend:
    """Load ``files`` onto ``device`` in ``dtype`` with a KV cache of ``max_seq_len`` positions;
    ``options`` are :class:`TorchBackend`'s keyword arguments."""
    max_batch_size = options.get("max_batch_size", 1)
    if isinstance(max_batch_size, bool) or not isinstance(max_batch_size, int) or max_batch_size < 1:
        raise InvalidRequestError(f"max_batch_size must be a positive integer, got {max_batch_size!r}")
    unknown = set(options) - {"cuda_graphs", "kv_cache_dtype", "max_batch_size", "fused_vision_stem",
                              "min_kv_bucket", "kv_int4_group_size", "fuse_projections", "fused_decode",
                              "int4_kernel"}
    if unknown:
        raise InvalidRequestError(f"unknown torch backend option(s): {', '.join(sorted(unknown))}")
    model = load_model(files, device=device, dtype=dtype, max_seq_len=max_seq_len, max_batch_size=max_batch_size)
    if files.family.adaptive_vision:
        from edgevlm.runtime.exits import load_exit_heads  # exits.json/.safetensors of `edgevlm calibrate`

        model.attach_exit_heads(load_exit_heads(files.model_dir, files.config, device=device, dtype=dtype))
    return TorchBackend(model, **options)
