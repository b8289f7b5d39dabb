"""onnxruntime backend: runs an engine bundle's ``onnx/vision.onnx`` and ``onnx/decoder.onnx``
(written by ``edgevlm quantize``, see :mod:`edgevlm.quantize.onnx_export` and
:mod:`edgevlm.quantize.onnx_vision_export` for the graph contracts).

LLaVA bundles (:class:`OnnxBackend`) run both graphs. Qwen2.5-VL, Qwen3-VL and SmolVLM2 bundles
(:class:`OnnxVisionBackend`) have a vision graph only: the vision tower runs on onnxruntime
(:class:`~edgevlm.runtime.backends.onnx_vision.VisionGraph`, host-side feeds for the request's grid),
the decoder on the torch backend (its KV cache, M-RoPE positions and Qwen3-VL's DeepStack adds).

Execution providers: CPU here; on ``device="cuda"`` the TensorRT and CUDA providers are put first
when this onnxruntime build has them. The vision graphs have dynamic shapes, so every rung of
the resolution ladder runs without reloading. LLaVA's KV cache is the decoder's ``present.*`` outputs
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


class OnnxBackend(Backend):
    """LLaVA on onnxruntime sessions (batch size 1, float32 activations)."""

    name = "onnx"

    def __init__(self, files: ModelFiles, *, device: torch.device, max_seq_len: int) -> None:
        root = Path(files.model_dir)
        _check_bundle(root, ("vision.onnx", "decoder.onnx"))
        self.device = torch.device("cpu") if device.type == "cpu" else device
        self.dtype = torch.float32
        self._max_seq_len = max_seq_len
        self.providers = providers_for(device)
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        try:
            self.vision = ort.InferenceSession(str(root / ONNX_DIR / "vision.onnx"), opts, providers=self.providers)
            self.decoder = ort.InferenceSession(str(root / ONNX_DIR / "decoder.onnx"), opts,
                                                providers=self.providers)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise ModelLoadError(f"onnxruntime cannot load {root / ONNX_DIR}: {exc}") from exc
        tc = files.config.text
        self.n_layers, self.n_kv, self.head_dim = tc.num_hidden_layers, tc.num_key_value_heads, tc.head_dim
        self.image_token_id = files.config.image_token_id
        self.embed_tokens = _embedding_table(files)  # (V, D) float32
        self.output_names = [o.name for o in self.decoder.get_outputs()]
        self._past: dict[str, np.ndarray] = {}
        self._len = 0
        logger.info("onnx backend: %s with %s", root / ONNX_DIR, ", ".join(self.providers))

    @property
    def max_seq_len(self) -> int:
        return self._max_seq_len

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

    def _run(self, embeds: np.ndarray, start: int) -> torch.Tensor:
        t = embeds.shape[1]
        feeds = {"inputs_embeds": embeds, "position_ids": np.arange(start, start + t, dtype=np.int64)[None]}
        empty = np.zeros((1, self.n_kv, 0, self.head_dim), np.float32)
        for i in range(self.n_layers):
            for kv in ("key", "value"):
                feeds[f"past.{i}.{kv}"] = self._past.get(f"present.{i}.{kv}", empty) if start else empty
        outs = dict(zip(self.output_names, self.decoder.run(self.output_names, feeds), strict=True))
        self._past = {k: v for k, v in outs.items() if k.startswith("present.")}
        self._len = start + t
        return torch.from_numpy(outs["logits"])  # (1, V)

    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        if position_ids is not None:
            raise ValueError("the ONNX decoder graph takes the slots as RoPE positions only")
        if embeds.shape[1] > self.max_seq_len:
            raise ValueError(f"prefill of {embeds.shape[1]} positions exceeds the KV cache ({self.max_seq_len})")
        return self._run(embeds.detach().to("cpu", torch.float32).contiguous().numpy(), 0)

    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        if rope_offset:
            raise ValueError("the ONNX decoder graph takes the slots as RoPE positions only")
        if not 0 < pos < self.max_seq_len:
            raise ValueError(f"decode position {pos} outside the KV cache (1..{self.max_seq_len - 1})")
        if pos > self._len:
            raise ValueError(f"decode position {pos} skips past the cached sequence of {self._len} positions")
        if pos < self._len:  # rewind: drop the cached positions >= pos
            self._past = {k: v[:, :, :pos] for k, v in self._past.items()}
        return self._run(self.embed_tokens[[[token_id]]], pos)

    def reset(self) -> None:
        self._past, self._len = {}, 0


class OnnxVisionBackend(Backend):
    """A Qwen2.5-VL / Qwen3-VL / SmolVLM2 bundle: the vision tower on onnxruntime
    (``onnx/vision.onnx``), the decoder on ``decoder`` (the torch backend of the same bundle)."""

    name = "onnx"

    def __init__(self, files: ModelFiles, decoder: Backend, providers: list[str]) -> None:
        from edgevlm.runtime.backends.onnx_vision import VisionGraph

        self.family = files.family.name
        self.decoder = decoder
        self.device, self.dtype = decoder.device, decoder.dtype
        self.providers = providers
        self.vision = VisionGraph(Path(files.model_dir) / ONNX_DIR / "vision.onnx", files, providers)
        logger.info("onnx backend: %s vision on %s, decoder on torch", self.family, ", ".join(providers))

    @property
    def max_seq_len(self) -> int:
        return self.decoder.max_seq_len

    def encode_image(self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None
                     ) -> torch.Tensor:
        raise ValueError(f"the {self.family} family encodes a VisionInput (encode_vision), not bare pixels")

    def encode_vision(self, vision: VisionInput, *, operating_point: OperatingPoint | None = None,
                      prompt_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Vision tokens ``(N_tokens, D_text)`` in the decoder's dtype, from the ONNX graph; Qwen3-VL's
        DeepStack outputs go to the decoder for the next prefill."""
        outs = self.vision.run(vision.pixel_values, grid_thw=vision.grid_thw,
                               pixel_mask=vision.extras.get("pixel_attention_mask"))
        model = self.decoder.model
        if self.family == "qwen3_vl":
            model.set_deepstack(outs[1:])
        return outs[0].reshape(-1, outs[0].shape[-1]).to(self.device, self.dtype)  # SmolVLM: tiles flattened

    def position_ids(self, input_ids: torch.Tensor, vision: VisionInput | None) -> tuple[torch.Tensor | None, int]:
        return self.decoder.position_ids(input_ids, vision)

    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        return self.decoder.embed(input_ids, image_features)

    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.decoder.prefill(embeds, operating_point=operating_point, position_ids=position_ids)

    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None,
               rope_offset: int = 0) -> torch.Tensor:
        return self.decoder.decode(token_id, pos, operating_point=operating_point, rope_offset=rope_offset)

    def reset(self) -> None:
        self.decoder.reset()

    def synchronize(self) -> None:
        self.decoder.synchronize()


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
    """Load a bundle's ONNX artifacts (LLaVA: ``dtype`` is ignored, the graphs compute in float32;
    the vision-only families: ``dtype`` is the torch decoder's).

    Raises:
        ModelLoadError: not a bundle, hash mismatch, ONNX files missing or not loadable, a family
            without ONNX artifacts.
        InvalidRequestError: any backend option (this backend takes none).
    """
    from edgevlm.runtime.backends.onnx_vision import VISION_FAMILIES

    check_options("onnx", options)
    family = files.family.name
    if family in VISION_FAMILIES:
        root = Path(files.model_dir)
        _check_bundle(root, ("vision.onnx",))
        from edgevlm.runtime.backends.torch_backend import load as load_torch

        decoder = load_torch(files, device=device, dtype=dtype, max_seq_len=max_seq_len)
        return OnnxVisionBackend(files, decoder, providers_for(device))
    if family != "llava":
        raise ModelLoadError(f"the onnx backend runs llava, {', '.join(VISION_FAMILIES)} bundles; "
                             f"{files.model_dir} is a {family} bundle (use --backend torch)")
    if dtype != torch.float32:
        logger.info("onnx backend computes in float32 (requested %s)", dtype)
    return OnnxBackend(files, device=device, max_seq_len=max_seq_len)
