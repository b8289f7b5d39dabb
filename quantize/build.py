"""Build an INT4 engine bundle from a Hugging Face-format checkpoint of any registered family, one
block at a time.

The layers are listed from the family's own runtime model (``family.build_model`` on the meta
device); W4A16 covers the shared decoder's linears (``language_model.layers.*``). LLaVA's vision
encoder may be INT4 too (``--vision int4``) and its AWQ calibration runs the tower directly; every
other family keeps its vision tower and connector 16-bit and is calibrated through its
``VLMModel`` / ``Processor`` interfaces (:func:`_family_calibration_inputs`). ONNX / TensorRT
artifacts are built for LLaVA only; other families get a one-line note and the torch bundle.

Pipeline (:func:`build_bundle`):

1. read ``config.json`` and the safetensors index (nothing loaded), plan every linear layer
   (:mod:`edgevlm.quantize.plan`) and hand the plan to ``on_plan`` before any quantization;
2. AWQ only: run the 16-bit vision tower + token embeddings on the calibration samples (images
   resized to the rungs of the resolution ladder in turn) to get the decoder's input embeddings,
   and the vision encoder's block inputs when it is quantized too;
3. for every vision block (``--vision int4``) and every decoder block: read just that block's
   tensors from the memory-mapped safetensors, build the runtime's own block module
   (:class:`~edgevlm.runtime.vision.VisionBlock`, :class:`~edgevlm.runtime.decoder.DecoderLayer`),
   run the calibration activations through it with AWQ observers (the block's float outputs are
   the next block's inputs, as in AutoAWQ), search/fold/quantize, write its tensors, free it;
4. copy the remaining tensors (embeddings, norms, projector, ``lm_head``) as 16-bit, the
   tokenizer and generation files, and ``config.json`` with the bundle's resolution ladder;
   with ``w4a16_layout="mma"`` also repack every INT4 layer the tensor-core layout holds into
   ``layouts/`` (:func:`_write_mma_layout`, read back from the written shards);
5. export the ONNX artifacts and (where ``tensorrt`` imports) the TensorRT engines; write the
   bundle's ``README.md`` (the source's describes the 16-bit weights and is not copied);
6. hash every file into ``manifest.json``;
7. run the ONNX graphs against the PyTorch modules (:mod:`edgevlm.quantize.onnx_check`) and record
   the check in the manifest; a mismatch refuses the bundle.

The tokenizer and chat template are checked first, right after ``config.json``: a checkpoint
whose template does not compile is refused before any quantization work.

Peak RAM is one block in float32, the calibration activations, the vision tower (AWQ) and one
output shard (``max_shard_mb``), not the model. Everything is written into ``<out>.partial`` and
renamed at the end, so a failed build never leaves a half-written bundle behind, and an earlier bundle
replaced with ``--overwrite`` stays whole until the new one is in place (:func:`edgevlm.atomic_files.replace_folder`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import resource
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from edgevlm.atomic_files import replace_folder
from edgevlm.errors import ConfigError, ModelLoadError
from edgevlm.quantize import awq
from edgevlm.quantize.api import apply_awq
from edgevlm.quantize.plan import LayerDecision, LinearInfo, format_plan, plan_layers
from edgevlm.quantize.shards import CheckpointReader, ShardWriter
from edgevlm.runtime.bundle import (
    BundleManifest,
    CalibrationInfo,
    KernelLayout,
    SourceInfo,
    file_entries,
    is_bundle,
    sha256_file,
)
from edgevlm.runtime.int4 import Int4Linear, _malloc_trim, quantize_int4, repack_int4_mma
from edgevlm.runtime.loader import ModelFiles, read_model_files

logger = logging.getLogger(__name__)

_WEIGHT_FILES = ("model.safetensors.index.json", "config.json")
Progress = Callable[[str, int, int], None]


@dataclass
class BuildOptions:
    """Knobs of :func:`build_bundle` (the CLI flags of ``edgevlm quantize``)."""

    method: str = "awq"  # "awq" | "rtn"
    group_size: int = 128
    vision: str = "fp16"  # "int4" | "fp16"
    lm_head: bool = False  # quantize lm_head (RTN) too
    keep_dtype: str = "bfloat16"  # dtype of tensors kept 16-bit: "bfloat16" | "float16"
    calib: str | None = "demo"  # "demo" or a folder (AWQ only)
    calib_samples: int = 32
    profile: str | None = None
    resolution_ladder: list[int] | None = None  # None: the profile's, else the model's own
    awq_grid: int = 20
    awq_max_tokens: int = 2048
    onnx: bool = True
    tensorrt: bool = True
    max_shard_mb: float = 64.0  # tensors held in memory before a shard is written (bounds peak RAM)
    w4a16_layout: str = "canonical"  # "canonical" | "mma": also store the tensor-core layout (W4A16_LAYOUTS)
    overwrite: bool = False


@dataclass
class BuildResult:
    bundle_dir: Path
    manifest: BundleManifest
    plan_text: str
    notes: list[str] = field(default_factory=list)


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB: ``VmHWM`` of ``/proc/self/status`` on
    Linux (``ru_maxrss`` would include the parent's RSS at fork time, kept across ``exec``), else
    ``ru_maxrss`` (KiB on Linux, bytes on macOS)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1024.0 / (1024.0 if sys.platform == "darwin" else 1.0)


def list_linears(files: ModelFiles, source: CheckpointReader) -> list[LinearInfo]:
    """Every ``nn.Linear`` of the family's runtime model (``files.family.build_model``, built on the
    meta device) present in the checkpoint, in module order."""
    with torch.device("meta"):
        model = files.family.build_model(files.config)
    out = []
    for name, m in model.named_modules():
        key = name + ".weight"
        if type(m) is nn.Linear and key in source.src_of:
            out.append(LinearInfo(name, source.src_of[key][: -len(".weight")], m.in_features, m.out_features))
    return out


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("edgevlm", "safetensors", "numpy", "onnx", "onnxruntime", "tensorrt", "tokenizers"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            continue
    return out


def _resolve_ladder(files: ModelFiles, opts: BuildOptions) -> list[int]:
    """The bundle's ladder: ``opts.resolution_ladder``, else the profile's, else the model's own; a
    rung below the vision patch size is refused before anything is built (the bundle's config.json
    would not load: :func:`edgevlm.runtime.config.parse_resolution_ladder`)."""
    patch = int(files.config.vision.patch_size)

    def checked(ladder, what: str) -> list[int]:
        small = sorted({r for r in ladder if r < patch})
        if small:
            raise ConfigError(f"{what}: rung(s) {', '.join(map(str, small))} px are below the model's vision patch "
                              f"size ({patch} px): a rung is at least one patch")
        return sorted(set(ladder), reverse=True)

    if opts.resolution_ladder:
        return checked(opts.resolution_ladder, "resolution_ladder")
    if opts.profile:
        from edgevlm.profile import load_profile

        ladder = load_profile(opts.profile).resolution_ladder_px
        if ladder:
            return checked(ladder, f"--profile {opts.profile}: resolution_ladder_px")
    return sorted(files.config.resolution_ladder, reverse=True)


W4A16_LAYOUTS = ("canonical", "mma")
"""``--w4a16-layout`` values: ``canonical`` (every bundle: the portable INT4 tensors only) or ``mma``
(also each INT4 linear's tensor-core layout, ``layouts/w4a16-mma-v1*.safetensors``: about twice the INT4
bytes; CUDA sm_80+ loads it instead of repacking)."""


def _check_options(opts: BuildOptions) -> None:
    if opts.w4a16_layout not in W4A16_LAYOUTS:
        raise ConfigError(f"w4a16 layout must be one of {', '.join(W4A16_LAYOUTS)}, got {opts.w4a16_layout!r}")
    if opts.method not in ("awq", "rtn"):
        raise ConfigError(f"method must be 'awq' or 'rtn', got {opts.method!r}")
    if opts.group_size not in (32, 64, 128):
        raise ConfigError(f"group size must be 32, 64 or 128, got {opts.group_size}")
    if opts.vision not in ("int4", "fp16"):
        raise ConfigError(f"vision must be 'int4' or 'fp16', got {opts.vision!r}")
    if opts.keep_dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"keep dtype must be 'bfloat16' or 'float16', got {opts.keep_dtype!r}")
    if opts.method == "awq" and not opts.calib:
        raise ConfigError("AWQ needs calibration data: --calib demo or --calib DIR (images + prompts.txt)")
    if opts.calib_samples < 1:
        raise ConfigError(f"calibration samples must be >= 1, got {opts.calib_samples}")
    if opts.method == "awq" and str(opts.calib) != "demo":
        from edgevlm.quantize.calib import check_folder

        check_folder(opts.calib)


# ------------------------------------------------------------------------------ calibration
def _calibration_inputs(files: ModelFiles, source: CheckpointReader, opts: BuildOptions, ladder: list[int],
                        want_vision: bool) -> tuple[list[torch.Tensor], list[torch.Tensor], CalibrationInfo]:
    """Decoder input embeddings ``[(1, T_i, D)]`` and vision block-0 inputs ``[(1, 1 + N_i, Dv)]``."""
    from edgevlm.quantize.calib import load_samples
    from edgevlm.runtime.models.llava.model import LlavaModel
    from edgevlm.runtime.preprocess import CLIP_MEAN, CLIP_STD, preprocess
    from edgevlm.runtime.tokenizer import VLMTokenizer

    cfg = files.config
    samples = load_samples(opts.calib, opts.calib_samples)
    tok = VLMTokenizer.from_dir(files.model_dir, cfg.image_token_id)
    with torch.device("meta"):
        model = LlavaModel(cfg)
    needed = source.names_under("vision_tower.") + ["language_model.embed_tokens.weight"]
    state = {n: t.float() for n, t in source.read(needed).items()}
    model.load_state_dict(state, strict=False, assign=True)
    del state
    mean, std = files.image_mean or CLIP_MEAN, files.image_std or CLIP_STD
    dec_inputs, vis_inputs, tokens = [], [], 0
    with torch.no_grad():
        for i, s in enumerate(samples):
            pixels = torch.from_numpy(preprocess(s.image, ladder[i % len(ladder)], cfg.vision.patch_size,
                                                 mean, std))[None]  # (1, 3, H, W)
            enc = model.vision_tower.encoder
            if want_vision:
                vis_inputs.append(enc.pre_layrnorm(enc.embeddings(pixels)))  # (1, 1 + N, Dv)
            feats = model.vision_tower(pixels)  # (1, N, D)
            ids = tok.encode_prompt(s.prompt, feats.shape[1])
            if s.answer:
                ids += tok.tok.encode(" " + s.answer, add_special_tokens=False).ids
            input_ids = torch.tensor([ids])
            embeds = model.language_model.embed_tokens(input_ids)
            mask = (input_ids == cfg.image_token_id)[..., None]
            dec_inputs.append(embeds.masked_scatter(mask, feats))  # (1, T, D)
            tokens += len(ids)
    info = CalibrationInfo(source=str(opts.calib), samples=len(samples), tokens=tokens)
    return dec_inputs, vis_inputs, info


class _Captured(Exception):
    """Raised by the pre-hook on the decoder once its inputs are recorded (the layers are not built)."""


def _family_calibration_inputs(files: ModelFiles, source: CheckpointReader, opts: BuildOptions, ladder: list[int]
                               ) -> tuple[list[torch.Tensor], _DecoderRunner, CalibrationInfo]:
    """Decoder inputs of any registered family, through its own interfaces (the ``Engine``'s path):
    ``processor.prepare`` (rungs of ``ladder`` in turn, or the checkpoint's own preprocessing when
    the ladder is empty), ``tokenizer.encode_request``, ``model.encode_vision``,
    ``model.position_ids``, ``model.embed`` and ``model.prefill``; a forward pre-hook on the shared
    ``Decoder`` records what reaches it (embeds ``(1, T, D)`` float32, the ``rope`` tables of
    multimodal RoPE, DeepStack's ``layer_adds``) and stops before the first layer. Only the tensors
    outside ``language_model.layers.`` are read (vision tower, connector, embeddings, norm, head).

    Raises:
        ConfigError / InvalidImageError: unusable calibration data (see :mod:`.calib`).
    """
    from edgevlm.quantize.calib import load_samples
    from edgevlm.runtime.tokenizer import VLMTokenizer

    cfg = files.config
    samples = load_samples(opts.calib, opts.calib_samples)
    tok = VLMTokenizer.from_dir(files.model_dir, cfg.image_token_id, family=files.family.name)
    processor = files.family.make_processor(files)
    rungs = list(ladder) or [None]
    prepared = []
    for i, s in enumerate(samples):
        vision = processor.prepare([s.image], resolution_px=rungs[i % len(rungs)])
        ids = tok.encode_request(s.prompt, vision, processor)
        if s.answer:
            ids += tok.tok.encode(" " + s.answer, add_special_tokens=False).ids
        prepared.append((vision, ids))
    with torch.device("meta"):
        model = files.family.build_model(cfg)
    needed = [n for n in source.src_of if not n.startswith("language_model.layers.")]
    state = {n: t.float() for n, t in source.read(needed).items()}
    model.load_state_dict(state, strict=False, assign=True)
    del state
    if cfg.tie_word_embeddings:
        model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.eval().requires_grad_(False)
    model.setup_caches(1, max(len(ids) for _, ids in prepared))  # RoPE tables (the layers stay on meta)
    seen: dict = {}

    def capture(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs
        raise _Captured

    hook = model.language_model.register_forward_pre_hook(capture, with_kwargs=True)
    dec_inputs, tables, adds, kinds, tokens = [], [], [], [], 0
    lm = model.language_model
    try:
        with torch.no_grad():
            for vision, ids in prepared:
                input_ids = torch.tensor([ids])
                feats = model.encode_vision(vision)
                pos, _ = model.position_ids(input_ids, vision)
                embeds = model.embed(input_ids, feats)
                try:
                    model.prefill(embeds) if pos is None else model.prefill(embeds, position_ids=pos)
                except _Captured:
                    pass
                x, input_pos = seen["args"][0], seen["args"][1]
                rope = seen["kwargs"].get("rope")
                if rope is None:
                    rope = (lm.rope_cos[input_pos].float(), lm.rope_sin[input_pos].float())
                dec_inputs.append(x.float())
                tables.append((rope[0].float(), rope[1].float()))
                adds.append(seen["kwargs"].get("layer_adds"))
                # Gemma 3: the sliding layers' own RoPE tables and the prompt's image blocks
                local = None if lm.local_rope is None else tuple(t[input_pos].float() for t in lm.local_rope[:2])
                kinds.append((local, seen["kwargs"].get("image_blocks")))
                tokens += len(ids)
    finally:
        hook.remove()
    info = CalibrationInfo(source=str(opts.calib), samples=len(samples), tokens=tokens)
    return dec_inputs, _DecoderRunner(cfg.text, tables, adds, kinds), info


# ------------------------------------------------------------------------------ blocks
class _DecoderRunner:
    """Runs one :class:`~edgevlm.runtime.decoder.DecoderLayer` on the calibration samples as the
    shared :class:`~edgevlm.runtime.decoder.Decoder` would: sample ``j``'s RoPE tables
    ``(T, Dh)`` or ``(1, T, Dh)`` float32 (1-D RoPE of :func:`~edgevlm.runtime.decoder.rope_inv_freq`,
    or the family's multimodal RoPE), and after layer ``i`` its ``layer_adds[i]`` (DeepStack). With
    ``tc.layer_types`` (Gemma 3) and the layer index (:meth:`for_layer`), sample ``j``'s ``kinds[j]``
    = ``(sliding layers' (cos, sin) or None, image_blocks or None)`` give each layer its own RoPE
    tables and attention mask, as :meth:`~edgevlm.runtime.decoder.Decoder.forward` does."""

    def __init__(self, tc, tables: list[tuple[torch.Tensor, torch.Tensor]],
                 adds: list[list | None] | None = None, kinds: list[tuple] | None = None) -> None:
        self.tc, self.tables = tc, tables
        self.adds = adds or [None] * len(tables)
        self.kinds = kinds or [(None, None)] * len(tables)

    def __call__(self, block: nn.Module, j: int, x: torch.Tensor, layer: int | None = None) -> torch.Tensor:
        from edgevlm.runtime.kv_cache import KVCache

        tc, t = self.tc, x.shape[1]
        cos, sin = (v.to(x.dtype) for v in self.tables[j])
        if cos.dim() == 3:  # (B, T, Dh) -> (B, 1, T, Dh): broadcast over heads (as Decoder.forward)
            cos, sin = cos[:, None], sin[:, None]
        block.self_attn.kv_cache = KVCache(1, tc.num_key_value_heads, t, tc.head_dim, dtype=x.dtype, device="cpu")
        if tc.layer_types is None or layer is None:
            return block(x, cos, sin, torch.arange(t), None)
        from edgevlm.runtime.decoder import prefill_masks

        local, blocks = self.kinds[j]
        sliding = tc.layer_types[layer] == "sliding_attention"
        if sliding and local is not None:
            cos, sin = (v.to(x.dtype) for v in local)
        full_mask, sliding_mask = prefill_masks(t, blocks, tc.sliding_layer_window, x.device)
        mask = sliding_mask if sliding else full_mask
        return block(x, cos, sin, torch.arange(t), mask, None, None, mask is not None)

    def for_layer(self, i: int) -> Callable[[nn.Module, int, torch.Tensor], torch.Tensor]:
        """The runner of decoder layer ``i`` (its kind of attention, Gemma 3)."""
        return lambda block, j, x: self(block, j, x, i)

    def add_after(self, i: int, j: int, x: torch.Tensor) -> torch.Tensor:
        """Sample ``j``'s ``h[mask] += feats`` after layer ``i`` (what the Decoder adds: DeepStack)."""
        adds = self.adds[j]
        add = adds[i] if adds is not None and i < len(adds) else None
        return x if add is None else x.index_put((add[0],), add[1].to(x.dtype), accumulate=True)

    def after_layer(self, i: int, outputs: list[torch.Tensor] | None) -> list[torch.Tensor] | None:
        """:meth:`add_after` on every sample's output of layer ``i``."""
        return None if outputs is None else [self.add_after(i, j, x) for j, x in enumerate(outputs)]


def _decoder_runner(files: ModelFiles, lengths: list[int]) -> _DecoderRunner:
    """The LLaVA runner: 1-D RoPE at slots ``0..T_j-1`` of the text config's own frequencies
    (:func:`~edgevlm.runtime.decoder.rope_inv_freq`: llama3 / linear scaling included)."""
    from edgevlm.runtime.decoder import rope_inv_freq, rope_tables

    tc = files.config.text
    cos, sin = rope_tables(tc.head_dim, max(lengths, default=1), tc.rope_theta, "cpu", rope_inv_freq(tc))
    return _DecoderRunner(tc, [(cos[:t], sin[:t]) for t in lengths])


def _on_meta(cls, cfg) -> nn.Module:
    with torch.device("meta"):
        return cls(cfg)


def _process_block(block: nn.Module, prefix: str, decisions: dict[str, LayerDecision], source: CheckpointReader,
                   writer: ShardWriter, opts: BuildOptions, inputs: list[torch.Tensor] | None, run,
                   keep_dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Load, (calibrate,) quantize and write one block; returns its float outputs for the next one."""
    names = source.names_under(prefix)
    source.written.update(names)
    state = {n[len(prefix):]: t.float() for n, t in source.read(names).items()}
    block.load_state_dict(state, strict=True, assign=True)  # block was built on "meta": no second copy
    del state
    if any(t.is_meta for t in [*block.parameters(), *block.buffers()]):
        raise RuntimeError(f"{prefix}: the runtime's block module has state that is not in the checkpoint")
    block.eval().requires_grad_(False)
    sizes = {n[len(prefix):]: d.group_size for n, d in decisions.items() if n.startswith(prefix) and d.action == "int4"}
    outputs = None
    if opts.method == "awq" and sizes:
        st = awq.prepare(block, sizes, fold=True, max_rows=opts.awq_max_tokens, seed=0)
        with torch.no_grad():
            outputs = [run(block, j, x) for j, x in enumerate(inputs)]
        results = awq.search(block, st, opts.awq_grid)
        st.remove_hooks()
        apply_awq(block, st, results)
        for rel, r in results.items():
            d = decisions[prefix + rel]
            where = "none" if r.alpha == 0.0 else ("folded" if r.fold_into else "input_scale")
            decisions[prefix + rel] = d.model_copy(update=dict(
                awq_scale=where, awq_alpha=r.alpha, rel_error=r.rel_error, rel_error_rtn=r.rel_error_rtn,
                awq_fold_into=prefix + r.fold_into if where == "folded" else None))
    else:
        if inputs is not None:
            with torch.no_grad():
                outputs = [run(block, j, x) for j, x in enumerate(inputs)]
        for rel, g in sizes.items():
            parent, _, child = rel.rpartition(".")
            setattr(block.get_submodule(parent), child, Int4Linear.from_linear(block.get_submodule(rel), g))
    for rel, t in block.state_dict().items():
        name = prefix + rel
        is_int4 = rel.endswith((".qweight", ".scales", ".zeros", ".input_scale"))
        writer.add(source.source_name(name), t if is_int4 or not t.is_floating_point() else t.to(keep_dtype))
    return outputs


def build_bundle(model_dir: str | Path, out_dir: str | Path, opts: BuildOptions | None = None, *,
                 on_plan: Callable[[str], None] | None = None, progress: Progress | None = None) -> BuildResult:
    """Quantize the checkpoint in ``model_dir`` into an engine bundle at ``out_dir``.

    Args:
        on_plan: called with the per-layer plan table before quantization starts.
        progress: called as ``progress(stage, done, total)``.
    Raises:
        ModelLoadError: the model folder is missing, invalid, or already a bundle; its tokenizer or
            chat template does not load (checked first); the ONNX graphs do not match PyTorch.
        ConfigError: bad options (``vision="int4"`` for a family other than llava), ``out_dir``
            exists and is not empty (without ``overwrite``; with it, when it is not an engine bundle),
            ``out_dir`` is or holds the model folder, an unknown profile, or unusable calibration data.
    """
    opts = opts or BuildOptions()
    _check_options(opts)
    t0 = time.perf_counter()
    model_dir, out_dir = Path(model_dir).expanduser().resolve(), Path(out_dir).expanduser().resolve()
    if is_bundle(model_dir):
        raise ModelLoadError(f"{model_dir} is already an engine bundle; quantize the 16-bit source model")
    files = read_model_files(model_dir)
    _check_tokenizer(files)  # before any quantization work: a bundle whose prompt cannot be built cannot answer
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file, not a folder (choose another --out)")
    if out_dir == model_dir or model_dir in out_dir.parents:
        raise ConfigError(f"output folder {out_dir} must not be inside the model folder")
    if out_dir in model_dir.parents:
        raise ConfigError(f"output folder {out_dir} holds the model folder {model_dir} (choose another --out)")
    held = sorted(p.name for p in out_dir.iterdir()) if out_dir.exists() else []
    if held and not opts.overwrite:
        raise ConfigError(f"output folder {out_dir} exists and is not empty (choose another --out, or --overwrite "
                          "to replace it)")
    if held and not is_bundle(out_dir):  # --overwrite deletes the folder: only ever an earlier bundle
        shown = ", ".join(held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
        raise ConfigError(f"--overwrite replaces an engine bundle, and output folder {out_dir} is not one (no "
                          f"manifest.json; it holds {shown}): choose another --out")
    cfg = files.config
    if opts.vision == "int4" and not files.family.int4_vision:
        raise ConfigError(f"--vision int4 is not supported for the {files.family.name} family (its vision encoder "
                          "stays 16-bit; INT4 vision: llava); use --vision fp16")
    ladder = _resolve_ladder(files, opts)
    progress = progress or (lambda stage, done, total: None)
    keep_dtype = getattr(torch, opts.keep_dtype)

    source = CheckpointReader(files)
    decisions = plan_layers(list_linears(files, source), group_size=opts.group_size, method=opts.method,
                            vision=opts.vision, lm_head=opts.lm_head, int4_vision=files.family.int4_vision)
    by_name = {d.name: d for d in decisions}
    if opts.lm_head and "language_model.lm_head" not in by_name:  # was: a silent no-op
        raise ConfigError("--lm-head int4: this checkpoint has no lm_head of its own (tie_word_embeddings: the head "
                          "is the embedding matrix, which stays 16-bit); use --lm-head fp16")
    for d in decisions:  # lm_head is always round-to-nearest (AWQ is applied per block only)
        if d.name == "language_model.lm_head" and d.action == "int4":
            by_name[d.name] = d.model_copy(update=dict(method="rtn", reason=d.reason + "; RTN (no AWQ for lm_head)"))
    plan_text = format_plan(list(by_name.values()))
    if on_plan:
        on_plan(plan_text)

    partial = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        writer = ShardWriter(partial, int(opts.max_shard_mb * 1024 * 1024))
        vision_int4 = any(d.action == "int4" and d.name.startswith("vision_tower.encoder.") for d in by_name.values())
        dec_in = vis_in = run = None
        calib_info = CalibrationInfo()
        if opts.method == "awq":
            progress("calibrate", 0, 1)
            if files.family.name == "llava":
                dec_in, vis_in, calib_info = _calibration_inputs(files, source, opts, ladder, vision_int4)
                run = _decoder_runner(files, [x.shape[1] for x in dec_in])
            else:
                dec_in, run, calib_info = _family_calibration_inputs(files, source, opts, ladder)
            progress("calibrate", 1, 1)
        from edgevlm.runtime.decoder import DecoderLayer
        from edgevlm.runtime.vision import VisionBlock

        n_vis = cfg.vision_blocks_needed if vision_int4 else 0
        n_dec = cfg.text.num_hidden_layers
        total = n_vis + n_dec + 1
        for i in range(n_vis):
            vis_in = _process_block(_on_meta(VisionBlock, cfg.vision), f"vision_tower.encoder.layers.{i}.", by_name, source,
                                    writer, opts, vis_in, lambda b, j, x: b(x), keep_dtype)
            progress("quantize", i + 1, total)
        vis_in = None
        for i in range(n_dec):
            dec_in = _process_block(_on_meta(DecoderLayer, cfg.text), f"language_model.layers.{i}.", by_name, source, writer,
                                    opts, dec_in, run.for_layer(i) if run is not None else None, keep_dtype)
            dec_in = run.after_layer(i, dec_in) if run is not None else None
            progress("quantize", n_vis + i + 1, total)
            _malloc_trim()  # hand the freed block buffers back: RSS tracks what is really held
        dec_in = None
        for name in [n for n in source.src_of if n not in source.written]:  # embeddings, norms, projector, head
            t = source.read([name])[name]
            d = by_name.get(name[: -len(".weight")])
            if d is not None and d.action == "int4":
                q = quantize_int4(t.float(), d.group_size)
                for suffix, v in (("qweight", q.qweight), ("scales", q.scales), ("zeros", q.zeros)):
                    writer.add(source.source_name(name[: -len("weight")] + suffix), v)
            else:
                writer.add(source.src_of[name], t.to(keep_dtype) if t.is_floating_point() else t)
        weight_names = writer.close()
        progress("quantize", total, total)
        layouts = []
        if opts.w4a16_layout == "mma":
            progress("layout", 0, 1)
            layouts = [r for r in [_write_mma_layout(partial, by_name, source, weight_names,
                                                     int(opts.max_shard_mb * 1024 * 1024))] if r is not None]
            progress("layout", 1, 1)
        notes = _copy_side_files(files, partial, ladder)
        notes += _build_artifacts(files, partial, opts, ladder)
        _write_readme(files, partial, opts, by_name, ladder, notes)
        manifest = _write_manifest(files, partial, opts, by_name, ladder, calib_info, writer, t0, notes, weight_names,
                                   layouts)
        if (partial / "onnx" / "vision.onnx").is_file():
            progress("check", 0, 1)
            manifest = _check_onnx(partial, manifest)
            progress("check", 1, 1)
        _apply_umask_modes(partial)
        replace_folder(partial, out_dir)  # an earlier bundle (--overwrite) stays whole until the new one is in
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return BuildResult(out_dir, manifest, plan_text, notes)


LAYOUT_DIR = "layouts"


def _write_mma_layout(out: Path, decisions: dict[str, LayerDecision], source: CheckpointReader,
                      weight_names: list[str], max_bytes: int) -> KernelLayout | None:
    """Store :func:`~edgevlm.runtime.int4_format.repack_int4_mma` of every INT4 layer whose shape the
    layout holds, read back from the bundle's own written shards (so the copy is exactly the repack of
    what is stored), as ``layouts/w4a16-mma-v<N>.safetensors`` (or ``-0000i-of-0000n`` shards of at most
    ``max_bytes``). Returns its manifest record, or None (one WARNING line) when no layer fits."""
    from safetensors import safe_open

    from edgevlm.runtime.bundle import MMA_LAYOUT_TENSORS
    from edgevlm.runtime.int4_format import (
        MMA_LAYOUT_NAME,
        MMA_LAYOUT_TARGETS,
        MMA_LAYOUT_VERSION,
        MMA_TENSOR_SUFFIXES,
        mma_layout_fits,
    )

    fits = [d for d in decisions.values()
            if d.action == "int4" and mma_layout_fits(d.out_features, d.in_features, d.group_size)]
    if not fits:
        logger.warning("--w4a16-layout mma: no INT4 layer has a shape the %s layout holds (out %% 16, in %% 64, "
                       "group size 64/128): nothing stored", MMA_LAYOUT_NAME)
        return None
    file_of = {}
    for name in weight_names:
        with safe_open(str(out / name), framework="pt", device="cpu") as f:
            file_of.update({k: out / name for k in f.keys()})
    folder = out / LAYOUT_DIR
    folder.mkdir()
    meta = {"format": "pt", "edgevlm_kernel_layout": f"{MMA_LAYOUT_NAME} v{MMA_LAYOUT_VERSION}"}
    writer = ShardWriter(folder, max_bytes, stem=f"{MMA_LAYOUT_NAME}-v{MMA_LAYOUT_VERSION}", index=False,
                         metadata=meta)
    for d in fits:
        canon = {}
        for part in ("qweight", "scales", "zeros"):
            key = source.source_name(f"{d.name}.{part}")
            with safe_open(str(file_of[key]), framework="pt", device="cpu") as f:
                canon[part] = f.get_tensor(key)
        for suffix, t in zip(MMA_TENSOR_SUFFIXES, repack_int4_mma(canon["qweight"], canon["scales"], canon["zeros"],
                                                                  d.group_size), strict=True):
            writer.add(d.name + suffix, t)
    files = [f"{LAYOUT_DIR}/{n}" for n in writer.close()]
    return KernelLayout(name=MMA_LAYOUT_NAME, version=MMA_LAYOUT_VERSION, targets=list(MMA_LAYOUT_TARGETS),
                        tensors=MMA_LAYOUT_TENSORS, files=files, layers=len(fits),
                        size_bytes=sum(writer.bytes_by_name.values()))


def _current_umask() -> int:
    """The process umask, read from ``/proc/self/status`` (Linux >= 4.7) so that it is never
    changed; elsewhere set and restored at once."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _apply_umask_modes(root: Path) -> None:
    """Give every file under ``root`` mode ``0o666 & ~umask`` and every folder ``0o777 & ~umask``
    (0644 / 0755 under the usual umask 022): some writers (onnx's external data, temporary files
    renamed into place) create files 0600, which a service user other than the builder cannot read."""
    mask = _current_umask()
    root.chmod(0o777 & ~mask)
    for path in root.rglob("*"):
        if path.is_symlink():
            continue
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def _check_tokenizer(files: ModelFiles) -> None:
    """The tokenizer loads and the chat template compiles and renders a user turn (what
    ``Engine.load`` checks on the bundle), before any quantization work.

    Raises:
        ModelLoadError: naming the source folder and the problem.
    """
    from edgevlm.runtime.tokenizer import VLMTokenizer

    try:
        VLMTokenizer.from_dir(files.model_dir, files.config.image_token_id, family=files.family.name)
    except ModelLoadError as exc:
        raise ModelLoadError(f"{files.model_dir}: {exc.message} (checked before quantizing: a bundle of this "
                             "model could not build a prompt)") from exc


def _check_onnx(out: Path, manifest: BundleManifest) -> BundleManifest:
    """Run :func:`edgevlm.quantize.onnx_check.check_bundle_onnx` on the finished bundle and record it
    in ``manifest.json`` (``onnx_check``); ModelLoadError on a mismatch refuses the bundle."""
    try:
        from edgevlm.quantize.onnx_check import check_bundle_onnx

        manifest.onnx_check = check_bundle_onnx(out)
    except ImportError as exc:
        manifest.artifacts["onnx"] = f"onnx/ (not checked against PyTorch: {exc.name} is not installed: " \
                                     "pip install 'edgevlm[onnx]')"
    (out / "manifest.json").write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def _write_readme(files: ModelFiles, out: Path, opts: BuildOptions, decisions: dict[str, LayerDecision],
                  ladder: list[int], notes: list[str]) -> None:
    """``README.md`` of the bundle: what it is, how it was built, how to run it (the source's README
    describes the 16-bit weights and is not copied)."""
    n4 = sum(d.action == "int4" for d in decisions.values())
    kept = len(decisions) - n4
    vision = "INT4" if opts.vision == "int4" else f"16-bit ({opts.keep_dtype})"
    graphs = ", ".join(sorted(p.name for p in (out / "onnx").glob("*.onnx"))) if (out / "onnx").is_dir() else ""
    artifacts = [f"`onnx/` ({graphs}; checked against PyTorch, see `onnx_check` in manifest.json)"
                 if graphs else "no ONNX artifacts"]
    if (out / "tensorrt").is_dir():
        artifacts.append("`tensorrt/` engines")
    if (out / LAYOUT_DIR).is_dir():
        artifacts.append(f"`{LAYOUT_DIR}/` the INT4 layers' tensor-core layout (w4a16-mma, CUDA sm_80+; read at load "
                         "instead of repacking; the canonical tensors stay for every other path)")
    lines = [
        f"# INT4 engine bundle of {files.model_dir.name}",
        "",
        f"Built by `edgevlm quantize` from `{files.model_dir}`. W4A16: the linear layers' weights are",
        f"INT4 ({opts.method.upper()}, group size {opts.group_size}; per-layer fallbacks in manifest.json), activations 16-bit; {n4} linear layers",
        f"INT4, {kept} kept in {opts.keep_dtype}. Vision encoder linears: {vision}. Every other tensor",
        f"(embeddings, norms, projector{', lm_head' if not opts.lm_head else ''}) is {opts.keep_dtype}.",
        "",
        f"- resolution ladder: {', '.join(str(r) for r in ladder)} px",
        f"- artifacts: {'; '.join(artifacts)}",
        "- `manifest.json`: the per-layer plan and errors, the source's hashes, versions, and every file's SHA-256",
        "  (checked on every load: a changed, added or outside file is refused)",
        *[f"- note: {n}" for n in notes],
        "",
        "Run it: `edgevlm ask --model BUNDLE --image scene.png \"how many shapes are there?\"` "
        "(`--backend onnx` for ONNX Runtime), or `Engine.load(\"BUNDLE\")`.",
        "",
        "The source model's own README (which describes its 16-bit weights) is not copied; read it in the source",
        "folder.",
    ]
    (out / "README.md").write_text("\n".join(lines) + "\n")


# Measured on (and fingerprinted to) the 16-bit weights: not valid for the bundle.
_NOT_COPIED = ("exits.json", "exits.safetensors", "frontier.json", "frontier.png")
# Describes the source's weights (float16, its accuracy): the bundle gets its own (_write_readme).
_README = "README.md"


def _copy_side_files(files: ModelFiles, out: Path, ladder: list[int]) -> list[str]:
    """config.json (with the bundle's ladder) and every other top-level file of the source except
    its weights and :data:`_NOT_COPIED`; returns notes on what was left out."""
    raw = json.loads(json.dumps(files.raw_config))
    if ladder:  # an empty ladder (SmolVLM, Qwen without edgevlm.resolution_ladder): the family's own rule
        raw.setdefault("edgevlm", {})["resolution_ladder"] = ladder
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    weights = {p.name for p in files.weight_files}
    skipped = []
    for p in sorted(files.model_dir.iterdir()):
        if not p.is_file() or p.name in _WEIGHT_FILES or p.name in weights or p.suffix in (".bin", ".pt", ".pth"):
            continue
        if p.name in _NOT_COPIED:
            skipped.append(p.name)
            continue
        if p.name == _README:
            continue
        shutil.copy2(p, out / p.name)
    if skipped:
        return [f"calibration: {', '.join(skipped)} not copied (measured on the 16-bit weights; "
                "run `edgevlm calibrate` on the bundle)"]
    return []


#: families whose vision tower and decoder :mod:`edgevlm.quantize.onnx_export` exports (the vision graphs of
#: all but LLaVA: :mod:`edgevlm.quantize.onnx_vision_export`)
ONNX_FAMILIES = ("llava", "qwen2_5_vl", "qwen3_vl", "smolvlm", "internvl", "gemma3")
#: families with a TensorRT build (:mod:`edgevlm.quantize.tensorrt_build`: LLaVA's vision profile)
TENSORRT_FAMILIES = ("llava",)


def _build_artifacts(files: ModelFiles, out: Path, opts: BuildOptions, ladder: list[int]) -> list[str]:
    """ONNX and TensorRT artifacts; returns one-line notes for what was not built (a family
    without an ONNX export gets one WARNING line and the torch bundle)."""
    family = files.family.name
    notes = []
    if family not in ONNX_FAMILIES and (opts.onnx or opts.tensorrt):
        note = (f"onnx: not built (no ONNX export for the {family} family; supported: "
                f"{', '.join(ONNX_FAMILIES)}); the torch bundle is built")
        logger.warning("%s", note)
        return [note] + (["tensorrt: not built (needs the ONNX export)"] if opts.tensorrt else [])
    if opts.onnx:
        try:
            from edgevlm.quantize.onnx_export import export_bundle_onnx
        except ImportError as exc:
            notes.append(f"onnx: not built ({exc.name} is not installed: pip install 'edgevlm[onnx]')")
        else:
            export_bundle_onnx(out, ladder)
    if opts.tensorrt and family not in TENSORRT_FAMILIES:
        notes.append(f"tensorrt: not built (the TensorRT build is LLaVA-only; no engine for {family})")
    elif opts.tensorrt and not opts.onnx:
        notes.append("tensorrt: not built (it builds from the ONNX export, which --no-onnx skipped); "
                     "the bundle is complete for torch")  # fmt: skip
    elif opts.tensorrt:
        from edgevlm.quantize.tensorrt_build import build_tensorrt_engines

        note = build_tensorrt_engines(out, ladder)
        if note:
            notes.append(note)
    return notes


def _write_manifest(files: ModelFiles, out: Path, opts: BuildOptions, decisions: dict[str, LayerDecision],
                    ladder: list[int], calib: CalibrationInfo, writer: ShardWriter, t0: float,
                    notes: list[str], weight_names: list[str], layouts: list[KernelLayout]) -> BundleManifest:
    src_paths = [files.model_dir / "config.json", *files.weight_files]
    src_paths += [p for p in sorted(files.model_dir.iterdir()) if p.is_file() and p not in src_paths
                  and p.suffix in (".json", ".jinja", ".txt", ".model")]
    src_entries = []
    for p in src_paths:
        src_entries.append({"path": p.name, "sha256": sha256_file(p), "size_bytes": p.stat().st_size})
    digest = "\n".join(f"{e['path']} {e['sha256']}" for e in sorted(src_entries, key=lambda e: e["path"]))
    import hashlib

    int4_bytes = f16_equiv = 0
    for d in decisions.values():
        if d.action == "int4" and d.name.startswith("language_model."):
            int4_bytes += d.out_features * d.in_features // 2 + 3 * d.out_features * (d.in_features // d.group_size)
            f16_equiv += 2 * d.out_features * d.in_features
    dec_bytes = sum(b for n, b in writer.bytes_by_name.items() if "language_model" in n or n.startswith("lm_head"))
    stats = {
        "quantize_time_s": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
        "decoder_linear_int4_bytes": float(int4_bytes),
        "decoder_linear_16bit_bytes": float(f16_equiv),
        "decoder_bytes": float(dec_bytes),
        "weights_bytes": float(sum(writer.bytes_by_name.values())),
        "kernel_layout_bytes": float(sum(r.size_bytes for r in layouts)),
    }
    artifacts = {"safetensors": ", ".join(weight_names)}
    for note in notes:  # a note on a built artifact ("onnx: onnx/vision.onnx only ...") describes it
        backend, _, text = note.partition(": ")
        artifacts.setdefault(backend, text)
    if (out / "onnx").is_dir():
        artifacts.setdefault("onnx", "onnx/")
    if (out / "tensorrt").is_dir():
        artifacts.setdefault("tensorrt", "tensorrt/")
    manifest = BundleManifest(
        created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        source=SourceInfo(path=str(files.model_dir), sha256=hashlib.sha256(digest.encode()).hexdigest(),
                          files=src_entries),
        method=opts.method, group_size=opts.group_size, vision=opts.vision, keep_dtype=opts.keep_dtype,
        layers=list(decisions.values()), resolution_ladder=ladder, patch_size_px=files.config.vision.patch_size,
        profile=opts.profile, calibration=calib, versions=_versions(), artifacts=artifacts, stats=stats,
        kernel_layouts=layouts, files=file_entries(out),
    )
    (out / "manifest.json").write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest
