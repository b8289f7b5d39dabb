"""The canonical W4A16 INT4 weight format of :mod:`edgevlm.runtime.int4`: quantize, pack, dequantize.

Group-wise asymmetric RTN quantization into the canonical storage layout (``qweight``, ``scales``,
``zeros``; the scheme and the layout are described in :mod:`edgevlm.runtime.int4`), its inverse, and
the fake-quantization AWQ searches with. Kernel selection and the ``nn.Linear`` drop-in
(:class:`~edgevlm.runtime.int4.Int4Linear`) stay in :mod:`edgevlm.runtime.int4`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
"""Group sizes a bundle may use (largest first is the fallback order, see ``quantize.plan``)."""

INT4_LAYOUT_VERSION = 1
FP16_MIN_NORMAL = 2.0**-14


@dataclass(frozen=True)
class Int4Weight:
    """One linear layer's weight in the canonical INT4 layout (see :mod:`edgevlm.runtime.int4`).

    Attributes:
        qweight: ``uint8 (N, K // 2)``, two 4-bit codes per byte, low nibble = even input channel.
        scales: ``float16 (N, K // group_size)``.
        zeros: ``uint8 (N, K // group_size)``, integer zero points in ``[0, 15]``.
        group_size: input channels per group (32, 64 or 128).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * 2

    def nbytes(self) -> int:
        """Storage bytes of the packed weight, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


def check_int4_shape(out_features: int, in_features: int, group_size: int) -> None:
    """Raise ``ValueError`` unless the shape can be stored with ``group_size``."""
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if in_features <= 0 or out_features <= 0:
        raise ValueError(f"bad weight shape ({out_features}, {in_features})")
    if in_features % group_size:
        raise ValueError(
            f"in_features={in_features} is not divisible by group_size={group_size} "
            "(quantize.plan picks a smaller group size or keeps the layer 16-bit)"
        )


def compute_qparams(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group ``scales (N, K/g) float16`` and ``zeros (N, K/g) uint8`` of a ``(N, K)`` weight.

    Raises ``ValueError`` for a bad shape or non-finite weights/scales.
    """
    n, k = weight.shape
    check_int4_shape(n, k, group_size)
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf")
    w_max = w.amax(dim=-1).clamp(min=0.0)  # (N, G)
    w_min = w.amin(dim=-1).clamp(max=0.0)
    exact = (w_max - w_min) / 15.0
    scales = exact.to(torch.float16)
    # Round the scale *up* to fp16 so the range fits in 15 steps: then no code is clipped and every
    # weight is within scale/2 of its dequantized value (rounding down could clip the group's max).
    scales = torch.where(scales.float() < exact, torch.nextafter(scales, torch.full_like(scales, float("inf"))), scales)
    if not torch.isfinite(scales).all():
        raise ValueError("weight range overflows float16 scales")
    scales = scales.clamp(min=FP16_MIN_NORMAL)
    zeros = torch.round(-w_min / scales.float()).clamp(0, 15).to(torch.uint8)
    return scales, zeros


def quantize_codes(
    weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """4-bit codes ``uint8 (N, K)`` in ``[0, 15]`` of ``weight (N, K)`` for given qparams."""
    n, k = weight.shape
    w = weight.detach().to(torch.float32).reshape(n, k // group_size, group_size)
    q = torch.round(w / scales.float().unsqueeze(-1)) + zeros.float().unsqueeze(-1)
    return q.clamp_(0, 15).to(torch.uint8).reshape(n, k)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Pack ``uint8 (N, K)`` codes in ``[0, 15]`` into ``uint8 (N, K // 2)`` (low nibble = even k)."""
    if codes.shape[-1] % 2:
        raise ValueError(f"in_features must be even to pack, got {codes.shape[-1]}")
    c = codes.to(torch.uint8)
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 (N, K // 2)`` -> ``uint8 (N, K)``."""
    if qweight.is_contiguous() and qweight.shape[-1] % 4 == 0 and qweight.storage_offset() % 4 == 0:
        words = qweight.view(torch.int32)  # 4 bytes at a time: uint8 bit ops are not vectorised on CPU
        lo = (words & 0x0F0F0F0F).view(torch.uint8)
        hi = ((words >> 4) & 0x0F0F0F0F).view(torch.uint8)
    else:
        lo, hi = qweight & 0x0F, qweight >> 4
    return torch.stack([lo, hi], dim=-1).reshape(*qweight.shape[:-1], -1)


def quantize_int4(weight: torch.Tensor, group_size: int = 128) -> Int4Weight:
    """Round-to-nearest (RTN) group-wise asymmetric INT4 quantization of a ``(N, K)`` weight.

    Raises ``ValueError`` when ``K`` is not divisible by ``group_size``, the group size is not
    supported, or the weight is not finite.
    """
    if weight.dim() != 2:
        raise ValueError(f"expected a 2-D weight, got shape {tuple(weight.shape)}")
    scales, zeros = compute_qparams(weight, group_size)
    codes = quantize_codes(weight, scales, zeros, group_size)
    return Int4Weight(pack_int4(codes), scales, zeros, group_size)


def dequantize_int4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Dense ``(N, K)`` weight in ``dtype`` from the canonical layout, computed as ``(q - zero) * scale``
    in float32 (float64 if asked): one rounding. In-place ops: a fresh large tensor costs page faults."""
    n = qweight.shape[0]
    k = qweight.shape[1] * 2
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    q = unpack_int4(qweight).reshape(n, k // group_size, group_size).to(compute)
    q.sub_(zeros.unsqueeze(-1).to(compute)).mul_(scales.unsqueeze(-1).to(compute))
    return q.reshape(n, k).to(dtype)


def fake_quantize_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Quantize-dequantize ``weight (N, K)`` (same dtype out); what the stored layer computes with.
    Same arithmetic as :func:`quantize_int4` + :func:`dequantize_int4`, in place (AWQ's inner loop)."""
    n, k = weight.shape
    scales, zeros = compute_qparams(weight, group_size)
    s = scales.float().unsqueeze(-1)  # (N, G, 1)
    z = zeros.float().unsqueeze(-1)
    q = torch.div(weight.detach().reshape(n, k // group_size, group_size).float(), s)
    q.round_().add_(z).clamp_(0, 15).sub_(z).mul_(s)
    return q.reshape(n, k).to(weight.dtype)
