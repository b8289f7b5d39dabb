"""The qwen3_vl family's weight-name map, as data (torch-free, so the registry can list families
without importing torch): checkpoint tensor names -> our module's parameter names, first
``re.search`` match wins, None = a tensor the runtime does not need."""

from __future__ import annotations

#: Checkpoint tensor name -> our parameter name (``re.sub`` replacement; None = not needed). Layouts:
#: transformers 5.x / the hub's Qwen3-VL (``model.visual.*``, ``model.language_model.*``, ``lm_head.*``)
#: and the older top-level ``visual.*`` / ``model.{layers,embed_tokens,norm}.*`` spelling.
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"^model\.visual\.(.+)$", r"visual.\1"),
    (r"^visual\.(.+)$", r"visual.\1"),
    (r"^model\.language_model\.(.+)$", r"language_model.\1"),
    (r"^model\.((?:layers|embed_tokens|norm)\..+)$", r"language_model.\1"),
    (r"^lm_head\.(.+)$", r"language_model.lm_head.\1"),
    (r".*rotary_emb\.inv_freq$", None),
)
