// W4A16 prefill helper: dequantize canonical INT4 rows into a dense bf16/fp16 weight in one pass
// (read 0.5 byte + scale/zero, write 2 bytes per weight), for `dequantize + cuBLAS` prefill.
//
// Canonical layout (edgevlm.runtime.int4): qweight uint8 (N, K/2), byte j of row n = q[n, 2j] (low nibble)
// | q[n, 2j + 1] << 4; scales fp16 (N, K/g); zeros uint8 (N, K/g). W[n, k] = (q - zero) * scale computed in
// fp32 and rounded once to the output type (bit-identical to edgevlm.runtime.int4.dequantize_int4).
// Rows [row0, row0 + rows) only: prefill may dequantize a weight
// in row chunks that stay in L2 for the matmul that follows.

#include "w4a16_common.cuh"

namespace edgevlm_w4a16 {

template <bool BF16>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (BF16) {
        const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&v);
    } else {
        const __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<const uint32_t*>(&v);
    }
}

// One thread turns one 32-bit word of qweight (8 weights) into one 16-byte store, so a warp reads 128
// contiguous bytes and writes 512 (coalesced both ways); WORDS words per thread, strided by the block.
template <bool BF16, int WORDS>
__global__ void __launch_bounds__(256)
w4a16_dequant_kernel(const uint32_t* __restrict__ qweight, const __half* __restrict__ scales,
                     const uint8_t* __restrict__ zeros, uint4* __restrict__ out, int K, int group_size, unsigned words) {
    grid_dep_launch();
    const unsigned base = blockIdx.x * (256u * WORDS) + threadIdx.x;
    const unsigned per_row = static_cast<unsigned>(K) >> 3;
    const unsigned groups = static_cast<unsigned>(K / group_size);
    uint32_t q[WORDS];
#pragma unroll
    for (int v = 0; v < WORDS; ++v) {  // all loads first: WORDS independent loads in flight per thread
        const unsigned c = base + v * 256u;
        q[v] = c < words ? __ldcs(qweight + c) : 0u;
    }
    grid_dep_wait();  // PDL: `out` may still be read by the previous kernel (a reused buffer)
#pragma unroll
    for (int v = 0; v < WORDS; ++v) {
        const unsigned c = base + v * 256u;
        if (c >= words) break;
        const unsigned n = c / per_row;
        const unsigned k0 = (c - n * per_row) << 3;
        const unsigned gi = n * groups + k0 / static_cast<unsigned>(group_size);
        const float s = __half2float(scales[gi]);
        const float zb = 8388608.f + static_cast<float>(zeros[gi]);  // 2^23 + zero
        uint32_t o[4];
#pragma unroll
        for (int p = 0; p < 4; ++p) {  // 2^23 + q as a float bit pattern, minus (2^23 + zero): q - zero, exact
            const float lo = __uint_as_float(((q[v] >> (8 * p)) & 0xFu) | 0x4B000000u) - zb;
            const float hi = __uint_as_float(((q[v] >> (8 * p + 4)) & 0xFu) | 0x4B000000u) - zb;
            o[p] = pack2<BF16>(lo * s, hi * s);
        }
        out[c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
}

// qweight/scales/zeros point at row `row0` of the canonical tensors; out is (rows, K) contiguous.
cudaError_t launch_w4a16_dequant(bool bf16, const void* qweight, const void* scales, const void* zeros, void* out,
                                 int rows, int K, int group_size, bool pdl, cudaStream_t stream) {
    if (rows < 1 || K % 32 || (group_size != 32 && group_size != 64 && group_size != 128) || K % group_size)
        return cudaErrorInvalidValue;
    constexpr int kWords = 4;
    const long long words = static_cast<long long>(rows) * (K / 8);
    if (words >= (1LL << 31)) return cudaErrorInvalidValue;  // 32-bit indexing (a 2^34-weight chunk)
    const unsigned blocks = static_cast<unsigned>((words + 256 * kWords - 1) / (256 * kWords));
    return launch_maybe_pdl(bf16 ? &w4a16_dequant_kernel<true, kWords> : &w4a16_dequant_kernel<false, kWords>,
                            dim3(blocks), dim3(256), 0, stream, pdl, static_cast<const uint32_t*>(qweight),
                            static_cast<const __half*>(scales), static_cast<const uint8_t*>(zeros),
                            static_cast<uint4*>(out), K, group_size, static_cast<unsigned>(words));
}

}  // namespace edgevlm_w4a16
