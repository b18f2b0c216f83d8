"""The wire codec today (msgpack + the typed dataclasses' field checks) beside msgspec (typed Structs decoded
and validated by msgspec's own msgpack decoder), per message, in one process.

What it answers (issue 51, "the msgspec evaluation"): how much of the coordinator's CPU per message the
codec is, and what msgspec would save. Each message is round-tripped the way it travels: typed object ->
frames -> typed object (`serde.encode` + `serde.decode` + `parse_message` today; `Encoder.encode` +
`Decoder(type=...).decode` for msgspec, which checks types as it decodes). The Structs below mirror
today's classes field for field; msgspec is needed only here (`pip install msgspec`).

Usage (from the repository root):
    PYTHONPATH=bench .venv/bin/python -m lab.wire_codecs [--rounds 20000] [--image-kib 64]
"""

import argparse
import json
import time
from typing import Any, Callable

from mserve.common import serde
from mserve.common.protocol.client import FROM_CLIENT, TO_CLIENT, Generate, Result, Sampling
from mserve.common.protocol.to_coordinator import TO_COORDINATOR, StepTokens, TokenItem
from mserve.common.protocol.typed import parse_message


def today(kind: int, msg: Any, accepted: dict) -> Callable[[], Any]:
    def round_trip() -> Any:
        frames = serde.encode(kind, msg.to_body())
        got_kind, body = serde.decode([bytes(f) for f in frames])
        return parse_message(got_kind, body, accepted)
    return round_trip


def with_msgspec(structs: dict[str, Any], name: str, obj: Any) -> Callable[[], Any]:
    import msgspec

    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(structs[name])

    def round_trip() -> Any:
        return dec.decode(enc.encode(obj))
    return round_trip


def msgspec_structs() -> dict[str, Any]:
    import msgspec

    class SamplingS(msgspec.Struct, omit_defaults=True):
        max_tokens: int = 256
        temperature: float = 0.0
        top_k: int = 0
        top_p: float = 1.0
        seed: int | None = None
        stop_token_ids: list[int] = []
        ignore_eos: bool = False

    class GenerateS(msgspec.Struct, omit_defaults=True):
        request_id: str
        messages: list[dict[str, Any]]
        sampling: SamplingS = msgspec.field(default_factory=SamplingS)
        priority: int = 0
        latency_class: str = "interactive"
        stream: bool = False
        tokens_to: str | None = None
        trace: str | None = None
        model: str | None = None
        v: int = 1

    class TokenItemS(msgspec.Struct, omit_defaults=True):
        request_id: str
        attempt: int
        token_ids: list[int]
        finished: bool = False
        finish_reason: str | None = None
        first: bool = False
        fetch_s: float | None = None
        worker_s: float | None = None
        cached_tokens: int | None = None

    class StepTokensS(msgspec.Struct, omit_defaults=True):
        items: list[TokenItemS]
        v: int = 1

    class ResultS(msgspec.Struct, omit_defaults=True):
        request_id: str
        token_ids: list[int]
        text: str
        finish_reason: str
        timings: dict[str, float]
        prompt_tokens: int = 0
        visual_tokens: int = 0
        cache_hits: dict[str, int] = {}
        attempts: int = 1
        v: int = 1

    return {"GENERATE": GenerateS, "STEP_TOKENS": StepTokensS, "RESULT": ResultS, "Sampling": SamplingS,
            "TokenItem": TokenItemS}


def messages(image_kib: int) -> list[tuple[str, Any, dict, Callable[[dict[str, Any]], Any]]]:
    """(name, today's typed message, the endpoint's accepted table, its msgspec Struct from the table)."""
    image = bytes(range(256)) * (image_kib * 4)
    content = [{"type": "image", "image": image}, {"type": "text", "text": "What is in the picture? " * 4}]
    gen = Generate(request_id="r-0001", messages=[{"role": "user", "content": content}],
                   sampling=Sampling(max_tokens=64, ignore_eos=True))
    items = [TokenItem(request_id=f"r-{i:04d}", attempt=1, token_ids=[1000 + i]) for i in range(16)]
    step = StepTokens(items=items)
    result = Result(request_id="r-0001", token_ids=list(range(64)), text="word " * 64, finish_reason="length",
                    timings={"queue_s": 0.01, "encode_s": 0.2, "prefill_s": 0.3, "decode_s": 1.2, "total_s": 1.8},
                    prompt_tokens=700, visual_tokens=576)

    def gen_s(s):
        return s["GENERATE"](request_id=gen.request_id, messages=gen.messages,
                             sampling=s["Sampling"](max_tokens=64, ignore_eos=True))

    def step_s(s):
        return s["STEP_TOKENS"](items=[s["TokenItem"](request_id=i.request_id, attempt=1, token_ids=i.token_ids)
                                       for i in items])

    def result_s(s):
        return s["RESULT"](**{k: getattr(result, k) for k in ("request_id", "token_ids", "text", "finish_reason",
                                                              "timings", "prompt_tokens", "visual_tokens")})

    return [(f"GENERATE ({image_kib} KiB image)", gen, FROM_CLIENT, gen_s), ("STEP_TOKENS (16 items)", step,
            TO_COORDINATOR, step_s), ("RESULT (64 tokens)", result, TO_CLIENT, result_s)]


def per_call_us(fn: Callable[[], Any], rounds: int) -> float:
    for _ in range(min(rounds, 200)):
        fn()
    best = float("inf")
    for _ in range(5):  # the best of five: a shared host's noise only ever adds time
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, (time.perf_counter() - t0) / rounds)
    return best * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20000)
    ap.add_argument("--image-kib", type=int, default=64)
    args = ap.parse_args()
    structs = msgspec_structs()
    rows = []
    for name, msg, accepted, to_struct in messages(args.image_kib):
        kind = int(msg.KIND)
        rounds = max(args.rounds // 10, 100) if name.startswith("GENERATE") else args.rounds
        a = per_call_us(today(kind, msg, accepted), rounds)
        b = per_call_us(with_msgspec(structs, msg.KIND.name, to_struct(structs)), rounds)
        rows.append({"message": name, "today_us": round(a, 2), "msgspec_us": round(b, 2), "ratio": round(a / b, 2)})
    print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
