"""Qwen2-Audio's audio-token arithmetic, as its processor and tower compute it, without torch.

Whisper's feature extractor pads (or cuts) a clip at `sampling_rate` to its window of `n_samples`
and marks one log-mel frame valid per started `hop_length` samples; the tower's stride-2 conv halves
the frames and its 2x average pool halves them again (Qwen2AudioProcessor._process_audio's
`num_audio_tokens`, Qwen2AudioEncoder._get_feat_extract_output_lengths). Settings come from the
checkpoint's feature-extractor config (processor_config.json's "feature_extractor", else
preprocessor_config.json), the way transformers reads them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mserve.common.checkpoint_files import IMAGE_PROCESSOR_FILE, PROCESSOR_FILE, CheckpointError, read_json


@dataclass(frozen=True)
class AudioFeatures:
    """The feature extractor's settings the token count depends on."""

    sampling_rate: int  # the rate a clip is resampled to
    hop_length: int  # samples per log-mel frame
    n_samples: int  # the window: a longer clip is cut to it

    @property
    def max_seconds(self) -> float:
        return self.n_samples / self.sampling_rate

    @property
    def min_seconds(self) -> float:
        """The shortest clip that gives one token: three frames (conv -> 2, pool -> 1)."""
        return (2 * self.hop_length + 1) / self.sampling_rate

    def frames(self, samples: int) -> int:
        """Valid log-mel frames of a clip of `samples` samples at `sampling_rate`."""
        return -(-min(samples, self.n_samples) // self.hop_length)

    def tokens(self, samples: int) -> int:
        """Audio placeholder tokens of a clip of `samples` samples at `sampling_rate` (0 for an empty one)."""
        frames = self.frames(samples)
        if frames <= 0:
            return 0
        conv = (frames - 1) // 2 + 1
        return max((conv - 2) // 2 + 1, 0)


def read_audio_features(model_dir: str | os.PathLike) -> AudioFeatures:
    d = Path(model_dir)
    nested = (read_json(d / PROCESSOR_FILE) or {}).get("feature_extractor")
    cfg: dict[str, Any] | None = nested if isinstance(nested, dict) else read_json(d / IMAGE_PROCESSOR_FILE)
    where = d / (PROCESSOR_FILE if isinstance(nested, dict) else IMAGE_PROCESSOR_FILE)
    if not cfg or "sampling_rate" not in cfg or "hop_length" not in cfg:
        raise CheckpointError(f"{d}: no feature extractor settings (sampling_rate, hop_length) in "
                              f"{PROCESSOR_FILE} or {IMAGE_PROCESSOR_FILE}")
    rate, hop = int(cfg["sampling_rate"]), int(cfg["hop_length"])
    n_samples = int(cfg.get("n_samples") or int(cfg.get("chunk_length", 30)) * rate)
    if rate <= 0 or hop <= 0 or n_samples <= 0:
        raise CheckpointError(f"{where}: sampling_rate, hop_length and n_samples must be positive")
    return AudioFeatures(sampling_rate=rate, hop_length=hop, n_samples=n_samples)
