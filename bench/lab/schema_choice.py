"""The wire schema's validator: today's hand-written typed.py beside msgspec Structs and pydantic models, for three
messages: decode + validate (msgpack bytes -> typed object), encode, what each says of bad input, and code lines.

What it answers (issue 51, item 2): does msgspec (or pydantic alone) replace common/protocol/typed.py with less
code, the same strictness and the same speed? The candidates are lab.schema_structs (field for field as today's
classes, with common/sampling_rules.py's bounds). Each decode path is what a socket does with frame 1: today
`serde.decode` + `parse_message` (+ `MediaRef.parse` of a GENERATE's stored image part, as admission does);
msgspec `Decoder(type).decode` (+ `msgspec.convert` of the part's ref); pydantic `msgpack.unpackb` +
`model_validate` (strict). Beside them: msgpack alone (today's share of the decode), msgspec.convert of serde's
decoded dict (msgspec behind today's framing, no media refs) and, for GENERATE, admission's GenerateIn (the
coordinator's edge today). msgspec is needed only here (`pip install msgspec`).

Usage (from the repository root; on a shared host read the medians and minimums of the interleaved samples):
    PYTHONPATH=bench .venv/bin/python -m lab.schema_choice [--calls 1000] [--samples 15] [--items 32]
"""

import argparse
import ast
import copy
import statistics
import time
import tokenize
from pathlib import Path
from typing import Any, Callable

import msgpack

from lab.schema_structs import media_parts, msgspec_decoder, msgspec_schema, pydantic_decoder, pydantic_schema
from mserve.common import serde
from mserve.common.protocol import MsgType, ProtocolError, parse_message
from mserve.common.protocol.client import FROM_CLIENT, Generate, MediaRef, Sampling
from mserve.common.protocol.to_coordinator import (TO_COORDINATOR, HandBack, Heartbeat, StepTokens, TokenItem,
                                                   WorkerInfo, WorkerLoad)
from mserve.common.serde import SCHEMA_VERSION

KINDS = ("GENERATE", "HEARTBEAT", "STEP_TOKENS")
ACCEPTED = {"GENERATE": FROM_CLIENT, "HEARTBEAT": TO_COORDINATOR, "STEP_TOKENS": TO_COORDINATOR}


# ----------------------------------------------------------------------------- today's path

def typed_decoder(kind: str) -> Callable[[bytes], Any]:
    head = bytes((int(MsgType[kind]),))

    def decode(frame: bytes) -> Any:
        body = serde.decode([head, frame])[1]
        msg = parse_message(int(MsgType[kind]), body, ACCEPTED[kind])
        return (msg, [MediaRef.parse(v, w) for w, v in media_parts(body)]) if kind == "GENERATE" else msg
    return decode


def samples(items: int) -> dict[str, Any]:
    """Today's typed message of each kind: a GENERATE with four chat messages and a stored image, a HEARTBEAT
    with a full load and the registration, a STEP_TOKENS of a decode batch (one token each, one item finishing
    with a hand-back)."""
    ref = MediaRef(hash="9f" * 32, nbytes=48213, size=[640, 480],
                   source={"kind": "shm", "id": "media-7f3a", "host": "h1", "tcp": "tcp://10.0.0.2:7101", "n": 48213})
    chat = [{"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                         {"type": "image", "media": ref.fields()}]},
            {"role": "assistant", "content": "A cat on a windowsill."},
            {"role": "user", "content": "What colour is it?"}]
    gen = Generate(request_id="req-000042", messages=chat, sampling=Sampling(max_tokens=128, temperature=0.7,
                                                                             top_p=0.9, seed=7), priority=1)
    load = WorkerLoad(queue_len=2, running=14, free_blocks=812, total_blocks=1024, tokens_per_s=231.5, rss_mib=5120.0,
                      weights_mib=3900.0, kv_pool_mib=1024.0, encode_s_per_image=0.08, queued=["req-51", "req-52"],
                      draining=False, counters={"steps": 18231, "prefix_hits": 340, "transfer_bytes": 1 << 30},
                      histograms={"step_seconds": {"count": 18231, "sum": 401.2, "buckets": [1, 5, 40, 200, 18231]}},
                      at=1765157000.25)
    info = WorkerInfo(worker_id="decode-0", role="decode", data_address="tcp://10.0.0.3:7200", host_id="h1", pid=4242,
                      model="small-llava", num_blocks=1024, data_key="k" * 40, load=load, model_path="/models/llava")
    step = [TokenItem(request_id=f"req-{i:06d}", attempt=1, token_ids=[1000 + i]) for i in range(items - 1)]
    step.append(TokenItem(request_id="req-999999", attempt=2, token_ids=[2], finished=True, finish_reason="stop",
                          worker_s=3.25, cached_tokens=64, hand_back=HandBack(descriptor={"kv": [28, 2, 3, 16, 2, 64]},
                                                                              token_ids=list(range(48)))))
    return {"GENERATE": gen, "HEARTBEAT": Heartbeat.of(info), "STEP_TOKENS": StepTokens(items=step)}


def frame(msg: Any) -> bytes:
    return bytes(serde.encode(int(msg.KIND), msg.to_body())[1])


def bad_inputs(msgs: dict[str, Any]) -> list[tuple[str, str, dict]]:
    """(what, kind, body): today's body of each sample with one thing wrong."""
    def edit(kind: str, change: Callable[[dict], None]) -> dict:
        body = copy.deepcopy(msgs[kind].to_body())
        change(body)
        return body
    return [
        ("wrong type deep", "HEARTBEAT", edit("HEARTBEAT", lambda b: b["load"].update(free_blocks="3"))),
        ("wrong type deep", "STEP_TOKENS", edit("STEP_TOKENS", lambda b: b["items"][-1]["hand_back"]["token_ids"]
                                                .__setitem__(5, "x"))),
        ("wrong type deep", "GENERATE", edit("GENERATE", lambda b: b["messages"][1]["content"][1]["media"]
                                             .update(nbytes="48213"))),
        ("bool for an int", "STEP_TOKENS", edit("STEP_TOKENS", lambda b: b["items"][3].update(attempt=True))),
        ("unknown key", "HEARTBEAT", edit("HEARTBEAT", lambda b: b["load"].update(free_blocks_v2=3))),
        ("unknown key", "GENERATE", edit("GENERATE", lambda b: b["sampling"].update(min_p=0.1))),
        ("missing field", "STEP_TOKENS", edit("STEP_TOKENS", lambda b: b["items"][2].pop("attempt"))),
        ("missing field", "HEARTBEAT", edit("HEARTBEAT", lambda b: b["info"].pop("host_id"))),
        ("out of bounds", "GENERATE", edit("GENERATE", lambda b: b["sampling"].update(temperature=5.0))),
        ("out of bounds", "GENERATE", edit("GENERATE", lambda b: b.update(priority=1000))),
        ("schema version", "HEARTBEAT", edit("HEARTBEAT", lambda b: b.update(v=SCHEMA_VERSION + 1))),
    ]


def verdict(decode: Callable[[bytes], Any], body: dict) -> str:
    try:
        decode(msgpack.packb(body, use_bin_type=True))
    except ProtocolError as exc:
        return str(exc)
    return "accepted"


# ----------------------------------------------------------------------------- timing

def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e6


def timings(paths: dict[str, Callable[[], Any]], calls: int, samples_n: int) -> dict[str, tuple[float, float]]:
    """{path: (median, min) µs per call} over `samples_n` samples, the paths interleaved within each sample."""
    for fn in paths.values():
        per_call_us(fn, max(calls // 10, 10))  # warm up
    got: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(samples_n):
        for name, fn in paths.items():
            got[name].append(per_call_us(fn, calls))
    return {name: (statistics.median(v), min(v)) for name, v in got.items()}


# ----------------------------------------------------------------------------- code lines

def code_lines(path: Path) -> tuple[set[int], ast.Module]:
    """Line numbers that hold code (not blank, not a comment, not a docstring), and the module's tree."""
    src = path.read_text()
    tree = ast.parse(src)
    lines = {t.start[0] for t in tokenize.generate_tokens(iter(src.splitlines(True)).__next__)
             if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                               tokenize.ENDMARKER)}
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) and isinstance(
                getattr(body[0], "value", None), ast.Constant) and isinstance(body[0].value.value, str):
            lines -= set(range(body[0].lineno, body[0].end_lineno + 1))
    return lines, tree


def declaration_lines(lines: set[int], cls: ast.ClassDef) -> int:
    """A class's declaration: its decorators and header, its fields and class constants (methods left out)."""
    spans = [(min([d.lineno for d in cls.decorator_list] + [cls.lineno]), cls.body[0].lineno - 1)]
    spans += [(s.lineno, s.end_lineno) for s in cls.body if not isinstance(s, (ast.FunctionDef, ast.Expr))]
    return len(lines & {n for a, b in spans for n in range(a, b + 1)})


def line_counts() -> dict[str, int]:
    proto = Path(serde.__file__).parent / "protocol"
    here = Path(__file__)
    three = {"Signed", "RequestClass", "Sampling", "MediaRef", "Generate", "WorkerLoad", "WorkerInfo", "Heartbeat",
             "HandBack", "TokenItem", "StepTokens"}
    out = {"typed.py": len(code_lines(proto / "typed.py")[0]), "today, 3 messages": 0, "today, all messages": 0}
    for name in ("client.py", "to_worker.py", "to_coordinator.py", "data_plane.py"):
        lines, tree = code_lines(proto / name)
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name != "DataMsg"):  # all Messages
            n_lines = declaration_lines(lines, cls)
            out["today, all messages"] += n_lines
            out["today, 3 messages"] += n_lines if cls.name in three else 0
    lines, tree = code_lines(here.parent / "schema_structs.py")
    fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    for label, fn in (("msgspec", "msgspec_schema"), ("pydantic", "pydantic_schema")):
        body = fns[fn].body
        out[f"{label}, 3 messages"] = sum(declaration_lines(lines, c) for c in body if isinstance(c, ast.ClassDef))
        base = [c for c in body if isinstance(c, (ast.FunctionDef, ast.Import, ast.ImportFrom))] + [fns[
            f"{label}_decoder"]]
        out[f"{label}, base"] = sum(len(lines & set(range(s.lineno, s.end_lineno + 1))) for s in base)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=1000, help="calls per timed sample")
    ap.add_argument("--samples", type=int, default=15, help="interleaved samples per path (median and min shown)")
    ap.add_argument("--items", type=int, default=32, help="token items in the STEP_TOKENS")
    args = ap.parse_args()
    msgs = samples(args.items)
    structs, models = msgspec_schema(), pydantic_schema()
    import msgspec
    enc = msgspec.msgpack.Encoder()
    decoders = {k: {"typed.py": typed_decoder(k), "msgspec": msgspec_decoder(structs, k),
                    "pydantic": pydantic_decoder(models, k)} for k in KINDS}
    print(f"== decode + validate, encode: µs per message, median / min of {args.samples} interleaved samples "
          f"of {args.calls} calls")
    print(f"{'message':<12} {'bytes':>6} | {'path':<30} {'median':>8} {'min':>8}")
    for kind in KINDS:
        msg, raw = msgs[kind], frame(msgs[kind])
        ms_obj, pd_obj = decoders[kind]["msgspec"](raw), decoders[kind]["pydantic"](raw)
        ms_obj = ms_obj[0] if kind == "GENERATE" else ms_obj
        pd_obj = pd_obj[0] if kind == "GENERATE" else pd_obj
        head = bytes((int(msg.KIND),))
        paths = {"decode typed.py": lambda: decoders[kind]["typed.py"](raw),
                 "  of which msgpack": lambda: serde.decode([head, raw]),
                 "decode msgspec": lambda: decoders[kind]["msgspec"](raw),
                 "  msgspec.convert after msgpack": lambda: msgspec.convert(serde.decode([head, raw])[1],
                                                                            structs[kind]),
                 "decode pydantic": lambda: decoders[kind]["pydantic"](raw),
                 "encode typed.py": lambda: serde.encode(int(msg.KIND), msg.to_body()),
                 "encode msgspec": lambda: [head, enc.encode(ms_obj)],
                 "encode pydantic": lambda: serde.encode(int(msg.KIND), pd_obj.model_dump(exclude_none=True))}
        if kind == "GENERATE":  # the coordinator's real edge today: admission's pydantic model (lax), then to_wire()
            from mserve.coordinator.admission import GenerateIn
            paths["decode admission's GenerateIn"] = lambda: GenerateIn.model_validate(serde.decode([head, raw])[1])
        for name, (med, low) in timings(paths, args.calls, args.samples).items():
            print(f"{kind:<12} {len(raw):>6} | {name:<30} {med:>8.2f} {low:>8.2f}")
        print(f"{'':<12} msgspec bytes {len(enc.encode(ms_obj))} (defaults left out)")
    print("\n== bad input: what each says")
    for what, kind, body in bad_inputs(msgs):
        print(f"-- {what} ({kind})")
        for name, decode in decoders[kind].items():
            print(f"   {name:<9} {verdict(decode, body)}")
    print("\n== code lines (no blanks, comments or docstrings; methods left out of declarations)")
    for name, n in line_counts().items():
        print(f"   {name:<30} {n}")


if __name__ == "__main__":
    main()
