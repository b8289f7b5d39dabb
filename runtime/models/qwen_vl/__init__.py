"""What the Qwen-VL families share (Qwen2.5-VL, Qwen3-VL): ``smart_resize`` preprocessing, patchify and
video frame sampling (:mod:`.preprocess`), multimodal RoPE position ids and cos/sin tables (:mod:`.rope`)."""
