"""OpenAI chat-completions responses: the whole reply, the streamed chunks, usage, and MServe's own headers."""

from __future__ import annotations

import time
import uuid
from typing import Any

def completion_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


# SLO-adaptive pruning (docs/operations.md): a reply whose images were pruned says so, in this header
# (non-streaming) and in an `mserve` object on the body (the finishing chunk when streaming).
KEEP_RATIO_HEADER = "X-MServe-Visual-Keep-Ratio"
MODEL_HEADER = "X-MServe-Model"  # the served model that answered: a variant when the request named a group


def pruned_marker(keep_ratio: float) -> dict[str, Any]:
    return {"visual_keep_ratio": keep_ratio}


def chat_response(cid: str, model: str, text: str, finish_reason: str, usage: dict[str, int],
                  token_ids: list[int] | None = None) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text, "refusal": None},
                              "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": usage, "system_fingerprint": None}


def chunk(cid: str, created: int, model: str, delta: dict[str, Any] | None, finish_reason: str | None = None,
          *, usage: dict[str, int] | None = None, include_usage: bool = False,
          token_ids: list[int] | None = None) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` makes the usage-only chunk (empty choices)."""
    out: dict[str, Any] = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                           "system_fingerprint": None, "choices": []}
    if delta is not None:
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        out["choices"].append(choice)
    if include_usage:
        out["usage"] = usage  # null on every chunk but the last, as OpenAI sends it
    return out
