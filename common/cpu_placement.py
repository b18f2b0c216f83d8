"""Which CPU cores each process of a one-host cluster runs on: the plan is pure; `pin` applies one.

Why place at all: on a host with fewer cores than busy processes, Linux spreads them by fairness, so
a disaggregated cluster's bottleneck stage (a prefill worker that always has prompts queued) gets
only a share of a core while a decode worker steps small batches as fast as it can on the other.
Measured on a 2-core host (bench/lab/NOTEBOOK.md, "CPU placement"): `disagg:1e1p1d` unplaced, the prefill
worker ran 81 % of a core and waited for one 24 % of the time; with the prefill worker alone on one
core and everything else on the other, throughput rose 5-10 %, goodput 20 % and TTFT p50 fell to
0.7x, while TPOT stayed far inside any SLO.

The plan (`plan`), from the cores this process may use and the stage workers in start order (a
"core" below is `per_worker` cores, a worker's --threads, when that is more than one):
- workers are taken heaviest role first: unified, prefill, decode, encode (a prompt's forward is a
  request's largest piece of model work; an encode is the smallest), in start order within a role;
- with more cores than workers, each worker gets a core of its own and the control plane
  (coordinator shards, gateway) the cores left over;
- otherwise the first (cores - 1) workers get a core each and the rest share the last core with the
  control plane, which needs little CPU but must not preempt the busiest model core;
- one core (or none known): nothing is placed.
A worker pins itself with `mserve worker --cpus LIST` (also `mserve coordinator`/`gateway`, or
$MSERVE_CPUS), before torch starts its threads, so every thread it makes inherits the set.

A worker's IO threads (`--io-cpus LIST`, $MSERVE_IO_CPUS): image decoding and the image processor, KV
and embedding transfers, zmq's socket threads. When the plan leaves the control plane a core no worker
runs on, each worker's IO threads go there, so a worker's own core runs only its model: what vLLM does
with one engine core beside the API server process that decodes and processes images (bench/lab/NOTEBOOK.md,
"A worker's IO threads off its model core"). When the control plane shares a worker's core, the IO
threads stay on their worker's core. Each IO thread moves itself (`on_io_cores`, first thing it runs);
zmq's threads get the cores as a context option (`io_zmq_context`).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Sequence

# Heaviest first: the order in which workers are given cores of their own.
ROLE_WEIGHT_ORDER = ("unified", "prefill", "decode", "encode")


@dataclass(frozen=True)
class Placement:
    workers: dict[str, tuple[int, ...]] = field(default_factory=dict)  # worker name -> its cores
    control: tuple[int, ...] = ()  # the coordinator shards' and the gateway's cores; () = not placed
    io: tuple[int, ...] = ()  # every worker's IO threads' cores; () = on the worker's own cores

    def describe(self) -> str:
        if not self.workers:
            return "not placed (one core)"
        parts = [f"{name} {format_cpu_list(c)}" for name, c in self.workers.items()]
        io = [f"workers' IO threads {format_cpu_list(self.io)}"] if self.io else []
        return ", ".join([*parts, f"coordinator/gateway {format_cpu_list(self.control)}", *io])


def plan(cores: Sequence[int], workers: Sequence[tuple[str, str]], per_worker: int = 1) -> Placement:
    """`workers`: (name, role) in start order; `per_worker`: the cores one worker's torch threads want
    (its --threads): the rule above, in units of that many cores; the cores past the last whole unit go
    to the control plane (alone, when every worker has a unit). Fewer than two units: nothing is placed."""
    cores = sorted(set(cores))
    per = max(1, per_worker)
    units = [tuple(cores[i:i + per]) for i in range(0, len(cores) - per + 1, per)]
    spare = tuple(cores[len(units) * per:])
    if len(units) < 2 or not workers:
        return Placement()
    rank = {role: i for i, role in enumerate(ROLE_WEIGHT_ORDER)}
    order = sorted(range(len(workers)), key=lambda i: (rank.get(workers[i][1], len(rank)), i))
    every_own = len(workers) < len(units) or (spare and len(workers) == len(units))
    own = len(workers) if every_own else len(units) - 1  # workers with a unit of their own
    out = {workers[i][0]: units[min(k, own)] for k, i in enumerate(order)}  # the rest: the unit after them
    control = tuple(c for unit in units[own:] for c in unit) + spare
    # IO threads beside the control plane only where no worker's model runs there.
    return Placement({name: out[name] for name, _ in workers}, control, control if every_own else ())


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """"0-2,5" -> (0, 1, 2, 5), as taskset -c and /sys/.../cpulist write them."""
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a core number or a range like 0-3") from None
        if first < 0 or last < first:
            raise ValueError(f"CPU list {text!r}: {part!r} is not a range of core numbers")
        cpus.update(range(first, last + 1))
    if not cpus:
        raise ValueError(f"CPU list {text!r} names no core")
    return tuple(sorted(cpus))


def format_cpu_list(cpus: Sequence[int]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def usable_cores() -> tuple[int, ...]:
    """The cores this process may run on (a container's cpuset, taskset's mask)."""
    return tuple(sorted(os.sched_getaffinity(0)))


def pin(text: str) -> tuple[int, ...]:
    """Run this process, and the threads it starts from now on, on the cores `text` lists."""
    cpus = parse_cpu_list(text)
    allowed = usable_cores()
    if missing := [c for c in cpus if c not in allowed]:
        raise ValueError(f"CPU list {text!r}: core(s) {format_cpu_list(missing)} are not among this process's "
                         f"cores ({format_cpu_list(allowed)})")
    os.sched_setaffinity(0, cpus)
    return cpus


# The IO threads' cores in this process (`pin_io`); () = wherever the thread that starts them runs.
_io_cpus: tuple[int, ...] = ()


def pin_io(text: str) -> tuple[int, ...]:
    """Run this process's IO threads (those that call `on_io_cores`, and zmq's) on the cores `text` lists.
    Before `pin`: the cores are checked against those the process may use, which `pin` narrows."""
    global _io_cpus
    cpus = parse_cpu_list(text)
    allowed = usable_cores()
    if missing := [c for c in cpus if c not in allowed]:
        raise ValueError(f"IO CPU list {text!r}: core(s) {format_cpu_list(missing)} are not among this process's "
                         f"cores ({format_cpu_list(allowed)})")
    _io_cpus = cpus
    return cpus


def on_io_cores() -> None:
    """Move the calling thread to this process's IO cores, when it has them (`pin_io`). An IO thread calls
    this first (as its target's first line, or a pool's `initializer`); the threads it starts inherit them."""
    if _io_cpus:
        os.sched_setaffinity(0, _io_cpus)  # pid 0: this thread alone (Linux)


def io_zmq_context(ctx) -> None:  # noqa: ANN001 - a zmq.Context; zmq is not imported here
    """Give zmq's own IO threads this process's IO cores: before the context's first socket starts them."""
    if _io_cpus:
        import zmq

        for c in _io_cpus:
            ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, c)


def add_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpus", metavar="LIST",
                   help="run this process on these CPU cores only, e.g. 0 or 2-3 or 0,2 (default: $MSERVE_CPUS, "
                        "else every core it may use); `mserve up` sets it per process (--cpu-placement)")


def add_io_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--io-cpus", metavar="LIST",
                   help="run this worker's IO threads (image decoding and processing, transfers, zmq's sockets) "
                        "on these cores, e.g. 1; its model runs on --cpus (default: $MSERVE_IO_CPUS, else beside "
                        "the model); `mserve up` sets it where the coordinator has a core no worker runs on")
