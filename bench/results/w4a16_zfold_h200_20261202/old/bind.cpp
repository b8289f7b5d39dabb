// A/B harness only: the lean kernel as committed before the zero fold (HEAD copy beside this file), built as its
// own extension with its namespace renamed (-Dedgevlm_w4a16=edgevlm_w4a16_old), same call as the ext's w4a16_lean.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>

namespace edgevlm_w4a16 {
cudaError_t launch_w4a16_lean(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                              int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta, bool pdl,
                              bool late_trigger, cudaStream_t stream);
}

torch::Tensor lean_old(torch::Tensor x, torch::Tensor qw, torch::Tensor meta, int64_t g, int64_t ks, int64_t depth,
                       int64_t tpc) {
    TORCH_CHECK(x.is_cuda() && x.is_contiguous() && qw.is_contiguous() && meta.is_contiguous());
    const int64_t M = x.size(0), K = x.size(1), N = qw.size(0) * 16;
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = torch::empty({M, N}, x.options());
    const cudaError_t err = edgevlm_w4a16::launch_w4a16_lean(
        x.scalar_type() == at::kBFloat16, qw.data_ptr(), meta.data_ptr(), x.data_ptr(), nullptr, y.data_ptr(),
        static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(g), static_cast<int>(ks),
        static_cast<int>(depth), static_cast<int>(tpc), false, false, c10::cuda::getCurrentCUDAStream().stream());
    TORCH_CHECK(err == cudaSuccess, "lean_old: ", cudaGetErrorString(err));
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("lean_old", &lean_old); }
