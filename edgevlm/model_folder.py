"""Checks of a model folder that need neither torch nor the weights' contents.

Used by ``edgevlm serve`` and ``edgevlm serve --check-config`` (the ``model.path`` key is checked
before anything is started) and by the runtime's loader (:mod:`edgevlm.runtime.loader`), which
finds its weight files here.

A model folder is a Hugging Face-format checkpoint (``config.json`` plus ``model.safetensors`` or
the shards that ``model.safetensors.index.json`` lists) or an INT4 engine bundle (the same plus
``manifest.json``). Only safetensors weights are accepted: pickle-based files can run code when
loaded.

The safetensors check reads only each file's header (format: https://github.com/huggingface/safetensors,
"Format": an 8-byte little-endian header size ``N``, ``N`` bytes of JSON mapping tensor names to
``{"dtype", "shape", "data_offsets": [begin, end]}`` plus an optional ``__metadata__``, then the
tensor bytes, whose offsets are relative to the end of the header). A file cut short or
overwritten in its header is refused before any tensor is read; flipped bytes inside tensor data
cannot be detected (safetensors has no checksum; engine bundles do: their manifest's SHA-256).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from edgevlm.errors import ModelLoadError

__all__ = ["BUNDLE_BACKEND_FILES", "check_config_model_path", "check_model_folder", "check_safetensors", "read_json",
           "weight_files"]

REFUSED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.gguf", "*.h5", "*.msgpack")
"""Weight-file patterns that are never loaded (pickle-based or not supported)."""

MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
"""Largest safetensors JSON header accepted (the reference implementation's own limit)."""


def read_json(path: Path, *, required: bool = True) -> Any:
    """Parse a JSON file.

    Returns:
        The parsed value; ``None`` when the file is missing and ``required`` is false.

    Raises:
        ModelLoadError: the file is missing (and required), unreadable or not valid JSON; the
            message names the file.
    """
    if not path.is_file():
        if required:
            raise ModelLoadError(f"model folder {path.parent} has no {path.name}")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of ``model.safetensors.index.json``
    (its ``weight_map``), else ``model.safetensors``, else every ``*.safetensors``.

    Raises:
        ModelLoadError: an index that lists a missing shard or has no ``weight_map``, only
            non-safetensors weights (named), or no weights at all.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = (read_json(index) or {}).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        files = sorted({model_dir / str(name) for name in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"model folder {model_dir} has no {f.name} (listed in {index.name})")
        return files
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    refused = sorted({p.name for pattern in REFUSED_WEIGHTS for p in model_dir.glob(pattern)})
    if refused:
        raise ModelLoadError(
            f"model folder {model_dir} holds {', '.join(refused)}: only safetensors weights are accepted "
            "(convert the checkpoint with transformers' save_pretrained(safe_serialization=True))"
        )
    raise ModelLoadError(f"model folder {model_dir} has no model.safetensors")


def check_safetensors(path: Path) -> int:
    """Check a safetensors file's header against the file's size, without reading tensor data.

    Returns:
        The number of tensors the header lists.

    Raises:
        ModelLoadError: unreadable, shorter than its header, a header that is not a JSON object
            of valid tensor entries, or tensor data that runs past the end of the file (truncated)
            or leaves bytes unaccounted for; the message names the file.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{path}: not a safetensors file ({size} bytes, shorter than its 8-byte header size)")
            (n,) = struct.unpack("<Q", head)
            if n < 2 or n > MAX_SAFETENSORS_HEADER_BYTES:
                raise ModelLoadError(f"{path}: not a safetensors file (header size field {n} is implausible)")
            if 8 + n > size:
                raise ModelLoadError(f"{path}: truncated safetensors file: {size} bytes, the header alone needs {8 + n}")
            raw = f.read(n)
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read ({exc.strerror or exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8").rstrip(" "))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: corrupt safetensors header (not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not a JSON object)")
    end = 0
    tensors = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(v, int) for v in offsets) or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelLoadError(f"{path}: corrupt safetensors header (tensor {name!r} has no valid data_offsets)")
        end = max(end, offsets[1])
        tensors += 1
    data_bytes = size - 8 - n
    if end > data_bytes:
        raise ModelLoadError(
            f"{path}: truncated safetensors file: the header declares {end} bytes of tensor data, "
            f"the file holds {data_bytes}"
        )
    if end < data_bytes:
        raise ModelLoadError(
            f"{path}: corrupt safetensors file: {data_bytes - end} bytes after the last tensor's data"
        )
    return tensors


BUNDLE_BACKEND_FILES: dict[str, tuple[str, ...]] = {
    "onnx": ("onnx/vision.onnx", "onnx/decoder.onnx"),
    "tensorrt": ("onnx/vision.onnx", "onnx/decoder.onnx", "tensorrt/vision.engine"),
}
"""Files (relative to the bundle root) each bundle-only backend needs; see
``edgevlm.runtime.bundle`` for the bundle format and ``edgevlm.runtime.backends`` for the backends."""


def check_model_folder(model_dir: str | Path, *, backend: str = "torch") -> list[Path]:
    """Check that a folder looks loadable: it exists, holds a ``config.json`` that is a JSON
    object, and safetensors weights whose headers are intact (see :func:`check_safetensors`).
    An engine bundle's ``manifest.json`` must be a JSON object too (its hashes are verified when
    it loads). The ``onnx`` and ``tensorrt`` backends run engine bundles only: for them the
    folder must hold ``manifest.json`` and the backend's artifacts (:data:`BUNDLE_BACKEND_FILES`).

    Returns:
        The weight files.

    Raises:
        ModelLoadError: the first problem found; the message names the folder or the file.
    """
    model_dir = Path(model_dir).expanduser()
    if not model_dir.exists():
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a folder (expected a model folder with config.json)")
    for name, required in (("config.json", True), ("manifest.json", False)):
        value = read_json(model_dir / name, required=required)
        if value is not None and not isinstance(value, dict):
            raise ModelLoadError(f"{model_dir / name}: expected a JSON object, got {type(value).__name__}")
    needs = BUNDLE_BACKEND_FILES.get(backend, ())
    if needs and not (model_dir / "manifest.json").is_file():
        raise ModelLoadError(
            f"{model_dir} is not an engine bundle (no manifest.json): backend {backend!r} runs bundles "
            "built by `edgevlm quantize`; use backend 'torch' for a checkpoint folder"
        )
    for rel in needs:
        if not (model_dir / rel).is_file():
            raise ModelLoadError(f"bundle {model_dir} has no {rel}, which backend {backend!r} needs")
    files = weight_files(model_dir)
    for f in files:
        check_safetensors(f)
    if (model_dir / "exits.safetensors").is_file():  # exit heads (edgevlm calibrate): loaded with the model
        check_safetensors(model_dir / "exits.safetensors")
    return files


def check_config_model_path(cfg) -> None:
    """A daemon config's ``model.path`` must name a folder that looks loadable
    (:func:`check_model_folder` for ``model.backend``); the shipped demo model when unset.
    Used by ``edgevlm serve --check-config`` and ``edgevlm doctor --config``.

    Raises:
        ConfigError: naming ``model.path`` and the problem.
    """
    from edgevlm.errors import ConfigError

    if cfg.model.path is None:  # the shipped demo model (a non-torch backend is refused by the config)
        return
    try:
        check_model_folder(cfg.model.path, backend=cfg.model.backend)
    except ModelLoadError as exc:
        raise ConfigError(f"model.path: {exc.message}") from None
