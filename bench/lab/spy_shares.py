"""Where a process's samples went: a py-spy raw profile (`py-spy record -f raw`) summed into shares.

    cd bench && PYTHONPATH=. ../.venv/bin/python -m lab.spy_shares PROFILE.raw [--within Engine.step] \\
        [--by frame|op] [--inductor-dir DIR] [--top 25]

`--within S` keeps only the samples whose stack names S (a worker's step function: `Engine.step` for
MServe, `worker_busy_loop` for vLLM-CPU's model process), so idle threads and start-up do not count.
`--by frame` (default) charges each sample to its innermost frame outside torch's module plumbing
(PackedLinear.forward, the decode kernel's `attend`, ...). `--by op` is for a torch.compile'd model
(vLLM's): each sample is charged to the operation on the line of the inductor-generated graph it was
in (`Runner.call (FILE.py:LINE)`), read from that file under `--inductor-dir`; samples outside the
graph are charged by frame. Used for bench/lab/NOTEBOOK.md, "Where vLLM-CPU's model core goes".
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

PLUMBING = ("module.py", "_ops.py", "_contextlib.py", "generic.py", "output_capturing.py")
FRAME = re.compile(r"(?P<fn>.*?) \((?P<file>[^()]*?):(?P<line>\d+)\)$")
GRAPH_LINE = re.compile(r"Runner\.call \((?P<file>[^()]*?):(?P<line>\d+)\)")


def read_raw(path: str | Path) -> list[tuple[list[str], int]]:
    """py-spy's raw format: one stack a line, frames joined by ';', then a space and the sample count."""
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            stack, count = line.rstrip().rsplit(" ", 1)
            out.append((stack.split(";"), int(count)))
    return out


def frame_key(frames: list[str]) -> str:
    """The innermost frame that is not torch's call plumbing, as `function file:line`."""
    for f in reversed(frames):
        m = FRAME.match(f)
        if m is None:
            return f  # a native frame without a file
        name = Path(m["file"]).name
        if name not in PLUMBING:
            return f"{m['fn']} {name}:{m['line']}"
    return frames[-1]


def graph_op(code: str) -> str:
    """The operation a line of inductor's generated code calls: `torch.ops._C.onednn_mm.default`,
    `cpp_fused_add_mul_3`, ..."""
    rhs = code.split("=", 1)[1] if "=" in code.split("(", 1)[0] else code
    return rhs.strip().split("(", 1)[0] or code.strip()


class GraphSource:
    """Lines of inductor's generated files, found by name under a folder and read once each."""

    def __init__(self, root: str | Path | None) -> None:
        self.root = Path(root) if root else None
        self.files: dict[str, list[str] | None] = {}

    def op(self, file: str, line: int) -> str:
        name = Path(file).name
        if name not in self.files:
            found = next(self.root.rglob(name), None) if self.root else None
            self.files[name] = found.read_text().splitlines() if found else None
        lines = self.files[name]
        if not lines or not 0 < line <= len(lines):
            return f"{name}:{line}"
        return graph_op(lines[line - 1])


def shares(stacks: list[tuple[list[str], int]], within: str | None = None, by: str = "frame",
           source: GraphSource | None = None) -> tuple[int, collections.Counter]:
    """(samples kept, samples per key)."""
    total, counts = 0, collections.Counter()
    for frames, n in stacks:
        if within and not any(within in f for f in frames):
            continue
        total += n
        key = None
        if by == "op":
            hits = [GRAPH_LINE.search(f) for f in frames]
            hits = [h for h in hits if h]
            if hits:
                key = (source or GraphSource(None)).op(hits[-1]["file"], int(hits[-1]["line"]))
        counts[key or frame_key(frames)] += n
    return total, counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lab.spy_shares", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("profile", help="a `py-spy record -f raw` output")
    p.add_argument("--within", default=None, help="keep only stacks with a frame containing this")
    p.add_argument("--by", choices=["frame", "op"], default="frame")
    p.add_argument("--inductor-dir", default=None, help="where the compiled graph's .py files are (--by op)")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)
    total, counts = shares(read_raw(args.profile), args.within, args.by, GraphSource(args.inductor_dir))
    if not total:
        raise SystemExit(f"no samples{' within ' + args.within if args.within else ''} in {args.profile}")
    print(f"{total} samples{' within ' + args.within if args.within else ''}")
    for key, n in counts.most_common(args.top):
        print(f"{n / total * 100:5.1f} %  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
