"""Which model families this build serves, and with which modalities: the lists the loader, the
processor, `mserve make-tiny-model --arch` and the docs read (one place)."""

from __future__ import annotations

# Families tested token-exact here (each one against Hugging Face generate). Any other model_type serves
# only after a load-time probe proves it token-exact (workers/probe.py), and is refused at load naming
# the trait the engine cannot honour (common/traits.py) or the case the probe failed.
SERVED_MODEL_TYPES = ("llava", "qwen2_vl", "qwen2_5_vl", "llava_next", "mistral3", "gemma3", "gemma4", "internvl",
                      "smolvlm", "idefics3", "qwen3_vl", "qwen3_vl_moe", "glm46v", "glm4v",
                      "glm4v_moe", "qwen3_5", "qwen3_5_moe", "qwen2_audio", "voxtral", "llama4")
# Families that take audio clips, token-exact here, in a checkpoint with an audio tower (an audio_config): their
# audio token is the one placeholder (Voxtral's count and prompt are its Tekken tokenizer's,
# common/families/voxtral.py), but Gemma 4's, whose clip is boa + audio tokens + eoa beside its images.
AUDIO_MODEL_TYPES = ("qwen2_audio", "voxtral", "gemma4")
# Families with a video token whose video path is verified token-exact (Qwen2.5-VL: with each video's
# second_per_grid_ts, from its frame rate, in the M-RoPE index; Qwen3-VL and its MoE: with its per-frame-group
# timestamps as text, common/families/qwen3_vl.py).
VIDEO_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe")
# What the engine lacks for families whose processor and model do have the generic hooks.
KNOWN_GAPS = {
    "llava_onevision": "image counts that depend on the prompt: with two or more images each is taken at its base "
                       "view only, but its processor's _get_num_multimodal_tokens counts every image with its tiles",
}


def has_audio_tower(model_type: str | None, cfg: dict) -> bool:
    """Whether this checkpoint's audio is served: a family of AUDIO_MODEL_TYPES, with an audio tower (Gemma 4's
    larger checkpoints have none)."""
    return model_type in AUDIO_MODEL_TYPES and cfg.get("audio_config") is not None
