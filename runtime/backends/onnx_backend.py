"""onnxruntime backend: runs an engine bundle's ``onnx/vision.onnx`` and ``onnx/decoder.onnx``
(written by ``edgevlm quantize``, see :mod:`edgevlm.quantize.onnx_export` and
:mod:`edgevlm.quantize.onnx_vision_export` for the graph contracts).

LLaVA bundles run on :class:`OnnxBackend`; the other families' bundles on
:class:`OnnxFamilyBackend` (the vision graph through
:class:`~edgevlm.runtime.backends.onnx_vision.VisionGraph` with host-side feeds for the request's grid,
M-RoPE ``position_ids (3, 1, T)``, Qwen3-VL's DeepStack features as the decoder's ``layer_add`` inputs,
Gemma 3's ``image_blocks`` and its scaled token embeddings).
Both keep the decoder's KV cache in :class:`DecoderSession`.

Execution providers: CPU here; on ``device="cuda"`` the TensorRT and CUDA providers are put first
when this onnxruntime build has them. The vision graphs have dynamic shapes, so every rung of
the resolution ladder runs without reloading. The KV cache is the decoder's ``present.*`` outputs
fed back as ``past.*`` (numpy arrays growing by one position per decode step); :meth:`prefill`
starts a new sequence. Token embeddings are looked up on the host from the bundle's
``embed_tokens`` tensor. Logits and features come back as float32 CPU torch tensors.

Needs ``pip install 'edgevlm[onnx]'`` (onnxruntime).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort
import torch

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.backends import Backend
from edgevlm.runtime.bundle import is_bundle, verify_bundle
from edgevlm.runtime.loader import ModelFiles, canonical_key
from edgevlm.types import OperatingPoint

if TYPE_CHECKING:
    from edgevlm.runtime.models.base import VisionInput

logger = logging.getLogger(__name__)

ONNX_DIR = "onnx"


def providers_for(device: torch.device) -> list[str]:
    """onnxruntime execution providers for ``device``, best first, among those available."""
    available = ort.get_available_providers()
    wanted = ["CPUExecutionProvider"]
    if device.type == "cuda":
        wanted = ["TensorrtExecutionProvider", "CUDAExecutionProvider"] + wanted
    return [p for p in wanted if p in available]


def _embedding_table(files: ModelFiles) -> np.ndarray:
    from safetensors import safe_open

    for path in files.weight_files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():
                if canonical_key(key, files) == "language_model.embed_tokens.weight":
                    return f.get_tensor(key).float().numpy()
    raise ModelLoadError(f"bundle {files.model_dir} has no token embedding tensor")


def _session(path: Path, providers: list[str]) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(path), opts, providers=providers)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise ModelLoadError(f"onnxruntime cannot load {path}: {exc}") from exc


class DecoderSession:
    """``onnx/decoder.onnx`` with its KV cache: the ``present.*`` outputs of a call are the next
    call's ``past.*`` inputs (numpy arrays, batch 1). ``max_seq_len`` bounds the cached positions."""

    def __init__(self, path: Path, providers: list[str], text_cfg, max_seq_len: int) -> None:
        self.session = _session(path, providers)
        self.n_layers, self.n_kv, self.head_dim = (text_cfg.num_hidden_layers, text_cfg.num_key_value_heads,
                                                   text_cfg.head_dim)
        self.hidden_size = text_cfg.hidden_size
        self.max_seq_len = max_seq_len
        self.output_names = [o.name for o in self.session.get_outputs()]
        self.n_layer_adds = sum(i.name.startswith("layer_add.") for i in self.session.get_inputs())
        self.takes_image_blocks = any(i.name == "image_blocks" for i in self.session.get_inputs())  # Gemma 3
        self._past: dict[str, np.ndarray] = {}
        self.length = 0

    def run(self, embeds: np.ndarray, position_ids: np.ndarray, start: int,
            layer_adds: list[np.ndarray] | None = None, image_blocks: np.ndarray | None = None) -> torch.Tensor:
        """``embeds`` ``(1, T, D)`` float32 at slots ``start .. start+T-1`` (the cache is cut to
        ``start`` first) with the graph's ``position_ids``, ``layer_add.{i}`` (zeros when None) and
        Gemma 3's ``image_blocks`` ``(1, T)`` int64 (-1 everywhere when None) -> logits ``(1, V)`` float32."""
        t = embeds.shape[1]
        feeds = {"inputs_embeds": embeds, "position_ids": position_ids}
        empty = np.zeros((1, self.n_kv, 0, self.head_dim), np.float32)
        for i in range(self.n_layers):
            for kv in ("key", "value"):
                past = self._past.get(f"present.{i}.{kv}") if start else None
                feeds[f"past.{i}.{kv}"] = empty if past is None else past[:, :, :start]
        zeros = np.zeros((1, t, self.hidden_size), np.float32)
        for i in range(self.n_layer_adds):
            feeds[f"layer_add.{i}"] = zeros if layer_adds is None else layer_adds[i]
        if self.takes_image_blocks:
            feeds["image_blocks"] = np.full((1, t), -1, np.int64) if image_blocks is None else image_blocks
        outs = dict(zip(self.output_names, self.session.run(self.output_names, feeds), strict=True))
        self._past = {k: v for k, v in outs.items() if k.startswith("present.")}
        self.length = start + t
        return torch.from_numpy(outs["logits"])  # (1, V)

    def check_prefill(self, n_positions: int) -> None:
        if n_positions > self.max_seq_len:
            raise ValueError(f"prefill of {n_positions} positions exceeds the KV cache ({self.max_seq_len})")

    def check_decode(self, pos: int) -> None:
        """A decode step at slot ``pos`` continues or rewinds the cached sequence (ValueError otherwise)."""
        if not 0 < pos < self.max_seq_len:
            raise ValueError(f"decode position {pos} outside the KV cache (1..{self.max_seq_len - 1})")
        if pos > self.length:
            raise ValueError(f"decode position {pos} skips past the cached sequence of {self.length} positions")

    def reset(self) -> None:
        self._past, self.length = {}, 0


class OnnxBackend(Backend):
    """LLaVA on onnxruntime sessions (batch size 1, float32 activations)."""

    name = "onnx"

    def __init__(self, files: ModelFiles, *, device: torch.device, max_seq_len: int) -> None:
        root = Path(files.model_dir)
        _check_bundle(root, ("vision.onnx", "decoder.onnx"))
        self.device = torch.device("cpu") if device.type == "cpu" else device
        self.dtype = torch.float32
        self.providers = providers_for(device)
        self.vision = _session(root / ONNX_DIR / "vision.onnx", self.providers)
        self.decoder = DecoderSession(root / ONNX_DIR / "decoder.onnx", self.providers, files.config.text,
                                      max_seq_len)
        self.image_token_id = files.config.image_token_id
        self.embed_tokens = _embedding_table(files)  # (V, D) float32
        logger.info("onnx backend: %s with %s", root / ONNX_DIR, ", ".join(self.providers))

    @property
    def max_seq_len(self) -> int:
        return self.decoder.max_seq_len

    def encode_image(self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None
                     ) -> torch.Tensor:
        x = pixel_values.detach().to("cpu", torch.float32).contiguous().numpy()  # (1, 3, H, W)
        (feats,) = self.vision.run(["image_features"], {"pixel_values": x})
        return torch.from_numpy(feats)  # (1, N, D_text)

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        ids = input_ids.detach().cpu()
        embeds = torch.from_numpy(self.embed_tokens[ids.numpy()])  # (1, T, D)
        if image_features is None:
            return embeds
        is_image = (ids == self.image_token_id)[..., None]
        if int(is_image.sum()) * embeds.shape[-1] != image_features.numel():
            raise ValueError(f"{int(is_image.sum())} image placeholder tokens but "
                             f"{image_features.shape[:-1].numel()} vision tokens")
        return embeds.masked_scatter(is_image, image_features.to(embeds.dtype).cpu())

    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            raise ValueError("the ONNX decoder graph takes the slots as RoPE positions only")
        self.decoder.check_prefill(embeds.shape[1])
        x = embeds.detach().to("cpu", torch.float32).contiguous().numpy()
        return self.decoder.run(x, np.arange(x.shape[1], dtype=np.int64)[None], 0)

    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        if rope_offset:
            raise ValueError("the ONNX decoder graph takes the slots as RoPE positions only")
        self.decoder.check_decode(pos)
        return self.decoder.run(self.embed_tokens[[[token_id]]], np.array([[pos]], dtype=np.int64), pos)

    def reset(self) -> None:
        self.decoder.reset()


class OnnxFamilyBackend(Backend):
    """A Qwen2.5-VL / Qwen3-VL / SmolVLM2 / InternVL / Gemma 3 bundle on onnxruntime (batch size 1,
    float32): the vision graph with its host-side feeds
    (:class:`~edgevlm.runtime.backends.onnx_vision.VisionGraph`), the decoder graph with M-RoPE
    ``position_ids (3, 1, T)`` for the Qwen families, Qwen3-VL's DeepStack features as ``layer_add.{i}``
    at the vision positions of the prompt, and Gemma 3's ``image_blocks`` of the prompt.

    The family's host-side rules (placing vision tokens into the prompt's embeddings, the M-RoPE
    positions, the image blocks) are its model's own ``embed`` / ``position_ids`` /
    ``image_blocks_for``, on a copy of the model built without weights except the token embedding
    table (in the family's own embedding module: Gemma 3 scales it)."""

    name = "onnx"

    def __init__(self, files: ModelFiles, *, device: torch.device, max_seq_len: int) -> None:
        from edgevlm.runtime.backends.onnx_vision import VisionGraph

        root = Path(files.model_dir)
        _check_bundle(root, ("vision.onnx", "decoder.onnx"))
        self.family, self.cfg = files.family.name, files.config
        self.device = torch.device("cpu") if device.type == "cpu" else device
        self.dtype = torch.float32
        self.providers = providers_for(device)
        self.vision = VisionGraph(root / ONNX_DIR / "vision.onnx", self.family, self.cfg, self.providers)
        self.decoder = DecoderSession(root / ONNX_DIR / "decoder.onnx", self.providers, self.cfg.text, max_seq_len)
        self.mrope = self.cfg.text.mrope_section is not None
        self.embed_tokens = _embedding_table(files)  # (V, D) float32
        with torch.device("meta"):  # host-side rules only: no weights but the embedding table
            self.host = files.family.build_model(self.cfg)
        # the family's own embedding module (Gemma 3: scaled by sqrt(hidden)) with the bundle's table
        self.host.language_model.embed_tokens.weight = torch.nn.Parameter(torch.from_numpy(self.embed_tokens),
                                                                          requires_grad=False)
        scale = self.cfg.text.embed_scale  # decode looks tokens up in the table: scaled alike
        self.embed_scale = None if scale is None else np.float32(self.host.language_model.embed_tokens.scale_for(
            torch.float32))
        self._deepstack: list[torch.Tensor] = []  # Qwen3-VL: from the last encode_vision
        self._vision_mask: torch.Tensor | None = None  # (1, T) bool, from the last embed with vision
        logger.info("onnx backend: %s %s with %s", self.family, root / ONNX_DIR, ", ".join(self.providers))

    @property
    def max_seq_len(self) -> int:
        return self.decoder.max_seq_len

    def encode_image(self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None
                     ) -> torch.Tensor:
        raise ValueError(f"the {self.family} family encodes a VisionInput (encode_vision), not bare pixels")

    def encode_vision(self, vision: VisionInput, *, operating_point: OperatingPoint | None = None,
                      prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Vision tokens ``(N_tokens, D_text)`` float32 from the vision graph (SmolVLM's tiles
        flattened in order); Qwen3-VL's DeepStack outputs are kept for the next :meth:`prefill`."""
        outs = self.vision.run(vision.pixel_values, grid_thw=vision.grid_thw,
                               pixel_mask=vision.extras.get("pixel_attention_mask"))
        self._deepstack = outs[1:]
        return outs[0].reshape(-1, outs[0].shape[-1])

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None, *,
                     kept_index: list[int] | None = None) -> tuple[torch.Tensor | None, int]:
        if kept_index is not None:  # the engine refuses pruning on this backend before it gets here
            raise ValueError("the ONNX backend does not prune vision tokens")
        return self.host.position_ids(input_ids.detach().cpu(), vision)

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        ids = input_ids.detach().cpu()
        with torch.no_grad():
            x = self.host.embed(ids, None if image_features is None else image_features.float().cpu())
        self._vision_mask = None
        if image_features is not None and self.decoder.n_layer_adds:
            mask = ids == self.cfg.image_token_id
            if self.cfg.video_token_id is not None:
                mask |= ids == self.cfg.video_token_id
            self._vision_mask = mask
        return x

    def _layer_adds(self, t: int) -> list[np.ndarray] | None:
        """The DeepStack ``layer_add.{i}`` ``(1, T, D)`` of the last encode/embed (consumed)."""
        mask, deepstack = self._vision_mask, self._deepstack
        self._vision_mask, self._deepstack = None, []
        if mask is None or not deepstack:
            return None
        if mask.shape[1] != t:
            raise ValueError("prefill embeddings do not match the last embed() call")
        adds = []
        for feats in deepstack[: self.decoder.n_layer_adds]:
            add = torch.zeros(1, t, self.decoder.hidden_size)
            add[mask] = feats
            adds.append(add.numpy())
        return adds

    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``embeds`` ``(1, T, D)`` at slots ``0..T-1``; ``position_ids`` ``(3, 1, T)`` (M-RoPE, from
        :meth:`position_ids`; None = the slots on every row) -> logits ``(1, V)``."""
        t = embeds.shape[1]
        self.decoder.check_prefill(t)
        slots = torch.arange(t)[None]  # (1, T)
        if self.mrope:
            pos = slots.expand(3, 1, t) if position_ids is None else position_ids.reshape(3, 1, t).cpu()
        elif position_ids is not None:
            raise ValueError(f"the {self.family} decoder graph takes the slots as RoPE positions only")
        else:
            pos = slots
        blocks = self.host.image_blocks_for(embeds)  # Gemma 3: each image's tokens attend to each other
        x = embeds.detach().to("cpu", torch.float32).contiguous().numpy()
        return self.decoder.run(x, pos.to(torch.int64).contiguous().numpy(), 0, self._layer_adds(t),
                                None if blocks is None else blocks.to(torch.int64).contiguous().numpy())

    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        """One token at slot ``pos``, RoPE position ``pos + rope_offset`` (M-RoPE: on all three rows)."""
        self.decoder.check_decode(pos)
        if self.mrope:
            positions = np.full((3, 1, 1), pos + int(rope_offset), dtype=np.int64)
        elif rope_offset:
            raise ValueError(f"the {self.family} decoder graph takes the slots as RoPE positions only")
        else:
            positions = np.array([[pos]], dtype=np.int64)
        x = self.embed_tokens[[[token_id]]]  # (1, 1, D)
        return self.decoder.run(x if self.embed_scale is None else x * self.embed_scale, positions, pos)

    def reset(self) -> None:
        self.decoder.reset()
        self._deepstack, self._vision_mask = [], None


def _check_bundle(root: Path, graphs: tuple[str, ...]) -> None:
    """``root`` is a verified engine bundle with ``onnx/<graph>`` for each of ``graphs``."""
    if not is_bundle(root):
        raise ModelLoadError(f"{root} is not an engine bundle: the onnx backend runs bundles built by "
                             "`edgevlm quantize` (ONNX artifacts in onnx/)")
    verify_bundle(root)
    for name in graphs:
        if not (root / ONNX_DIR / name).is_file():
            raise ModelLoadError(f"bundle {root} has no {ONNX_DIR}/{name} (rebuild it without --no-onnx)")


def check_options(backend: str, options: dict) -> None:
    """Raise InvalidRequestError for options this backend does not take (it takes none)."""
    if options:
        from edgevlm.errors import InvalidRequestError

        raise InvalidRequestError(f"the {backend} backend takes no options (got {', '.join(sorted(options))})")


def load(files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_seq_len: int,
         **options) -> OnnxBackend:
    """Load a bundle's ONNX artifacts (``dtype`` is ignored: the graphs compute in float32).

    Raises:
        ModelLoadError: not a bundle, hash mismatch, ONNX files missing or not loadable, a family
            without ONNX artifacts.
        InvalidRequestError: any backend option (this backend takes none).
    """
    from edgevlm.runtime.backends.onnx_vision import VISION_FAMILIES

    check_options("onnx", options)
    family = files.family.name
    if family not in ("llava", *VISION_FAMILIES):
        raise ModelLoadError(f"the onnx backend runs llava, {', '.join(VISION_FAMILIES)} bundles; "
                             f"{files.model_dir} is a {family} bundle (use --backend torch)")
    if dtype != torch.float32:
        logger.info("onnx backend computes in float32 (requested %s)", dtype)
    if family == "llava":
        return OnnxBackend(files, device=device, max_seq_len=max_seq_len)
    return OnnxFamilyBackend(files, device=device, max_seq_len=max_seq_len)
