"""The llava family's weight-name map, as data (torch-free, so the registry can list families
without importing torch): checkpoint tensor names -> our module's parameter names, first
``re.search`` match wins, None = a tensor the runtime does not need."""

from __future__ import annotations

#: checkpoint tensor name -> :class:`LlavaModel` parameter name (``re.sub`` replacement), or None
#: for tensors the runtime does not use; the first matching rule wins, no match keeps the name.
#: Layouts: transformers 5.x in memory (``model.vision_tower.*``, ``model.language_model.*``,
#: ``model.multi_modal_projector.*``, ``lm_head.*``); 5.x ``save_pretrained`` and 4.x
#: (``vision_tower.[vision_model.]*``, ``language_model.model.*``, ``language_model.lm_head.*``,
#: ``multi_modal_projector.*``). The towers' final norms (CLIP's / SigLIP's ``post_layernorm``)
#: and SigLIP's pooling ``head`` do not reach LLaVA's features (it reads hidden states).
WEIGHT_RULES: tuple[tuple[str, str | None], ...] = (
    (r"(position_ids|rotary_emb\.inv_freq)$", None),
    (r"^(?:model\.)?(?:language_model\.)?lm_head\.(.*)$", r"language_model.lm_head.\1"),
    (r"^(?:model\.)?language_model\.(?:model\.)?(.*)$", r"language_model.\1"),
    (r"^(?:model\.)?multi_modal_projector\.(.*)$", r"vision_tower.projector.\1"),
    (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(?:post_layernorm|head)\.", None),
    (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?encoder\.layers\.(.*)$", r"vision_tower.encoder.layers.\1"),
    (r"^(?:model\.)?vision_tower\.(?:vision_model\.)?(.*)$", r"vision_tower.encoder.\1"),
)

OPTIONAL_PREFIXES = ("vision_tower.encoder.layers.",)
