"""Audio clips -> embeddings on an encode worker: the checkpoint's own feature extractor and audio tower.

A model with `get_audio_features` (Gemma 4) runs it on the feature extractor's batch, as its forward does, and
each clip keeps the rows its output mask marks valid. Qwen2-Audio's model has no `get_audio_features`: its
forward pads each clip's log-mel features to the window, masks the tower's attention past each clip's valid
frames, runs the tower and the projector and keeps each clip's first `output_lengths` rows. This does those
same steps, one clip per row of the batch, so each clip's rows are what HF's forward scatters into its prompt.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch


@torch.inference_mode()
def encode_audio(model: torch.nn.Module, family: Any, clips: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """Mono float32 waveforms at the feature extractor's rate -> one [tokens, hidden] tensor per clip."""
    from transformers.masking_utils import create_bidirectional_mask

    if not clips:
        return []
    fe = family.processor.feature_extractor
    if getattr(model.model, "get_audio_features", None) is not None:
        return _own_audio_features(model, fe, clips)
    inputs = fe(list(clips), sampling_rate=fe.sampling_rate, padding="max_length", return_attention_mask=True,
                return_tensors="pt")
    tower, projector = model.model.audio_tower, model.model.multi_modal_projector
    weight = next(tower.parameters())
    features = inputs["input_features"].to(weight.device, weight.dtype)
    conv_lengths, out_lengths = tower._get_feat_extract_output_lengths(inputs["attention_mask"].sum(-1))
    max_len = (features.shape[-1] - 2) // 2 + 1
    valid = (torch.arange(max_len)[None, :] < conv_lengths[:, None]).long().to(weight.device)
    mask = create_bidirectional_mask(config=tower.config, attention_mask=valid,
                                     inputs_embeds=torch.zeros(len(clips), max_len, 1, dtype=weight.dtype,
                                                               device=weight.device))
    hidden = projector(tower(features, attention_mask=mask).last_hidden_state)
    return [hidden[i, : int(n)].contiguous() for i, n in enumerate(out_lengths.tolist())]


def _own_audio_features(model: torch.nn.Module, fe: Any, clips: Sequence[np.ndarray]) -> list[torch.Tensor]:
    """The model's get_audio_features on the extractor's batch (padded to the longest clip, as the processor
    pads it); each clip's valid rows, the ones HF's forward scatters into its prompt."""
    inputs = fe(list(clips), sampling_rate=fe.sampling_rate, return_tensors="pt")
    weight = next(model.model.audio_tower.parameters())
    out = model.model.get_audio_features(inputs["input_features"].to(weight.device, weight.dtype),
                                         inputs["input_features_mask"].to(weight.device), return_dict=True)
    return [rows[valid].contiguous() for rows, valid in zip(out.pooler_output, out.attention_mask)]
