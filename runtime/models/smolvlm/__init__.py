"""SmolVLM / SmolVLM2 / Idefics3: SigLIP-style tower, pixel-shuffle connector, SmolLM2 (Llama) decoder."""
