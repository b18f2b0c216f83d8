"""Per-stage costs the simulator runs on: a JSON cost file (bench/lab/costs/*.json) behind small formulas.

Every formula is linear in what the stage does, with the coefficients the calibration fitted
(`lab.calibrate`) or the GPU-class file states (`lab.sim.gpu_costs`):

* encode batch of k images = batch_s + sum(image_s + per_mpx_s * megapixels)
* prefill step = step_s + per_token_s * tokens + per_seq_s * sequences + per_visual_token_s * image
  placeholder tokens (chunks of at most chunk_tokens)
* decode step = step_s + per_seq_s * batch + per_ctx_token_s * sum(context lengths)
* transfer of n bytes = fixed_s + per_byte_s * n; a KV hand-off = handoff per_byte_s * KV bytes, split
  between the sending prefill worker (export) and the receiving decode worker (fetch + import)
* coordinator: CPU per request (admission and the stage messages), per STEP_TOKENS message, per token
  item (the item in, TOKENS out), and per worker per second (heartbeats, Redis load reads, ticks)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

COSTS_DIR = Path(__file__).resolve().parent.parent / "costs"

# Share of a KV hand-off paid by the sender (gather into the shm segment); the receiver pays the rest
# (mapping, fetch, scatter into its pool). From the transfer bench: in-process export + import 2.3 ms
# of the 3.1 ms pool-to-pool shm path, export and import about equal.
KV_SENDER_SHARE = 0.4


@dataclass
class Costs:
    data: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> Costs:
        p = Path(path)
        if not p.exists() and (COSTS_DIR / p).exists():
            p = COSTS_DIR / p
        if not p.exists() and (COSTS_DIR / f"{p}.json").exists():
            p = COSTS_DIR / f"{p}.json"
        return cls(json.loads(p.read_text()))

    @property
    def name(self) -> str:
        return str(self.data.get("name", "costs"))

    # -- where processes run ------------------------------------------------------------------------
    @property
    def cores(self) -> float | None:
        """CPU cores the processes share, less the background load; None: one processor each."""
        cpu = self.data.get("cpu")
        if not cpu or cpu.get("cores") is None:
            return None
        return max(0.1, float(cpu["cores"]) - float(cpu.get("background_cores", 0.0)))

    def worker_overhead_cores(self, role: str) -> float:
        """Cores one worker of `role` uses beyond its stage work (a number, or one per role)."""
        o = (self.data.get("cpu") or {}).get("worker_overhead_cores", 0.0)
        return float(o.get(role, 0.0) if isinstance(o, dict) else o)

    @property
    def hop_s(self) -> float:
        return float(self.data.get("network", {}).get("hop_s", 1e-4))

    @property
    def backend(self) -> str:
        return str(self.data.get("network", {}).get("backend", "shm"))

    # -- prompts ----------------------------------------------------------------------------------
    def text_tokens(self, words: int) -> int:
        p = self.data["prompts"]
        return int(round(p["template_tokens"] + p["tokens_per_word"] * words))

    @property
    def visual_tokens(self) -> int:
        return int(round(self.data["prompts"]["visual_tokens_per_image"]))

    # -- stages -----------------------------------------------------------------------------------
    def encode_s(self, sizes: list[tuple[int, int]]) -> float:
        e = self.data["encode"]
        return e["batch_s"] + sum(e["image_s"] + e["per_mpx_s"] * w * h / 1e6 for w, h in sizes)

    @property
    def max_encode_images(self) -> int:
        return int(self.data["encode"].get("max_images", 8))

    def prefill_step_s(self, tokens: int, seqs: int, visual_tokens: float = 0.0) -> float:
        p = self.data["prefill"]
        return (p["step_s"] + p["per_token_s"] * tokens + p.get("per_seq_s", 0.0) * seqs
                + p.get("per_visual_token_s", 0.0) * visual_tokens)

    @property
    def chunk_tokens(self) -> int:
        return int(self.data["prefill"].get("chunk_tokens", 512))

    def decode_step_s(self, batch: int, ctx_tokens: int) -> float:
        d = self.data["decode"]
        return d["step_s"] + d["per_seq_s"] * batch + d["per_ctx_token_s"] * ctx_tokens

    @property
    def max_num_seqs(self) -> int:
        return int(self.data["decode"].get("max_num_seqs", 64))

    @property
    def kv_blocks(self) -> tuple[int, int]:
        d = self.data["decode"]
        return int(d.get("num_blocks", 2048)), int(d.get("block_size", 16))

    # -- transfers --------------------------------------------------------------------------------
    def transfer_s(self, nbytes: float, backend: str | None = None) -> float:
        t = self.data.get("transfer", {}).get(backend or self.backend)
        if not t:
            return 0.0
        return t["fixed_s"] + t["per_byte_s"] * nbytes

    def kv_handoff_s(self, tokens: int, backend: str | None = None) -> tuple[float, float]:
        """(sender, receiver) seconds to hand `tokens` tokens of KV from a prefill to a decode worker."""
        h = self.data.get("transfer", {}).get("kv_handoff")
        if not h:
            return 0.0, 0.0
        per_byte = h[f"{backend or self.backend}_per_byte_s"]
        total = per_byte * tokens * self.data["sizes"]["kv_bytes_per_token"] + h.get("fixed_s", 0.0)
        return KV_SENDER_SHARE * total, (1 - KV_SENDER_SHARE) * total

    def embedding_bytes(self, images: int) -> float:
        return images * self.visual_tokens * self.data["sizes"]["embedding_bytes_per_visual_token"]

    # -- coordinator ------------------------------------------------------------------------------
    @property
    def coord(self) -> dict[str, float]:
        return self.data["coordinator"]

    def coord_request_s(self, has_images: bool) -> float:
        c = self.coord
        return c["per_image_request_s"] if has_images else c["per_text_request_s"]

    def coord_step_msg_s(self, items: int) -> float:
        c = self.coord
        return c["per_step_msg_s"] + c["per_token_item_s"] * items

    def coord_housekeeping_s(self, workers: int, period_s: float) -> float:
        """CPU of one housekeeping period: heartbeats and Redis load reads of every worker, ticks."""
        c = self.coord
        return period_s * (c.get("idle_s_per_s", 0.0) + c["per_worker_per_s"] * workers)

    def coord_request_cpu_s(self, has_images: bool, output_tokens: int, decode_batch: float) -> float:
        """Coordinator CPU one request costs, for the closed-form ceiling."""
        steps_share = (output_tokens - 1) / max(1.0, decode_batch)
        return (self.coord_request_s(has_images) + self.coord["per_token_item_s"] * (output_tokens - 1)
                + self.coord["per_step_msg_s"] * steps_share)
