"""The qwen2_5_vl family's weight-name map, as data (torch-free, so the registry can list families
without importing torch): checkpoint tensor names -> our module's parameter names, first
``re.search`` match wins, None = a tensor the runtime does not need."""

from __future__ import annotations

#: (regex on the checkpoint tensor name, replacement giving our parameter name | None = not needed).
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"(^|\.)rotary_emb\.inv_freq$", None),
    (r"^(?:model\.)?visual\.(.+)$", r"visual.\1"),
    (r"^model\.language_model\.(.+)$", r"language_model.\1"),
    (r"^model\.((?:embed_tokens|layers|norm)\..+)$", r"language_model.\1"),
    (r"^lm_head\.(.+)$", r"language_model.lm_head.\1"),
)
