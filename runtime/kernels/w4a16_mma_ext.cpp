// torch binding of the W4A16 tensor-core decode kernel (w4a16_mma.cu); built on first use by
// edgevlm.runtime.kernels.w4a16_mma through torch.utils.cpp_extension.load.
#include <torch/extension.h>

#include <optional>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace edgevlm_w4a16 {
cudaError_t launch_w4a16_mma(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                             int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta,
                             int mode, cudaStream_t stream);
}

// x (M, K) bf16/fp16 contiguous, qw int32 (N/16, K/64, 32, 4), meta int32 (N/16, K/g, 16), bias float32 (N,)
// or None -> y (M, N) in x's dtype. ksplit/depth: a compiled pair; tiles_per_cta >= 1; mode 0 (mode 1 is
// the loads-only diagnostic of bench/w4a16_marlin.py: wrong results by design).
torch::Tensor w4a16_mma(torch::Tensor x, torch::Tensor qw, torch::Tensor meta, std::optional<torch::Tensor> bias,
                        int64_t group_size, int64_t ksplit, int64_t depth, int64_t tiles_per_cta,
                        int64_t mode) {
    TORCH_CHECK(x.is_cuda() && qw.is_cuda() && meta.is_cuda(), "w4a16_mma: tensors must be on a CUDA device");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "w4a16_mma: x must be a contiguous (M, K) tensor");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "w4a16_mma: x must be bf16 or fp16");
    TORCH_CHECK(qw.scalar_type() == at::kInt && qw.dim() == 4 && qw.is_contiguous() && qw.size(2) == 32 &&
                    qw.size(3) == 4,
                "w4a16_mma: qw must be a contiguous int32 (N/16, K/64, 32, 4) tensor");
    TORCH_CHECK(meta.scalar_type() == at::kInt && meta.dim() == 3 && meta.is_contiguous() && meta.size(2) == 16,
                "w4a16_mma: meta must be a contiguous int32 (N/16, K/g, 16) tensor");
    const int64_t M = x.size(0), K = x.size(1), N = qw.size(0) * 16;
    TORCH_CHECK(M >= 1 && M <= 16, "w4a16_mma: M must be 1..16, got ", M);
    TORCH_CHECK(qw.size(1) * 64 == K, "w4a16_mma: x has ", K, " input channels, the weight ", qw.size(1) * 64);
    TORCH_CHECK(group_size == 64 || group_size == 128, "w4a16_mma: group_size must be 64 or 128");
    TORCH_CHECK(meta.size(0) == qw.size(0) && meta.size(1) * group_size == K, "w4a16_mma: meta does not match");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0,
                "w4a16_mma: x and qw must be 16-byte aligned");
    const float* bias_ptr = nullptr;
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                    "w4a16_mma: bias must be a contiguous float32 (N,) tensor");
        bias_ptr = bias->data_ptr<float>();
    }
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = torch::empty({M, N}, x.options());
    const cudaError_t err = edgevlm_w4a16::launch_w4a16_mma(
        x.scalar_type() == at::kBFloat16, qw.data_ptr(), meta.data_ptr(), x.data_ptr(), bias_ptr, y.data_ptr(),
        static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(group_size),
        static_cast<int>(ksplit), static_cast<int>(depth), static_cast<int>(tiles_per_cta),
        static_cast<int>(mode), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "w4a16_mma: launch failed: ", cudaGetErrorString(err));
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("w4a16_mma", &w4a16_mma, "W4A16 decode GEMM on the tensor cores (M <= 16)");
}
