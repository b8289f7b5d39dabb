// Device helpers shared by the W4A16 kernels (w4a16_mma.cu: register ring, sm_80+; w4a16_bulk.cu: bulk
// copies into shared memory, sm_90): the magic-number nibble conversion, bf16x2/f16x2 fma, the
// mma.m16n8k16 wrapper, streaming loads, the bf16/fp16 store. No torch header.
#pragma once

#include <atomic>
#include <cstdint>
#include <cuda_bf16.h>
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

// Weights are read once: keep them out of L1 (the activations live there).
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
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

// The epilogue of one 16-row tile: the fp32 sums acc[MT][4] of warp 0 (mma accumulator layout: lane (g, t) holds
// output rows n0 = tile * 16 + g and n0 + 8, batch rows mt * 8 + 2t + (c & 1)) plus the rows' bias, to y (M, N) in
// the activations' dtype; batch rows >= M are not stored.
template <bool BF16, int MT>
__device__ __forceinline__ void store_tile(void* y, const float (&acc)[MT][4], int M, int N, int n0, int t,
                                           float bias0, float bias1) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int m = mt * 8 + 2 * t + (c & 1);
            if (m < M)
                store_out<BF16>(y, static_cast<size_t>(m) * N + n0 + ((c & 2) ? 8 : 0),
                                acc[mt][c] + ((c & 2) ? bias1 : bias0));
        }
}

// one bf16 / fp16 (low 16 bits of `bits`) as float
template <bool BF16>
__device__ __forceinline__ float to_float(uint32_t bits) {
    if constexpr (BF16) {
        return __uint_as_float(bits << 16);
    } else {
        return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));
    }
}

constexpr int kZxMaxM = 4;  // rows up to which the zero point is folded in through the x sums (ZX)

// ZX: the activation sums X_G[m] of this warp's groups g0 .. g0 + gw - 1 (GT * 64 channels each), rows
// m < M <= kZxMaxM, into xs[gi * kZxMaxM + m] (fp32, shared memory). 16 lanes per (group, row) pair for
// GT = 2 (8 lanes for GT = 1), one 16-byte load each, several pairs' loads in flight; a 16/8-lane butterfly
// sum. The caller syncs the warp before reading xs.
template <bool BF16, int GT>
__device__ __forceinline__ void warp_group_xsums(const uint16_t* __restrict__ x, int K, int M, int g0, int gw,
                                                 float* xs, int lane) {
    constexpr int kLanes = GT * 8;        // 16-byte chunks per group row
    constexpr int kPairs = 32 / kLanes;   // (group, row) pairs per warp pass
    const int sub = lane % kLanes;
    const int pairs = gw * M;
#pragma unroll 4
    for (int p0 = 0; p0 < pairs; p0 += kPairs) {
        const int p = p0 + lane / kLanes;
        float v = 0.f;
        if (p < pairs) {
            const int gi = p / M;
            const int m = p - gi * M;
            const uint4 u = __ldg(reinterpret_cast<const uint4*>(x + static_cast<size_t>(m) * K +
                                                                 static_cast<size_t>(g0 + gi) * GT * 64) + sub);
            v = ((to_float<BF16>(u.x & 0xFFFFu) + to_float<BF16>(u.x >> 16)) +
                 (to_float<BF16>(u.y & 0xFFFFu) + to_float<BF16>(u.y >> 16))) +
                ((to_float<BF16>(u.z & 0xFFFFu) + to_float<BF16>(u.z >> 16)) +
                 (to_float<BF16>(u.w & 0xFFFFu) + to_float<BF16>(u.w >> 16)));
        }
#pragma unroll
        for (int off = kLanes / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
        if (sub == 0 && p < pairs) xs[(p / M) * kZxMaxM + (p % M)] = v;
    }
}

// Programmatic dependent launch (sm_90; no-ops elsewhere). A kernel launched with the programmatic
// stream-serialization attribute may start before the previous kernel in the stream has finished: it
// must not read what that kernel writes, nor write anything, before grid_dep_wait() (which returns once
// the previous grid has completed and its writes are visible; at once when there is none).
// grid_dep_launch() lets the next such kernel be scheduled as soon as every CTA of this grid has run it.
__device__ __forceinline__ void grid_dep_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void grid_dep_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Ask L2 for the 128-byte line holding p (no register is written; sm_80+).
__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Launch `kernel`; with `pdl`, as a programmatic dependent of the previous kernel in the stream (sm_90,
// CUDA >= 11.8; where such a launch is refused it falls back to an ordinary launch, once and for all).
template <typename... KArgs, typename... Args>
cudaError_t launch_maybe_pdl(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                             bool pdl, Args... args) {
#if defined(CUDART_VERSION) && CUDART_VERSION >= 11080
    static bool pdl_refused = false;
    if (pdl && !pdl_refused) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = grid;
        cfg.blockDim = block;
        cfg.dynamicSmemBytes = smem;
        cfg.stream = stream;
        cudaLaunchAttribute attr[1];
        attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attr;
        cfg.numAttrs = 1;
        const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<KArgs>(args)...);
        if (err == cudaSuccess) return cudaGetLastError();
        if (err != cudaErrorNotSupported && err != cudaErrorInvalidValue) return err;
        (void)cudaGetLastError();  // clear it, launch plainly from now on
        pdl_refused = true;
    }
#else
    (void)pdl;
#endif
    kernel<<<grid, block, smem, stream>>>(static_cast<KArgs>(args)...);
    return cudaGetLastError();
}

// Shared-memory address of a generic pointer into shared memory, and 16- / 4-byte shared loads by that address
// (the rings of w4a16_bulk.cu and of w4a16_lean.cu's cp.async variant).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ uint4 lds128(uint32_t addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ uint32_t lds32(uint32_t addr) {
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// Opt Kernel into `bytes` (> 48 KB) of dynamic shared memory on the current device, once per (kernel, device):
// cudaFuncSetAttribute applies to the current device only, so a flag per kernel alone would leave a second GPU
// at the 48 KB default (its launches then fail). Devices 0..63 are remembered; others set it at every call.
template <auto Kernel>
cudaError_t opt_in_dynamic_smem(int bytes) {
    static std::atomic<unsigned long long> done{0};
    int dev = 0;
    cudaError_t err = cudaGetDevice(&dev);
    if (err != cudaSuccess) return err;
    const unsigned long long bit = dev >= 0 && dev < 64 ? 1ull << dev : 0ull;
    if (bit != 0 && (done.load(std::memory_order_acquire) & bit) != 0) return cudaSuccess;
    err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err == cudaSuccess) done.fetch_or(bit, std::memory_order_acq_rel);
    return err;
}

// (a & b) | c in one LOP3 (the compiler splits it in two when b and c are both immediates).
__device__ __forceinline__ uint32_t and_or(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

}  // namespace edgevlm_w4a16
