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


# ----------------------------------------------------------------------------- tensor-core ("mma") layout
MMA_LAYOUT_VERSION = 1
"""Version of the layout :func:`repack_int4_mma` writes (the CUDA kernel in
``runtime/kernels/w4a16_mma.cu`` reads exactly this version)."""

MMA_GROUP_SIZES: tuple[int, ...] = (64, 128)
"""Group sizes the tensor-core layout supports (a group must cover whole 64-channel blocks)."""

MMA_LAYOUT_NAME = "w4a16-mma"
"""Name of the tensor-core layout in a bundle's ``manifest.json`` (``kernel_layouts[].name``)."""

MMA_LAYOUT_TARGETS: tuple[str, ...] = ("sm_80+",)
"""CUDA targets whose kernel reads this layout: compute capability 8.0 and newer (the register-ring
kernel ``w4a16_mma.cu``; sm_90's bulk-copy kernel ``w4a16_bulk.cu`` reads the same tensors)."""

MMA_TENSOR_SUFFIXES: tuple[str, str] = (".mma_qweight", ".mma_meta")
"""Tensor names of a stored mma layout: ``<layer>.mma_qweight`` and ``<layer>.mma_meta`` (``<layer>`` =
the runtime module name of ``manifest.json``'s ``layers[].name``), the two outputs of
:func:`repack_int4_mma`."""


def mma_layout_fits(out_features: int, in_features: int, group_size: int) -> bool:
    """Whether :func:`repack_int4_mma` can hold this weight shape (see :func:`check_mma_shape`)."""
    try:
        check_mma_shape(out_features, in_features, group_size)
    except ValueError:
        return False
    return True


def mma_layout_shapes(out_features: int, in_features: int, group_size: int
                      ) -> tuple[tuple[int, int, int, int], tuple[int, int, int]]:
    """Shapes of ``(qw, meta)`` that :func:`repack_int4_mma` returns for an ``(N, K)`` weight:
    ``(N/16, K/64, 32, 4)`` and ``(N/16, K/group_size, 16)`` (both int32). Raises ``ValueError`` for a
    shape the layout cannot hold."""
    check_mma_shape(out_features, in_features, group_size)
    return (out_features // 16, in_features // 64, 32, 4), (out_features // 16, in_features // group_size, 16)


def mma_target_served(targets: list[str] | tuple[str, ...], capability: tuple[int, int]) -> bool:
    """Whether a CUDA device of compute ``capability`` (e.g. ``(8, 7)``) is one of ``targets``
    (``"sm_87"`` exactly, ``"sm_80+"`` that one and newer; other spellings never match)."""
    major, minor = capability
    cc = 10 * major + minor
    for t in targets:
        body = t[3:] if t.startswith("sm_") else ""
        plus = body.endswith("+")
        digits = body[:-1] if plus else body
        if digits.isdigit() and (cc >= int(digits) if plus else cc == int(digits)):
            return True
    return False


def check_mma_shape(out_features: int, in_features: int, group_size: int) -> None:
    """Raise ``ValueError`` unless the tensor-core layout can hold this weight shape."""
    if group_size not in MMA_GROUP_SIZES:
        raise ValueError(f"the mma layout needs group_size in {MMA_GROUP_SIZES}, got {group_size}")
    if out_features % 16 or in_features % 64 or in_features % group_size:
        raise ValueError(
            f"the mma layout needs out_features % 16 == 0 and in_features % 64 == 0, got ({out_features}, {in_features})")


def repack_int4_mma(qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                    group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-layout canonical INT4 tensors for the tensor-core W4A16 kernel (layout version 1).

    Returns ``(qw, meta)`` on ``qweight``'s device:

    * ``qw``: ``int32 (N/16, K/64, 32, 4)``, the same bytes as ``qweight``, reordered so that lane ``L``
      of a warp loads word ``j`` = its 8 elements of the ``mma.m16n8k16`` A fragment of k-tile ``j`` of
      the (16-row, 64-channel) block: with ``g = L // 4``, ``t = L % 4``, nibble ``p = 4e + 2h + rb`` (bits
      ``4p .. 4p + 3``) holds ``q[16 * n_tile + 8 rb + g, 64 * k_block + 16 t + 4 j + 2 h + e]``.
      (Fragment rows/columns are from the PTX ISA's m16n8k16 tables; the channel order inside a block
      is a permutation chosen so the same lane's B registers are 16 consecutive activations.)
    * ``meta``: ``int32 (N/16, K/group_size, 16)``, per output row of a tile and group the fp16 bit
      pattern of the scale in bits 0-15 and the zero point in bits 16-19.

    Exact and invertible (:func:`unpack_int4_mma`). Raises ``ValueError`` for a shape the layout
    cannot hold (see :func:`check_mma_shape`).
    """
    n, k = int(qweight.shape[0]), int(qweight.shape[1]) * 2
    check_mma_shape(n, k, group_size)
    codes = unpack_int4(qweight).reshape(n // 16, 2, 8, k // 64, 4, 4, 2, 2)  # (NT, rb, g, KB, t, j, h, e)
    nibbles = codes.permute(0, 3, 2, 4, 5, 7, 6, 1).reshape(n // 16, k // 64, 32, 4, 8)  # (NT, KB, lane, j, p)
    qw = pack_int4(nibbles.contiguous()).view(torch.int32).reshape(n // 16, k // 64, 32, 4).contiguous()
    meta = (scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) | (zeros.to(torch.int32) << 16)
    meta = meta.reshape(n // 16, 16, k // group_size).permute(0, 2, 1).contiguous()
    return qw, meta


GATED_ROW_TILE = 16
"""Rows per tile of the gated row order (8 gate channels, then their 8 up partners): a gated projection's
``out_features`` (2 I) must be a multiple of it (:func:`gated_rows_ok`)."""


def gated_rows_ok(out_features: int) -> bool:
    """Whether a fused gate/up projection of ``out_features`` rows (2 I) can take :func:`gated_row_order`."""
    return out_features % GATED_ROW_TILE == 0


def check_gated_rows(out_features: int, where: str) -> None:
    """Raise ``ValueError`` naming ``where`` unless :func:`gated_rows_ok`."""
    if not gated_rows_ok(out_features):
        raise ValueError(f"{where}: a gated projection needs out_features % {GATED_ROW_TILE} == 0 (2 x a multiple "
                         f"of 8), got {out_features}")


def gated_row_order(out_features: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Row order of a fused gate/up weight (``out_features`` = 2 I rows: gate channels ``0..I-1``, then up) for the
    W4A16 kernel's gated-MLP epilogue: int64 ``(2 I,)``, entry ``r`` is the canonical row that goes to row ``r``.
    Each 16-row tile ``j`` takes gate rows ``8j .. 8j + 7`` then up rows ``I + 8j .. I + 8j + 7``, so the mma rows
    ``g`` and ``g + 8`` of a tile (one lane's accumulators) are a gate channel and its up partner. Raises
    ``ValueError`` unless ``out_features`` is a multiple of 16."""
    check_gated_rows(out_features, "gated_row_order")
    inter = out_features // 2
    gate = torch.arange(inter, device=device).reshape(-1, 8)  # (I/8, 8)
    return torch.cat([gate, gate + inter], dim=1).reshape(-1)


def unpack_int4_mma(qw: torch.Tensor, meta: torch.Tensor, group_size: int) -> Int4Weight:
    """Inverse of :func:`repack_int4_mma`: the canonical ``Int4Weight`` (exact)."""
    nt, kb = int(qw.shape[0]), int(qw.shape[1])
    nibbles = unpack_int4(qw.contiguous().view(torch.uint8).reshape(nt, kb, 32, 4, 4))  # (NT, KB, lane, j, 8)
    codes = nibbles.reshape(nt, kb, 8, 4, 4, 2, 2, 2).permute(0, 7, 2, 1, 3, 4, 6, 5)  # (NT, rb, g, KB, t, j, h, e)
    qweight = pack_int4(codes.reshape(nt * 16, kb * 64).contiguous())
    m = meta.permute(0, 2, 1).reshape(nt * 16, -1)
    scales = (m & 0xFFFF).to(torch.int16).view(torch.float16).contiguous()
    zeros = ((m >> 16) & 0xF).to(torch.uint8).contiguous()
    return Int4Weight(qweight, scales, zeros, group_size)
