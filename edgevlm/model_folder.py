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

Confinement (:func:`check_loaded_files`, run by :func:`weight_files`, so by every loader): every file
the runtime reads from a folder (:data:`LOADED_FILES`, the weights, shards, exit heads, ONNX and
TensorRT artifacts) must resolve, symlinks followed, to a file inside the folder; in an engine bundle
it must also be listed in ``manifest.json`` (whose SHA-256 :func:`edgevlm.runtime.bundle.verify_bundle`
then checks). One exception, for checkpoint folders only: a Hugging Face Hub cache snapshot
(``models--org--name/snapshots/<revision>/``) holds symlinks into the repository's own
``models--org--name/blobs/``, which are accepted (layout: huggingface_hub "Manage the cache").
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from edgevlm.errors import ModelLoadError
from edgevlm.protocol import json_type_name

__all__ = ["BUNDLE_BACKEND_FILES", "LOADED_FILES", "check_config_model_path", "check_loaded_files", "check_model_folder",
           "check_safetensors", "confined_path", "read_image_processor", "read_json", "weight_files",
           "weights_fingerprint"]

REFUSED_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl", "*.gguf", "*.h5", "*.msgpack")
"""Weight-file patterns that are never loaded (pickle-based or not supported)."""

MAX_SAFETENSORS_HEADER_BYTES = 100 * 1024 * 1024
#: Bits per element of each safetensors dtype (the format's list; sub-byte kinds pack whole bytes).
SAFETENSORS_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64,
    "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
"""Largest safetensors JSON header accepted (the reference implementation's own limit)."""

LOADED_FILES = (
    "config.json", "generation_config.json", "preprocessor_config.json",  # runtime/loader.py
    "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",  # runtime/tokenizer.py
    "model.safetensors.index.json", "exits.json", "frontier.json",  # weights index, exit heads, controller
)
"""Top-level files the runtime reads by name when present; besides them every ``*.safetensors``
and every file under ``onnx/`` and ``tensorrt/`` (ONNX external data included) is read."""

LOADED_FOLDERS = ("onnx", "tensorrt")
MANIFEST = "manifest.json"

INT4_SUFFIXES = (".qweight", ".scales", ".zeros", ".input_scale")
"""Tensor-name suffixes of an engine bundle's INT4 layers (``edgevlm.runtime.bundle``'s format; their
dtypes are part of the format and never converted). A folder whose weights hold them is a bundle."""


def int4_layers(tensor_names: Iterable[str]) -> list[str]:
    """The INT4 layers (module names, sorted) among safetensors tensor names (:data:`INT4_SUFFIXES`)."""
    return sorted({n.rsplit(".", 1)[0] for n in tensor_names if n.endswith(INT4_SUFFIXES)})


def name_layers(layers: list[str], *, most: int = 2) -> str:
    """``"a, b and 3 more"``: the first ``most`` of ``layers`` for a one-line message."""
    return ", ".join(layers[:most]) + (f" and {len(layers) - most} more" if len(layers) > most else "")


def missing_manifest_error(model_dir: Path, layers: list[str]) -> ModelLoadError:
    """The refusal of a folder whose weights hold INT4 ``layers`` but that has no ``manifest.json``: an
    engine bundle copied without it (its layers cannot be read as a checkpoint's)."""
    return ModelLoadError(
        f"{model_dir} holds INT4 layers ({name_layers(layers)}) but no {MANIFEST}: an engine bundle whose "
        f"{MANIFEST} is missing (copy the whole bundle again, or rebuild it with `edgevlm quantize`)"
    )


def _hub_blobs(root: Path) -> Path | None:
    """``models--org--name/blobs`` when ``root`` is a Hugging Face Hub cache snapshot folder."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith("models--"):
        return root.parent.parent / "blobs"
    return None


def confined_path(model_dir: Path, rel: str, *, what: str = "file", allow_hub_blobs: bool = True,
                  folder: str = "model folder") -> Path:
    """``model_dir / rel`` after checking that it stays inside ``model_dir`` once symlinks are
    resolved (``rel`` is '/'-separated, relative, without ``..``). The returned path is the
    unresolved one (its name is what the user sees); it need not exist. ``folder`` names the
    folder in messages ("model folder", "bundle").

    Raises:
        ModelLoadError: ``rel`` is absolute, holds ``..``, or resolves outside the folder; the
            message names the file and where it leads.
    """
    root = model_dir.resolve()
    parts = Path(rel).parts
    if Path(rel).is_absolute() or rel.startswith(("/", "\\")) or ".." in parts or not parts:
        raise ModelLoadError(f"{model_dir}: {what} {rel!r} leaves the {folder} (absolute path or '..')")
    path = model_dir / rel
    target = path.resolve()
    allowed = [root]
    blobs = _hub_blobs(root) if allow_hub_blobs else None
    if blobs is not None:
        allowed.append(blobs.resolve())
    if not any(target == a or target.is_relative_to(a) for a in allowed):
        raise ModelLoadError(
            f"{model_dir}: {what} {rel} resolves to {target}, outside the {folder} (a symlink or path that "
            f"leaves the {folder} is refused: copy the file into it)"
        )
    return path


def _manifest_paths(model_dir: Path) -> set[str] | None:
    """The ``files[].path`` entries of a bundle's manifest (None for a checkpoint folder). Only
    the paths: the schema and the hashes are :mod:`edgevlm.runtime.bundle`'s."""
    raw = read_json(model_dir / MANIFEST, required=False)
    if raw is None:
        return None
    entries = raw.get("files") if isinstance(raw, dict) else None
    if not isinstance(entries, list):
        raise ModelLoadError(f"{model_dir / MANIFEST}: 'files' must be a list of {{path, sha256, size_bytes}}")
    return {str(e.get("path")) for e in entries if isinstance(e, dict)}


def _loaded_candidates(model_dir: Path, is_bundle: bool) -> list[str]:
    """Relative paths of every file present that the runtime may read (see :data:`LOADED_FILES`)."""
    out = [name for name in LOADED_FILES if (model_dir / name).exists() or (model_dir / name).is_symlink()]
    out += sorted(p.name for p in model_dir.glob("*.safetensors"))
    for folder in LOADED_FOLDERS:
        sub = model_dir / folder
        if sub.is_dir():
            confined_path(model_dir, folder, what="folder", allow_hub_blobs=not is_bundle,
                          folder="bundle" if is_bundle else "model folder")
            out += sorted(p.relative_to(model_dir).as_posix() for p in sub.rglob("*") if not p.is_dir())
    return out


def check_loaded_files(model_dir: Path, extra: list[str] | None = None) -> None:
    """Every file the runtime may read from ``model_dir`` (plus ``extra`` relative paths, e.g.
    the shards an index lists) resolves inside it; in an engine bundle each is also listed in
    ``manifest.json``. See the module docstring.

    Raises:
        ModelLoadError: naming the first file that leaves the folder or, in a bundle, that the
            manifest does not cover.
    """
    listed = _manifest_paths(model_dir)
    for rel in dict.fromkeys(_loaded_candidates(model_dir, listed is not None) + list(extra or [])):
        confined_path(model_dir, rel, allow_hub_blobs=listed is None,
                      folder="model folder" if listed is None else "bundle")
        if listed is not None and rel not in listed:
            raise ModelLoadError(
                f"bundle {model_dir}: {rel} is not listed in {MANIFEST}, so no SHA-256 covers it (a file added "
                "after the build is refused: remove it, or rebuild the bundle)"
            )


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


def read_image_processor(model_dir: Path) -> dict | None:
    """The image processor's settings: ``processor_config.json``'s ``image_processor`` (transformers
    5 writes the processor's parts nested there) or the top level of ``preprocessor_config.json``;
    None when the checkpoint has neither. Read by the loader (``ModelFiles.image_processor``) and by a
    family's ``read_image_config`` (``edgevlm serve --check-config``).

    Raises:
        ModelLoadError: either file holds something other than a JSON object (was: ignored, with a
            warning that the checkpoint has no such file).
    """
    proc = read_json(model_dir / "processor_config.json", required=False)
    if proc is not None and not isinstance(proc, dict):
        raise ModelLoadError(f"{model_dir / 'processor_config.json'}: expected a JSON object, got "
                             f"{json_type_name(proc)}")
    if isinstance(proc, dict) and isinstance(proc.get("image_processor"), dict):
        return proc["image_processor"]
    pre = read_json(model_dir / "preprocessor_config.json", required=False)
    if pre is not None and not isinstance(pre, dict):
        raise ModelLoadError(f"{model_dir / 'preprocessor_config.json'}: expected a JSON object, got "
                             f"{json_type_name(pre)}")
    return pre

def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards of ``model.safetensors.index.json``
    (its ``weight_map``), else ``model.safetensors``, else every ``*.safetensors``.

    Every file the folder would load is checked first (:func:`check_loaded_files`): it must stay
    inside the folder and, in a bundle, be covered by the manifest.

    Raises:
        ModelLoadError: an index that lists a missing shard, a shard outside the folder, or has no
            ``weight_map``; a loaded file outside the folder or (bundle) not in the manifest; only
            non-safetensors weights (named), or no weights at all.
    """
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        raw = read_json(index)
        weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: missing or empty 'weight_map'")
        names = sorted({str(name) for name in weight_map.values()})
        check_loaded_files(model_dir, names)
        files = [model_dir / name for name in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"model folder {model_dir} has no {f.name} (listed in {index.name})")
        return files
    check_loaded_files(model_dir)
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


def _entry_size_problem(entry: dict, span: int) -> str | None:
    """What is wrong with a header entry's ``dtype`` and ``shape`` for its ``span`` bytes of data
    (safetensors' own reader refuses such a file only when a tensor is read), or None."""
    dtype, shape = entry.get("dtype"), entry.get("shape")
    bits = SAFETENSORS_DTYPE_BITS.get(dtype) if isinstance(dtype, str) else None
    if bits is None:
        return f"has an unknown dtype {dtype!r}"
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                              for d in shape):
        return "has no valid shape"
    numel = 1
    for d in shape:
        numel *= d
    if numel * bits != span * 8:
        return f"is {dtype} {shape}, {numel * bits // 8} bytes, but its data_offsets span {span} bytes"
    return None


def check_safetensors(path: Path) -> list[str]:
    """Check a safetensors file's header against the file's size, without reading tensor data.

    Returns:
        The names of the tensors the header lists, in its order.

    Raises:
        ModelLoadError: unreadable, shorter than its header, a header that is not a JSON object
            of valid tensor entries, or tensor data that runs past the end of the file (truncated)
            or leaves bytes unaccounted for, a tensor whose dtype and shape do not fill its data span;
            the message names the file.
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
    tensors: list[str] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list) or len(offsets) != 2
            or not all(isinstance(v, int) for v in offsets) or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ModelLoadError(f"{path}: corrupt safetensors header (tensor {name!r} has no valid data_offsets)")
        problem = _entry_size_problem(entry, offsets[1] - offsets[0])
        if problem:
            raise ModelLoadError(f"{path}: corrupt safetensors header (tensor {name!r} {problem})")
        end = max(end, offsets[1])
        tensors.append(name)
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


def check_weight_headers(model_dir: Path, files: list[Path]) -> None:
    """Check the headers of a folder's weight ``files`` (:func:`check_safetensors`), and that weights
    holding INT4 layers come with the bundle's ``manifest.json`` (else :func:`missing_manifest_error`:
    a bundle copied without it), as loading its weights refuses them. Used by ``serve --check-config``
    and ``edgevlm bench --model``.

    Raises:
        ModelLoadError: naming the file, or the folder and its first INT4 layers.
    """
    names = [name for f in files for name in check_safetensors(f)]
    if not (model_dir / MANIFEST).is_file():
        layers = int4_layers(names)
        if layers:
            raise missing_manifest_error(model_dir, layers)


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
    Weights holding INT4 layers without a ``manifest.json`` (a bundle copied without it) are refused
    (:func:`missing_manifest_error`), as loading would refuse them.

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
            raise ModelLoadError(f"{model_dir / name}: expected a JSON object, got {json_type_name(value)}")
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
    check_weight_headers(model_dir, files)
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


def weights_fingerprint(model_dir: str | Path) -> str:
    """A cheap identity of a model's weights: SHA-256 over each safetensors file's size and its
    first and last MiB (header and tensor data), so exit heads and a ``frontier.json`` are never
    used with other weights. Torch-free (``serve --check-config`` checks ``controller.frontier``
    with it).

    Raises ModelLoadError when the folder has no weights."""
    import hashlib

    h = hashlib.sha256()
    for path in weight_files(Path(model_dir)):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}:".encode())
        with open(path, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(size - (1 << 20))
                h.update(f.read())
    return h.hexdigest()
