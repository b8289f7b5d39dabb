"""The patch embedding both Qwen-VL towers share (Qwen2.5-VL without bias, Qwen3-VL with one)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class PatchEmbed(nn.Module):
    """Conv3d with kernel == stride over ``(C, T, p, p)`` patches (``proj``, as transformers' towers
    save it), computed as one matmul on the flattened rows the Qwen-VL processors emit.

    ``cfg``: the tower config (``in_channels``, ``hidden_size``, ``patch_size``, ``temporal_patch_size``).
    """

    def __init__(self, cfg: Any, bias: bool) -> None:
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``(N, C*T*p*p)`` -> ``(N, hidden_size)`` in the weight's dtype."""
        w = self.proj.weight
        return F.linear(pixel_values.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)
