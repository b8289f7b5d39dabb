// W4A16 decode GEMM (M = 1..16 activation rows) on the tensor cores, over the "mma" INT4 layout.
//
// y (M, N) = x (M, K) @ W^T + bias, W[n, k] = (q[n, k] - zero[n, k / g]) * scale[n, k / g], q in [0, 15],
// group size g = 64 or 128 (AWQ/GPTQ asymmetric INT4). x and y are bf16 or fp16, accumulation fp32.
//
// Layout (built by edgevlm.runtime.int4_format.repack_int4_mma, MMA_LAYOUT_VERSION 1; facts from the
// PTX ISA's mma.m16n8k16 fragment tables, technique after Marlin, Frantar et al. 2024):
//   qw   uint4 [N/16][K/64][32 lanes]: the 16 output rows x 64 input channels of one (n-tile, k-block)
//        are 4 A fragments (16 x 16) of mma.m16n8k16; lane (g = lane/4, t = lane%4) holds word j of the
//        block = its 8 A elements of k-tile j: nibble p = 4e + 2h + rb is row 8rb + g, fragment column
//        2t + 8h + e, input channel k = 16t + 4j + 2h + e of the block (a fixed permutation inside the
//        block, shared with the B operand, so that a lane's 8 B registers of the 4 k-tiles are the 16
//        consecutive activations x[m, 16t .. 16t + 15]: two 16-byte loads).
//   meta u32   [N/16][K/g][16]: fp16 scale bits | zero << 16, per output row of the tile and group.
// The weight is the A operand (16 output rows), the activations the B operand (8 batch columns per
// mma; M > 8 uses two): "swap AB", so a decode row count of 1..16 wastes no weight bytes.
//
// Dequantization: (w >> 4r) & 0x000F000F | magic (one LOP3) gives two bf16/fp16 numbers 128 + q
// (1024 + q for fp16), one fma subtracts (128 + zero): the exact small integer q - zero feeds the mma; the
// fp32 group sum is scaled once per group after the mma (exact products, one fp32 rounding per group: more
// accurate than scaling each weight in 16 bits). Two independent mma chains per group (even/odd k-tiles).
//
// Schedule: a CTA streams `tiles_per_cta` consecutive 16-row n-tiles; its KSPLIT warps split the groups of
// K; each warp keeps DEPTH groups of 16-byte weight loads in flight in a register ring that runs across
// tile boundaries; per tile the warps' fp32 partials are summed in shared memory in a fixed order
// (deterministic: no atomics), bias added, stored. (A cp.async shared-memory ring variant measured slower
// on the H200: 14.6 vs 13.2 us on 12288x4096 at M = 1, bench/results/w4a16_marlin_h200_20261201.md.)
// This file includes no torch header: `nvcc -arch=sm_87 -c w4a16_mma.cu` checks it stand-alone.

#include "w4a16_common.cuh"

namespace edgevlm_w4a16 {

// MT: 8-column batch tiles (1: M <= 8, 2: M <= 16). GT: 64-channel blocks per group (1: g 64, 2: g 128).
// KSPLIT warps split the groups of K; DEPTH groups of weight loads in flight per warp; a CTA streams
// `tiles_per_cta` consecutive 16-row tiles with the load ring running across tile boundaries.
// LOADS_ONLY (diagnostic): stream the weights and fold them into the output without any arithmetic.
// ZX (MT = 1, M <= kZxMaxM): the zero point folded in through the activation sums, as in w4a16_bulk.cu
// (the mma gets B + q straight from the mask-or; per group and row, - (B + z) X_G is added to the group sum).
template <bool BF16, int MT, int GT, int KSPLIT, int DEPTH, bool LOADS_ONLY, bool ZX = false>
__global__ void __launch_bounds__(KSPLIT * 32)
w4a16_mma_kernel(const uint4* __restrict__ qw, const uint32_t* __restrict__ meta, const uint16_t* __restrict__ x,
                 const float* __restrict__ bias, void* __restrict__ y, int M, int N, int K, int tiles_per_cta,
                 int pf_tiles) {
    using M16 = Magic<BF16>;
    grid_dep_launch();  // PDL: the next kernel may be scheduled once every CTA of this one runs
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int kblocks = K >> 6;
    const int groups = kblocks / GT;
    const int g0 = static_cast<int>(static_cast<long long>(groups) * warp / KSPLIT);
    const int gw = static_cast<int>(static_cast<long long>(groups) * (warp + 1) / KSPLIT) - g0;  // this warp's
    const int gmax = (groups + KSPLIT - 1) / KSPLIT;  // items per tile, the same for every warp
    const int tile0 = blockIdx.x * tiles_per_cta;
    const int ntiles = min(tiles_per_cta, N / 16 - tile0);
    const int total = ntiles * gmax;
    const uint32_t kMask = 0x000F000Fu;
    const uint32_t kBias = M16::kBias2;

    const uint4* wbase = qw + lane;
    const uint32_t* mbase = meta + g;
    const uint4* xr[MT];
    bool xv[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = mt * 8 + g;
        xv[mt] = m < M;
        xr[mt] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(xv[mt] ? m : 0) * K) + 2 * t;
    }

    uint4 wb[DEPTH][GT];
    uint32_t mb[DEPTH][2];
    int pf_tile = 0, pf_local = 0;  // the next item to prefetch
#define EDGEVLM_LOAD_ITEM(SLOT)                                                                           \
    do {                                                                                                  \
        if (pf_tile < ntiles && pf_local < gw) {                                                          \
            const int grp_ = g0 + pf_local;                                                               \
            const size_t tile_ = static_cast<size_t>(tile0 + pf_tile);                                    \
            _Pragma("unroll") for (int i = 0; i < GT; ++i) wb[SLOT][i] =                                  \
                ld_stream(wbase + (tile_ * kblocks + static_cast<size_t>(grp_ * GT + i)) * 32);           \
            const uint32_t* mp_ = mbase + (tile_ * groups + grp_) * 16;                                   \
            mb[SLOT][0] = __ldg(mp_);                                                                     \
            mb[SLOT][1] = __ldg(mp_ + 8);                                                                 \
        }                                                                                                 \
        if (++pf_local == gmax) {                                                                         \
            pf_local = 0;                                                                                 \
            ++pf_tile;                                                                                    \
        }                                                                                                 \
    } while (0)
    // L2 prefetch (pf_tiles > 0): this warp's weight and meta bytes of tile `tl`, one 128-byte line per
    // lane and instruction, pf_tiles tiles ahead of the register ring (the whole CTA's range when
    // pf_tiles >= tiles_per_cta): the DRAM stream no longer waits on the ring's DEPTH.
    auto prefetch_tile = [&](int tl) {
        if (gw <= 0) return;
        const size_t tile_ = static_cast<size_t>(tile0 + tl);
        const char* wp = reinterpret_cast<const char*>(qw + (tile_ * kblocks + static_cast<size_t>(g0) * GT) * 32);
        const int wlines = gw * GT * 4;
        for (int l = lane; l < wlines; l += 32) prefetch_l2(wp + static_cast<size_t>(l) * 128);
        const uintptr_t m0p = reinterpret_cast<uintptr_t>(meta + (tile_ * groups + g0) * 16);
        const uintptr_t m1p = m0p + static_cast<uintptr_t>(gw) * 64 - 1;
        const int mlines = static_cast<int>((m1p >> 7) - (m0p >> 7)) + 1;
        if (lane < mlines) prefetch_l2(reinterpret_cast<const void*>(((m0p >> 7) + lane) << 7));
    };
    if (pf_tiles > 0) {
        const int n = min(pf_tiles, ntiles);
        for (int tl = 0; tl < n; ++tl) prefetch_tile(tl);
    }
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) EDGEVLM_LOAD_ITEM(s);
    grid_dep_wait();  // PDL: only weights were read so far; x (and y) may belong to the previous kernel
    extern __shared__ float xs_all[];  // ZX: [KSPLIT][gmax][kZxMaxM]
    float* xs = xs_all + warp * gmax * kZxMaxM;
    if constexpr (ZX) {
        warp_group_xsums<BF16, GT>(x, K, M, g0, gw, xs, lane);  // while the first weight loads fly
        __syncwarp();
    }

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mt][c] = 0.f;

    __shared__ float red[2][KSPLIT > 1 ? KSPLIT - 1 : 1][MT * 4][32];
    int cur_tile = 0, cur_local = 0, parity = 0;
    for (int base = 0; base < total; base += DEPTH) {
#pragma unroll
        for (int s = 0; s < DEPTH; ++s) {
            if (base + s < total) {  // uniform over the CTA: every warp walks gmax items per tile
                const int next_local = cur_local + 1 == gmax ? 0 : cur_local + 1;
                if (cur_local < gw) {
                    if constexpr (LOADS_ONLY) {
#pragma unroll
                        for (int i = 0; i < GT; ++i)
                            acc[0][0] += __uint_as_float((wb[s][i].x ^ wb[s][i].y ^ wb[s][i].z ^ wb[s][i].w ^
                                                          mb[s][0] ^ mb[s][1]) & 0x3F800000u);
                    } else {
                        uint4 xb[MT][GT][2];  // this item's B fragments (L1-resident activations)
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                            for (int i = 0; i < GT; ++i) {
                                if (xv[mt]) {
                                    const uint4* p = xr[mt] + static_cast<size_t>((g0 + cur_local) * GT + i) * 8;
                                    xb[mt][i][0] = __ldg(p);
                                    xb[mt][i][1] = __ldg(p + 1);
                                } else {
                                    xb[mt][i][0] = make_uint4(0, 0, 0, 0);
                                    xb[mt][i][1] = make_uint4(0, 0, 0, 0);
                                }
                            }
                        const uint32_t m0 = mb[s][0];
                        const uint32_t m1 = mb[s][1];
                        uint32_t nz0 = 0, nz1 = 0;
                        if constexpr (!ZX) {
                            nz0 = (M16::kNegBias + (m0 >> 16)) * 0x10001u;  // -(bias + zero)
                            nz1 = (M16::kNegBias + (m1 >> 16)) * 0x10001u;
                        }
                        const float s0 = __half2float(__ushort_as_half(static_cast<unsigned short>(m0 & 0xFFFFu)));
                        const float s1 = __half2float(__ushort_as_half(static_cast<unsigned short>(m1 & 0xFFFFu)));
                        float gacc[2][MT][4];  // two independent mma chains (even / odd k-tiles)
#pragma unroll
                        for (int c2 = 0; c2 < 2; ++c2)
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                                for (int c = 0; c < 4; ++c) gacc[c2][mt][c] = 0.f;
#pragma unroll
                        for (int i = 0; i < GT; ++i) {
#pragma unroll
                            for (int j = 0; j < 4; ++j) {
                                const uint32_t w = word_of(wb[s][i], j);
                                uint32_t a[4];
#pragma unroll
                                for (int r = 0; r < 4; ++r) {
                                    const uint32_t v = and_or(r == 0 ? w : (w >> (4 * r)), kMask, kBias);
                                    if constexpr (ZX)
                                        a[r] = v;  // B + q
                                    else
                                        a[r] = fma2<BF16>(v, M16::kOne2, (r & 1) ? nz1 : nz0);  // q - zero, exact
                                }
#pragma unroll
                                for (int mt = 0; mt < MT; ++mt) {
                                    const uint4& xq = xb[mt][i][j >> 1];
                                    mma16816<BF16>(gacc[j & 1][mt], a, (j & 1) ? xq.z : xq.x, (j & 1) ? xq.w : xq.y);
                                }
                            }
                        }
                        if constexpr (ZX) {
                            const float b0 = (BF16 ? 128.f : 1024.f) + static_cast<float>(m0 >> 16);
                            const float b1 = (BF16 ? 128.f : 1024.f) + static_cast<float>(m1 >> 16);
                            const int c0 = 2 * t;
                            const float xs0 = c0 < kZxMaxM ? xs[cur_local * kZxMaxM + c0] : 0.f;
                            const float xs1 = c0 + 1 < kZxMaxM ? xs[cur_local * kZxMaxM + c0 + 1] : 0.f;
                            acc[0][0] = fmaf(s0, fmaf(-b0, xs0, gacc[0][0][0] + gacc[1][0][0]), acc[0][0]);
                            acc[0][1] = fmaf(s0, fmaf(-b0, xs1, gacc[0][0][1] + gacc[1][0][1]), acc[0][1]);
                            acc[0][2] = fmaf(s1, fmaf(-b1, xs0, gacc[0][0][2] + gacc[1][0][2]), acc[0][2]);
                            acc[0][3] = fmaf(s1, fmaf(-b1, xs1, gacc[0][0][3] + gacc[1][0][3]), acc[0][3]);
                        } else {
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt) {
                                acc[mt][0] = fmaf(s0, gacc[0][mt][0] + gacc[1][mt][0], acc[mt][0]);
                                acc[mt][1] = fmaf(s0, gacc[0][mt][1] + gacc[1][mt][1], acc[mt][1]);
                                acc[mt][2] = fmaf(s1, gacc[0][mt][2] + gacc[1][mt][2], acc[mt][2]);
                                acc[mt][3] = fmaf(s1, gacc[0][mt][3] + gacc[1][mt][3], acc[mt][3]);
                            }
                        }
                    }
                }
                EDGEVLM_LOAD_ITEM(s);
                if (cur_local == gmax - 1) {  // the tile is done: fixed-order reduction over the warps
                    if (pf_tiles > 0 && cur_tile + pf_tiles < ntiles) prefetch_tile(cur_tile + pf_tiles);
                    if (KSPLIT > 1) {
                        if (warp > 0) {
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                                for (int c = 0; c < 4; ++c) red[parity][warp - 1][mt * 4 + c][lane] = acc[mt][c];
                        }
                        __syncthreads();
                    }
                    if (warp == 0) {
#pragma unroll
                        for (int w = 1; w < KSPLIT; ++w)
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                                for (int c = 0; c < 4; ++c) acc[mt][c] += red[parity][w - 1][mt * 4 + c][lane];
                        const int n0 = (tile0 + cur_tile) * 16 + g;
                        const float bias0 = bias != nullptr ? bias[n0] : 0.f;
                        const float bias1 = bias != nullptr ? bias[n0 + 8] : 0.f;
                        store_tile<BF16, MT>(y, acc, M, N, n0, t, bias0, bias1);
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[mt][c] = 0.f;
                    parity ^= 1;
                    ++cur_tile;
                }
                cur_local = next_local;
            }
        }
    }
#undef EDGEVLM_LOAD_ITEM
}

template <bool BF16, int MT, int GT, int KSPLIT, int DEPTH, bool LOADS_ONLY, bool ZX = false>
cudaError_t launch_typed(const void* qw, const void* meta, const void* x, const float* bias, void* y, int M, int N,
                         int K, int tiles_per_cta, int pf_tiles, bool pdl, cudaStream_t stream) {
    const int tiles = N / 16;
    const int grid = (tiles + tiles_per_cta - 1) / tiles_per_cta;
    const int groups = K / (GT * 64);
    const int xs_bytes = ZX ? KSPLIT * ((groups + KSPLIT - 1) / KSPLIT) * kZxMaxM * 4 : 0;
    if (xs_bytes > 16 * 1024) return cudaErrorInvalidValue;  // static (<= 30 KB) + dynamic stays under 48 KB
    return launch_maybe_pdl(w4a16_mma_kernel<BF16, MT, GT, KSPLIT, DEPTH, LOADS_ONLY, ZX>, dim3(grid), dim3(KSPLIT * 32),
                            static_cast<size_t>(xs_bytes), stream, pdl, static_cast<const uint4*>(qw),
                            static_cast<const uint32_t*>(meta), static_cast<const uint16_t*>(x), bias, y, M, N, K,
                            tiles_per_cta, pf_tiles);
}

template <bool BF16, int MT, int GT>
cudaError_t launch_split(int ksplit, int depth, int mode, const void* qw, const void* meta, const void* x,
                         const float* bias, void* y, int M, int N, int K, int tiles_per_cta, int pf_tiles, bool pdl,
                         cudaStream_t stream) {
#define EDGEVLM_W4A16_CASE(KS, D)                                                                        \
    if (ksplit == KS && depth == D) {                                                                    \
        if (mode == 1)                                                                                   \
            return launch_typed<BF16, MT, GT, KS, D, true>(qw, meta, x, bias, y, M, N, K, tiles_per_cta, pf_tiles, pdl, stream); \
        if constexpr (MT == 1)                                                                           \
            if (mode == 0 && M <= kZxMaxM)                                                               \
                return launch_typed<BF16, MT, GT, KS, D, false, true>(qw, meta, x, bias, y, M, N, K,     \
                                                                      tiles_per_cta, pf_tiles, pdl, stream);           \
        return launch_typed<BF16, MT, GT, KS, D, false>(qw, meta, x, bias, y, M, N, K, tiles_per_cta, pf_tiles, pdl, stream); \
    }
    EDGEVLM_W4A16_CASE(4, 2)
    EDGEVLM_W4A16_CASE(4, 4)
    EDGEVLM_W4A16_CASE(4, 8)
    EDGEVLM_W4A16_CASE(8, 2)
    EDGEVLM_W4A16_CASE(8, 4)
    EDGEVLM_W4A16_CASE(16, 2)
    EDGEVLM_W4A16_CASE(16, 4)
#undef EDGEVLM_W4A16_CASE
    return cudaErrorInvalidValue;
}

// Entry point of the torch binding (w4a16_mma_ext.cpp). mode 0 computes (with the ZX fold at M <= 4);
// mode 2 computes without the ZX fold; mode 1 is the loads-only diagnostic (wrong results by design). Returns cudaErrorInvalidValue for an unsupported
// (group_size, ksplit, depth, M, tiles_per_cta) or a shape that is not a multiple of the tiles; else the
// launch's error.
cudaError_t launch_w4a16_mma(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                             int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta, int mode,
                             int pf_tiles, bool pdl, cudaStream_t stream) {
    if (M < 1 || M > 16 || N % 16 || K % 64 || (group_size != 64 && group_size != 128) || K % group_size ||
        tiles_per_cta < 1 || mode < 0 || mode > 2 || pf_tiles < 0)
        return cudaErrorInvalidValue;
    const bool two = M > 8;
    const bool g128 = group_size == 128;
#define EDGEVLM_W4A16_TYPE(B)                                                                                   \
    if (two)                                                                                                    \
        return g128 ? launch_split<B, 2, 2>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, pf_tiles, pdl, stream) \
                    : launch_split<B, 2, 1>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, pf_tiles, pdl, stream); \
    return g128 ? launch_split<B, 1, 2>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, pf_tiles, pdl, stream)    \
                : launch_split<B, 1, 1>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, pf_tiles, pdl, stream);
    if (bf16) {
        EDGEVLM_W4A16_TYPE(true)
    }
    EDGEVLM_W4A16_TYPE(false)
#undef EDGEVLM_W4A16_TYPE
}

}  // namespace edgevlm_w4a16
