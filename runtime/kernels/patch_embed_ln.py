"""Fused ViT stem: patch embedding + position embedding + LayerNorm in one Triton kernel.

The CLIP vision stem computes ``pre_layrnorm(concat(cls, conv_pxp(pixels)) + pos)`` (Radford et
al., CLIP, 2021; transformers' ``CLIPVisionEmbeddings`` + ``pre_layrnorm``). Unfused that is a
convolution writing ``(B, D, h, w)``, a transpose, a concat, an add and a LayerNorm: four
round-trips of the ``(B, 1 + N, D)`` activations through memory. Here one kernel gathers each
patch straight from the image (an implicit im2col: no patch matrix is materialised), multiplies it
with the ``(D, C*p*p)`` weight on the tensor cores with an fp32 accumulator, adds the position
embedding and normalises the row (LayerNorm, Ba et al. 2016, fp32 statistics) before writing it
once. A program owns ``BLOCK_M`` patches and the whole hidden dimension, so the row statistics
never leave registers. The CLS row, identical for every image, is computed once with torch.

Checked against the unfused path (:meth:`FusedVisionStem.reference`) by
``tests/gpu_perf/test_kernels.py`` (Triton interpreter, fp16/fp32) and ``bench/gpu_suite.py`` (CUDA, bf16).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from edgevlm.runtime.kernels import interpreter_mode

logger = logging.getLogger(__name__)


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    configs = [triton.Config({"BLOCK_M": 16, "BLOCK_K": 32}, num_warps=4, num_stages=2)]
    if not interpreter_mode():
        configs += [
            triton.Config({"BLOCK_M": 16, "BLOCK_K": 64}, num_warps=8, num_stages=1),
            triton.Config({"BLOCK_M": 32, "BLOCK_K": 32}, num_warps=8, num_stages=2),
        ]

    @triton.autotune(configs=configs, key=["N_ROWS_PER_IMAGE", "D", "KDIM"])
    @triton.jit
    def patch_embed_ln_kernel(
        px_ptr, w_ptr, pos_ptr, lnw_ptr, lnb_ptr, out_ptr,
        total_rows, eps,
        C: tl.constexpr, H: tl.constexpr, W: tl.constexpr, P: tl.constexpr, GW: tl.constexpr,
        N_ROWS_PER_IMAGE: tl.constexpr, D: tl.constexpr, KDIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid = tl.program_id(0)
        rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (image, patch) index
        row_ok = rows < total_rows
        img = rows // N_ROWS_PER_IMAGE
        patch = rows % N_ROWS_PER_IMAGE
        gy = patch // GW
        gx = patch % GW
        # offset of each patch's top-left pixel in channel 0
        base = img * (C * H * W) + (gy * P) * W + gx * P  # (BLOCK_M,)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for k0 in range(0, KDIM, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)  # k = (c, ky, kx) as in the conv weight's layout
            k_ok = k < KDIM
            c = k // (P * P)
            ky = (k // P) % P
            kx = k % P
            koff = c * (H * W) + ky * W + kx  # (BLOCK_K,)
            a = tl.load(px_ptr + base[:, None] + koff[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + d[None, :] * KDIM + k[:, None], mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        pos = tl.load(pos_ptr + patch[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        x = acc + pos.to(tl.float32)
        mean = tl.sum(x, axis=1) / D  # padded columns hold exact zeros
        xc = tl.where(d_ok[None, :], x - mean[:, None], 0.0)
        var = tl.sum(xc * xc, axis=1) / D
        y = xc * tl.rsqrt(var + eps)[:, None]
        gamma = tl.load(lnw_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        beta = tl.load(lnb_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        y = y * gamma[None, :] + beta[None, :]
        out_row = img * (N_ROWS_PER_IMAGE + 1) + 1 + patch  # row 0 of each image is the CLS token
        tl.store(out_ptr + out_row[:, None] * D + d[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])

    return patch_embed_ln_kernel


def fused_patch_embed_layernorm(pixel_values: torch.Tensor, conv_weight: torch.Tensor, class_embedding: torch.Tensor,
                                pos_embed: torch.Tensor, ln_weight: torch.Tensor, ln_bias: torch.Tensor,
                                eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """``LayerNorm(concat(cls, patches(pixel_values) @ W^T) + pos_embed)`` in one kernel (plus a
    tiny torch op for the CLS row).

    Args:
        pixel_values: ``(B, C, H, W)``, H and W multiples of the patch size ``p``; cast to the
            weight's dtype (as the unfused path does).
        conv_weight: ``(D, C, p, p)`` patch-embedding convolution weight (no bias).
        class_embedding: ``(D,)``; pos_embed: ``(1 + N, D)`` for the ``h x w = N`` patch grid.
        ln_weight, ln_bias: ``(D,)``; eps: the LayerNorm epsilon.
        out: optional contiguous ``(B, 1 + N, D)`` output buffer in the weight's dtype.
    Returns:
        ``(B, 1 + N, D)`` in the weight's dtype.
    Raises:
        ValueError: shapes that do not fit together.
    """
    b, c, h, w = pixel_values.shape
    d, c_w, p, p2 = conv_weight.shape
    if c != c_w or p != p2 or h % p or w % p:
        raise ValueError(f"pixels {tuple(pixel_values.shape)} do not fit a {tuple(conv_weight.shape)} patch embedding")
    gh, gw = h // p, w // p
    n = gh * gw
    if tuple(pos_embed.shape) != (1 + n, d):
        raise ValueError(f"pos_embed is {tuple(pos_embed.shape)}, expected {(1 + n, d)}")
    dtype = conv_weight.dtype
    px = pixel_values.to(dtype).contiguous()
    weight = conv_weight.reshape(d, c * p * p).contiguous()
    if out is None:
        out = torch.empty(b, 1 + n, d, dtype=dtype, device=px.device)
    elif tuple(out.shape) != (b, 1 + n, d) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {(b, 1 + n, d)} {dtype} tensor")
    cls = (class_embedding.float() + pos_embed[0].float())[None]  # (1, D)
    out[:, 0] = F.layer_norm(cls, (d,), ln_weight.float(), ln_bias.float(), eps).to(dtype)
    patch_pos = pos_embed[1:].contiguous()  # (N, D)
    total = b * n
    block_d = 1 << (d - 1).bit_length()

    def grid(meta):
        return ((total + meta["BLOCK_M"] - 1) // meta["BLOCK_M"],)

    _kernel()[grid](px, weight, patch_pos, ln_weight.contiguous(), ln_bias.contiguous(), out, total, float(eps),
                    C=c, H=h, W=w, P=p, GW=gw, N_ROWS_PER_IMAGE=n, D=d, KDIM=c * p * p, BLOCK_D=block_d)
    return out


class FusedVisionStem(nn.Module):
    """Drop-in for ``pre_layrnorm(embeddings(pixel_values))`` of a
    :class:`~edgevlm.runtime.vision.VisionEncoder`, running :func:`fused_patch_embed_layernorm`.
    Holds references to the encoder's own parameters (no copies); position embeddings
    interpolated for a grid size are cached."""

    def __init__(self, embeddings: nn.Module, pre_layrnorm: nn.LayerNorm) -> None:
        super().__init__()
        self.embeddings = [embeddings]  # in a list: not registered as a submodule (no double params)
        self.pre_layrnorm = [pre_layrnorm]
        self._pos: dict[tuple[int, int], torch.Tensor] = {}

    def reference(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """The unfused path: ``(B, C, H, W)`` -> ``(B, 1 + N, D)``."""
        return self.pre_layrnorm[0](self.embeddings[0](pixel_values))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        emb, ln = self.embeddings[0], self.pre_layrnorm[0]
        p = emb.cfg.patch_size
        grid = (pixel_values.shape[-2] // p, pixel_values.shape[-1] // p)
        pos = self._pos.get(grid)
        if pos is None:
            pos = emb.position_embeddings(*grid).detach().contiguous()  # (1 + N, D)
            self._pos[grid] = pos
        return fused_patch_embed_layernorm(pixel_values, emb.patch_embedding.weight, emb.class_embedding, pos,
                                           ln.weight, ln.bias, ln.eps)
