"""When a decode-step kernel is launched as a programmatic dependent (PDL): the one rule for the W4A16 CUDA kernels
(:mod:`~edgevlm.runtime.kernels.w4a16_mma`) and the Triton decode kernels (:mod:`~edgevlm.runtime.kernels.decode_fused`).

Programmatic dependent launch (NVIDIA, CUDA C++ Programming Guide, "Programmatic Dependent Launch and
Synchronization"; PTX ISA ``griddepcontrol``; Hopper, sm_90, and newer) lets a kernel start while the previous one in
the stream still runs; it waits (``griddepcontrol.wait``) before it touches memory the previous kernels write. Each
module keeps its own on/off switch (``w4a16_mma.PDL``, ``decode_fused.PDL``, for benchmarks); this module says where
it applies at all:

* ``EDGEVLM_PDL`` = ``auto`` (default): on sm_90+ for launches of at most :data:`MAX_ROWS` activation rows (decode
  steps of up to that many sequences), ``on``: every launch on sm_90+, ``off``: none. Read at each call, so a new CUDA
  graph capture picks up a change.

Why :data:`MAX_ROWS` = 8 (H200, LLaVA-1.5-7B-shape W4A16 decode step at position 609,
``bench/results/session11_h200_20261202/``): with both modules' kernels as programmatic dependents the step took
2.179 -> 1.997 ms at batch 1 and 2.908 -> 2.730 ms at batch 8, bit-identical to plain launches over 20 graph replays
each (``bench/decode_pdl_check.py``), but 3.879 -> 4.030 ms at batch 16 (slower) and, at batch 32, where the W4A16
products run on the sm_90 bulk-copy kernel, replays differed from each other (rel 0.03-0.05 in the logits; not
explained yet: each module alone, and the W4A16 kernels with only up to 16 rows, were bit-identical).

``rows`` is the launch's own row count, whatever the phase: a W4A16 product of at most :data:`MAX_ROWS` rows outside
a decode step (a prefill chunk, a short vision or speculative batch through ``Int4Linear``) is a programmatic
dependent too. That is as safe as in the decode step: every kernel launched so (the W4A16 register / lean / bulk
kernels, the Triton decode kernels) reads nothing but its weights and writes nothing before its
``griddepcontrol.wait``, and a plainly launched kernel after it waits for it to finish, as always. The one input read
before the wait, the weights, must not come from the kernel right before: ``Int4Linear`` launches plainly on the call
that repacks its layout. What is not measured there is the gain.
"""

from __future__ import annotations

import os

import torch

MODE_ENV = "EDGEVLM_PDL"
MAX_ROWS: int | None = 8
"""Under ``auto``, the most activation rows a launch may have to be a programmatic dependent (None: no limit)."""
CAPABILITY = (9, 0)
"""Compute capability from which the hardware has programmatic dependent launch (Hopper)."""

_CAPABLE: dict[int, bool] = {}


def mode() -> str:
    """``"auto"``, ``"on"`` or ``"off"`` from ``EDGEVLM_PDL`` (unset or unrecognised: ``"auto"``)."""
    value = os.environ.get(MODE_ENV, "auto").strip().lower()
    if value in ("0", "off", "false", "no"):
        return "off"
    if value in ("1", "on", "true", "yes"):
        return "on"
    return "auto"


def capable(device: torch.device | str) -> bool:
    """Whether ``device`` is a CUDA device of compute capability >= :data:`CAPABILITY` (checked once per device)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    ok = _CAPABLE.get(index)
    if ok is None:
        ok = _CAPABLE[index] = torch.cuda.get_device_capability(index) >= CAPABILITY
    return ok


def allowed(device: torch.device | str, rows: int | None) -> bool:
    """Whether a launch over ``rows`` activation rows (the launch's own rows: the decode batch in a decode step, a
    chunk's rows elsewhere, see the module docstring; None: a launch without rows, e.g. the prefill's
    dequantization) on ``device`` may be a programmatic dependent: :func:`mode` not ``off``, :func:`capable`, and
    under ``auto`` ``rows <= MAX_ROWS`` (never for ``rows=None``)."""
    m = mode()
    if m == "off" or not capable(device):
        return False
    if m == "on":
        return True
    return rows is not None and (MAX_ROWS is None or rows <= MAX_ROWS)
