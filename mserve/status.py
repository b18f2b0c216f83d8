"""`mserve status`: the cluster as the coordinator and Redis see it, as a table or as JSON.

Two sources, read once each, either of which may be down:

* the coordinator's STATUS reply (client address): workers with role, liveness and load, live
  workers per role, requests in flight and those waiting in its class queues, its counters, the
  model, whether it sees Redis healthy;
* Redis (read only): the worker registry, each worker's published load (with when it was
  published: the heartbeat age), the embedding and prefix index sizes, the workers' counters.

`collect` reads, `build_report` merges the two into one JSON-able dict (pure: tests feed it
hand-made dicts), `format_report` renders that dict as plain text. Keys neither function knows are
ignored, so a newer coordinator's reply still renders. Only the stdlib is imported at module
level: `mserve --help` builds this module's parser.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

DEFAULT_COORDINATOR = "tcp://127.0.0.1:5555"  # the coordinator's default --bind
ROLE_ORDER = ("encode", "prefill", "decode", "unified")


# --------------------------------------------------------------------------- reading


def redact(url: str) -> str:
    """The URL without its password, for printing."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        port = f":{parts.port}" if parts.port else ""
        netloc = f"{parts.username or ''}:***@{host}{port}"
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "(unparsable url)"


def read_coordinator(address: str, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """(STATUS reply, None), or (None, why it could not be read)."""
    from mserve.coordinator.client import Client, MServeError

    try:
        with Client(address, timeout_s=timeout_s) as client:
            reply = client.status()
    except MServeError:
        return None, f"no STATUS reply within {timeout_s:g}s"
    except Exception as exc:  # a malformed address, a socket error
        return None, f"{exc.__class__.__name__}: {exc}"
    if not isinstance(reply, dict):
        return None, f"unexpected STATUS reply: {type(reply).__name__}"
    return reply, None


def read_redis(url: str, timeout_s: float) -> tuple[dict[str, Any] | None, str | None]:
    """({"workers", "loads", "census", "shards"}, None), or (None, why Redis was not read)."""
    from mserve.common.redis_store import RedisStore
    from mserve.common.shards import ShardRegistry

    # The store warns once when Redis is down; here the report says so instead.
    store_log = logging.getLogger("mserve.common.redis_store")
    level = store_log.level
    store_log.setLevel(logging.ERROR)
    try:
        store = RedisStore(url, socket_timeout_s=timeout_s)
    except Exception as exc:  # a malformed URL
        store_log.setLevel(level)
        return None, f"{exc.__class__.__name__}: {exc}"
    try:
        if not store.ping():
            return None, "unreachable"
        workers = store.list_workers()
        loads = store.get_loads(sorted(workers))
        census = store.census()
        shards = ShardRegistry(store).live()
        if census is None or not store.healthy:
            return None, "connection lost while reading"
        return {"workers": workers, "loads": loads, "census": census, "shards": shards}, None
    finally:
        store.close()
        store_log.setLevel(level)


def collect(coordinator: str, redis_url: str | None, timeout_s: float) -> dict[str, Any]:
    coord, coord_error = read_coordinator(coordinator, timeout_s)
    redis_data, redis_error = (read_redis(redis_url, timeout_s) if redis_url
                               else (None, "no --redis given (nor $MSERVE_REDIS, $REDIS_URL)"))
    return build_report(coordinator, coord, coord_error, redact(redis_url) if redis_url else None, redis_data,
                        redis_error, now=time.time())


# --------------------------------------------------------------------------- merging


def _num(v: Any) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v: Any) -> int | None:
    n = _num(v)
    return int(n) if n is not None else None


def _role_key(role: str) -> tuple[int, str]:
    return (ROLE_ORDER.index(role) if role in ROLE_ORDER else len(ROLE_ORDER), role)


# The load figures a worker's row shows, as WorkerLoad (common/protocol/to_coordinator.py) names them.
ROW_FIGURES = ("queue_len", "running", "free_blocks", "total_blocks", "tokens_per_s", "rss_mib", "state_kib_per_seq")


def _worker_row(wid: str, cw: dict[str, Any] | None, reg: dict[str, Any] | None, rload: dict[str, Any] | None,
                coordinator_up: bool, now: float) -> dict[str, Any]:
    from mserve.common.protocol.to_coordinator import WorkerLoad  # the one spelling of the load's keys

    cload = cw.get("load") if cw and isinstance(cw.get("load"), dict) else None
    load = WorkerLoad.read(cload if cload is not None else (rload or {}))
    if cw is not None:
        alive: bool | None = bool(cw.get("alive"))
    else:  # registered in Redis (its key lives while it heartbeats), unknown to the coordinator
        alive = None if coordinator_up else True
    role = (cw or {}).get("role") or (reg or {}).get("role") or "?"
    free, total = load.free_blocks, load.total_blocks
    published = _num((rload or {}).get("updated_at"))
    # Cache figures a worker reports beside its load (in Redis, in the coordinator's view of it, or in the
    # per-worker "counters" a newer coordinator adds): hits, and cached blocks.
    extra = cw.get("counters") if cw and isinstance(cw.get("counters"), dict) else {}
    hits = {k: v for src in (rload or {}, cload or {}, extra) for k, v in src.items()
            if isinstance(k, str) and ("hit" in k or k.startswith("cached_")) and _num(v) is not None}
    return {
        "id": wid, "role": str(role), "alive": alive,
        "draining": bool((cw or {}).get("draining")),  # got SIGTERM: finishing its work, taking nothing new
        # a role switch under way: "decode->prefill (draining)", then "(reloading)" (coordinator/role_switching.py)
        "switching": (cw or {}).get("switching"),
        "seen_by": [s for s, seen in (("coordinator", cw is not None), ("redis", reg is not None)) if seen],
        # The load's figures under WorkerLoad's names (`inflight`: the coordinator's, never Redis's).
        **{name: getattr(load, name) for name in ROW_FIGURES}, "inflight": WorkerLoad.read(cload).inflight,
        "kv_used": total - free if free is not None and total else None,
        "heartbeat_age_s": round(max(0.0, now - published), 2) if published is not None else None,
        "load_hits": hits,
    }


def _pools(workers: list[dict[str, Any]], coord_roles: dict[str, Any]) -> list[dict[str, Any]]:
    roles = sorted({w["role"] for w in workers} | set(coord_roles), key=_role_key)
    pools = []
    for role in roles:
        members = [w for w in workers if w["role"] == role]
        live = [w for w in members if w["alive"]]
        with_pool = [w for w in live if w["kv_used"] is not None]
        pools.append({
            "role": role, "alive": len(live), "total": len(members),
            "queue_len": sum(w["queue_len"] or 0 for w in live), "running": sum(w["running"] or 0 for w in live),
            "kv_used": sum(w["kv_used"] for w in with_pool) if with_pool else None,
            "kv_total": sum(w["total_blocks"] for w in with_pool) if with_pool else None,
            "tokens_per_s": round(sum(w["tokens_per_s"] or 0.0 for w in live), 2),
        })
    return pools


def _queued(v: dict[str, Any]) -> dict[str, dict[str, int]]:
    """The coordinator's class queues: {stage: {class: requests waiting}}."""
    return {str(stage): {str(c): _int(n) for c, n in classes.items() if _int(n)}
            for stage, classes in v.items() if isinstance(classes, dict)}


def build_report(coordinator: str, coord: dict[str, Any] | None, coord_error: str | None, redis_url: str | None,
                 redis_data: dict[str, Any] | None, redis_error: str | None, now: float) -> dict[str, Any]:
    """One JSON-able dict from what was read; either source may be None (with its error)."""
    coord = coord if isinstance(coord, dict) else None
    cworkers = coord.get("workers") if coord and isinstance(coord.get("workers"), dict) else {}
    registry = (redis_data or {}).get("workers") or {}
    rloads = (redis_data or {}).get("loads") or {}
    census = (redis_data or {}).get("census")
    ids = sorted(set(cworkers) | set(registry))
    rows = [_worker_row(wid, cworkers.get(wid) if isinstance(cworkers.get(wid), dict) else None,
                        registry.get(wid), rloads.get(wid), coord is not None, now) for wid in ids]
    rows.sort(key=lambda w: (_role_key(w["role"]), w["id"]))
    counters: dict[str, dict[str, Any]] | None = None
    if census is not None or any(w["load_hits"] for w in rows):
        counters = {wid: dict(c) for wid, c in ((census or {}).get("counters") or {}).items()}
        for w in rows:  # Redis's counters outlive a worker's restarts: they win over the same name here
            for k, v in w["load_hits"].items():
                counters.setdefault(w["id"], {}).setdefault(k, v)
    for w in rows:
        del w["load_hits"]
    stats = coord.get("stats") if coord and isinstance(coord.get("stats"), dict) else None
    return {
        "coordinator": {
            "address": coordinator, "reachable": coord is not None, "error": coord_error,
            "model": coord.get("model") if coord else None,
            # only for a family without tests here, served after its workers' load-time probe
            **({"verification": coord["verification"]} if coord and coord.get("verification") == "verified at load"
               else {}),
            "redis_healthy": coord.get("redis_healthy") if coord else None,
            "requests_in_flight": _int(coord.get("requests_in_flight")) if coord else None,
            # only from a coordinator that reports its class queues (the key is absent otherwise)
            **({"queued": _queued(coord["queued"])} if coord and isinstance(coord.get("queued"), dict) else {}),
            # role switches under way and done (coordinator/role_switching.py); absent from an older coordinator
            **({"role_switching": coord["role_switching"]} if coord and isinstance(coord.get("role_switching"), dict)
               else {}),
            # only from a coordinator serving several models (coordinator/models.py): each one's pools and counts
            **({"models": _models(coord["models"])} if coord and isinstance(coord.get("models"), dict)
               and len(coord["models"]) > 1 else {}),
        },
        "redis": {"url": redis_url, "read": redis_data is not None,
                  "error": None if redis_data is not None else redis_error},
        # coordinator shards registered in Redis (docs/scaling.md); {} for a cluster of one coordinator
        "shards": dict((redis_data or {}).get("shards") or {}),
        "pools": _pools(rows, coord["roles"] if coord and isinstance(coord.get("roles"), dict) else {}),
        "workers": rows,
        "caches": {
            "embedding_index": dict(census["emb"]) if census else None,
            "prefix_index": dict(census["prefix"]) if census else None,
            "worker_counters": counters,
        },
        "stats": dict(stats) if stats is not None else None,
    }


def _models(models: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{model: {roles, requests_in_flight, completed, shed}} from the coordinator's per-model STATUS."""
    out = {}
    for name, m in sorted(models.items()):
        m = m if isinstance(m, dict) else {}
        stats = m.get("stats") if isinstance(m.get("stats"), dict) else {}
        out[name] = {"roles": dict(m.get("roles") or {}), "requests_in_flight": _int(m.get("requests_in_flight")),
                     "completed": _int(stats.get("completed")), "shed": _int(stats.get("shed"))}
    return out


# --------------------------------------------------------------------------- rendering


def table(headers: list[str], rows: list[list[Any]], left: int = 1, indent: str = "  ") -> list[str]:
    """Aligned columns: the first `left` left-aligned (names), the rest right-aligned (numbers)."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[Any]) -> str:
        out = [str(c).ljust(widths[i]) if i < left else str(c).rjust(widths[i]) for i, c in enumerate(cells)]
        return (indent + "  ".join(out)).rstrip()

    return [line(headers)] + [line(r) for r in rows]


def _f(v: Any, fmt: str = "{}") -> str:
    return "-" if v is None else fmt.format(v)


def _kv(used: Any, total: Any) -> str:
    return "-" if used is None or not total else f"{used}/{total}"


def _alive(v: bool | None, draining: bool = False, switching: str | None = None) -> str:
    if switching:
        return f"switching {switching}"
    return "redis" if v is None else ("draining" if v and draining else "yes" if v else "no")


def _index_line(name: str, unit: str, per_model: dict[str, int] | None, model: str | None) -> str:
    if per_model is None:
        return f"{name}: - (Redis not read)"
    if model is not None:
        others = sum(n for m, n in per_model.items() if m != model)
        extra = f" (+{others} under other model names)" if others else ""
        return f"{name}: {per_model.get(model, 0)} {unit}{extra}"
    parts = ", ".join(f"{n} ({m})" for m, n in sorted(per_model.items()))
    return f"{name}: {sum(per_model.values())} {unit}" + (f": {parts}" if len(per_model) > 1 else "")


def format_report(report: dict[str, Any]) -> str:
    c, r = report["coordinator"], report["redis"]
    lines = []
    if c["reachable"]:
        healthy = {True: "healthy", False: "down or unset"}.get(c["redis_healthy"], "?")  # as the coordinator sees it
        lines.append(f"coordinator {c['address']}  redis {healthy}  requests in flight {_f(c['requests_in_flight'])}  "
                     f"model {c['model']}" + (f" ({c['verification']})" if c.get("verification") else ""))
    else:
        lines.append(f"coordinator {c['address']} UNREACHABLE: {c['error']}")
        lines.append("  (workers below are Redis's registry only; load is what they last published there)"
                     if r["read"] else "  (and Redis was not read either: nothing more to show)")
    lines.append(f"redis read from {r['url']}" if r["read"]
                 else f"redis not read: {r['error']}" + (f" ({r['url']})" if r["url"] else ""))
    if report.get("shards"):  # the request counts above are this one shard's
        lines.append(f"coordinator shards ({len(report['shards'])}): " + ", ".join(
            f"{sid} {info.get('client', '?')}" for sid, info in sorted(report["shards"].items())))
    if not c["reachable"] and not r["read"]:
        return "\n".join(lines)

    lines += ["", "pools"]
    if report["pools"]:
        lines += table(["role", "alive/total", "queue", "running", "KV used/total", "tok/s"],
                       [[p["role"], f"{p['alive']}/{p['total']}", p["queue_len"], p["running"],
                         _kv(p["kv_used"], p["kv_total"]), f"{p['tokens_per_s']:.1f}"] for p in report["pools"]])
    else:
        lines.append("  (no workers)")
    if c.get("models"):  # several models: each has its own pools, queues and shedding
        lines += ["", "models"]
        lines += table(["model", "live workers", "in flight", "completed", "shed"],
                       [[name, " ".join(f"{n} {role}" for role, n in sorted(m["roles"].items(), key=lambda x: _role_key(x[0])))
                         or "none", _f(m["requests_in_flight"]), _f(m["completed"]), _f(m["shed"])]
                        for name, m in c["models"].items()], left=2)
    queued = {stage: classes for stage, classes in (c.get("queued") or {}).items() if classes}
    if queued:  # requests waiting at the coordinator for a worker with room (max_stages_per_worker)
        lines.append("  waiting at the coordinator: " + "; ".join(
            f"{stage} {sum(classes.values())} (" + ", ".join(f"{k} {n}" for k, n in classes.items()) + ")"
            for stage, classes in queued.items()))

    workers = report["workers"]
    lines += ["", "workers"]
    if workers:
        lines += table(["id", "role", "alive", "queue", "running", "inflight", "KV used/total", "tok/s", "RSS MiB",
                        "heartbeat"],
                       [[w["id"], w["role"], _alive(w["alive"], w["draining"], w.get("switching")), _f(w["queue_len"]), _f(w["running"]),
                         _f(w["inflight"]), _kv(w["kv_used"], w["total_blocks"]), _f(w["tokens_per_s"], "{:.1f}"),
                         _f(w["rss_mib"], "{:.0f}"), _f(w["heartbeat_age_s"], "{:.1f}s ago")] for w in workers],
                       left=3)
        if any(w["alive"] is None for w in workers):
            lines.append("  alive 'redis': registered in Redis but unknown to this coordinator")
        with_state = [w for w in workers if w.get("state_kib_per_seq")]
        if with_state:  # a hybrid model (Qwen3.5): what each running sequence holds beside the KV pool
            lines.append("  linear-attention state per sequence, beside the KV pool: " + ", ".join(
                f"{w['id']} {w['state_kib_per_seq']:.1f} KiB" for w in with_state))
    else:
        lines.append("  (no workers)")

    caches, model = report["caches"], c["model"]
    lines += ["", "caches" + (f" (model {model})" if model and caches["embedding_index"] is not None else "")]
    if caches["embedding_index"] is None and caches["worker_counters"] is None:
        lines.append("  (Redis not read)")
    else:
        lines.append("  " + _index_line("embedding index", "images", caches["embedding_index"], model) + "    "
                     + _index_line("prefix index", "blocks", caches["prefix_index"], model))
        counters = caches["worker_counters"] or {}
        names = sorted({k for cs in counters.values() for k in cs})
        if names:
            order = {w["id"]: i for i, w in enumerate(workers)}  # as the workers table, then the rest by id
            ids = sorted(counters, key=lambda wid: (order.get(wid, len(order)), wid))
            lines += table(["worker", *names], [[wid, *(_f(counters[wid].get(k)) for k in names)] for wid in ids])

    lines += ["", "coordinator counters"]
    stats = report["stats"]
    lines.append("  " + "   ".join(f"{k} {v}" for k, v in stats.items()) if stats
                 else "  (coordinator not read)" if stats is None else "  (none)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def default_redis_url() -> str | None:
    return os.environ.get("MSERVE_REDIS") or os.environ.get("REDIS_URL") or None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator", default=DEFAULT_COORDINATOR, metavar="ADDR",
                   help="the coordinator's client address, what its --bind is (default %(default)s)")
    p.add_argument("--redis", default=None, metavar="URL",
                   help="the cluster's Redis, read only: worker registry, heartbeat ages, cache index sizes, "
                        "cache counters (default: $MSERVE_REDIS, else $REDIS_URL, else Redis is not read)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (coordinator, redis, pools, workers, caches, stats) instead of tables")
    p.add_argument("--timeout", type=float, default=3.0, metavar="S",
                   help="seconds to wait for the coordinator's reply, and per Redis call (default %(default)s)")


def main(args: argparse.Namespace) -> int:
    """Exit code 1 when the coordinator did not answer, 0 otherwise (Redis being down is reported, not fatal)."""
    report = collect(args.coordinator, args.redis or default_redis_url(), args.timeout)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    sys.stdout.flush()
    return 0 if report["coordinator"]["reachable"] else 1
