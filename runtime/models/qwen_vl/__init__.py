"""What the Qwen-VL families share (Qwen2.5-VL, Qwen3-VL): ``smart_resize`` preprocessing, patchify and
video frame sampling (:mod:`.preprocess`), multimodal RoPE position ids and cos/sin tables (:mod:`.rope`),
the family config base and its special token ids (:mod:`.config`, :mod:`.tokens`) and the Conv3d patch
embedding (:mod:`.patch_embed`)."""
