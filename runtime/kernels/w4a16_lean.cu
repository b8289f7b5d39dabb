// W4A16 decode GEMM, "lean" variant of the register-ring kernel (w4a16_mma.cu): the same layout
// (MMA_LAYOUT_VERSION 1), the same arithmetic in the same order (bit-identical outputs), fewer instructions
// around it. Built by default (EDGEVLM_W4A16_LEAN=0 leaves it out, see w4a16_mma.py): on the H200 it beat the
// register ring on every 7B / Qwen3-VL shape at M = 1..16 (7B qkv at M = 1: 13.93 -> 11.48 us; a 7B layer's
// four matmuls back to back 53.7 -> 47.4 us), bit-identical to it (bench/results/w4a16_kernel_h200_20261202.md).
//
// Why: on the H200 the register ring spends 218 warp instructions per 1 KB item (one 16-row tile x one
// 128-channel group; SASS of the M = 1 instance, bench/results/w4a16_kernel_h200_20261202.md), 115 of them
// the dequantization and mma and ~100 address arithmetic and control: per item it recomputes 64-bit
// addresses of the weights, scales and activations from (tile, group) indices, predicates the activation
// loads of batch columns >= M and zeroes their registers first. The kernel runs at 1.5-2.2x its own
// loads-only time, i.e. the work per byte, not the bytes in flight, limits it. Here:
//   * weights and meta are walked with pointers advanced by constant strides (one 64-bit add per item,
//     one more at a tile boundary);
//   * a lane whose batch column is >= M loads row M - 1 instead of zeros: the mma's output columns are
//     independent, those columns are never stored, so no predicate and no zeroing;
//   * the activation fragments of an item are addressed off one per-warp base with one multiply.
// Everything else (KSPLIT warps split K, DEPTH-deep register ring across tile boundaries, fixed-order
// reduction over the warps, PDL) is as in w4a16_mma.cu.
//
// Tried and reverted (H200, 12-02 session 8, bench/results/w4a16_kernel_h200_20261202.md): the zero point folded
// out of the inner loop (bias + q straight into the mma, plus a second mma per k16 step with the constant A
// fragment -(bias + zero) on the same activations). 158 -> 141 warp instructions per 1 KB item at M = 1, within
// 1.3e-4 of the register ring, but 2-33 % slower on every 7B / Qwen3-VL shape at M = 1, 8, 16 (7B down M = 1
// 11.08 -> 14.72 us; a 7B layer's four matmuls 47.8 -> 53.0 us). Where the register count stayed (gate_up (8, 2):
// 64) it lost 2-4 %: 16 instead of 8 mma per item cost more than the 32 fma2 they replaced; where it grew
// (down (16, 2): 64 -> 76 registers, one 512-thread CTA per SM instead of two) it lost up to a third.
// Also tried and reverted (H200, 12-03 session 16, bench/results/session16_h200_20261203/): each item taken out of
// its ring slot and the slot refilled before the item's compute (DEPTH loads in flight during it instead of
// DEPTH - 1; the refill's loads moved ahead of the HMMAs in the SASS). Bit-identical, but registers 64 -> 78-80 for
// (4, 2) and the gated (8, 2), 96 -> 117 for (8, 4) (nvcc 13, sm_90), and slower: the decode step 1.841-1.855 ->
// 1.882 ms at batch 1, 2.589-2.605 -> 2.755 at batch 8; 7B gate/up at M = 1 19.30 -> 20.29 us.
//
// LATE_TRIGGER (-DEDGEVLM_W4A16_LEAN_TRIGGER: built by default for sm_90+ since session 11, see
// w4a16_mma.lean_trigger_build; EDGEVLM_W4A16_LEAN_TRIGGER=1 / 0 forces it either way):
// under PDL the next kernel is released once every CTA has issued its last weight load (the ring's last refill)
// instead of at entry. At entry, the next kernel's CTAs take SM slots while this grid's partial last wave still
// runs; on the H200 the lean kernel gained less from PDL than the register ring and lost on some shapes
// (bench/results/w4a16_kernel_h200_20261202.md). Only the release point moves: the arithmetic, the order and the
// outputs are the same (bit-identical).

// GATED (the fused gate/up projection of a gated MLP, SwiGLU / GeGLU): the weight's rows come interleaved per 16-row
// tile (rows 0-7 of tile j are gate channels 8j..8j+7, rows 8-15 the up channels of the same indices;
// int4_format.gated_row_order), so the lane that holds a gate output (mma rows g) holds its up partner too (rows
// g + 8), and the epilogue writes act(gate) * up, (M, N / 2), in fp32 from the fp32 sums (+ bias) with one rounding:
// decode steps of up to w4a16_mma.GATED_MAX_M rows run no separate SiLU*up kernel and write no (M, N) intermediate.
// act: 0 SiLU, 1 tanh-approximated GELU, each computed as g * sigmoid(.) (decode_fused.gated_act's formulas). Same
// loads and mma as the plain kernel.

#include "w4a16_common.cuh"

namespace edgevlm_w4a16 {

// cp.async (sm_80+, PTX ISA 7.0): 16 bytes global -> shared through L2 only (.cg), 4 bytes through L1 (.ca);
// one commit group per ring slot; wait until at most N of this thread's groups are pending.
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async4(uint32_t dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Bytes of one ring slot of the ASYNC ring: GT x 512 bytes of weights (lane-major 16-byte chunks) + 16 meta words.
template <int GT>
__host__ __device__ constexpr int async_slot_bytes() {
    return GT * 512 + 64;
}

// act(gate) * up of the GATED epilogue (act 0: SiLU, else the tanh-approximated GELU), fp32.
__device__ __forceinline__ float gated_value(float gate, float up, int act) {
    const float z = act == 0 ? gate : 1.5957691216057308f * (gate + 0.044715f * gate * gate * gate);  // 2 sqrt(2/pi)
    return gate / (1.f + __expf(-z)) * up;
}

template <bool BF16, int MT, int GT, int KSPLIT, int DEPTH, bool LATE_TRIGGER = false, bool ASYNC = false,
          bool GATED = false>
__global__ void __launch_bounds__(KSPLIT * 32)
w4a16_lean_kernel(const uint4* __restrict__ qw, const uint32_t* __restrict__ meta, const uint16_t* __restrict__ x,
                  const float* __restrict__ bias, void* __restrict__ y, int M, int N, int K, int tiles_per_cta,
                  int act) {
    using M16 = Magic<BF16>;
    if constexpr (!LATE_TRIGGER) grid_dep_launch();  // PDL: the next kernel may be scheduled once every CTA runs
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int kblocks = K >> 6;
    const int groups = kblocks / GT;
    const int g0 = static_cast<int>(static_cast<long long>(groups) * warp / KSPLIT);
    const int gw = static_cast<int>(static_cast<long long>(groups) * (warp + 1) / KSPLIT) - g0;
    const int gmax = (groups + KSPLIT - 1) / KSPLIT;  // items per tile, the same for every warp
    const int tile0 = blockIdx.x * tiles_per_cta;
    const int ntiles = min(tiles_per_cta, N / 16 - tile0);
    const int total = ntiles * gmax;
    const uint32_t kMask = 0x000F000Fu;
    const uint32_t kBias = M16::kBias2;

    // the next item to load: pointers walked by constant strides (gmax items per tile, the last gmax - gw of
    // them not loaded); at a tile boundary they jump to the next tile's first group of this warp
    const uint4* wp = qw + (static_cast<size_t>(tile0) * kblocks + static_cast<size_t>(g0) * GT) * 32 + lane;
    const uint32_t* mp = meta + (static_cast<size_t>(tile0) * groups + g0) * 16 + g;
    const size_t wjump = static_cast<size_t>(kblocks - gmax * GT) * 32;
    const size_t mjump = static_cast<size_t>(groups - gmax) * 16;
    int ld_left = total, ld_local = 0;

    // activations: lane (g, t) of batch tile mt reads row mt * 8 + g (row M - 1 past the last row: its
    // output column is computed and never stored), 16 consecutive channels per 64-block from 16 t
    const uint4* xb0[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
        xb0[mt] = reinterpret_cast<const uint4*>(x + static_cast<size_t>(min(mt * 8 + g, M - 1)) * K) + 2 * t +
                  static_cast<size_t>(g0) * GT * 8;

    // the ring: registers (ASYNC false) or, per warp, DEPTH slots of shared memory filled by cp.async (ASYNC
    // true: the loads in flight cost no registers; the lanes g of t == 0 copy the slot's 16 meta words)
    uint4 wb[DEPTH][GT];  // unused (and compiled away) with ASYNC
    uint32_t mb[DEPTH][2];
    extern __shared__ __align__(16) unsigned char lean_ring[];
    constexpr int kSlot = async_slot_bytes<GT>();
    const uint32_t ring = ASYNC ? smem_addr(lean_ring) + warp * DEPTH * kSlot : 0u;
#define EDGEVLM_LEAN_LOAD(SLOT)                                                                      \
    do {                                                                                             \
        if constexpr (ASYNC) {                                                                       \
            if (ld_left > 0 && ld_local < gw) {                                                      \
                const uint32_t dst = ring + (SLOT) * kSlot;                                          \
                _Pragma("unroll") for (int i = 0; i < GT; ++i) cp_async16(dst + i * 512 + lane * 16, wp + i * 32); \
                if (t == 0) {                                                                        \
                    cp_async4(dst + GT * 512 + 4 * g, mp);                                           \
                    cp_async4(dst + GT * 512 + 4 * (g + 8), mp + 8);                                 \
                }                                                                                    \
            }                                                                                        \
            cp_async_commit(); /* one group per slot, empty or not: the wait below counts them */    \
        } else if (ld_left > 0 && ld_local < gw) {                                                   \
            _Pragma("unroll") for (int i = 0; i < GT; ++i) wb[SLOT][i] = ld_stream(wp + i * 32);     \
            mb[SLOT][0] = __ldg(mp);                                                                 \
            mb[SLOT][1] = __ldg(mp + 8);                                                             \
        }                                                                                            \
        if (--ld_left == 0 && LATE_TRIGGER) grid_dep_launch(); /* the last refill: release the next */ \
        wp += GT * 32;                                                                               \
        mp += 16;                                                                                    \
        if (++ld_local == gmax) {                                                                    \
            ld_local = 0;                                                                            \
            wp += wjump;                                                                             \
            mp += mjump;                                                                             \
        }                                                                                            \
    } while (0)
#pragma unroll
    for (int s = 0; s < DEPTH; ++s) EDGEVLM_LEAN_LOAD(s);
    grid_dep_wait();  // PDL: only weights were read so far; x (and y) may belong to the previous kernel

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
                if (cur_local < gw) {
                    uint4 wv[GT];
                    uint32_t m0, m1;
                    if constexpr (ASYNC) {  // this slot's group landed (the newer DEPTH - 1 may still fly)
                        cp_async_wait<DEPTH - 1>();
                        __syncwarp();  // the meta words copied by the lanes t == 0 are visible to the warp
                        const uint32_t src = ring + s * kSlot;
#pragma unroll
                        for (int i = 0; i < GT; ++i) wv[i] = lds128(src + i * 512 + lane * 16);
                        m0 = lds32(src + GT * 512 + 4 * g);
                        m1 = lds32(src + GT * 512 + 4 * (g + 8));
                    } else {
#pragma unroll
                        for (int i = 0; i < GT; ++i) wv[i] = wb[s][i];
                        m0 = mb[s][0];
                        m1 = mb[s][1];
                    }
                    uint4 xf[MT][GT][2];  // this item's B fragments (L1-resident activations)
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        const uint4* p = xb0[mt] + cur_local * (GT * 8);
#pragma unroll
                        for (int i = 0; i < GT; ++i) {
                            xf[mt][i][0] = __ldg(p + i * 8);
                            xf[mt][i][1] = __ldg(p + i * 8 + 1);
                        }
                    }
                    const uint32_t nz0 = (M16::kNegBias + (m0 >> 16)) * 0x10001u;  // -(bias + zero)
                    const uint32_t nz1 = (M16::kNegBias + (m1 >> 16)) * 0x10001u;
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
                            const uint32_t w = word_of(wv[i], j);
                            uint32_t a[4];
#pragma unroll
                            for (int r = 0; r < 4; ++r) {
                                const uint32_t v = and_or(r == 0 ? w : (w >> (4 * r)), kMask, kBias);
                                a[r] = fma2<BF16>(v, M16::kOne2, (r & 1) ? nz1 : nz0);  // q - zero, exact
                            }
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt) {
                                const uint4& xq = xf[mt][i][j >> 1];
                                mma16816<BF16>(gacc[j & 1][mt], a, (j & 1) ? xq.z : xq.x, (j & 1) ? xq.w : xq.y);
                            }
                        }
                    }
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        acc[mt][0] = fmaf(s0, gacc[0][mt][0] + gacc[1][mt][0], acc[mt][0]);
                        acc[mt][1] = fmaf(s0, gacc[0][mt][1] + gacc[1][mt][1], acc[mt][1]);
                        acc[mt][2] = fmaf(s1, gacc[0][mt][2] + gacc[1][mt][2], acc[mt][2]);
                        acc[mt][3] = fmaf(s1, gacc[0][mt][3] + gacc[1][mt][3], acc[mt][3]);
                    }
                }
                if constexpr (ASYNC) __syncwarp();  // every lane has read slot s before it is re-filled
                EDGEVLM_LEAN_LOAD(s);
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
                        if constexpr (GATED) {  // rows g: gate, rows g + 8: up of output channel tile * 8 + g
                            const int ch = (tile0 + cur_tile) * 8 + g;
#pragma unroll
                            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                                for (int c = 0; c < 2; ++c) {
                                    const int m = mt * 8 + 2 * t + c;
                                    if (m < M)
                                        store_out<BF16>(y, static_cast<size_t>(m) * (N / 2) + ch,
                                                        gated_value(acc[mt][c] + bias0, acc[mt][c + 2] + bias1, act));
                                }
                        } else {
                            store_tile<BF16, MT>(y, acc, M, N, n0, t, bias0, bias1);
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
            }
        }
    }
#undef EDGEVLM_LEAN_LOAD
}

// One lean instance: the dynamic shared memory of its cp.async ring opted into first (ASYNC), then the launch.
template <bool BF16, int MT, int GT, int KSPLIT, int DEPTH, bool LATE_TRIGGER, bool ASYNC, bool GATED>
cudaError_t lean_launch_instance(const void* qw, const void* meta, const void* x, const float* bias, void* y, int M,
                                 int N, int K, int tiles_per_cta, bool pdl, int act, cudaStream_t stream) {
    constexpr auto kernel = w4a16_lean_kernel<BF16, MT, GT, KSPLIT, DEPTH, LATE_TRIGGER, ASYNC, GATED>;
    const size_t smem = ASYNC ? static_cast<size_t>(KSPLIT) * DEPTH * async_slot_bytes<GT>() : 0;
    if constexpr (ASYNC) {
        const cudaError_t err = opt_in_dynamic_smem<kernel>(static_cast<int>(smem));
        if (err != cudaSuccess) return err;
    }
    const int grid = (N / 16 + tiles_per_cta - 1) / tiles_per_cta;
    return launch_maybe_pdl(kernel, dim3(grid), dim3(KSPLIT * 32), smem, stream, pdl, static_cast<const uint4*>(qw),
                            static_cast<const uint32_t*>(meta), static_cast<const uint16_t*>(x), bias, y, M, N, K,
                            tiles_per_cta, act);
}

template <bool BF16, int MT, int GT, int KSPLIT, int DEPTH, bool ASYNC = false, bool GATED = false>
cudaError_t lean_launch_typed(const void* qw, const void* meta, const void* x, const float* bias, void* y, int M,
                              int N, int K, int tiles_per_cta, bool pdl, bool late_trigger, int act,
                              cudaStream_t stream) {
#ifdef EDGEVLM_W4A16_LEAN_TRIGGER
    if (late_trigger)
        return lean_launch_instance<BF16, MT, GT, KSPLIT, DEPTH, true, ASYNC, GATED>(qw, meta, x, bias, y, M, N, K,
                                                                                    tiles_per_cta, pdl, act, stream);
#else
    if (late_trigger) return cudaErrorInvalidValue;  // not compiled in (a build without -DEDGEVLM_W4A16_LEAN_TRIGGER)
#endif
    return lean_launch_instance<BF16, MT, GT, KSPLIT, DEPTH, false, ASYNC, GATED>(qw, meta, x, bias, y, M, N, K,
                                                                                 tiles_per_cta, pdl, act, stream);
}

template <bool BF16, int MT, int GT>
cudaError_t lean_launch_cfg(int ksplit, int depth, bool async_ring, int act, const void* qw, const void* meta,
                            const void* x, const float* bias, void* y, int M, int N, int K, int tiles_per_cta, bool pdl,
                            bool late_trigger, cudaStream_t stream) {
#define EDGEVLM_W4A16_LEAN_CASE(KS, D, A, G)                                                                     \
    if (ksplit == KS && depth == D && async_ring == A && (act >= 0) == G)                                        \
        return lean_launch_typed<BF16, MT, GT, KS, D, A, G>(qw, meta, x, bias, y, M, N, K, tiles_per_cta, pdl,   \
                                                            late_trigger, act, stream);
    EDGEVLM_W4A16_LEAN_CASE(4, 2, false, false)
    EDGEVLM_W4A16_LEAN_CASE(4, 4, false, false)
    EDGEVLM_W4A16_LEAN_CASE(8, 2, false, false)
    EDGEVLM_W4A16_LEAN_CASE(8, 3, false, false)
    EDGEVLM_W4A16_LEAN_CASE(8, 4, false, false)
    EDGEVLM_W4A16_LEAN_CASE(16, 2, false, false)
    EDGEVLM_W4A16_LEAN_CASE(16, 3, false, false)
    EDGEVLM_W4A16_LEAN_CASE(16, 4, false, false)
    // the cp.async ring (ASYNC_CONFIGS of w4a16_mma.py): (KSPLIT, slots per warp)
    EDGEVLM_W4A16_LEAN_CASE(4, 4, true, false)
    EDGEVLM_W4A16_LEAN_CASE(4, 8, true, false)
    EDGEVLM_W4A16_LEAN_CASE(8, 4, true, false)
    EDGEVLM_W4A16_LEAN_CASE(8, 8, true, false)
    EDGEVLM_W4A16_LEAN_CASE(16, 2, true, false)
    EDGEVLM_W4A16_LEAN_CASE(16, 4, true, false)
    // the gated-MLP epilogue (GATED_CONFIGS of w4a16_mma.py): register ring only
    EDGEVLM_W4A16_LEAN_CASE(4, 2, false, true)
    EDGEVLM_W4A16_LEAN_CASE(4, 4, false, true)
    EDGEVLM_W4A16_LEAN_CASE(8, 2, false, true)
    EDGEVLM_W4A16_LEAN_CASE(8, 3, false, true)
    EDGEVLM_W4A16_LEAN_CASE(8, 4, false, true)
#undef EDGEVLM_W4A16_LEAN_CASE
    return cudaErrorInvalidValue;
}

// Entry point of the torch binding (w4a16_mma_ext.cpp, built with -DEDGEVLM_W4A16_LEAN). Same contract as
// launch_w4a16_mma with mode 2 (no x-sum fold, no prefetch); returns cudaErrorInvalidValue for an unsupported
// (group_size, ksplit, depth, M, tiles_per_cta, act) or shape, and for late_trigger in a build without
// -DEDGEVLM_W4A16_LEAN_TRIGGER. late_trigger: the PDL release after the last ring refill (see LATE_TRIGGER).
// async_ring: the ring in shared memory filled by cp.async (ASYNC; depth = slots per warp). act: -1 the plain
// product y (M, N); 0 / 1 the GATED epilogue, y (M, N / 2) = SiLU / tanh-GELU (gate) * up, for a weight whose rows
// are interleaved by int4_format.gated_row_order (register ring only).
cudaError_t launch_w4a16_lean(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                              int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta, bool pdl,
                              bool late_trigger, bool async_ring, int act, cudaStream_t stream) {
    if (M < 1 || M > 16 || N % 16 || K % 64 || (group_size != 64 && group_size != 128) || K % group_size ||
        tiles_per_cta < 1 || act < -1 || act > 1)
        return cudaErrorInvalidValue;
    const bool two = M > 8;
    const bool g128 = group_size == 128;
#define EDGEVLM_W4A16_LEAN_TYPE(B)                                                                                    \
    if (two)                                                                                                          \
        return g128 ? lean_launch_cfg<B, 2, 2>(ksplit, depth, async_ring, act, qw, meta, x, bias, y, M, N, K,         \
                                               tiles_per_cta, pdl, late_trigger, stream)                              \
                    : lean_launch_cfg<B, 2, 1>(ksplit, depth, async_ring, act, qw, meta, x, bias, y, M, N, K,         \
                                               tiles_per_cta, pdl, late_trigger, stream);                             \
    return g128 ? lean_launch_cfg<B, 1, 2>(ksplit, depth, async_ring, act, qw, meta, x, bias, y, M, N, K,             \
                                           tiles_per_cta, pdl, late_trigger, stream)                                  \
                : lean_launch_cfg<B, 1, 1>(ksplit, depth, async_ring, act, qw, meta, x, bias, y, M, N, K,             \
                                           tiles_per_cta, pdl, late_trigger, stream);
    if (bf16) {
        EDGEVLM_W4A16_LEAN_TYPE(true)
    }
    EDGEVLM_W4A16_LEAN_TYPE(false)
#undef EDGEVLM_W4A16_LEAN_TYPE
}

}  // namespace edgevlm_w4a16
