"""Load a Hugging Face-format LLaVA checkpoint from a local folder, without transformers.

Files read (Hugging Face Hub conventions, https://huggingface.co/docs/transformers/main_classes/model):
``config.json``; weights ``model.safetensors`` or the shards listed in
``model.safetensors.index.json`` (``weight_map``); ``generation_config.json`` (optional, EOS ids);
``preprocessor_config.json`` (optional, ``image_mean``/``image_std``). Tokenizer files are read by
:mod:`edgevlm.runtime.tokenizer`. No remote code is executed and only safetensors weights are
accepted (pickle-based ``.bin``/``.pt`` files can run arbitrary code when loaded).

Weight layouts accepted (all mapped to :class:`~edgevlm.runtime.llava.LlavaModel`'s names):

* transformers 5.x in memory: ``model.vision_tower.*``, ``model.language_model.*``,
  ``model.multi_modal_projector.*``, ``lm_head.*``;
* transformers 5.x ``save_pretrained`` and legacy 4.x: ``vision_tower.[vision_model.]*``,
  ``language_model.model.*``, ``language_model.lm_head.*``, ``multi_modal_projector.*``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from edgevlm.errors import ModelLoadError
from edgevlm.model_folder import check_safetensors, read_json, weight_files
from edgevlm.runtime.config import LlavaConfig, parse_config
from edgevlm.runtime.llava import LlavaModel

logger = logging.getLogger(__name__)

_IGNORED_SUFFIXES = ("position_ids", "rotary_emb.inv_freq")


@dataclass
class ModelFiles:
    """What a checkpoint folder holds besides the weights."""

    model_dir: Path
    raw_config: dict
    config: LlavaConfig
    weight_files: list[Path]
    eos_token_ids: list[int] = field(default_factory=list)
    image_mean: tuple[float, float, float] | None = None
    image_std: tuple[float, float, float] | None = None


def read_model_files(model_dir: str | Path) -> ModelFiles:
    """Read and validate a checkpoint folder's metadata (no tensors are loaded).

    Raises:
        ModelLoadError: the folder, ``config.json`` or the weights are missing or invalid.
    """
    model_dir = Path(model_dir).expanduser()
    if not model_dir.exists():
        raise ModelLoadError(f"model folder {model_dir} does not exist")
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir} is not a folder (expected a model folder with config.json)")
    raw = read_json(model_dir / "config.json")
    cfg = parse_config(raw)
    files = weight_files(model_dir)
    for f in files:
        check_safetensors(f)  # header vs file size: a truncated file is named before torch reads it
    eos: list[int] = []
    gen = read_json(model_dir / "generation_config.json", required=False)
    if isinstance(gen, dict):
        value = gen.get("eos_token_id")
        eos = [value] if isinstance(value, int) else [v for v in (value or []) if isinstance(v, int)]
    if not eos:
        eos = list(cfg.text.eos_token_id)
    mf = ModelFiles(model_dir=model_dir, raw_config=raw, config=cfg, weight_files=files, eos_token_ids=eos)
    pre = read_json(model_dir / "preprocessor_config.json", required=False)
    if isinstance(pre, dict):
        mean, std = pre.get("image_mean"), pre.get("image_std")
        if isinstance(mean, list) and isinstance(std, list) and len(mean) == 3 and len(std) == 3:
            mf.image_mean = tuple(float(v) for v in mean)
            mf.image_std = tuple(float(v) for v in std)
    return mf


def canonical_key(key: str, cfg: LlavaConfig) -> str | None:
    """Map a checkpoint tensor name to :class:`LlavaModel`'s name; None for tensors the runtime does
    not need (CLIP's post_layernorm, blocks past the deepest feature layer, buffers)."""
    if key.startswith("model.") and key.split(".", 2)[1] in ("vision_tower", "language_model", "multi_modal_projector"):
        key = key[len("model."):]
    if key.endswith(_IGNORED_SUFFIXES):
        return None
    if key.startswith(("lm_head.", "language_model.lm_head.")):
        return "language_model.lm_head." + key.split("lm_head.", 1)[1]
    if key.startswith("language_model.model."):
        return "language_model." + key[len("language_model.model."):]
    if key.startswith("language_model."):
        return key
    if key.startswith("multi_modal_projector."):
        return "vision_tower.projector." + key[len("multi_modal_projector."):]
    if key.startswith("vision_tower."):
        rest = key[len("vision_tower."):]
        if rest.startswith("vision_model."):
            rest = rest[len("vision_model."):]
        if rest.startswith("post_layernorm."):
            return None
        if rest.startswith("encoder.layers."):
            idx = int(rest.split(".")[2])
            if idx >= cfg.vision_blocks_needed:
                return None
            rest = rest[len("encoder."):]
        return "vision_tower.encoder." + rest
    return key  # unknown: reported as unexpected


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
) -> LlavaModel:
    """Build :class:`LlavaModel` from the safetensors weights (memory-mapped by ``safe_open``) on
    ``device`` in ``dtype`` and allocate its KV caches ``(B, n_kv_heads, max_seq_len, head_dim)``.

    Raises:
        ModelLoadError: a required tensor is missing, has the wrong shape, or an unknown one is present.
    """
    from edgevlm.runtime.bundle import is_bundle, load_bundle_model

    if is_bundle(files.model_dir):  # INT4 engine bundle from `edgevlm quantize` (see runtime/bundle.py)
        return load_bundle_model(files, device=device, dtype=dtype, max_seq_len=max_seq_len,
                                 max_batch_size=max_batch_size)
    with torch.device("meta"):
        model = LlavaModel(files.config)
    load_weights(model, files, device=device, dtype=dtype)
    model.setup_caches(max_batch_size, max_seq_len)
    logger.info(
        "loaded %s: %.1fM parameters, %s on %s, KV cache %d positions",
        files.model_dir, sum(p.numel() for p in model.parameters()) / 1e6, dtype, device, max_seq_len,
    )
    return model


def load_weights(
    model: LlavaModel,
    files: ModelFiles,
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    keep_suffixes: tuple[str, ...] = (),
    what: str = "checkpoint",
) -> None:
    """Read every tensor of ``files.weight_files`` (memory-mapped by ``safe_open``) into ``model``,
    a :class:`LlavaModel` built on the meta device, then tie the embeddings (when the config says
    so) and put it in eval mode. Checkpoint names are mapped by :func:`canonical_key`.

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
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied_head = "language_model.lm_head.weight" if cfg.tie_word_embeddings else None
    expected.pop(tied_head, None)
    state: dict[str, torch.Tensor] = {}
    unexpected: list[str] = []
    for path in files.weight_files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = canonical_key(key, cfg)
                    if name is None or name == tied_head:
                        continue
                    if name not in expected:
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
    if unexpected:
        raise ModelLoadError(
            f"{what} {files.model_dir} has tensors the LLaVA runtime does not know: {', '.join(unexpected[:5])}"
        )
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ModelLoadError(f"{what} {files.model_dir} is missing tensor(s): {', '.join(missing[:5])}")
    model.load_state_dict(state, strict=False, assign=True)
    if tied_head is not None:
        model.language_model.lm_head.weight = model.language_model.embed_tokens.weight
    model.eval().requires_grad_(False)
