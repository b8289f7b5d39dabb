"""``edgevlm doctor``'s software rows: ``python``, ``edgevlm``, ``torch``, ``cuda``, ``int4 kernels``,
``tensorrt``, ``onnxruntime``, ``opencv`` and ``capture path``. See :mod:`edgevlm.daemon.doctor`."""

from __future__ import annotations

import platform
import re
import shutil
import sys
from pathlib import Path

from edgevlm.daemon.doctor_host import CheckResult, _fail, _Host, _ok, _warn


def _check_python() -> CheckResult:
    return _ok("python", f"{platform.python_version()} ({sys.executable})")


def _check_edgevlm() -> CheckResult:
    import edgevlm

    return _ok("edgevlm", f"{getattr(edgevlm, '__version__', '?')} ({Path(edgevlm.__file__).parent})")


def _check_torch(h: _Host) -> CheckResult:
    try:
        import torch
    except ImportError:
        hint = (
            "install NVIDIA's PyTorch wheel for this JetPack"
            if h.is_jetson
            else "pip install 'edgevlm[runtime]'"
        )
        verdict = _fail if h.backend == "torch" else _warn
        return verdict("torch", f"not installed: {hint}")
    where = Path(torch.__file__).parent
    return _ok("torch", f"{torch.__version__} ({where})")


def _check_cuda(h: _Host) -> CheckResult:
    try:
        import torch
    except ImportError:
        return _warn("cuda", "torch not installed")
    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        names = ", ".join(
            f"{torch.cuda.get_device_name(i)} (sm_{''.join(map(str, torch.cuda.get_device_capability(i)))})"
            for i in range(n)
        )
        return _ok("cuda", f"CUDA {torch.version.cuda}, {n} device(s): {names}")
    built = torch.version.cuda
    if h.is_jetson:
        why = "torch has no CUDA build: was JetPack's torch replaced by a PyPI wheel?" if not built else (
            f"torch built for CUDA {built} sees no GPU: is the user in the video/render groups?"
        )  # fmt: skip
        return _fail("cuda", why)
    if h.model_device.startswith("cuda"):
        return _fail("cuda", f"config asks for model.device={h.model_device} but torch sees no CUDA device")
    return _warn("cuda", "no CUDA device: the model runs on the CPU")


def _check_int4(h: _Host) -> CheckResult:
    try:
        import torch
    except ImportError:
        return _warn("int4 kernels", "torch not installed")
    ops = torch.ops.aten
    have = [n for n in ("_weight_int4pack_mm", "_weight_int4pack_mm_for_cpu") if hasattr(ops, n)]
    if not have:
        return _warn(
            "int4 kernels", f"torch {torch.__version__} has no int4 kernels: INT4 bundles dequantize (slower)"
        )
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    try:
        from edgevlm.runtime.int4 import kernel_convention
    except Exception as exc:  # noqa: BLE001 - the runtime may be missing its extra
        return _ok("int4 kernels", f"present: {', '.join(have)} (not probed: {exc})")
    chosen = {d: kernel_convention(torch.device(d)) for d in devices}
    working = {d: c for d, c in chosen.items() if c}
    detail = f"present: {', '.join(have)}; working: " + (
        ", ".join(f"{d}={c}" for d, c in working.items()) or "none"
    )
    if "cuda" in chosen and not chosen["cuda"]:
        return _warn("int4 kernels", detail + " (CUDA INT4 layers will dequantize)")
    if not working:
        return _warn("int4 kernels", detail + " (INT4 layers will dequantize)")
    return _ok("int4 kernels", detail)


def _check_tensorrt(h: _Host) -> CheckResult:
    try:
        import tensorrt
    except Exception as exc:  # noqa: BLE001 - ImportError or a broken install (OSError on libs)
        why = f"not importable ({type(exc).__name__})"
        if h.backend == "tensorrt":
            return _fail("tensorrt", f"{why} but config uses backend tensorrt")
        hint = "install JetPack's python3-libnvinfer" if h.is_jetson else "optional backend"
        return _warn("tensorrt", f"{why}: {hint}")
    return _ok("tensorrt", f"{tensorrt.__version__}")


def _check_onnxruntime(h: _Host) -> CheckResult:
    try:
        import onnxruntime
    except Exception as exc:  # noqa: BLE001
        why = f"not importable ({type(exc).__name__})"
        if h.backend == "onnx":
            return _fail(
                "onnxruntime", f"{why} but config uses backend onnx: pip install 'edgevlm[onnx]'"
            )
        return _warn("onnxruntime", f"{why}: optional backend (pip install 'edgevlm[onnx]')")
    providers = onnxruntime.get_available_providers()
    detail = f"{onnxruntime.__version__}, providers: {', '.join(providers)}"
    accel = {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
    if h.is_jetson and not accel & set(providers):
        return _warn("onnxruntime", detail + " (CPU only: install the Jetson onnxruntime-gpu wheel)")
    return _ok("onnxruntime", detail)


def _check_opencv(h: _Host) -> list[CheckResult]:
    try:
        import cv2
    except Exception as exc:  # noqa: BLE001
        return [
            _fail("opencv", f"not importable ({type(exc).__name__}): pip install 'edgevlm[runtime]'"),
            _warn("capture path", "no OpenCV"),
        ]
    m = re.search(r"GStreamer:\s*(\w+)", cv2.getBuildInformation())
    gst = bool(m and m.group(1).upper() == "YES")
    rows = [_ok("opencv", f"{cv2.__version__} ({'with' if gst else 'without'} GStreamer)")]
    gst_launch = shutil.which("gst-launch-1.0")
    wants_gst = h.config is not None and any(s.kind == "gstreamer" for s in h.config.sources)
    if gst:
        rows.append(_ok("capture path", "GStreamer pipelines through OpenCV's GStreamer backend"))
    elif gst_launch:
        rows.append(
            _ok(
                "capture path",
                f"GStreamer pipelines through a {gst_launch} subprocess (OpenCV lacks GStreamer)",
            )
        )
    elif wants_gst:
        rows.append(
            _fail(
                "capture path",
                "a GStreamer source is configured but OpenCV lacks GStreamer and gst-launch-1.0 is missing",
            )
        )
    else:
        rows.append(
            _warn(
                "capture path", "no GStreamer (OpenCV without it, no gst-launch-1.0): CSI cameras unavailable"
            )
        )
    return rows
