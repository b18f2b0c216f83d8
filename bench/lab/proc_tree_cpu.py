"""CPU time per process of a process tree, from /proc: which process of a server does the work.

    python -m lab.proc_tree_cpu snap A.json PID...        # before a run: every thread under each PID
    python -m lab.proc_tree_cpu snap B.json PID...        # after it
    python -m lab.proc_tree_cpu diff A.json B.json        # CPU-s and cores per process, biggest first
    python -m lab.proc_tree_cpu watch B.json PID          # until PID exits (a `bench compare` run),
    python -m lab.proc_tree_cpu diff B.json.start B.json  # the last CPU times seen of every thread

Unlike `lab.cpu_monitor` (which matches command lines) it follows parent links, so it also counts
processes that rename themselves (vLLM's `VLLM::Worker`, `VLLM::EngineCore`). Used for bench/lab/NOTEBOOK.md,
"Why 1.3x per core is out of reach".
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time


def children() -> dict[int, list[int]]:
    out: dict[int, list[int]] = collections.defaultdict(list)
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/stat") as f:
                out[int(f.read().rsplit(")", 1)[1].split()[1])].append(int(p))
        except OSError:
            pass
    return out


def snapshot(roots: list[int]) -> dict[str, tuple[str, int]]:
    """"pid:tid" -> (the process's command line, its utime + stime in clock ticks) for every thread."""
    kids, out, todo = children(), {}, list(roots)
    while todo:
        pid = todo.pop()
        todo += kids.get(pid, [])
        try:
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().replace("\0", " ").strip()[:100]
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                out[f"{pid}:{tid}"] = (cmd, int(fields[11]) + int(fields[12]))
        except OSError:  # exited meanwhile
            pass
    return out


def diff(a: dict, b: dict) -> str:
    wall, hz = b["t"] - a["t"], os.sysconf("SC_CLK_TCK")
    per_proc: collections.Counter = collections.Counter()
    for key, (cmd, ticks) in b["threads"].items():
        per_proc[(key.split(":")[0], cmd)] += ticks - a["threads"].get(key, (cmd, 0))[1]
    lines = [f"wall {wall:.1f} s"]
    for (pid, cmd), ticks in per_proc.most_common():
        if ticks:
            lines.append(f"{ticks / hz:8.1f} CPU-s {ticks / hz / wall:5.2f} cores  pid {pid}  {cmd}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) < 2 or args[0] not in ("snap", "watch", "diff"):
        print(__doc__, file=sys.stderr)
        return 2
    if args[0] == "diff":
        with open(args[1]) as fa, open(args[2]) as fb:
            print(diff(json.load(fa), json.load(fb)))
        return 0
    out, pids = args[1], [int(p) for p in args[2:]]
    if args[0] == "snap":
        with open(out, "w") as f:
            json.dump({"t": time.time(), "threads": snapshot(pids)}, f)
        return 0
    start, seen = time.time(), {}
    while os.path.exists(f"/proc/{pids[0]}"):
        seen.update(snapshot(pids))
        time.sleep(1)
    with open(out, "w") as f:
        json.dump({"t": time.time(), "threads": seen}, f)
    with open(out + ".start", "w") as f:
        json.dump({"t": start, "threads": {}}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
