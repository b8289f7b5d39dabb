"""PyTorch backend: :class:`~edgevlm.runtime.llava.LlavaModel` in eager mode (CPU fp32/bf16,
CUDA fp16/bf16) with its static KV cache."""

from __future__ import annotations

import logging

import torch

from edgevlm.runtime.backends import Backend
from edgevlm.runtime.llava import LlavaModel
from edgevlm.runtime.loader import ModelFiles, load_model
from edgevlm.types import OperatingPoint

logger = logging.getLogger(__name__)


class TorchBackend(Backend):
    """Runs the model with plain PyTorch modules (SDPA attention)."""

    name = "torch"

    def __init__(self, model: LlavaModel) -> None:
        self.model = model
        self.device = model.device
        self.dtype = model.dtype
        self._pos = torch.zeros(1, dtype=torch.long, device=self.device)  # decode position buffer
        self._tok = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # decode token buffer

    @property
    def max_seq_len(self) -> int:
        return self.model.language_model.max_seq_len

    @torch.inference_mode()
    def encode_image(self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None) -> torch.Tensor:
        return self.model.encode_image(pixel_values.to(self.device))  # (1, N, D_text)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor, image_features: torch.Tensor | None) -> torch.Tensor:
        return self.model.embed(input_ids.to(self.device), image_features)  # (1, T, D_text)

    @torch.inference_mode()
    def prefill(self, embeds: torch.Tensor, *, operating_point: OperatingPoint | None = None) -> torch.Tensor:
        if embeds.shape[1] > self.max_seq_len:
            raise ValueError(f"prefill of {embeds.shape[1]} positions exceeds the KV cache ({self.max_seq_len})")
        return self.model.prefill(embeds)  # (1, V)

    @torch.inference_mode()
    def decode(self, token_id: int, pos: int, *, operating_point: OperatingPoint | None = None) -> torch.Tensor:
        if not 0 <= pos < self.max_seq_len:
            raise ValueError(f"decode position {pos} outside the KV cache (0..{self.max_seq_len - 1})")
        self._tok.fill_(token_id)  # static input buffers: a CUDA graph can capture model.decode later
        self._pos.fill_(pos)
        return self.model.decode(self._tok, self._pos)  # (1, V)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def load(files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_seq_len: int) -> TorchBackend:
    """Load ``files`` onto ``device`` in ``dtype`` with a KV cache of ``max_seq_len`` positions."""
    return TorchBackend(load_model(files, device=device, dtype=dtype, max_seq_len=max_seq_len))
