"""Audio clips -> embeddings on an encode worker: the checkpoint's own feature extractor and audio tower.

Qwen2-Audio's model has no `get_audio_features`: its forward pads each clip's log-mel features to the
window, masks the tower's attention past each clip's valid frames, runs the tower and the projector and
keeps each clip's first `output_lengths` rows. This does those same steps, one clip per row of the
batch, so each clip's rows are what HF's forward scatters into its prompt.

Voxtral's does have `get_audio_features`: each clip padded to whole chunks as its Tekken tokenizer pads it,
its features cut into chunks as VoxtralProcessor cuts them, every chunk of every clip in one batch, and
each clip's rows (its token count, common/families/voxtral.py) taken in order.
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
    if family.model_type == "voxtral":
        return _encode_voxtral(model, family, clips)
    fe = family.processor.feature_extractor
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


def _encode_voxtral(model: torch.nn.Module, family: Any, clips: Sequence[np.ndarray]) -> list[torch.Tensor]:
    processor = family.processor
    kwargs = processor._merge_kwargs()["audio_kwargs"]  # the processor's own feature settings
    per_chunk = kwargs.pop("max_source_positions")
    pad = processor.tokenizer.tokenizer.instruct_tokenizer.audio_encoder.pad
    rate = family.audio_features.sampling_rate
    features = processor._retrieve_input_features([pad(np.asarray(c), rate) for c in clips], per_chunk, **kwargs)
    weight = next(model.model.audio_tower.parameters())
    rows = model.model.get_audio_features(features.to(weight.device, weight.dtype), return_dict=True).pooler_output
    return [r.contiguous() for r in rows.split([family.audio_features.tokens(len(c)) for c in clips])]
