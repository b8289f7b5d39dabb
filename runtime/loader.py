"""Load a Hugging Face-format VLM checkpoint from a local folder, without transformers, for any
registered model family (:mod:`edgevlm.runtime.models`).

Steps: read ``config.json`` -> :func:`~edgevlm.runtime.models.family_for` (by ``model_type``) ->
the family parses it -> the family builds its model on the meta device -> every checkpoint tensor
name is mapped by the family's ``weight_rules`` (data: regex rules) -> the tensors are read into
the model. Files read (Hugging Face Hub conventions,
https://huggingface.co/docs/transformers/main_classes/model): ``config.json``; weights
``model.safetensors`` or the shards listed in ``model.safetensors.index.json`` (``weight_map``);
``generation_config.json`` (optional, EOS ids); the image processor's settings from
``processor_config.json``'s ``image_processor`` (what transformers 5 writes) or
``preprocessor_config.json``. Tokenizer files are read by :mod:`edgevlm.runtime.tokenizer`. No
remote code is executed and only safetensors weights are accepted (pickle-based ``.bin``/``.pt``
files can run arbitrary code when loaded).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from edgevlm.errors import ModelLoadError
from edgevlm.model_folder import (
    check_safetensors,
    int4_layers,
    missing_manifest_error,
    name_layers,
    read_image_processor,
    read_json,
    weight_files,
)
from edgevlm.runtime.models import family_for
from edgevlm.runtime.models.base import ModelFamily

logger = logging.getLogger(__name__)


@dataclass
class ModelFiles:
    """What a checkpoint folder holds besides the weights.

    ``config`` is the family's parsed config; ``image_processor`` the image processor's settings
    (a dict in transformers' names, None when the checkpoint has none); ``image_mean`` /
    ``image_std`` its normalisation when given."""

    model_dir: Path
    raw_config: dict
    config: Any
    weight_files: list[Path]
    family: ModelFamily | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    image_processor: dict | None = None
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None


def read_model_files(model_dir: str | Path) -> ModelFiles:
    """Read and validate a checkpoint folder's metadata (no tensors are loaded).

    Raises:
        ModelLoadError: the folder, ``config.json`` or the weights are missing or invalid, or no
            registered family serves its ``model_type`` (the message names the supported ones).
    """
    model_dir = Path(model_dir).expanduser()
    if not model_dir.exists():
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a folder (expected a model folder with config.json)")
    raw = read_json(model_dir / "config.json")
    if not isinstance(raw, dict):
        raise ModelLoadError("config.json: top level must be a JSON object")
    family = family_for(raw)
    cfg = family.parse_config(raw)
    files = weight_files(model_dir)
    for f in files:  # (not check_weight_headers: quantize reads its bundle before it writes the manifest)
        check_safetensors(f)  # header vs file size: a truncated file is named before torch reads it
    eos: list[int] = []
    gen = read_json(model_dir / "generation_config.json", required=False)
    if isinstance(gen, dict):
        value = gen.get("eos_token_id")
        eos = [value] if isinstance(value, int) else [v for v in (value or []) if isinstance(v, int)]
    if not eos:
        eos = list(cfg.text.eos_token_id)
    mf = ModelFiles(model_dir=model_dir, raw_config=raw, config=cfg, weight_files=files, family=family,
                    eos_token_ids=eos, image_processor=read_image_processor(model_dir))
    pre = mf.image_processor or {}
    mean, std = pre.get("image_mean"), pre.get("image_std")
    if isinstance(mean, list) and isinstance(std, list) and len(mean) == 3 and len(std) == 3:
        mf.image_mean = tuple(float(v) for v in mean)
        mf.image_std = tuple(float(v) for v in std)
    return mf


def compile_weight_rules(rules: tuple[tuple[str, str | None], ...]) -> list[tuple[re.Pattern, str | None]]:
    """``weight_rules`` (see :class:`~edgevlm.runtime.models.base.ModelFamily`) compiled once."""
    return [(re.compile(pattern), repl) for pattern, repl in rules]


def map_weight_name(key: str, rules: list[tuple[re.Pattern, str | None]]) -> str | None:
    """The model's parameter name for checkpoint tensor ``key``: the first rule whose pattern is
    found in it rewrites it (``re.sub``), or drops it (None); no match keeps ``key``."""
    for pattern, repl in rules:
        if pattern.search(key):
            return None if repl is None else pattern.sub(repl, key, count=1)
    return key


def canonical_key(key: str, files: ModelFiles) -> str | None:
    """:func:`map_weight_name` with the rules of ``files``' family."""
    return map_weight_name(key, _rules(files.family))


_COMPILED: dict[str, list[tuple[re.Pattern, str | None]]] = {}


def _unbuilt(name: str, optional: tuple[str, ...], expected: dict) -> bool:
    """Whether ``name`` belongs to a module the model did not build: under an optional prefix
    (``vision_tower.encoder.layers.``) with an index (``7``) of which the model has no parameter."""
    for prefix in optional:
        if name.startswith(prefix):
            head = prefix + name[len(prefix):].split(".", 1)[0] + "."
            return not any(k.startswith(head) for k in expected)
    return False


def _rules(family: ModelFamily | None) -> list[tuple[re.Pattern, str | None]]:
    if family is None:
        raise ValueError("ModelFiles without a family (use read_model_files)")
    if family.name not in _COMPILED:
        _COMPILED[family.name] = compile_weight_rules(family.weight_rules)
    return _COMPILED[family.name]


def parse_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """Resolve a dtype argument; None = float32 on CPU, bfloat16 on CUDA. ValueError if unknown."""
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        result = dtype
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                 "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                 "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
        result = names.get(str(dtype).lower().removeprefix("torch."))
    if result not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported dtype {dtype!r} (float32, bfloat16 or float16)")
    return result


def load_model(
    files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_seq_len: int, max_batch_size: int = 1
) -> torch.nn.Module:
    """Build the family's model from the safetensors weights (memory-mapped by ``safe_open``) on
    ``device`` in ``dtype`` and allocate its KV caches ``(B, n_kv_heads, max_seq_len, head_dim)``.

    Raises:
        ModelLoadError: a required tensor is missing, has the wrong shape, or an unknown one is present.
    """
    from edgevlm.runtime.bundle import is_bundle, load_bundle_model

    if is_bundle(files.model_dir):  # INT4 engine bundle from `edgevlm quantize` (see runtime/bundle.py)
        return load_bundle_model(files, device=device, dtype=dtype, max_seq_len=max_seq_len,
                                 max_batch_size=max_batch_size)
    with torch.device("meta"):
        model = files.family.build_model(files.config)
    load_weights(model, files, device=device, dtype=dtype)
    model.setup_caches(max_batch_size, max_seq_len)
    logger.info(
        "loaded %s: %.1fM parameters, %s on %s, KV cache %d positions",
        files.model_dir, sum(p.numel() for p in model.parameters()) / 1e6, dtype, device, max_seq_len,
    )
    return model


def load_weights(
    model: torch.nn.Module,
    files: ModelFiles,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    keep_suffixes: tuple[str, ...] = (),
    what: str = "checkpoint",
) -> None:
    """Read every tensor of ``files.weight_files`` (memory-mapped by ``safe_open``) into ``model``,
    the family's model built on the meta device, then tie the embeddings (when the config says
    so) and put it in eval mode. Checkpoint names are mapped by the family's ``weight_rules``;
    names under its ``optional_prefixes`` that the model does not build are skipped.

    Floating tensors are converted to ``dtype`` except those whose canonical name ends with one
    of ``keep_suffixes`` (INT4 codes, scales and zeros keep their stored dtypes); integer tensors
    keep theirs. A tied ``lm_head`` stored in the file is skipped.

    Raises:
        ModelLoadError: a file that safetensors cannot read, a tensor of the wrong shape, tensors
            the model does not have, or tensors the model needs that no file holds; ``what``
            ("checkpoint", "bundle") names the folder in the message.
    """
    from safetensors import safe_open

    cfg = files.config
    rules = _rules(files.family)
    optional = files.family.optional_prefixes
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied_head = "language_model.lm_head.weight" if cfg.tie_word_embeddings else None
    expected.pop(tied_head, None)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in files.weight_files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = map_weight_name(key, rules)
                    if name is None or name == tied_head:
                        continue
                    if name not in expected:
                        if not _unbuilt(name, optional, expected):
                            unexpected.append(key)
                        continue
                    t = f.get_tensor(key)
                    if tuple(t.shape) != expected[name]:
                        raise ModelLoadError(
                            f"{path.name}: tensor {key} has shape {tuple(t.shape)}, "
                            f"config.json implies {expected[name]}"
                        )
                    keep = name.endswith(keep_suffixes) if keep_suffixes else False
                    keep = keep or not t.is_floating_point()
                    state[name] = t.to(device=device, dtype=t.dtype if keep else dtype)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ModelLoadError(f"{path}: cannot read safetensors file ({exc})") from exc
    int4 = int4_layers(unexpected)
    if int4:  # a bundle's INT4 layers that no manifest.json declares
        if what == "checkpoint":
            raise missing_manifest_error(files.model_dir, int4)
        raise ModelLoadError(
            f"bundle {files.model_dir}: the weights hold INT4 layers that manifest.json does not list as INT4 "
            f"({name_layers(int4)}): manifest.json was edited or comes from another build (rebuild the bundle)"
        )
    if unexpected:
        raise ModelLoadError(
            f"{what} {files.model_dir} has tensors the {files.family.name} runtime does not know: "
            f"{', '.join(unexpected[:5])}"
        )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{what} {files.model_dir} is missing tensor(s): {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied_head is not None:
        model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.eval().requires_grad_(False)
