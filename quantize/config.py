"""Versioned quantization configs (torchao-shaped: a small config object passed to ``quantize_``).

``Int4WeightOnlyConfig`` selects W4A16: group-wise asymmetric INT4 weights (scales and zero points
per ``group_size`` input channels, layout in :mod:`edgevlm.runtime.int4`), 16-bit activations.
``method="rtn"`` rounds to nearest; ``method="awq"`` is activation-aware weight quantization
(Lin et al., "AWQ", MLSys 2024, arXiv:2306.00978): per-input-channel scales searched on
calibration activations, then RTN of the scaled weights.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Int4WeightOnlyConfig(BaseModel):
    """W4A16 weight-only INT4 quantization of ``nn.Linear`` layers (config version 1).

    With ``method="awq"`` use the two steps of :func:`edgevlm.quantize.quantize_`: ``step="prepare"``
    installs activation observers, the caller runs calibration batches through the model, then
    ``step="convert"`` searches the scales and swaps in :class:`~edgevlm.runtime.int4.Int4Linear`.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    version: Literal[1] = Field(1, description="Config schema version.")
    group_size: Literal[32, 64, 128] = Field(128, description="Input channels per quantization group.")
    method: Literal["rtn", "awq"] = Field("rtn", description="rtn (round to nearest) or awq.")
    step: Literal["prepare", "convert"] | None = Field(
        None, description="AWQ only: 'prepare' (install observers) or 'convert' (search, fold, quantize)."
    )
    awq_grid: int = Field(20, ge=1, le=200, description="AWQ: alpha candidates i/awq_grid for i in [0, awq_grid).")
    awq_max_tokens: int = Field(
        2048, ge=16, description="AWQ: calibration rows per layer input kept for the loss (reservoir sample)."
    )
    awq_fold: bool = Field(True, description="AWQ: fold scales into the preceding norm/linear where possible.")
    seed: int = Field(0, description="Seed of the AWQ reservoir sampling.")
