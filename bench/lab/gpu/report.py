"""The markdown table of the GPU check's results (gpu_check.md), from its JSON report (bench/lab/gpu/check.py)."""

from __future__ import annotations

from typing import Any


def render(r: dict[str, Any]) -> str:
    env = r.get("environment", {})
    lines = [f"# mserve GPU check — {env.get('gpu', env.get('device', '?'))}", "",
             f"torch {env.get('torch')}, transformers {env.get('transformers')}, python {env.get('python')}, "
             f"started {env.get('started')}" + (f", finished {r['finished']}" if r.get("finished") else " (unfinished)"),
             "", "## bf16 exactness and the 1e1p1d cluster (greedy ids vs HF generate in bf16, same device)", "",
             "| check | requests equal | first mismatch | notes |", "|---|---:|---|---|"]
    rows = [(f"engine {arch}", v) for arch, v in r.get("exact", {}).items()]
    rows += [(f"cluster {name}", v) for name, v in r.get("cluster", {}).items()]
    for name, v in rows:
        if "error" in v:
            lines.append(f"| {name} | error | | {_cell(v['error'])} |")
            continue
        first = v["mismatches"][0] if v["mismatches"] else None
        where = f"request {first['request']} at token {first['first_diff']}" if first else "none"
        notes = f"KV {v['kv_dtype']}" if "kv_dtype" in v else f"start {v.get('start_s', 0):.0f} s; " + _memory(v.get("memory", {}))
        ipc = [n for n, c in v.get("cuda_ipc_senders", {}).items() if c > 0]
        if ipc:
            notes += "; CUDA IPC into " + ", ".join(ipc)
        lines.append(f"| {name} | {v['equal']}/{v['requests']} | {where} | {notes} |")
    big = r.get("big")
    if big:
        lines += ["", "## Throughput, random-weight LLaVA" + (f" ({big.get('size')}, {big.get('parameters_b', 0):.2f}B)" if "size" in big else ""), ""]
        if "error" in big:
            lines.append(f"error: {_cell(big['error'])}")
        else:
            lines += _big(big)
    att = r.get("attention")
    if att:
        lines += ["", "## What exact-length attention costs (bench/lab/gpu/attention.py)", ""]
        lines += [f"error: {_cell(att['error'])}"] if "error" in att else _attention(att)
    lines += ["", "Timings (s): " + ", ".join(f"{k} {v:.1f}" for k, v in r.get("timings_s", {}).items())]
    return "\n".join(lines) + "\n"


def _big(b: dict[str, Any]) -> list[str]:
    lines = ["Engine: attention over each request's exact key count (the bf16 default, HF's tokens); padded: one "
             "SDPA call per group over masked padding. Decode tok/s counts tokens after every request has its first.", "",
             "| batch | engine decode tok/s | engine padded | HF generate decode tok/s | engine / HF | engine e2e tok/s "
             "| HF e2e tok/s |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for batch, e in b.get("engine", {}).items():
        h = b.get("hf_generate", {}).get(batch, {})
        hd = h.get("decode_tokens_per_s", 0.0)
        padded = b.get("engine_padded", {}).get(batch, {}).get("decode_tokens_per_s", float("nan"))
        lines.append(f"| {batch} | {e['decode_tokens_per_s']:.1f} | {padded:.1f} | {hd:.1f} | "
                     f"{e['decode_tokens_per_s'] / hd if hd else float('nan'):.2f}x | {e['tokens_per_s']:.1f} | "
                     f"{h.get('tokens_per_s', 0.0):.1f} |")
    lines += _serving(b.get("serving"), "")
    mem = b.get("memory_after_serving", {})
    lines += ["", f"Memory per role: encode holds the vision weights ({b.get('vision_weights_mib', 0):.0f} MiB), "
              f"prefill and decode the text weights ({b.get('text_weights_mib', 0):.0f} MiB) plus their KV pool "
              f"(here {b.get('kv_pool_mib', 0):.0f} MiB); this unified process: "
              + ", ".join(f"{k} {v:.0f}" for k, v in mem.items()) + "."]
    return lines


def _serving(s: dict[str, Any] | None, how: str) -> list[str]:
    if not s:
        return []
    return ["", f"Serving{how} (one engine, {s['requests']} requests, {s['image_requests']} with an image, Poisson "
            f"{s['rate']} req/s, {s['new_tokens']} tokens each): {s['requests_per_s']:.2f} req/s, "
            f"{s['output_tokens_per_s']:.1f} tok/s; TTFT p50/p99 {s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms; "
            f"TPOT p50/p99 {s['tpot_p50_ms']:.1f}/{s['tpot_p99_ms']:.1f} ms."]


def _attention(a: dict[str, Any]) -> list[str]:
    lines = ["Padded attention in bf16 against HF generate's ids: " + "; ".join(
        f"{arch} {v['equal']}/{v['requests']} equal" + (f" (first differences at tokens {v['first_diffs']})"
                                                       if v["first_diffs"] else "")
        for arch, v in a.get("padded_tokens", {}).items()) + ".", "",
        "| batch | attention | step wall ms | device busy ms | aten calls / step | SDPA calls / step | top host ops (ms/step) |",
        "|---:|---|---:|---:|---:|---:|---|"]
    for p in a.get("profile", []):
        top = ", ".join(f"{o['op'][6:]} {o['host_ms_per_step']:.1f}" for o in p["top_host_ops"][:4])
        lines.append(f"| {p['batch']} | {p['attention']} | {p['step_wall_ms']:.1f} | {p['device_busy_ms_per_step']:.1f} | "
                     f"{p['aten_calls_per_step']:.0f} | {p['sdpa_calls_per_step']:.0f} | {top} |")
    return lines + _serving(a.get("serving_padded"), " with padded attention")


def _memory(memory: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{name} " + "/".join(f"{k} {v:.0f}" for k, v in m.items()) for name, m in memory.items())


def _cell(text: str) -> str:
    return " ".join(str(text).split())[:300].replace("|", "/")
