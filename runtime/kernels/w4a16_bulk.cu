// W4A16 decode GEMM, sm_90 variant: the weights stream through a per-warp shared-memory ring filled by
// the bulk-copy engine (cp.async.bulk, completing on an mbarrier), M = 1..32 activation rows.
//
// Same function, layout (MMA_LAYOUT_VERSION 1) and arithmetic as w4a16_mma.cu: y (M, N) = x (M, K) @ W^T
// + bias over qw uint4 [N/16][K/64][32] and meta u32 [N/16][K/g][16]; exact q - zero into mma.m16n8k16
// (weights as the A operand, activations as B: "swap AB"), fp32 group sums scaled once per group, a
// fixed-order reduction over the warps of a CTA (bit-stable).
//
// What differs is how the weight bytes reach the registers. The register ring of w4a16_mma.cu keeps
// DEPTH groups of 16-byte loads in flight per warp, paid for in registers (occupancy); on the H200 its
// full kernel ran ~1.5x the time of its own loads-only variant (bench/results/w4a16_marlin_h200_20261201.md):
// the stream waited on the dequantization. Here one lane of each warp issues one bulk copy per group
// (GT * 512 bytes of weights + 64 bytes of scale/zero) into a STAGES-deep ring in shared memory, so
// STAGES groups are in flight per warp at no register cost, and a stage is re-filled as soon as the
// warp has read it into registers (before it computes on it). The bulk copy and mbarrier.expect_tx are
// Hopper's (PTX ISA 8.0, sm_90); the ring-of-stages schedule is the usual software pipeline (as in
// CUTLASS's TMA pipelines). Built for sm_90 only; on older GPUs w4a16_mma.cu serves.
//
// MT = 4 (M 17..32, batched decode at batch 32) is served here only: with the weights in shared memory
// the registers left hold four 8-column accumulator tiles.

#include "w4a16_common.cuh"

namespace edgevlm_w4a16 {

__device__ __forceinline__ void mbar_init(uint32_t bar, uint32_t count) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
#endif
}

// lane 0: announce `bytes` of transactions on `bar` and start the two copies (weights, meta)
__device__ __forceinline__ void bulk_issue(uint32_t bar, uint32_t wdst, const void* wsrc, uint32_t wbytes, uint32_t mdst,
                                           const void* msrc, uint32_t mbytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(wbytes + mbytes) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(wdst),
                 "l"(wsrc), "r"(wbytes), "r"(bar)
                 : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(mdst),
                 "l"(msrc), "r"(mbytes), "r"(bar)
                 : "memory");
#endif
}

__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    uint32_t done = 0;
    do {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
#endif
}

template <int MT, int GT, int WARPS, int STAGES>
struct BulkSmem {
    static constexpr int kStageW = GT * 512;  // weight bytes of one (tile, group) item
    static constexpr int kStageM = 64;        // 16 meta words
    static constexpr int kRed = WARPS > 1 ? 2 * (WARPS - 1) * MT * 4 * 32 * 4 : 16;
    static constexpr int kRing = WARPS * STAGES * (kStageW + kStageM);
    static constexpr int kBars = WARPS * STAGES * 8;
    static constexpr int kBytes = kRed + kRing + kBars;  // + the x sums (ZX), sized at launch
};

// WARPS warps split the groups of K of each of the CTA's `tiles_per_cta` 16-row tiles; each warp walks
// its items (tile-major) through its own STAGES-deep ring.
//
// ZX (M <= kZxMaxM): the mma gets the biased codes B + q as they come out of the mask-or (B = 128 for
// bf16, 1024 for fp16; exact), and the group sum is corrected once per group and output row:
// sum_k (q - z) x_k = sum_k (B + q) x_k - (B + z) X_G with X_G = sum of the group's activations (fp32,
// computed once per warp for its groups). This drops the fma per two weights (4 of 12 ALU instructions
// per 32-bit word); the cancellation costs ~1e-5 relative in fp32 (B * |X_G| against the result).
template <bool BF16, int MT, int GT, int WARPS, int STAGES, bool ZX>
__global__ void __launch_bounds__(WARPS * 32)
w4a16_bulk_kernel(const uint4* __restrict__ qw, const uint32_t* __restrict__ meta, const uint16_t* __restrict__ x,
                  const float* __restrict__ bias, void* __restrict__ y, int M, int N, int K, int tiles_per_cta) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using M16 = Magic<BF16>;
    using S = BulkSmem<MT, GT, WARPS, STAGES>;
    extern __shared__ __align__(128) unsigned char smem[];
    float* red = reinterpret_cast<float*>(smem);  // [2][WARPS - 1][MT * 4][32]
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int kblocks = K >> 6;
    const int groups = kblocks / GT;
    const int g0 = static_cast<int>(static_cast<long long>(groups) * warp / WARPS);
    const int gw = static_cast<int>(static_cast<long long>(groups) * (warp + 1) / WARPS) - g0;
    const int gmax = (groups + WARPS - 1) / WARPS;
    const int tile0 = blockIdx.x * tiles_per_cta;
    const int ntiles = min(tiles_per_cta, N / 16 - tile0);
    const int total = ntiles * gw;

    const uint32_t ring = smem_addr(smem + S::kRed) + warp * STAGES * (S::kStageW + S::kStageM);
    const uint32_t bars = smem_addr(smem + S::kRed + S::kRing) + warp * STAGES * 8;
    float* xs = reinterpret_cast<float*>(smem + S::kBytes) + warp * gmax * kZxMaxM;  // [gi][m] (ZX)
    // the next item to issue, walked incrementally (tile-major over this warp's groups)
    const uint4* wsrc = qw + (static_cast<size_t>(tile0) * kblocks + static_cast<size_t>(g0) * GT) * 32;
    const uint32_t* msrc = meta + (static_cast<size_t>(tile0) * groups + g0) * 16;
    int iss_gi = 0, iss_s = 0, issued = 0;
    auto issue_next = [&]() {  // lane 0 only
        bulk_issue(bars + 8 * iss_s, ring + iss_s * S::kStageW, wsrc, S::kStageW,
                   ring + STAGES * S::kStageW + iss_s * S::kStageM, msrc, S::kStageM);
        wsrc += GT * 32;
        msrc += 16;
        if (++iss_gi == gw) {
            iss_gi = 0;
            wsrc += static_cast<size_t>(kblocks - gw * GT) * 32;
            msrc += static_cast<size_t>(groups - gw) * 16;
        }
        iss_s = iss_s + 1 == STAGES ? 0 : iss_s + 1;
        ++issued;
    };
    if (lane == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) mbar_init(bars + 8 * s, 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        for (int s = 0; s < STAGES && issued < total; ++s) issue_next();
    }
    grid_dep_wait();  // PDL: only weights were requested so far; x (and y) may belong to the previous kernel
    // the next kernel may be scheduled once every CTA of this one has passed its wait (not at entry: the step's
    // Triton kernels release theirs after their wait too, so at most one grid waits ahead)
    grid_dep_launch();

    const uint4* xr[MT];
    bool xv[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
        const int m = mt * 8 + g;
        xv[mt] = m < M;
        xr[mt] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(xv[mt] ? m : 0) * K) + 2 * t +
                 static_cast<size_t>(g0) * GT * 8;  // this warp's first group
    }
    if constexpr (ZX) warp_group_xsums<BF16, GT>(x, K, M, g0, gw, xs, lane);  // while the first copies fly
    __syncwarp();
    const uint32_t kMask = 0x000F000Fu;
    const uint32_t kBias = M16::kBias2;

    int item = 0;
    for (int tl = 0; tl < ntiles; ++tl) {
        float acc[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mt][c] = 0.f;
        for (int gi = 0; gi < gw; ++gi, ++item) {
            const int s = item & (STAGES - 1);
            mbar_wait(bars + 8 * s, static_cast<uint32_t>(item / STAGES) & 1u);
            uint4 wv[GT];
#pragma unroll
            for (int i = 0; i < GT; ++i) wv[i] = lds128(ring + s * S::kStageW + i * 512 + lane * 16);
            const uint32_t mbase = ring + STAGES * S::kStageW + s * S::kStageM;
            const uint32_t m0 = lds32(mbase + 4 * g);
            const uint32_t m1 = lds32(mbase + 4 * (g + 8));
            __syncwarp();  // every lane has its words: the stage may be re-filled
            if (lane == 0 && issued < total) issue_next();
            const float s0 = __half2float(__ushort_as_half(static_cast<unsigned short>(m0 & 0xFFFFu)));
            const float s1 = __half2float(__ushort_as_half(static_cast<unsigned short>(m1 & 0xFFFFu)));
            float gacc[2][MT][4];  // two independent mma chains (even / odd k-tiles)
#pragma unroll
            for (int c2 = 0; c2 < 2; ++c2)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) gacc[c2][mt][c] = 0.f;
            uint32_t nz0 = 0, nz1 = 0;
            if constexpr (!ZX) {
                nz0 = (M16::kNegBias + (m0 >> 16)) * 0x10001u;  // -(bias + zero), twice
                nz1 = (M16::kNegBias + (m1 >> 16)) * 0x10001u;
            }
#pragma unroll
            for (int i = 0; i < GT; ++i) {
                uint4 xb[MT][2];  // this 64-block's B fragments (L1-resident activations)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt) {
                    if (xv[mt]) {
                        const uint4* p = xr[mt] + (gi * GT + i) * 8;
                        xb[mt][0] = __ldg(p);
                        xb[mt][1] = __ldg(p + 1);
                    } else {
                        xb[mt][0] = make_uint4(0, 0, 0, 0);
                        xb[mt][1] = make_uint4(0, 0, 0, 0);
                    }
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const uint32_t w = word_of(wv[i], j);
                    uint32_t a[4];
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const uint32_t v = and_or(r == 0 ? w : (w >> (4 * r)), kMask, kBias);  // B + q
                        if constexpr (ZX)
                            a[r] = v;
                        else
                            a[r] = fma2<BF16>(v, M16::kOne2, (r & 1) ? nz1 : nz0);  // q - zero, exact
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const uint4& xq = xb[mt][j >> 1];
                        mma16816<BF16>(gacc[j & 1][mt], a, (j & 1) ? xq.z : xq.x, (j & 1) ? xq.w : xq.y);
                    }
                }
            }
            if constexpr (ZX) {
                // rows g (c 0, 1) and g + 8 (c 2, 3); columns 2t, 2t + 1 (c & 1), only mt = 0 can be < M
                const float b0 = (BF16 ? 128.f : 1024.f) + static_cast<float>(m0 >> 16);
                const float b1 = (BF16 ? 128.f : 1024.f) + static_cast<float>(m1 >> 16);
                const int c0 = 2 * t;
                const float xs0 = c0 < kZxMaxM ? xs[gi * kZxMaxM + c0] : 0.f;
                const float xs1 = c0 + 1 < kZxMaxM ? xs[gi * kZxMaxM + c0 + 1] : 0.f;
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
        // the tile is done: fixed-order reduction over the warps (double-buffered by tile parity)
        float* rbuf = red + (tl & 1) * (WARPS > 1 ? WARPS - 1 : 1) * MT * 4 * 32;
        if (WARPS > 1) {
            if (warp > 0) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) rbuf[((warp - 1) * MT * 4 + mt * 4 + c) * 32 + lane] = acc[mt][c];
            }
            __syncthreads();
        }
        if (warp == 0) {
#pragma unroll 1
            for (int w = 1; w < WARPS; ++w)
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int c = 0; c < 4; ++c) acc[mt][c] += rbuf[((w - 1) * MT * 4 + mt * 4 + c) * 32 + lane];
            const int n0 = (tile0 + tl) * 16 + g;
            const float bias0 = bias != nullptr ? bias[n0] : 0.f;
            const float bias1 = bias != nullptr ? bias[n0 + 8] : 0.f;
            store_tile<BF16, MT>(y, acc, M, N, n0, t, bias0, bias1);
        }
    }
#else
    __trap();  // built for sm_90 only (the launcher refuses older devices)
#endif
}

constexpr int kBulkSmemLimit = 200 * 1024;  // the dynamic shared memory the launcher opts into

template <bool BF16, int MT, int GT, int WARPS, int STAGES, bool ZX>
cudaError_t bulk_launch_typed(const void* qw, const void* meta, const void* x, const float* bias, void* y, int M, int N,
                              int K, int tiles_per_cta, bool pdl, cudaStream_t stream) {
    using S = BulkSmem<MT, GT, WARPS, STAGES>;
    constexpr auto kernel = w4a16_bulk_kernel<BF16, MT, GT, WARPS, STAGES, ZX>;
    const cudaError_t err = opt_in_dynamic_smem<kernel>(kBulkSmemLimit);
    if (err != cudaSuccess) return err;
    const int groups = K / (GT * 64);
    const int bytes = S::kBytes + (ZX ? WARPS * ((groups + WARPS - 1) / WARPS) * kZxMaxM * 4 : 0);
    if (bytes > kBulkSmemLimit) return cudaErrorInvalidValue;
    const int tiles = N / 16;
    const int grid = (tiles + tiles_per_cta - 1) / tiles_per_cta;
    return launch_maybe_pdl(kernel, dim3(grid), dim3(WARPS * 32), static_cast<size_t>(bytes), stream, pdl,
                            static_cast<const uint4*>(qw), static_cast<const uint32_t*>(meta),
                            static_cast<const uint16_t*>(x), bias, y, M, N, K, tiles_per_cta);
}

template <bool BF16, int MT, int GT>
cudaError_t bulk_launch_cfg(int warps, int stages, bool allow_zx, const void* qw, const void* meta, const void* x, const float* bias,
                            void* y, int M, int N, int K, int tiles_per_cta, bool pdl, cudaStream_t stream) {
#define EDGEVLM_W4A16_BULK_CASE(W, ST)                                                                          \
    if (warps == W && stages == ST) {                                                                       \
        if constexpr (MT == 1)                                                                              \
            if (allow_zx && M <= kZxMaxM)                                                                            \
                return bulk_launch_typed<BF16, MT, GT, W, ST, true>(qw, meta, x, bias, y, M, N, K, tiles_per_cta, \
                                                                    pdl, stream);                                \
        return bulk_launch_typed<BF16, MT, GT, W, ST, false>(qw, meta, x, bias, y, M, N, K, tiles_per_cta, pdl, stream); \
    }
    EDGEVLM_W4A16_BULK_CASE(4, 4)
    EDGEVLM_W4A16_BULK_CASE(4, 8)
    EDGEVLM_W4A16_BULK_CASE(8, 4)
    EDGEVLM_W4A16_BULK_CASE(8, 8)
#undef EDGEVLM_W4A16_BULK_CASE
    return cudaErrorInvalidValue;
}

// Entry point of the torch binding (w4a16_mma_ext.cpp). allow_zx: fold the zero point in through the x
// sums where M <= kZxMaxM (false: the diagnostic without). Returns cudaErrorInvalidValue for an
// unsupported (group_size, warps, stages, M, tiles_per_cta) or shape, cudaErrorInvalidDevice on a GPU
// older than sm_90; else the launch's error.
cudaError_t launch_w4a16_bulk(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                              int M, int N, int K, int group_size, int warps, int stages, int tiles_per_cta,
                              bool allow_zx, bool pdl, cudaStream_t stream) {
    if (M < 1 || M > 32 || N % 16 || K % 64 || (group_size != 64 && group_size != 128) || K % group_size ||
        tiles_per_cta < 1)
        return cudaErrorInvalidValue;
    int dev = 0, major = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    if (err != cudaSuccess) return err;
    if (major < 9) return cudaErrorInvalidDevice;
    const bool g128 = group_size == 128;
    const int mt = M <= 8 ? 1 : (M <= 16 ? 2 : 4);
#define EDGEVLM_W4A16_BULK_MT(B, MTV)                                                                              \
    if (mt == MTV)                                                                                                 \
        return g128 ? bulk_launch_cfg<B, MTV, 2>(warps, stages, allow_zx, qw, meta, x, bias, y, M, N, K, tiles_per_cta, pdl, stream) \
                    : bulk_launch_cfg<B, MTV, 1>(warps, stages, allow_zx, qw, meta, x, bias, y, M, N, K, tiles_per_cta, pdl, stream);
    if (bf16) {
        EDGEVLM_W4A16_BULK_MT(true, 1)
        EDGEVLM_W4A16_BULK_MT(true, 2)
        EDGEVLM_W4A16_BULK_MT(true, 4)
    } else {
        EDGEVLM_W4A16_BULK_MT(false, 1)
        EDGEVLM_W4A16_BULK_MT(false, 2)
        EDGEVLM_W4A16_BULK_MT(false, 4)
    }
#undef EDGEVLM_W4A16_BULK_MT
    return cudaErrorInvalidValue;
}

}  // namespace edgevlm_w4a16
