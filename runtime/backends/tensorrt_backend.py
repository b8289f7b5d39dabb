"""TensorRT backend: the vision encoder runs as the bundle's TensorRT engine
(``tensorrt/vision.engine``, one optimization profile spanning the resolution ladder, built by
:mod:`edgevlm.quantize.tensorrt_build`); the decoder runs the bundle's ONNX decoder through
onnxruntime with the TensorRT/CUDA execution providers, because its INT4 ``MatMulNBits`` layers
are an onnxruntime contrib op that TensorRT's ONNX parser does not implement.

TensorRT Python API used (TensorRT 10): ``trt.Runtime.deserialize_cuda_engine``,
``ICudaEngine.create_execution_context``, ``IExecutionContext.set_input_shape`` /
``get_tensor_shape`` / ``set_tensor_address`` / ``execute_async_v3``. Buffers are torch CUDA
tensors. Needs ``tensorrt`` (``pip install 'edgevlm[tensorrt]'``, or JetPack's build) and a
CUDA device; importing this module without tensorrt raises ImportError, which the backend
registry reports as a ModelLoadError naming the extra.

Not run on the development machines (no tensorrt, no GPU): only the import guard and the error
paths are tested here.
"""

from __future__ import annotations

import logging
from pathlib import Path

import tensorrt as trt
import torch

from edgevlm.errors import ModelLoadError
from edgevlm.runtime.backends.onnx_backend import OnnxBackend, check_options
from edgevlm.runtime.loader import ModelFiles
from edgevlm.types import OperatingPoint

logger = logging.getLogger(__name__)

ENGINE_PATH = Path("tensorrt") / "vision.engine"


class TensorRTBackend(OnnxBackend):
    """TensorRT vision engine + onnxruntime decoder (see the module docstring)."""

    name = "tensorrt"

    def __init__(self, files: ModelFiles, *, device: torch.device, max_seq_len: int) -> None:
        if device.type != "cuda":
            raise ModelLoadError("the tensorrt backend needs a CUDA device (device='cuda')")
        super().__init__(files, device=device, max_seq_len=max_seq_len)
        path = Path(files.model_dir) / ENGINE_PATH
        if not path.is_file():
            raise ModelLoadError(f"bundle {files.model_dir} has no {ENGINE_PATH} (built only where tensorrt "
                                 "was importable at `edgevlm quantize` time)")
        self._trt_logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._trt_logger)
        self._engine = self._runtime.deserialize_cuda_engine(path.read_bytes())
        if self._engine is None:
            raise ModelLoadError(f"{path}: TensorRT cannot deserialize the engine (built for another "
                                 "TensorRT version or GPU?)")
        self._context = self._engine.create_execution_context()
        self._stream = torch.cuda.Stream(device=device)

    def encode_image(self, pixel_values: torch.Tensor, *, operating_point: OperatingPoint | None = None
                     ) -> torch.Tensor:
        x = pixel_values.to(self.device, torch.float32).contiguous()  # (1, 3, H, W)
        ctx = self._context
        if not ctx.set_input_shape("pixel_values", tuple(x.shape)):
            raise ValueError(f"input {tuple(x.shape)} is outside the engine's optimization profile")
        out = torch.empty(tuple(ctx.get_tensor_shape("image_features")), dtype=torch.float32, device=self.device)
        ctx.set_tensor_address("pixel_values", x.data_ptr())
        ctx.set_tensor_address("image_features", out.data_ptr())
        if not ctx.execute_async_v3(self._stream.cuda_stream):
            raise RuntimeError("TensorRT execution failed")
        self._stream.synchronize()
        return out.cpu()  # (1, N, D_text); the onnxruntime decoder takes host arrays

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def load(files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_seq_len: int,
         **options) -> TensorRTBackend:
    """Load a bundle's TensorRT vision engine and ONNX decoder (float32 I/O; ``dtype`` ignored).
    Raises ModelLoadError (see :class:`TensorRTBackend`) or InvalidRequestError for any option."""
    check_options("tensorrt", options)
    return TensorRTBackend(files, device=device, max_seq_len=max_seq_len)
