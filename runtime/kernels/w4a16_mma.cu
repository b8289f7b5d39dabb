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
// (1024 + q for fp16), fed to the mma as they are; a second mma with an all-ones A sums the activations,
// and each group's fp32 result is scale * (sum (128 + q) x - (128 + zero) * sum x): the zero point and the
// scale cost a few fp32 operations per group instead of one 16-bit operation per weight, and every
// product is exact (more accurate than scaling each weight in 16 bits).
//
// Schedule: one CTA per 16-row n-tile (or `tiles_per_cta` consecutive ones); its KSPLIT warps split the
// groups of K; each warp streams its weight words through its own STAGES-deep shared-memory ring of
// cp.async copies (the bytes in flight cost no registers), then the warps' fp32 partials are summed in
// shared memory in a fixed order (deterministic: no atomics), bias added, stored.
// This file includes no torch header: `nvcc -arch=sm_87 -c w4a16_mma.cu` checks it stand-alone.

#include <cstdint>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace edgevlm_w4a16 {

template <bool BF16>
struct Magic;
template <>
struct Magic<true> {                          // bf16: 7 mantissa bits, 128 + q exact for q < 128
    static constexpr uint32_t kBias2 = 0x43004300u;   // 128.0, 128.0
    static constexpr uint32_t kNegBias = 0xC300u;     // -128.0; + zero -> -(128 + zero)
    static constexpr uint32_t kOne2 = 0x3F803F80u;    // 1.0, 1.0
};
template <>
struct Magic<false> {                         // fp16: 10 mantissa bits, 1024 + q exact
    static constexpr uint32_t kBias2 = 0x64006400u;
    static constexpr uint32_t kNegBias = 0xE400u;
    static constexpr uint32_t kOne2 = 0x3C003C00u;
};

template <bool BF16>
__device__ __forceinline__ uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    if constexpr (BF16) {
        asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    } else {
        asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    }
    return d;
}

template <bool BF16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    if constexpr (BF16) {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    } else {
        asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
            "{%0,%1,%2,%3};"
            : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
            : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    }
}

__device__ __forceinline__ uint32_t word_of(const uint4& v, int j) {
    return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}


template <bool BF16>
__device__ __forceinline__ void store_out(void* y, size_t idx, float v) {
    if constexpr (BF16) {
        // round to nearest even, as __float2bfloat16_rn
        uint32_t u = __float_as_uint(v);
        uint16_t out;
        if ((u & 0x7F800000u) == 0x7F800000u && (u & 0x007FFFFFu)) {
            out = static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
        } else {
            u += 0x7FFFu + ((u >> 16) & 1u);
            out = static_cast<uint16_t>(u >> 16);
        }
        static_cast<uint16_t*>(y)[idx] = out;
    } else {
        static_cast<__half*>(y)[idx] = __float2half_rn(v);
    }
}

// (a & b) | c in one LOP3 (the compiler splits it in two when b and c are both immediates).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Asynchronous global -> shared copies (sm_80+): the bytes in flight live in shared memory, not registers.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    const uint32_t s = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Shared memory of one warp's ring stage: GT x 32 lanes x 16 B of weights, then 2 x 32 lanes x 4 B of meta.
template <int GT>
struct Stage {
    static constexpr int kU4 = GT * 32 + 16;
};

// MT: 8-column batch tiles (1: M <= 8, 2: M <= 16). GT: 64-channel blocks per group (1: g 64, 2: g 128).
// KSPLIT warps split the groups of K; each warp keeps STAGES - 1 groups of cp.async copies in flight in
// its own shared-memory ring (each lane copies and later reads only its own bytes: no barrier needed); a
// CTA streams `tiles_per_cta` consecutive 16-row tiles with the ring running across tile boundaries.
// Zero points: the mma sums (128 + q) x (the raw magic-number values), a second mma with an all-ones A
// sums x, and the group result is scale * (sum_qx - (128 + zero) * sum_x): no per-weight subtraction.
// LOADS_ONLY (diagnostic): stream the weights through the ring and fold them into the output without
// any arithmetic.
template <bool BF16, int MT, int GT, int KSPLIT, int STAGES, bool LOADS_ONLY>
__global__ void __launch_bounds__(KSPLIT * 32)
w4a16_mma_kernel(const uint4* __restrict__ qw, const uint32_t* __restrict__ meta, const uint16_t* __restrict__ x,
                 const float* __restrict__ bias, void* __restrict__ y, int M, int N, int K, int tiles_per_cta) {
    using M16 = Magic<BF16>;
    constexpr int kStageU4 = Stage<GT>::kU4;
    extern __shared__ uint4 ring_all[];
    __shared__ float red[2][KSPLIT > 1 ? KSPLIT - 1 : 1][MT * 4][32];
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
    const uint32_t kOnes[4] = {M16::kOne2, M16::kOne2, M16::kOne2, M16::kOne2};
    uint4* ring = ring_all + warp * STAGES * kStageU4;

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

    int pf_tile = 0, pf_local = 0, pf_slot = 0;  // the next item to copy
    auto issue = [&]() {
        if (pf_tile < ntiles && pf_local < gw) {
            const int grp = g0 + pf_local;
            const size_t tile = static_cast<size_t>(tile0 + pf_tile);
            uint4* st = ring + pf_slot * kStageU4;
#pragma unroll
            for (int i = 0; i < GT; ++i)
                cp_async16(st + i * 32 + lane, wbase + (tile * kblocks + static_cast<size_t>(grp * GT + i)) * 32);
            uint32_t* ms = reinterpret_cast<uint32_t*>(st + GT * 32);
            const uint32_t* mp = mbase + (tile * groups + grp) * 16;
            cp_async4(ms + lane, mp);
            cp_async4(ms + 32 + lane, mp + 8);
        }
        cp_async_commit();  // possibly empty: keeps the group count uniform
        if (++pf_local == gmax) {
            pf_local = 0;
            ++pf_tile;
        }
        pf_slot = pf_slot + 1 == STAGES ? 0 : pf_slot + 1;
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue();

    float acc[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[mt][c] = 0.f;

    int cur_tile = 0, cur_local = 0, cur_slot = 0, parity = 0;
    for (int it = 0; it < total; ++it) {  // uniform over the CTA: every warp walks gmax items per tile
        cp_async_wait<STAGES - 2>();  // this lane's copies of item `it` have landed
        issue();                      // item it + STAGES - 1, into the slot read by the previous item
        if (cur_local < gw) {
            const uint4* st = ring + cur_slot * kStageU4;
            uint4 wv[GT];
#pragma unroll
            for (int i = 0; i < GT; ++i) wv[i] = st[i * 32 + lane];
            const uint32_t* ms = reinterpret_cast<const uint32_t*>(st + GT * 32);
            const uint32_t m0 = ms[lane];
            const uint32_t m1 = ms[32 + lane];
            if constexpr (LOADS_ONLY) {
#pragma unroll
                for (int i = 0; i < GT; ++i)
                    acc[0][0] += __uint_as_float((wv[i].x ^ wv[i].y ^ wv[i].z ^ wv[i].w ^ m0 ^ m1) & 0x3F800000u);
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
                float gacc[2][MT][4];  // sum (bias + q) x: two independent mma chains (even / odd k-tiles)
                float xsum[MT][4];     // sum x per batch column (rows all equal)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        gacc[0][mt][c] = 0.f;
                        gacc[1][mt][c] = 0.f;
                        xsum[mt][c] = 0.f;
                    }
#pragma unroll
                for (int i = 0; i < GT; ++i) {
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const uint32_t w = word_of(wv[i], j);
                        uint32_t a[4];
#pragma unroll
                        for (int r = 0; r < 4; ++r) a[r] = and_or(r == 0 ? w : (w >> (4 * r)), kMask, kBias);
#pragma unroll
                        for (int mt = 0; mt < MT; ++mt) {
                            const uint4& xq = xb[mt][i][j >> 1];
                            const uint32_t b0 = (j & 1) ? xq.z : xq.x;
                            const uint32_t b1 = (j & 1) ? xq.w : xq.y;
                            mma16816<BF16>(gacc[j & 1][mt], a, b0, b1);
                            mma16816<BF16>(xsum[mt], kOnes, b0, b1);
                        }
                    }
                }
                const float s0 = __half2float(__ushort_as_half(static_cast<unsigned short>(m0 & 0xFFFFu)));
                const float s1 = __half2float(__ushort_as_half(static_cast<unsigned short>(m1 & 0xFFFFu)));
                const float bias_const = BF16 ? 128.f : 1024.f;
                const float zb0 = bias_const + static_cast<float>(m0 >> 16);
                const float zb1 = bias_const + static_cast<float>(m1 >> 16);
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    acc[mt][0] = fmaf(s0, fmaf(-zb0, xsum[mt][0], gacc[0][mt][0] + gacc[1][mt][0]), acc[mt][0]);
                    acc[mt][1] = fmaf(s0, fmaf(-zb0, xsum[mt][1], gacc[0][mt][1] + gacc[1][mt][1]), acc[mt][1]);
                    acc[mt][2] = fmaf(s1, fmaf(-zb1, xsum[mt][2], gacc[0][mt][2] + gacc[1][mt][2]), acc[mt][2]);
                    acc[mt][3] = fmaf(s1, fmaf(-zb1, xsum[mt][3], gacc[0][mt][3] + gacc[1][mt][3]), acc[mt][3]);
                }
            }
        }
        if (cur_local == gmax - 1) {  // the tile is done: fixed-order reduction over the warps
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
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) {
                        const int m = mt * 8 + 2 * t + (c & 1);
                        const int n = n0 + ((c & 2) ? 8 : 0);
                        if (m < M)
                            store_out<BF16>(y, static_cast<size_t>(m) * N + n, acc[mt][c] + ((c & 2) ? bias1 : bias0));
                    }
            }
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[mt][c] = 0.f;
            parity ^= 1;
            ++cur_tile;
            cur_local = 0;
        } else {
            ++cur_local;
        }
        cur_slot = cur_slot + 1 == STAGES ? 0 : cur_slot + 1;
    }
    cp_async_wait<0>();
}

template <bool BF16, int MT, int GT, int KSPLIT, int STAGES, bool LOADS_ONLY>
cudaError_t launch_typed(const void* qw, const void* meta, const void* x, const float* bias, void* y, int M, int N,
                         int K, int tiles_per_cta, cudaStream_t stream) {
    auto kernel = w4a16_mma_kernel<BF16, MT, GT, KSPLIT, STAGES, LOADS_ONLY>;
    const int smem = KSPLIT * STAGES * Stage<GT>::kU4 * 16;
    if (smem > 48 * 1024) {
        const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (err != cudaSuccess) return err;  // more than this GPU gives a block
    }
    const int tiles = N / 16;
    const int grid = (tiles + tiles_per_cta - 1) / tiles_per_cta;
    kernel<<<grid, KSPLIT * 32, smem, stream>>>(static_cast<const uint4*>(qw), static_cast<const uint32_t*>(meta),
                                                 static_cast<const uint16_t*>(x), bias, y, M, N, K, tiles_per_cta);
    return cudaGetLastError();
}

template <bool BF16, int MT, int GT>
cudaError_t launch_split(int ksplit, int stages, int mode, const void* qw, const void* meta, const void* x,
                         const float* bias, void* y, int M, int N, int K, int tiles_per_cta, cudaStream_t stream) {
#define EDGEVLM_W4A16_CASE(KS, S)                                                                         \
    if (ksplit == KS && stages == S)                                                                      \
        return mode == 1 ? launch_typed<BF16, MT, GT, KS, S, true>(qw, meta, x, bias, y, M, N, K, tiles_per_cta, \
                                                                   stream)                               \
                         : launch_typed<BF16, MT, GT, KS, S, false>(qw, meta, x, bias, y, M, N, K,       \
                                                                    tiles_per_cta, stream);
    EDGEVLM_W4A16_CASE(4, 4)
    EDGEVLM_W4A16_CASE(4, 8)
    EDGEVLM_W4A16_CASE(8, 4)
    EDGEVLM_W4A16_CASE(8, 8)
    EDGEVLM_W4A16_CASE(16, 4)
    EDGEVLM_W4A16_CASE(16, 8)
#undef EDGEVLM_W4A16_CASE
    return cudaErrorInvalidValue;
}

// Entry point of the torch binding (w4a16_mma_ext.cpp). `depth` is the number of ring stages (STAGES - 1
// groups of copies in flight per warp). mode 0 computes; mode 1 is the loads-only diagnostic (wrong results
// by design). Returns cudaErrorInvalidValue for an unsupported (group_size, ksplit, depth, M, tiles_per_cta)
// or a shape that is not a multiple of the tiles; else the launch's error.
cudaError_t launch_w4a16_mma(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                             int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta, int mode,
                             cudaStream_t stream) {
    if (M < 1 || M > 16 || N % 16 || K % 64 || (group_size != 64 && group_size != 128) || K % group_size ||
        tiles_per_cta < 1 || (mode != 0 && mode != 1))
        return cudaErrorInvalidValue;
    const bool two = M > 8;
    const bool g128 = group_size == 128;
#define EDGEVLM_W4A16_TYPE(B)                                                                                   \
    if (two)                                                                                                    \
        return g128 ? launch_split<B, 2, 2>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, stream) \
                    : launch_split<B, 2, 1>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, stream); \
    return g128 ? launch_split<B, 1, 2>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, stream)    \
                : launch_split<B, 1, 1>(ksplit, depth, mode, qw, meta, x, bias, y, M, N, K, tiles_per_cta, stream);
    if (bf16) {
        EDGEVLM_W4A16_TYPE(true)
    }
    EDGEVLM_W4A16_TYPE(false)
#undef EDGEVLM_W4A16_TYPE
}

}  // namespace edgevlm_w4a16
