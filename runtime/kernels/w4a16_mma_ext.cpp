// torch binding of the W4A16 tensor-core decode kernel (w4a16_mma.cu); built on first use by
// edgevlm.runtime.kernels.w4a16_mma through torch.utils.cpp_extension.load.
#include <torch/extension.h>

#include <optional>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

namespace edgevlm_w4a16 {
cudaError_t launch_w4a16_mma(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                             int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta,
                             int mode, int pf_tiles, bool pdl, cudaStream_t stream);
cudaError_t launch_w4a16_bulk(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                              int M, int N, int K, int group_size, int warps, int stages, int tiles_per_cta,
                              bool allow_zx, bool pdl, cudaStream_t stream);
cudaError_t launch_w4a16_dequant(bool bf16, const void* qweight, const void* scales, const void* zeros, void* out,
                                 int rows, int K, int group_size, bool pdl, cudaStream_t stream);
#ifdef EDGEVLM_W4A16_LEAN
cudaError_t launch_w4a16_lean(bool bf16, const void* qw, const void* meta, const void* x, const float* bias, void* y,
                              int M, int N, int K, int group_size, int ksplit, int depth, int tiles_per_cta, bool pdl,
                              bool late_trigger, bool async_ring, int act, cudaStream_t stream);
#endif
}

// x (M, K) bf16/fp16 contiguous, qw int32 (N/16, K/64, 32, 4), meta int32 (N/16, K/g, 16), bias float32 (N,)
// or None -> y (M, N) in x's dtype. ksplit/depth: a compiled pair; tiles_per_cta >= 1; mode 0 (x-sum
// zero-point fold at M <= 4) or 2 (without it); mode 1 is
// the loads-only diagnostic of bench/w4a16_marlin.py: wrong results by design). pf_tiles: L2 prefetch
// distance in 16-row tiles (0: none); pdl: launch as a programmatic dependent (sm_90).
torch::Tensor w4a16_mma(torch::Tensor x, torch::Tensor qw, torch::Tensor meta, std::optional<torch::Tensor> bias,
                        int64_t group_size, int64_t ksplit, int64_t depth, int64_t tiles_per_cta,
                        int64_t mode, int64_t pf_tiles, bool pdl) {
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
        static_cast<int>(mode), static_cast<int>(pf_tiles), pdl, at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "w4a16_mma: launch failed: ", cudaGetErrorString(err));
    return y;
}

#ifdef EDGEVLM_W4A16_LEAN
// The lean register-ring variant (w4a16_lean.cu; built unless EDGEVLM_W4A16_LEAN=0): same tensors and function as
// w4a16_mma (mode 2), M <= 16; ksplit/depth a compiled pair of that file. late_trigger: release the PDL dependent after the last ring
// refill instead of at entry (only in a build with -DEDGEVLM_W4A16_LEAN_TRIGGER; else the launch fails).
// async_ring: the ring of weight loads in shared memory, filled by cp.async (depth = slots per warp).
// The argument checks of both lean bindings (`who` names the function in the messages); returns the bias pointer.
static const float* check_lean_args(const char* who, const torch::Tensor& x, const torch::Tensor& qw,
                                    const torch::Tensor& meta, const std::optional<torch::Tensor>& bias,
                                    int64_t group_size) {
    TORCH_CHECK(x.is_cuda() && qw.is_cuda() && meta.is_cuda(), who, ": tensors must be on a CUDA device");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), who, ": x must be a contiguous (M, K) tensor");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, who, ": x must be bf16 or fp16");
    TORCH_CHECK(qw.scalar_type() == at::kInt && qw.dim() == 4 && qw.is_contiguous() && qw.size(2) == 32 &&
                    qw.size(3) == 4,
                who, ": qw must be a contiguous int32 (N/16, K/64, 32, 4) tensor");
    TORCH_CHECK(meta.scalar_type() == at::kInt && meta.dim() == 3 && meta.is_contiguous() && meta.size(2) == 16,
                who, ": meta must be a contiguous int32 (N/16, K/g, 16) tensor");
    const int64_t M = x.size(0), K = x.size(1), N = qw.size(0) * 16;
    TORCH_CHECK(M >= 1 && M <= 16, who, ": M must be 1..16, got ", M);
    TORCH_CHECK(qw.size(1) * 64 == K, who, ": x has ", K, " input channels, the weight ", qw.size(1) * 64);
    TORCH_CHECK(group_size == 64 || group_size == 128, who, ": group_size must be 64 or 128");
    TORCH_CHECK(meta.size(0) == qw.size(0) && meta.size(1) * group_size == K, who, ": meta does not match");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0,
                who, ": x and qw must be 16-byte aligned");
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                    who, ": bias must be a contiguous float32 (N,) tensor");
        return bias->data_ptr<float>();
    }
    return nullptr;
}

torch::Tensor w4a16_lean(torch::Tensor x, torch::Tensor qw, torch::Tensor meta, std::optional<torch::Tensor> bias,
                         int64_t group_size, int64_t ksplit, int64_t depth, int64_t tiles_per_cta, bool pdl,
                         bool late_trigger, bool async_ring) {
    const float* bias_ptr = check_lean_args("w4a16_lean", x, qw, meta, bias, group_size);
    const int64_t M = x.size(0), K = x.size(1), N = qw.size(0) * 16;
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = torch::empty({M, N}, x.options());
    const cudaError_t err = edgevlm_w4a16::launch_w4a16_lean(
        x.scalar_type() == at::kBFloat16, qw.data_ptr(), meta.data_ptr(), x.data_ptr(), bias_ptr, y.data_ptr(),
        static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(group_size),
        static_cast<int>(ksplit), static_cast<int>(depth), static_cast<int>(tiles_per_cta), pdl, late_trigger,
        async_ring, -1, at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "w4a16_lean: launch failed: ", cudaGetErrorString(err));
    return y;
}

// The lean kernel with the gated-MLP epilogue (w4a16_lean.cu, GATED): qw/meta/bias of the fused gate/up weight with
// its rows interleaved per 16-row tile (int4_format.gated_row_order), y (M, N / 2) = act(gate) * up in x's dtype;
// act 0 SiLU, 1 tanh-approximated GELU; ksplit/depth a pair of w4a16_mma.GATED_CONFIGS.
torch::Tensor w4a16_lean_gated(torch::Tensor x, torch::Tensor qw, torch::Tensor meta,
                               std::optional<torch::Tensor> bias, int64_t group_size, int64_t ksplit, int64_t depth,
                               int64_t tiles_per_cta, bool pdl, bool late_trigger, int64_t act) {
    const float* bias_ptr = check_lean_args("w4a16_lean_gated", x, qw, meta, bias, group_size);
    TORCH_CHECK(act == 0 || act == 1, "w4a16_lean_gated: act must be 0 (SiLU) or 1 (GELU, tanh), got ", act);
    const int64_t M = x.size(0), K = x.size(1), N = qw.size(0) * 16;
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = torch::empty({M, N / 2}, x.options());
    const cudaError_t err = edgevlm_w4a16::launch_w4a16_lean(
        x.scalar_type() == at::kBFloat16, qw.data_ptr(), meta.data_ptr(), x.data_ptr(), bias_ptr, y.data_ptr(),
        static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(group_size),
        static_cast<int>(ksplit), static_cast<int>(depth), static_cast<int>(tiles_per_cta), pdl, late_trigger, false,
        static_cast<int>(act), at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "w4a16_lean_gated: launch failed: ", cudaGetErrorString(err));
    return y;
}
#endif

// The sm_90 bulk-copy variant (w4a16_bulk.cu): same tensors as w4a16_mma, M up to 32; warps/stages a compiled
// pair (4 or 8 each), tiles_per_cta >= 1; allow_zx: the x-sum zero-point fold at M <= 4 (false: diagnostic).
torch::Tensor w4a16_bulk(torch::Tensor x, torch::Tensor qw, torch::Tensor meta, std::optional<torch::Tensor> bias,
                         int64_t group_size, int64_t warps, int64_t stages, int64_t tiles_per_cta, bool allow_zx,
                         bool pdl) {
    TORCH_CHECK(x.is_cuda() && qw.is_cuda() && meta.is_cuda(), "w4a16_bulk: tensors must be on a CUDA device");
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "w4a16_bulk: x must be a contiguous (M, K) tensor");
    TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf, "w4a16_bulk: x must be bf16 or fp16");
    TORCH_CHECK(qw.scalar_type() == at::kInt && qw.dim() == 4 && qw.is_contiguous() && qw.size(2) == 32 &&
                    qw.size(3) == 4,
                "w4a16_bulk: qw must be a contiguous int32 (N/16, K/64, 32, 4) tensor");
    TORCH_CHECK(meta.scalar_type() == at::kInt && meta.dim() == 3 && meta.is_contiguous() && meta.size(2) == 16,
                "w4a16_bulk: meta must be a contiguous int32 (N/16, K/g, 16) tensor");
    const int64_t M = x.size(0), K = x.size(1), N = qw.size(0) * 16;
    TORCH_CHECK(M >= 1 && M <= 32, "w4a16_bulk: M must be 1..32, got ", M);
    TORCH_CHECK(qw.size(1) * 64 == K, "w4a16_bulk: x has ", K, " input channels, the weight ", qw.size(1) * 64);
    TORCH_CHECK(group_size == 64 || group_size == 128, "w4a16_bulk: group_size must be 64 or 128");
    TORCH_CHECK(meta.size(0) == qw.size(0) && meta.size(1) * group_size == K, "w4a16_bulk: meta does not match");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0 && reinterpret_cast<uintptr_t>(qw.data_ptr()) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(meta.data_ptr()) % 16 == 0,
                "w4a16_bulk: x, qw and meta must be 16-byte aligned");
    const float* bias_ptr = nullptr;
    if (bias.has_value() && bias->defined()) {
        TORCH_CHECK(bias->is_cuda() && bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                    "w4a16_bulk: bias must be a contiguous float32 (N,) tensor");
        bias_ptr = bias->data_ptr<float>();
    }
    const c10::cuda::CUDAGuard guard(x.device());
    auto y = torch::empty({M, N}, x.options());
    const cudaError_t err = edgevlm_w4a16::launch_w4a16_bulk(
        x.scalar_type() == at::kBFloat16, qw.data_ptr(), meta.data_ptr(), x.data_ptr(), bias_ptr, y.data_ptr(),
        static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), static_cast<int>(group_size),
        static_cast<int>(warps), static_cast<int>(stages), static_cast<int>(tiles_per_cta), allow_zx, pdl,
        at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "w4a16_bulk: launch failed: ", cudaGetErrorString(err));
    return y;
}

// Canonical INT4 rows [row0, row0 + rows) -> dense (rows, K) in bf16 (bf16 true) or fp16, written into out when given.
torch::Tensor w4a16_dequant(torch::Tensor qweight, torch::Tensor scales, torch::Tensor zeros, int64_t group_size,
                            int64_t row0, int64_t rows, bool bf16, std::optional<torch::Tensor> out, bool pdl) {
    const at::ScalarType dtype = bf16 ? at::kBFloat16 : at::kHalf;
    TORCH_CHECK(qweight.is_cuda() && scales.is_cuda() && zeros.is_cuda(), "w4a16_dequant: tensors must be on CUDA");
    TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.dim() == 2 && qweight.is_contiguous(),
                "w4a16_dequant: qweight must be a contiguous uint8 (N, K/2) tensor");
    const int64_t N = qweight.size(0), K = qweight.size(1) * 2;
    TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128, "w4a16_dequant: bad group_size");
    TORCH_CHECK(K % group_size == 0 && K % 32 == 0, "w4a16_dequant: K must be a multiple of 32 and of group_size");
    TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.is_contiguous() && scales.numel() == N * (K / group_size),
                "w4a16_dequant: scales must be a contiguous float16 (N, K/g) tensor");
    TORCH_CHECK(zeros.scalar_type() == at::kByte && zeros.is_contiguous() && zeros.numel() == N * (K / group_size),
                "w4a16_dequant: zeros must be a contiguous uint8 (N, K/g) tensor");
    TORCH_CHECK(row0 >= 0 && rows >= 1 && row0 + rows <= N, "w4a16_dequant: rows out of range");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(qweight.data_ptr()) % 16 == 0, "w4a16_dequant: qweight must be 16-byte aligned");
    const c10::cuda::CUDAGuard guard(qweight.device());
    torch::Tensor y;
    if (out.has_value() && out->defined()) {
        y = *out;
        TORCH_CHECK(y.is_cuda() && y.scalar_type() == dtype && y.is_contiguous() && y.numel() >= rows * K,
                    "w4a16_dequant: out must be a contiguous tensor of dtype with >= rows * K elements");
        y = y.view({-1}).narrow(0, 0, rows * K).view({rows, K});
    } else {
        y = torch::empty({rows, K}, qweight.options().dtype(dtype));
    }
    const int64_t groups = K / group_size;
    const cudaError_t err = edgevlm_w4a16::launch_w4a16_dequant(
        dtype == at::kBFloat16, static_cast<const uint8_t*>(qweight.data_ptr()) + row0 * (K / 2),
        static_cast<const at::Half*>(scales.data_ptr()) + row0 * groups, static_cast<const uint8_t*>(zeros.data_ptr()) + row0 * groups,
        y.data_ptr(), static_cast<int>(rows), static_cast<int>(K), static_cast<int>(group_size), pdl,
        at::cuda::getCurrentCUDAStream());
    TORCH_CHECK(err == cudaSuccess, "w4a16_dequant: launch failed: ", cudaGetErrorString(err));
    return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("w4a16_mma", &w4a16_mma, "W4A16 decode GEMM on the tensor cores (M <= 16)");
    m.def("w4a16_bulk", &w4a16_bulk, "W4A16 decode GEMM, sm_90 bulk-copy variant (M <= 32)");
    m.def("w4a16_dequant", &w4a16_dequant, "canonical INT4 rows -> dense bf16/fp16 (prefill)");
#ifdef EDGEVLM_W4A16_LEAN
    m.def("w4a16_lean", &w4a16_lean, "W4A16 decode GEMM, lean register-ring variant (M <= 16)");
    m.def("w4a16_lean_gated", &w4a16_lean_gated, "W4A16 decode GEMM with the gated-MLP epilogue (M <= 16)");
#endif
#ifdef EDGEVLM_W4A16_LEAN_TRIGGER
    m.attr("lean_late_trigger") = true;  // the late-trigger instances are compiled in
#else
    m.attr("lean_late_trigger") = false;
#endif
}
