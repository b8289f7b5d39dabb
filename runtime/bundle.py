"""INT4 engine bundles: the manifest schema, hash verification, and loading into the PyTorch runtime.

A bundle is a directory written by ``edgevlm quantize`` (:mod:`edgevlm.quantize.build`)::

    manifest.json            BundleManifest (this module), format_version 1
    config.json              the source config, edgevlm.resolution_ladder set to the bundle's ladder
    model.safetensors        (or model-0000i-of-0000n.safetensors + model.safetensors.index.json)
                             source key names; INT4 layers as <prefix>.qweight/.scales/.zeros
                             (+ .input_scale for unfolded AWQ scales) in the canonical layout of
                             edgevlm.runtime.int4; every other tensor 16-bit
    tokenizer.json, tokenizer_config.json, generation_config.json, ...   copied from the source
    onnx/vision.onnx, onnx/decoder.onnx (+ .data)   ONNX artifacts (when built; checked against
                             PyTorch at build time, the record in manifest.json's onnx_check)
    layouts/w4a16-mma-v1.safetensors   (or -0000i-of-0000n) only with `--w4a16-layout mma`: every INT4
                             layer's tensor-core layout (names: MMA_LAYOUT_TENSORS), recorded in
                             manifest.json's kernel_layouts; read at load instead of repacking
                             (attach_kernel_layouts); the canonical tensors stay
    README.md                what the bundle is (written by the build; the source's is not copied)
    tensorrt/...             TensorRT engines (only where tensorrt was importable at build time)

Every file except ``manifest.json`` is listed in the manifest with its SHA-256; :func:`verify_bundle`
recomputes them and raises :class:`~edgevlm.errors.ModelLoadError` naming the first file that is
missing or differs. :func:`load_bundle_model` is what ``Engine.load`` runs (through
``edgevlm.runtime.loader.load_model``) when the folder holds a ``manifest.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer

from edgevlm.errors import ModelLoadError
from edgevlm.model_folder import INT4_SUFFIXES, confined_path, weight_files
from edgevlm.validation import first_error_message

if TYPE_CHECKING:
    import torch

    from edgevlm.runtime.loader import ModelFiles

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
BUNDLE_FORMAT = "edgevlm-bundle"
BUNDLE_FORMAT_VERSION = 1
INT4_LAYOUT = (
    "canonical-v1: qweight uint8 (out, in/2), low nibble = even input channel; "
    "scales float16 (out, in/group_size); zeros uint8 (out, in/group_size); w = (q - zero) * scale"
)


class FileEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Path relative to the bundle root, '/'-separated.")
    sha256: str = Field(description="Hex SHA-256 of the file's bytes.")
    size_bytes: int = Field(ge=0, description="File size in bytes.")


class LayerDecision(BaseModel):
    """What the quantizer did with one linear layer (printed as the plan before quantizing)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Module name in the family's runtime model, e.g. language_model.layers.0.mlp.up_proj.")
    source_key: str = Field(description="Weight tensor prefix in the source checkpoint (without '.weight').")
    in_features: int = Field(gt=0, description="Input channels (K).")
    out_features: int = Field(gt=0, description="Output channels (N).")
    action: Literal["int4", "keep"] = Field(description="int4 = W4A16 in the bundle; keep = 16-bit weights.")
    group_size: int | None = Field(None, description="INT4 group size used (None when kept).")
    method: Literal["rtn", "awq"] | None = Field(None, description="Quantization method (None when kept).")
    reason: str = Field("", description="Why: requested group size, fallback rule applied, or why it stays 16-bit.")
    awq_scale: Literal["folded", "input_scale", "none"] | None = Field(
        None, description="Where the AWQ input-channel scales went: folded into the preceding op, kept as an "
        "explicit input scale, or none (AWQ chose alpha = 0)."
    )
    awq_fold_into: str | None = Field(None, description="Module the AWQ scales were folded into.")
    awq_alpha: float | None = Field(None, description="Chosen AWQ exponent alpha (s = mean|x|^alpha).")
    rel_error_rtn: float | None = Field(None, description="Relative output MSE of RTN on calibration inputs.")
    rel_error: float | None = Field(None, description="Relative output MSE of the stored layer on calibration inputs.")


class SourceInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    path: str = Field(description="Source model folder as given on the command line (absolute).")
    sha256: str = Field(description="SHA-256 over the sorted 'path sha256' lines of the source files below.")
    files: list[FileEntry] = Field(description="Source files read (config, weights, tokenizer files).")


class CalibrationInfo(BaseModel):
    model_config = ConfigDict(extra="forbid")

    source: str | None = Field(None, description="'demo', a folder path, or None (RTN needs no calibration).")
    samples: int = Field(0, ge=0, description="Calibration (image, prompt) pairs run.")
    tokens: int = Field(0, ge=0, description="Decoder tokens seen per layer (before subsampling).")


class OnnxVisionCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    height_px: int = Field(gt=0, description="Input height H of pixel_values (1, 3, H, W); Qwen: grid h * patch.")
    width_px: int = Field(gt=0, description="Input width W.")
    max_error: float = Field(ge=0, description="max|onnx - torch| / max(1, max|torch|) of image_features "
                                               "(and of every DeepStack output, the largest).")
    max_abs_torch: float = Field(ge=0, description="max|torch| of image_features (the error's scale).")
    grid_thw: list[list[int]] | None = Field(None, description="Qwen families: the (t, h, w) patch grid of each "
                                                               "item fed (None: LLaVA, SmolVLM).")
    n_tiles: int | None = Field(None, description="SmolVLM: tiles of height_px x width_px fed (None: others).")
    padded: bool = Field(False, description="SmolVLM: a tile had padded pixels (pixel_attention_mask).")


class OnnxDecoderCheck(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompt_tokens: int = Field(gt=0, description="Prefill length (text + vision tokens).")
    decode_steps: int = Field(ge=0, description="Greedy decode steps compared after the prefill.")
    prefill_max_error: float = Field(ge=0, description="Relative max error of the prefill logits (1, V).")
    decode_max_error: float = Field(ge=0, description="Largest relative max error over the decode steps' logits.")
    max_abs_torch: float = Field(ge=0, description="max|torch| of the prefill logits.")


class OnnxCheck(BaseModel):
    """``manifest.json``'s ``onnx_check``: the ONNX graphs run against the PyTorch modules at
    build time (:mod:`edgevlm.quantize.onnx_check`)."""

    model_config = ConfigDict(extra="forbid")

    onnxruntime: str = Field(description="onnxruntime version that ran the graphs.")
    providers: list[str] = Field(description="Execution providers used.")
    tolerance: float = Field(gt=0, description="Largest accepted relative max error.")
    vision: list[OnnxVisionCheck] = Field(description="One entry per input size checked.")
    decoder: OnnxDecoderCheck = Field(description="Prefill and decode logits on a short prompt.")
    passed: bool = Field(description="Every error within the tolerance (a failed check refuses the bundle).")

    @property
    def max_error(self) -> float:
        """The worst error of every output checked."""
        d = self.decoder
        return max([v.max_error for v in self.vision] + [d.prefill_max_error, d.decode_max_error])


class KernelLayout(BaseModel):
    """``manifest.json``'s ``kernel_layouts[]``: a kernel-specific copy of the INT4 weights stored next
    to the canonical tensors (``edgevlm quantize --w4a16-layout mma``), so the runtime need not
    repack at load. The canonical tensors stay in the bundle (the CPU path and ONNX read them)."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Layout name; 'w4a16-mma': runtime.int4_format.repack_int4_mma's output.")
    version: int = Field(ge=1, description="Layout version it was written in (runtime.int4_format.MMA_LAYOUT_VERSION).")
    targets: list[str] = Field(description="CUDA targets whose kernel reads it: 'sm_80+' = compute capability "
                                           "8.0 and newer, 'sm_87' = that one only.")
    tensors: str = Field(description="Tensor names and layouts in the files.")
    files: list[str] = Field(description="Safetensors files holding it, relative to the bundle root (also in files).")
    layers: int = Field(ge=0, description="INT4 layers stored (those whose shape the layout can hold).")
    size_bytes: int = Field(ge=0, description="Bytes of its tensors (about the INT4 layers' own bytes again).")


MMA_LAYOUT_TENSORS = (
    "<layer>.mma_qweight int32 (out/16, in/64, 32, 4) and <layer>.mma_meta int32 (out/16, in/group_size, 16), "
    "<layer> = layers[].name; exactly runtime.int4_format.repack_int4_mma of the layer's canonical tensors"
)


class BundleManifest(BaseModel):
    """``manifest.json`` of an engine bundle (format_version 1)."""

    model_config = ConfigDict(extra="forbid")

    format: Literal["edgevlm-bundle"] = Field(BUNDLE_FORMAT, description="Magic string.")
    format_version: Literal[1] = Field(BUNDLE_FORMAT_VERSION, description="Bundle format version.")
    created_utc: str = Field(description="ISO 8601 creation time (UTC).")
    source: SourceInfo = Field(description="The 16-bit model the bundle was built from.")
    scheme: Literal["W4A16"] = Field("W4A16", description="Weight/activation scheme.")
    method: Literal["rtn", "awq"] = Field(description="Quantization method.")
    group_size: Literal[32, 64, 128] = Field(description="Requested INT4 group size (per-layer fallbacks in layers).")
    int4_layout: str = Field(INT4_LAYOUT, description="Storage layout of INT4 tensors.")
    vision: Literal["int4", "fp16"] = Field(description="Whether the vision encoder's linears are INT4.")
    keep_dtype: Literal["bfloat16", "float16"] = Field(description="dtype of the tensors kept 16-bit.")
    layers: list[LayerDecision] = Field(description="Per-layer decisions, in module order.")
    resolution_ladder: list[int] = Field(description="Resolution ladder (longer side, px), largest first.")
    patch_size_px: int = Field(gt=0, description="Vision patch size; ladder rungs are rounded to it.")
    profile: str | None = Field(None, description="Target device profile name (profiles/<name>.yaml).")
    calibration: CalibrationInfo = Field(default_factory=CalibrationInfo, description="Calibration data used.")
    versions: dict[str, str] = Field(description="Tool and library versions (edgevlm, torch, python, ...).")
    artifacts: dict[str, str] = Field(
        default_factory=dict, description="Backend -> artifact folder, or a one-line note why it was not built."
    )
    stats: dict[str, float] = Field(default_factory=dict, description="Build measurements (time, peak RAM, bytes).")
    onnx_check: OnnxCheck | None = Field(
        None, description="The ONNX graphs checked against PyTorch at build time (None: no ONNX artifacts)."
    )
    kernel_layouts: list[KernelLayout] = Field(
        default_factory=list, description="Kernel-specific INT4 layouts stored besides the canonical tensors "
        "(empty: canonical only, the default; the runtime repacks at load)."
    )
    files: list[FileEntry] = Field(description="Every file of the bundle except manifest.json, with SHA-256.")

    @model_serializer(mode="wrap")
    def _omit_empty_kernel_layouts(self, handler):
        """A canonical-only bundle's manifest has no ``kernel_layouts`` key: an edgevlm from before the
        field (whose schema forbids unknown keys) still reads it."""
        data = handler(self)
        if isinstance(data, dict) and not data.get("kernel_layouts"):
            data.pop("kernel_layouts", None)
        return data


def sha256_file(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex SHA-256 of a file, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def file_entries(root: str | Path, *, exclude: tuple[str, ...] = (MANIFEST_NAME,)) -> list[FileEntry]:
    """SHA-256 entries of every regular file under ``root`` (sorted, ``exclude`` left out)."""
    root = Path(root)
    out = []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_file() and rel not in exclude:
            out.append(FileEntry(path=rel, sha256=sha256_file(p), size_bytes=p.stat().st_size))
    return out


def is_bundle(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is an engine bundle (holds ``manifest.json``)."""
    return (Path(model_dir) / MANIFEST_NAME).is_file()


def read_manifest(bundle_dir: str | Path) -> BundleManifest:
    """Parse ``manifest.json`` (no hash check). Raises ModelLoadError if missing, not JSON, invalid, of another
    ``format_version``, or storing its INT4 tensors in another ``int4_layout`` than :data:`INT4_LAYOUT`."""
    path = Path(bundle_dir) / MANIFEST_NAME
    if not path.is_file():
        raise ModelLoadError(f"{bundle_dir} is not an engine bundle (no {MANIFEST_NAME})")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: not valid JSON ({exc})") from exc
    if isinstance(raw, dict) and raw.get("format_version") not in (None, BUNDLE_FORMAT_VERSION):
        raise ModelLoadError(
            f"{path}: bundle format_version {raw.get('format_version')!r} is not supported by this edgevlm "
            f"(supports {BUNDLE_FORMAT_VERSION}); rebuild the bundle with this version's `edgevlm quantize`"
        )
    layout = raw.get("int4_layout") if isinstance(raw, dict) else None
    if layout is not None and layout != INT4_LAYOUT:  # tensors this runtime would misread, without a word
        name = str(layout).split(":", 1)[0][:80]
        raise ModelLoadError(
            f"{path}: INT4 layout {name!r} is not the one this edgevlm reads ({INT4_LAYOUT.split(':', 1)[0]}); "
            "rebuild the bundle with this version's `edgevlm quantize`"
        )
    try:
        return BundleManifest.model_validate(raw)
    except ValidationError as exc:
        raise ModelLoadError(f"{path}: {first_error_message(exc)}") from None


def verify_bundle(bundle_dir: str | Path) -> BundleManifest:
    """Read the manifest and check every listed file's size and SHA-256.

    Every listed path must stay inside the bundle (no ``..``, no absolute path, no symlink that
    leads out), and every file the runtime reads must be listed
    (:func:`edgevlm.model_folder.weight_files` runs :func:`~edgevlm.model_folder.check_loaded_files`).

    Raises:
        ModelLoadError: bad manifest, a listed file missing or outside the bundle, a loaded file
            not listed, or a size/hash mismatch; the message names the file.
    """
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    paths = [confined_path(root, e.path, what=f"file listed in {MANIFEST_NAME}", allow_hub_blobs=False,
                           folder="bundle") for e in manifest.files]
    weight_files(root)  # checks that what the runtime reads is inside the bundle and listed (edgevlm.model_folder)
    for entry, path in zip(manifest.files, paths, strict=True):
        if not path.is_file():
            raise ModelLoadError(f"bundle {root}: file {entry.path} listed in {MANIFEST_NAME} is missing")
        if path.stat().st_size != entry.size_bytes or sha256_file(path) != entry.sha256:
            raise ModelLoadError(
                f"bundle {root}: file {entry.path} does not match its SHA-256 in {MANIFEST_NAME} "
                "(corrupted or modified; rebuild or re-copy the bundle)"
            )
    listed = {e.path for e in manifest.files} | {MANIFEST_NAME}
    extra = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()]
    extra = [p for p in extra if p not in listed]
    if extra:
        logger.warning("bundle %s: files not listed in the manifest are ignored: %s", root, ", ".join(extra[:5]))
    return manifest


def swap_int4_layers(model: torch.nn.Module, manifest: BundleManifest, *, device=None, dtype=None) -> int:
    """Replace every ``nn.Linear`` the manifest marks ``int4`` with an empty :class:`Int4Linear`
    (on ``device``, bias in ``dtype``). Returns the number replaced.

    Raises ModelLoadError when a layer named in the manifest is not an ``nn.Linear`` of that shape.
    """
    from torch import nn

    from edgevlm.runtime.int4 import Int4Linear

    count = 0
    for d in manifest.layers:
        if d.action != "int4":
            continue
        parent_name, _, child = d.name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name) if parent_name else model
            old = getattr(parent, child)
        except AttributeError as exc:
            raise ModelLoadError(f"{MANIFEST_NAME}: layer {d.name} does not exist in the model") from exc
        if not isinstance(old, nn.Linear) or (old.in_features, old.out_features) != (d.in_features, d.out_features):
            raise ModelLoadError(f"{MANIFEST_NAME}: layer {d.name} is not a Linear({d.in_features}, {d.out_features})")
        new = Int4Linear(
            d.in_features, d.out_features, old.bias is not None, d.group_size or manifest.group_size,
            has_input_scale=d.awq_scale == "input_scale", device=device or old.weight.device,
            dtype=dtype or old.weight.dtype,
        )
        setattr(parent, child, new)
        count += 1
    return count


def attach_kernel_layouts(model: torch.nn.Module, manifest: BundleManifest, bundle_dir: str | Path,
                          device: torch.device) -> int:
    """Give the INT4 layers the bundle's stored tensor-core layout (``kernel_layouts``, name
    ``w4a16-mma``) where the kernel reads it, so :func:`~edgevlm.runtime.int4.prepare_int4_kernels`
    need not repack; returns the number of layers served from the stored copy.

    At most one log line: the kernel is absent on ``device`` (CPU, no nvcc, pre-sm_80,
    ``EDGEVLM_W4A16_MMA=0``): the stored copy is ignored (INFO, in the kernel's own fallback line; then
    tinygemm / the CPU paths as for any bundle); no stored copy (INFO) or one of another layout version
    or for other targets (WARNING): the layers are repacked from the canonical tensors at load, as
    before. A layout name this edgevlm does not know is ignored (INFO). Call after the weights are
    loaded (and :func:`verify_bundle` has checked the files' SHA-256).

    Raises:
        ModelLoadError: the stored layout has this edgevlm's version but is inconsistent with the
            layers: a tensor missing, of the wrong dtype or shape, or not taken by any layer, or a
            listed file not in ``manifest.json``'s files or unreadable (the message names the tensor
            or file). The bundle is refused, as for a canonical tensor of the wrong shape: the hashes
            matched, so the builder wrote it so; rebuild it.
    """
    import torch

    from edgevlm.runtime.int4 import Int4Linear, mma_device_ok
    from edgevlm.runtime.int4_format import (
        MMA_LAYOUT_NAME,
        MMA_LAYOUT_VERSION,
        MMA_TENSOR_SUFFIXES,
        mma_layout_fits,
        mma_layout_shapes,
        mma_target_served,
    )

    root, dev = Path(bundle_dir), torch.device(device)
    for r in manifest.kernel_layouts:
        if r.name != MMA_LAYOUT_NAME:
            logger.info("bundle %s: stored kernel layout %s v%d is unknown to this edgevlm: ignored", root, r.name,
                        r.version)
    record = next((r for r in manifest.kernel_layouts if r.name == MMA_LAYOUT_NAME), None)
    fits = {}
    for d in manifest.layers:
        m = model.get_submodule(d.name) if d.action == "int4" else None
        if isinstance(m, Int4Linear) and mma_layout_fits(m.out_features, m.in_features, m.group_size):
            fits[d.name] = m
    if not fits:
        return 0
    stored = f"{MMA_LAYOUT_NAME} layout v{record.version} ({', '.join(record.targets)})" if record else ""
    if not mma_device_ok(dev, note=f"; the bundle's stored {stored} is ignored" if record else ""):
        return 0
    if record is None:
        logger.info("bundle %s stores no %s layout: repacking %d INT4 layers at load (`edgevlm quantize "
                    "--w4a16-layout mma` stores it)", root, MMA_LAYOUT_NAME, len(fits))
        return 0
    cap = torch.cuda.get_device_capability(dev)
    if record.version != MMA_LAYOUT_VERSION or not mma_target_served(record.targets, cap):
        why = (f"this edgevlm reads v{MMA_LAYOUT_VERSION}" if record.version != MMA_LAYOUT_VERSION
               else f"it does not serve sm_{cap[0]}{cap[1]}")
        logger.warning("bundle %s stores the %s, but %s: repacking %d INT4 layers at load from the canonical "
                       "tensors (rebuild the bundle with this edgevlm to skip this)", root, stored, why, len(fits))
        return 0
    listed = {e.path for e in manifest.files}
    want = {}
    for name, m in fits.items():
        for suffix, shape in zip(MMA_TENSOR_SUFFIXES, mma_layout_shapes(m.out_features, m.in_features, m.group_size),
                                 strict=True):
            want[name + suffix] = (name, shape)
    got: dict[str, dict[str, torch.Tensor]] = {}
    served: set[str] = set()
    from safetensors import safe_open

    for rel in record.files:
        path = confined_path(root, rel, what=f"kernel layout file listed in {MANIFEST_NAME}", allow_hub_blobs=False,
                             folder="bundle")
        if rel not in listed:
            raise ModelLoadError(f"bundle {root}: kernel layout file {rel} is not listed in {MANIFEST_NAME}'s files "
                                 "(no SHA-256 covers it); rebuild the bundle")
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key not in want:
                        raise ModelLoadError(f"bundle {root}: {rel} holds tensor {key}, which no INT4 layer's "
                                             f"{MMA_LAYOUT_NAME} layout takes; rebuild the bundle")
                    name, shape = want[key]
                    t = f.get_tensor(key)
                    if t.dtype != torch.int32 or tuple(t.shape) != shape:
                        raise ModelLoadError(
                            f"bundle {root}: stored layout tensor {key} in {rel} is {t.dtype} {tuple(t.shape)}, "
                            f"layer {name} needs torch.int32 {shape} ({MMA_LAYOUT_NAME} v{MMA_LAYOUT_VERSION}); "
                            "the bundle is refused: rebuild it")
                    pair = got.setdefault(name, {})
                    pair[key[len(name):]] = t
                    if len(pair) == len(MMA_TENSOR_SUFFIXES):
                        fits[name].set_mma_layout(*(pair[s] for s in MMA_TENSOR_SUFFIXES))
                        del got[name]
                        served.add(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({exc})") from exc
    if len(served) < len(fits):
        name = next(n for n in fits if n not in served)
        missing = next(name + s for s in MMA_TENSOR_SUFFIXES if s not in got.get(name, {}))
        raise ModelLoadError(f"bundle {root}: the stored {stored} has no tensor {missing} (INT4 layer {name}); "
                             "the bundle is refused: rebuild it")
    return len(served)


def load_bundle_model(files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_seq_len: int,
                      max_batch_size: int = 1) -> torch.nn.Module:
    """Verify a bundle and build its family's model (``files.family.build_model``, any registered
    family) with :class:`Int4Linear` layers where the manifest says ``int4``.

    INT4 tensors keep their stored dtypes (uint8 codes/zeros, fp16 scales, fp32 input scales);
    other floating tensors are converted to ``dtype``.

    Raises:
        ModelLoadError: hash mismatch (names the file), bad manifest, or missing/unexpected tensors.
    """
    import torch

    from edgevlm.runtime.loader import load_weights

    manifest = verify_bundle(files.model_dir)
    with torch.device("meta"):
        model = files.family.build_model(files.config)
    n_int4 = swap_int4_layers(model, manifest, device="meta", dtype=dtype)
    load_weights(model, files, device=device, dtype=dtype, keep_suffixes=INT4_SUFFIXES, what="bundle")
    model.setup_caches(max_batch_size, max_seq_len)
    from edgevlm.runtime.int4 import prepare_int4_kernels

    n_stored = attach_kernel_layouts(model, manifest, files.model_dir, device)
    n_packed = prepare_int4_kernels(model)
    logger.info("loaded bundle %s: %d INT4 layers (%s, group_size %d; %d with int4 kernels, %d of them from the "
                "stored layout), %s on %s", files.model_dir, n_int4, manifest.method, manifest.group_size, n_packed,
                n_stored, dtype, device)
    return model
