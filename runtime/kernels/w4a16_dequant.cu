// W4A16 prefill helper: dequantize canonical INT4 rows into a dense bf16/fp16 weight in one pass
// (read 0.5 byte + scale/zero, write 2 bytes per weight), for `dequantize + cuBLAS` prefill.
//
// Canonical layout (edgevlm.runtime.int4): qweight uint8 (N, K/2), byte j of row n = q[n, 2j] (low nibble)
// | q[n, 2j + 1] << 4; scales fp16 (N, K/g); zeros uint8 (N, K/g). W[n, k] = (q - zero) * scale computed in
// fp32 and rounded once to the output type (bit-identical to edgevlm.runtime.int4.dequantize_int4).
// One thread turns 16 bytes of qweight (32 weights of one group: 32 divides every supported group size)
// into 64 output bytes (four 16-byte stores). Rows [row0, row0 + rows) only: prefill may dequantize a weight
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

template <bool BF16>
__global__ void __launch_bounds__(256)
w4a16_dequant_kernel(const uint4* __restrict__ qweight, const __half* __restrict__ scales,
                     const uint8_t* __restrict__ zeros, uint4* __restrict__ out, int K, int group_size, long long chunks) {
    const long long c = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;  // 32-weight chunk
    if (c >= chunks) return;
    const int per_row = K >> 5;
    const long long n = c / per_row;
    const int k0 = static_cast<int>(c - n * per_row) << 5;
    const int groups = K / group_size;
    const long long gi = n * groups + k0 / group_size;
    const float s = __half2float(scales[gi]);
    const float z = static_cast<float>(zeros[gi]);
    const uint4 q = ld_stream(qweight + c);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
    uint32_t o[16];
#pragma unroll
    for (int w = 0; w < 4; ++w)
#pragma unroll
        for (int p = 0; p < 4; ++p) {
            const uint32_t byte = (words[w] >> (8 * p)) & 0xFFu;
            const float lo = (static_cast<float>(byte & 0xFu) - z) * s;
            const float hi = (static_cast<float>(byte >> 4) - z) * s;
            o[w * 4 + p] = pack2<BF16>(lo, hi);
        }
    uint4* dst = out + c * 4;
#pragma unroll
    for (int v = 0; v < 4; ++v) dst[v] = make_uint4(o[4 * v], o[4 * v + 1], o[4 * v + 2], o[4 * v + 3]);
}

// qweight/scales/zeros point at row `row0` of the canonical tensors; out is (rows, K) contiguous.
cudaError_t launch_w4a16_dequant(bool bf16, const void* qweight, const void* scales, const void* zeros, void* out,
                                 int rows, int K, int group_size, cudaStream_t stream) {
    if (rows < 1 || K % 32 || (group_size != 32 && group_size != 64 && group_size != 128) || K % group_size)
        return cudaErrorInvalidValue;
    const long long chunks = static_cast<long long>(rows) * (K / 32);
    const unsigned blocks = static_cast<unsigned>((chunks + 255) / 256);
    if (bf16)
        w4a16_dequant_kernel<true><<<blocks, 256, 0, stream>>>(
            static_cast<const uint4*>(qweight), static_cast<const __half*>(scales), static_cast<const uint8_t*>(zeros),
            static_cast<uint4*>(out), K, group_size, chunks);
    else
        w4a16_dequant_kernel<false><<<blocks, 256, 0, stream>>>(
            static_cast<const uint4*>(qweight), static_cast<const __half*>(scales), static_cast<const uint8_t*>(zeros),
            static_cast<uint4*>(out), K, group_size, chunks);
    return cudaGetLastError();
}

}  // namespace edgevlm_w4a16
