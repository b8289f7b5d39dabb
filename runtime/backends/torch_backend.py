"""PyTorch backend: any registered model family's model (:mod:`edgevlm.runtime.models`; early exit
and pruning through the model's ``encode_vision_adaptive`` for families with ``adaptive_vision``) on CPU fp32/bf16
or CUDA fp16/bf16, with
its static KV cache, CUDA-graph decode, a choice of KV cache precision, and batched entry points
for several concurrent requests (used by :mod:`edgevlm.runtime.batching`).

Options (``load(..., **options)`` / :class:`TorchBackend` keyword arguments; profile keys of the
cloud profiles):

* ``cuda_graphs`` (default: True on CUDA): decode steps replay CUDA graphs
  (:mod:`edgevlm.runtime.cuda_graphs`), and so does the vision tower of families that offer it
  (``enable_vision_graphs``, :mod:`edgevlm.runtime.vision_graphs`) and LLaVA's tower (one graph per
  input size and batch bucket); a prefill replays one per rows and length bucket
  (:mod:`edgevlm.runtime.prefill_graphs`) for every family, a single request's and the batched
  rows' alike, the family's hooks (M-RoPE tables, Qwen3-VL's DeepStack, Gemma 3's image blocks,
  pruned LLaVA tokens' positions: ``DecoderVLM.prefill_inputs`` / ``prefill_batch_inputs``) as
  graph inputs. Ignored on CPU (eager). A 7B prefill launched eagerly is bound by the host's kernel launches; replayed,
  by the GPU (``bench/ttft_breakdown.py``).
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
  SiLU x up — for W4A16 gate/up projections in the matmul's epilogue up to ``w4a16_mma.GATED_MAX_M`` rows), for
  16-bit KV caches.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from edgevlm.errors import InvalidRequestError, ModelLoadError
from edgevlm.runtime.backends import Backend, check_decode_span
from edgevlm.runtime.kv_cache import DEFAULT_INT4_GROUP_SIZE, KV_CACHE_DTYPES, kv_bucket
from edgevlm.runtime.loader import ModelFiles, load_model
from edgevlm.runtime.models.base import VisionInput
from edgevlm.runtime.preprocess import pixel_norm
from edgevlm.types import OperatingPoint

logger = logging.getLogger(__name__)


class TorchBackend(Backend):
    """Runs the model with plain PyTorch modules (SDPA attention).

    Raises:
        InvalidRequestError: a bad option value.
        ModelLoadError: ``fused_vision_stem`` asked for where triton or CUDA is missing.
    """

    name = "torch"
    #: a parked row (no request) is fed on from slot 0 by the feeding steps and parked again at this slot:
    #: its garbage attention stays a few keys long, and the host writes it once per this many steps
    PARKED_SLOTS = 32
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
            if hasattr(model, "enable_vision_graphs"):  # the tower per input geometry (Qwen2.5-VL, Qwen3-VL)
                model.enable_vision_graphs()
        if fused_vision_stem:
            self.enable_fused_vision_stem()
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)  # eager decode input buffers
        # encode_images' pinned host staging per image shape, with the event of its last copy to the device
        self._pinned: dict[tuple, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self._prefill_graphs = None  # PrefillGraphs of every prefill (CUDA graphs on), made on first use
        self._vision_forwards: dict = {}  # normalisation (None: float pixels) -> the batched encode's forward
        self._vision_graphs: dict = {}  # normalisation -> VisionGraphs of that forward (CUDA graphs on)
        self._no_grid = torch.zeros((1, 3), dtype=torch.long)  # VisionGraphs' grid key: LLaVA has none
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)
        # greedy_step's device-resident inputs (the graphs' buffers with CUDA graphs): rows fed by the last
        # feeding step (0: another writer ran since), and the host's copy of every row's next slot
        rows = self.max_batch_size
        self._feed_buffers = (self.graphs.tokens, self.graphs.positions, self.graphs.rope_offsets) \
            if self.graphs is not None else tuple(torch.zeros(*shape, dtype=torch.long, device=self.device)
                                                  for shape in ((rows, 1), (rows,), (rows,)))
        self._fed_rows = 0
        self._fed_slots = [0] * rows
        self._parked = set(range(rows))  # rows holding no request (fed on from slot 0 up to PARKED_SLOTS)
        self._single_meta = torch.zeros(2, 1, dtype=torch.long, device=self.device)  # a single prefill's length, row

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
        if self.graphs is not None and pixel_values.dtype != torch.uint8:
            return self._encode_batch(list(pixel_values.split(1)), None)  # (N_img, N, D_text), graph replays
        return self.model.encode_image(pixel_values.to(self.device))  # (1, N, D_text)

    vision_trunks = True
    """:meth:`encode_vision` takes a ``trunk`` (:class:`~edgevlm.runtime.vision_cache.VisionTrunk`)."""

    @torch.inference_mode()
    def encode_vision(self, vision: VisionInput, *, operating_point: OperatingPoint | None = None,
                      prompt_ids: torch.Tensor | None = None, trunk: Any = None) -> torch.Tensor:
        """The family model's ``encode_vision``: ``(N_total, D_text)`` vision tokens (with its
        ``encode_vision_adaptive``, early exit / token pruning, when ``operating_point`` asks for
        them; ``prompt_ids`` ``(1, T)`` for question-conditioned exit confidence heads; ``trunk``:
        the frame's kept encoder walk for an early exit, see :mod:`edgevlm.runtime.vision_cache`)."""
        op = operating_point
        if op is not None and (op.exit_layer, op.exit_threshold, op.keep_ratio) != (None, None, None):
            feats, self.last_vision_info = self.model.encode_vision_adaptive(vision, op, prompt_ids, trunk)
            return feats  # (N', D_text)
        self.last_vision_info = None
        if self.graphs is not None and self._pixel_tower(vision):  # LLaVA's tower: graph replays
            return self.encode_image(vision.pixel_values).flatten(0, 1)  # as LlavaModel.encode_vision
        return self.model.encode_vision(vision)  # (N_total, D_text)

    def _pixel_tower(self, vision: VisionInput) -> bool:
        """Whether ``vision`` is float images for LLaVA's pixel path (the model's ``encode_image`` of
        ``(B, 3, H, W)``, which :meth:`encode_images` batches); other families encode their
        ``VisionInput`` themselves."""
        return (callable(getattr(self.model, "encode_image", None)) and bool(vision.kinds)
                and all(k == "image" for k in vision.kinds) and vision.pixel_values.dim() == 4
                and vision.pixel_values.dtype != torch.uint8)

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None, *,
                     kept_index: list[int] | None = None) -> tuple[torch.Tensor | None, int]:
        """See :meth:`Backend.position_ids`. A pruned multimodal-RoPE prompt (``kept_index`` given and
        fewer vision tokens in ``input_ids`` than ``vision`` has): the positions of the unpruned
        prompt, of which every kept token keeps its own ``(t, h, w)``
        (:func:`edgevlm.runtime.pruning.pruned_position_ids`). 1-D RoPE families return ``(None, 0)``
        (SmolVLM: consecutive slots; LLaVA places its pruned tokens itself in prefill)."""
        input_ids = input_ids.to(self.device)
        if kept_index is None or vision is None or vision.grid_thw is None or len(kept_index) >= vision.num_tokens:
            return self.model.position_ids(input_ids, vision)
        from edgevlm.runtime.pruning import expand_vision_run, pruned_position_ids

        cfg = self.model.cfg
        vision_ids = {cfg.image_token_id} | ({cfg.video_token_id} if cfg.video_token_id is not None else set())
        full_ids, start, _ = expand_vision_run(input_ids[0].tolist(), vision_ids, vision.num_tokens)
        full, _ = self.model.position_ids(torch.tensor([full_ids], dtype=torch.long, device=self.device), vision)
        if full is None:  # no multimodal RoPE after all
            return None, 0
        return pruned_position_ids(full, start, vision.num_tokens, kept_index)

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
        """See :meth:`Backend.prefill`: ``embeds`` ``(1, T, D)`` (the model's last ``embed``) from slot 0
        with the family's ``position_ids`` -> the last logits ``(1, V)``. With ``cuda_graphs`` a
        replay of the prefill graph of one row for every family (:meth:`_replay_prefill`).

        Raises ValueError: a prompt past the KV cache, or what the model's ``prefill`` refuses."""
        if embeds.shape[1] > self.max_seq_len:
            raise ValueError(f"prefill of {embeds.shape[1]} positions exceeds the KV cache ({self.max_seq_len})")
        graphs = self._prefill_graphs_for_device()
        prefill_inputs = getattr(self.model, "prefill_inputs", None)
        if graphs is not None and prefill_inputs is not None and embeds.shape[0] == 1:
            # the family's hooks of this prefill (its pending side state handed over, as its prefill does)
            hooks = prefill_inputs(embeds, position_ids)
            meta = self._single_meta
            meta[0].fill_(embeds.shape[1])  # lengths (1,); rows (1,) = 0
            return self._replay_prefill(graphs, embeds, meta[0], meta[1], hooks)  # (1, V)
        if position_ids is None:
            return self.model.prefill(embeds)  # (1, V)
        return self.model.prefill(embeds, position_ids=position_ids)

    def _replay_prefill(self, graphs, embeds: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor, hooks: dict,
                        spare_rows: list[int] | None = None) -> torch.Tensor:
        """``Decoder.prefill_batch(embeds (n, T, D), lengths (n,), rows (n,), **hooks)`` (the
        family's ``prefill_inputs`` / ``prefill_batch_inputs``) as a replay of ``graphs``: padded to
        the rows and length buckets (:func:`~edgevlm.runtime.prefill_graphs.pad_prefill`; padding
        rows go to ``spare_rows``, cache rows holding no request, else repeat the last prompt into
        its own row) -> the last logits ``(n, V)``. ``rows`` may be on the device (n = 1 needs no
        padding row); with padding rows it is read on the host."""
        from edgevlm.runtime.prefill_graphs import length_bucket, pad_prefill, padding_rows, rows_bucket

        n, t = embeds.shape[:2]
        pad_rows = rows_bucket(n) - n
        extra = padding_rows(rows.tolist(), spare_rows, pad_rows) if pad_rows else []
        embeds, lengths, rows, hooks = pad_prefill(embeds, lengths, rows, hooks, length_bucket(t, self.max_seq_len),
                                                   extra)
        return graphs(embeds, lengths, rows, **hooks)[:n]

    @torch.inference_mode()
    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"decode position {pos} outside the KV cache (0..{self.max_seq_len - 1})")
        kv_len = self.kv_len_for(pos + 1)
        self._fed_rows = 0  # the greedy steps' rows were fed by the host since
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
    def encode_images(self, pixel_values: list[torch.Tensor], *,
                      normalize: tuple[Sequence[float], Sequence[float]] | None = None) -> list[torch.Tensor]:
        """Vision-encode several requests' images, one encoder batch per distinct input size:
        ``(1, 3, H_i, W_i)`` float32 normalised each, or with ``normalize=(mean, std)`` (per channel,
        0..1 scale) ``(1, H_i, W_i, 3)`` uint8 resized images, normalised here on the device as
        :func:`~edgevlm.runtime.preprocess.preprocess` does on the host (``(x / 255 - mean) / std``
        in float32) -> ``(1, N_i, D_text)`` each, in the input order.

        On CUDA a batch is gathered in a pinned host buffer and copied asynchronously; with
        ``cuda_graphs`` the LLaVA tower's forward (the normalisation included) replays a CUDA graph
        per input size and batch bucket (1, 2, 4, ... rows; rows past the batch are don't-care): a
        launch-bound tower (the demo's) costs one replay instead of a launch per kernel.

        Raises ValueError: uint8 pixels without ``normalize``, float pixels with it, or a ``normalize``
        that is not three means and three positive stds (:func:`~edgevlm.runtime.preprocess.pixel_norm`)."""
        uint8 = [px.dtype == torch.uint8 for px in pixel_values]
        if any(u != (normalize is not None) for u in uint8):
            raise ValueError("encode_images: uint8 pixels need normalize=(mean, std), float pixels none")
        if normalize is not None:  # tuples of floats: the key of the cached forward / graphs (lists would not hash)
            normalize = pixel_norm(normalize)
        out: list[torch.Tensor | None] = [None] * len(pixel_values)
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for i, px in enumerate(pixel_values):
            by_shape.setdefault(tuple(px.shape[1:]), []).append(i)
        for idx in by_shape.values():
            feats = self._encode_batch([pixel_values[i] for i in idx], normalize)  # (n, N, D)
            for j, i in enumerate(idx):
                out[i] = feats[j : j + 1]
        return out  # type: ignore[return-value]

    def _encode_batch(self, pixels: list[torch.Tensor], normalize) -> torch.Tensor:
        """``n`` images of one size and dtype (see :meth:`encode_images`) -> ``(n, N, D_text)``."""
        n = len(pixels)
        forward = self._vision_forwards.get(normalize)
        if forward is None:
            forward = self._vision_forwards[normalize] = self._vision_forward(normalize)
        if self.device.type != "cuda":
            return forward(torch.cat(pixels).to(self.device), None)
        bucket = n if self.graphs is None else 1 << (n - 1).bit_length()
        if pixels[0].device.type == "cuda":  # already on the device (rows past n are don't-care)
            batch = torch.cat(pixels if bucket == n else [*pixels, pixels[-1].expand(bucket - n, *pixels[-1].shape[1:])])
        else:
            key = (pixels[0].dtype, *pixels[0].shape[1:])
            staging, copied = self._pinned.get(key, (None, None))
            if staging is None or staging.shape[0] < bucket:
                staging = torch.empty((max(bucket, self.max_batch_size), *pixels[0].shape[1:]),
                                      dtype=pixels[0].dtype, pin_memory=True)
            elif copied is not None:
                copied.synchronize()  # the previous copy out of this buffer (usually long done)
            torch.cat(pixels, out=staging[:n])
            batch = staging[:bucket].to(self.device, non_blocking=True)  # (bucket, ...)
            copied = torch.cuda.Event()
            copied.record()
            self._pinned[key] = (staging, copied)
        if self.graphs is None:
            return forward(batch, None)[:n]
        graphs = self._vision_graphs.get(normalize)
        if graphs is None:
            from edgevlm.runtime.vision_graphs import VisionGraphs

            # the sizes of a resolution ladder x the batch buckets (graphs share one memory pool)
            graphs = VisionGraphs(forward, self.device, max_graphs=4 + 2 * max(1, self.max_batch_size).bit_length())
            self._vision_graphs[normalize] = graphs
        return graphs(batch, self._no_grid)[:n]

    def _vision_forward(self, normalize):
        """``(pixels, _) -> (B, N, D_text)``: the model's ``encode_image``, after the device-side
        normalisation of ``(B, H, W, 3)`` uint8 pixels when ``normalize`` is given."""
        if normalize is None:
            return lambda px, _grid: self.model.encode_image(px)
        mean = torch.tensor(normalize[0], dtype=torch.float32, device=self.device).view(1, 3, 1, 1)
        std = torch.tensor(normalize[1], dtype=torch.float32, device=self.device).view(1, 3, 1, 1)

        def forward(px: torch.Tensor, _grid) -> torch.Tensor:
            x = px.permute(0, 3, 1, 2).float() * (1.0 / 255.0)  # (B, 3, H, W), preprocess's order of operations
            return self.model.encode_image((x - mean) / std)

        return forward

    @torch.inference_mode()
    def encode_vision_state(self, vision: VisionInput) -> tuple[torch.Tensor, object]:
        """One request's vision for a batched prefill: ``(vision tokens (N, D_text), side state)``,
        the state being the model's :meth:`~edgevlm.runtime.decoder.DecoderVLM.take_vision_state`
        (Qwen3-VL's DeepStack features; None for other families), handed to :meth:`prefill_batch`."""
        self.last_vision_info = None
        feats = self.model.encode_vision(vision)  # (N_total, D_text)
        return feats, self.model.take_vision_state()

    def take_vision_state(self) -> object:
        """The side state of the last encode (e.g. after an adaptive :meth:`encode_image`: LLaVA's
        pruned-token positions), handed over for :meth:`prefill_batch`; None when there is none."""
        return self.model.take_vision_state()

    @torch.inference_mode()
    def prefill_batch(self, embeds: list[torch.Tensor], rows: list[int], *,
                      input_ids: list[torch.Tensor] | None = None,
                      position_ids: list[torch.Tensor | None] | None = None,
                      vision_states: list | None = None, spare_rows: list[int] | None = None) -> torch.Tensor:
        """Prefill several prompts ``(1, T_i, D)`` into cache rows ``rows`` (right-padded to the
        longest); returns each prompt's last logits ``(n, V)``. Per prompt, optionally: its ids
        ``(1, T_i)``, its :meth:`position_ids` (M-RoPE ``(3, 1, T_i)`` or None) and its
        :meth:`encode_vision_state` state (see the model's ``prefill_batch``). With ``cuda_graphs``
        a replay of the prefill graph of the rows and length buckets (every family: the model's
        ``prefill_batch_inputs`` as graph inputs); ``spare_rows``: cache rows holding no request,
        which the bucket's padding rows may fill (else they repeat the last prompt into its row).

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
        rows_dev = torch.tensor(rows, device=self.device)
        graphs = self._prefill_graphs_for_device()
        if graphs is None or not hasattr(self.model, "prefill_batch_inputs"):
            return self.model.prefill_batch(embeds, rows_dev, input_ids=input_ids, position_ids=position_ids,
                                            vision_states=vision_states)
        x, lengths, rows_dev, hooks = self.model.prefill_batch_inputs(
            embeds, rows_dev, input_ids=input_ids, position_ids=position_ids, vision_states=vision_states)
        return self._replay_prefill(graphs, x, lengths, rows_dev, hooks, spare_rows)  # (n, V)

    @torch.inference_mode()
    def prefill_images_batch(self, input_ids: list[list[int]], image_features: list[torch.Tensor],
                             rows: list[int], spare_rows: list[int] | None = None) -> torch.Tensor:
        """Prefill several image prompts of a family whose placeholders take the image features in
        order (LLaVA's ``embed``) with one embedding and one prefill call: ``input_ids[i]`` (vision
        placeholders included) with its image's ``(1, N_i, D_text)`` features, into cache row
        ``rows[i]``. Returns each prompt's last logits ``(n, V)``: the numbers of
        :meth:`prefill_batch` (the same right-padded prefill, embedded once for the whole group).

        With ``cuda_graphs`` the prefill replays a CUDA graph per rows and length bucket
        (:mod:`edgevlm.runtime.prefill_graphs`); ``spare_rows`` are cache rows holding no request,
        which the bucket's padding rows may fill (else they repeat the group's last prompt into its
        row).

        Raises ValueError: counts that disagree, a prompt past the KV cache, rows outside it."""
        import numpy as np

        n = len(input_ids)
        if not n or n != len(rows) or n != len(image_features):
            raise ValueError(f"{n} prompts, {len(image_features)} images for {len(rows)} cache rows")
        lengths = [len(ids) for ids in input_ids]
        t = max(lengths)
        if t > self.max_seq_len:
            raise ValueError(f"prefill of {t} positions exceeds the KV cache ({self.max_seq_len})")
        if max(rows) >= self.max_batch_size or min(rows) < 0:
            raise ValueError(f"cache rows {rows} outside 0..{self.max_batch_size - 1}")
        graphs = self._prefill_graphs_for_device()
        feats = [f.reshape(-1, f.shape[-1]) for f in image_features]  # (N_i, D_text) each
        if graphs is not None:
            from edgevlm.runtime.prefill_graphs import length_bucket, padding_rows, rows_bucket

            pad_rows = rows_bucket(n) - n
            rows = list(rows) + padding_rows(list(rows), spare_rows, pad_rows)
            input_ids = list(input_ids) + [input_ids[-1]] * pad_rows
            lengths = lengths + [lengths[-1]] * pad_rows
            feats = feats + [feats[-1]] * pad_rows
            t = length_bucket(t, self.max_seq_len)
        image_token = self.model.cfg.image_token_id
        pad = 0 if image_token != 0 else 1  # padding must not read as a placeholder
        host = np.full((len(input_ids), t), pad, dtype=np.int64)
        for i, ids in enumerate(input_ids):
            host[i, : lengths[i]] = ids
        m = len(rows)
        meta = np.concatenate([np.asarray(lengths, np.int64), np.asarray(rows, np.int64)])
        pinned = self.device.type == "cuda"
        ids_dev = torch.from_numpy(host)
        meta_dev = torch.from_numpy(meta)
        if pinned:
            ids_dev, meta_dev = ids_dev.pin_memory(), meta_dev.pin_memory()
        ids_dev = ids_dev.to(self.device, non_blocking=pinned)  # (m, T)
        meta_dev = meta_dev.to(self.device, non_blocking=pinned)
        embeds = self.model.embed(ids_dev, torch.cat(feats))  # (m, T, D); the features in row order
        if graphs is not None:
            return graphs(embeds, meta_dev[:m], meta_dev[m:])[:n]  # (n, V)
        return self.model.language_model.prefill_batch(embeds, meta_dev[:m], meta_dev[m:])  # (n, V)

    def _prefill_graphs_for_device(self):
        """The :class:`~edgevlm.runtime.prefill_graphs.PrefillGraphs` of every prefill (:meth:`prefill`,
        :meth:`prefill_batch`, :meth:`prefill_images_batch`; CUDA graphs on), made on first use;
        None = eager."""
        if self.graphs is None:
            return None
        if self._prefill_graphs is None:
            from edgevlm.runtime.prefill_graphs import PrefillGraphs

            self._prefill_graphs = PrefillGraphs(self.model.language_model.prefill_batch, self.device)
        return self._prefill_graphs

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
        self._fed_rows = 0  # the greedy steps' rows were fed by the host since
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

    # ---- greedy decoding with the inputs kept on the device ------------------------------------
    @torch.inference_mode()
    def greedy_step(self, n: int, new_inputs: dict[int, tuple[int, int, int] | None] | None = None
                    ) -> PendingTokens:
        """Queue one greedy decode step of cache rows ``0..n-1`` whose next inputs stay on the device.

        Rows in ``new_inputs`` (``row -> (token_id, slot, rope_offset)``) feed what the host gives; a
        row mapped to None holds no request from now on (it is parked). Every other row that the
        previous call fed with a request (no :meth:`decode` / :meth:`decode_batch` since) feeds its
        greedy token of that step at its slot + 1, written by the step itself on the device
        (:func:`~edgevlm.runtime.sampling.greedy_feed`; with CUDA graphs a feeding graph per
        ``(batch, kv_len)``, :mod:`edgevlm.runtime.cuda_graphs`). Any other row, and the graph's
        padding rows past ``n``, hold no request and are parked: fed from slot 0 and parked again
        at :attr:`PARKED_SLOTS` (garbage over at most that many keys, as :meth:`decode_batch`'s free
        rows compute at slot 0; never fed on behind the live rows, whose attention length it would cost).
        Nothing waits for the device: the caller queues step ``k + 1`` and only then reads step
        ``k``'s tokens (:meth:`PendingTokens.tokens`), so the host's per-token work overlaps the GPU.
        A row the caller keeps feeding must stay inside the cache (the caller's token budget does
        that); a row fed past the last slot is parked instead.

        Returns the step's greedy tokens of rows ``0..n-1`` as :class:`PendingTokens`. Raises
        ``ValueError`` for ``n`` outside ``1..max_batch_size`` or a row/slot outside the cache."""
        tokens, positions, offsets = self._feed_buffers
        new_inputs = new_inputs or {}
        if not 1 <= n <= self.max_batch_size:
            raise ValueError(f"greedy_step: {n} rows, cache of {self.max_batch_size} rows")
        for row, given in new_inputs.items():
            if not (0 <= row < n and (given is None or 0 <= given[1] < self.max_seq_len)):
                slot = None if given is None else given[1]
                raise ValueError(f"greedy_step: row {row} slot {slot} outside {n} rows x {self.max_seq_len} slots")
        if self.graphs is not None:
            from edgevlm.runtime.cuda_graphs import graph_batch_size

            b = graph_batch_size(n, self.max_batch_size)
        else:
            b = n
        slots, parked = self._fed_slots, self._parked
        writes = {}
        for row in range(b):  # rows past n: the graph's padding, no request
            given = new_inputs.get(row, ())
            if given:
                writes[row] = given
                parked.discard(row)
                continue
            was_parked = row in parked
            if given is None or row >= n or row >= self._fed_rows or slots[row] >= self.max_seq_len:
                parked.add(row)  # no request (or one fed to the cache's end)
            if row in parked and (not was_parked or row >= self._fed_rows
                                  or slots[row] >= min(self.PARKED_SLOTS, self.max_seq_len)):
                writes[row] = (0, 0, 0)  # (again) at slot 0
        if writes:
            self._write_feed_rows(writes, b)
        for row, (_, slot, _) in writes.items():
            slots[row] = slot
        kv_len = self.kv_len_for(max(slots[:b]) + 1)
        if self.graphs is not None:
            self.graphs.replay(b, kv_len, feed=True)
        else:
            from edgevlm.runtime.cuda_graphs import decode_step_from

            decode_step_from(self.model.language_model, tokens, positions, offsets, b, kv_len, feed=True)
        for row in range(b):
            slots[row] += 1
        self._fed_rows = b
        return PendingTokens(tokens[:n, 0], self.device)

    def _write_feed_rows(self, writes: dict[int, tuple[int, int, int]], b: int) -> None:
        """Write ``row -> (token, slot, rope_offset)`` into rows ``0..b-1`` of the feed buffers, the
        other rows kept: one copy from pinned host memory (no wait for the queued steps) and a select."""
        tokens, positions, offsets = self._feed_buffers
        cuda = self.device.type == "cuda"
        vals = [[0] * b for _ in range(4)]  # token, slot, offset, written
        for row, (tok, slot, off) in writes.items():
            vals[0][row], vals[1][row], vals[2][row], vals[3][row] = tok, slot, off, 1
        stage = torch.tensor(vals, dtype=torch.long)
        dev = (stage.pin_memory() if cuda else stage).to(self.device, non_blocking=True)
        keep = dev[3] == 0
        tokens[:b, 0] = torch.where(keep, tokens[:b, 0], dev[0])
        positions[:b] = torch.where(keep, positions[:b], dev[1])
        offsets[:b] = torch.where(keep, offsets[:b], dev[2])

    def greedy_tokens(self, token_id: int, pos: int, max_tokens: int, *,
                      operating_point: OperatingPoint | None = None, rope_offset: int = 0):
        """:meth:`Backend.greedy_tokens` over :meth:`greedy_step` (row 0): step ``k + 1`` is queued
        before token ``k`` is read, so a consumer that stops at token ``k`` leaves one step computed
        for nothing (its KV write lands past the answer's last slot, where the next prompt's
        prefill or decode overwrites it before any read)."""
        check_decode_span(pos, max_tokens, self.max_seq_len)
        if max_tokens < 1:
            return
        pending = self.greedy_step(1, {0: (token_id, pos, rope_offset)})
        for _ in range(max_tokens - 1):
            queued = self.greedy_step(1)
            yield pending.tokens()[0]
            pending = queued
        yield pending.tokens()[0]

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


class PendingTokens:
    """The greedy tokens of one queued decode step (:meth:`TorchBackend.greedy_step`): copied to
    pinned host memory behind the step on its stream; :meth:`tokens` waits for that copy only."""

    def __init__(self, tokens: torch.Tensor, device: torch.device) -> None:
        if device.type == "cuda":
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host, self._event = tokens.clone(), None

    def tokens(self) -> list[int]:
        """The step's token ids, row by row (blocks until the step and its copy are done)."""
        if self._event is not None:
            self._event.synchronize()
        return self._host.tolist()


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
