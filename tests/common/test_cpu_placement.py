"""CPU placement: the plan (pure), the core lists, and `--cpus` pinning a real process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mserve.common.cpu_placement import format_cpu_list, parse_cpu_list, plan

DISAGG = [("encode-0", "encode"), ("prefill-0", "prefill"), ("decode-0", "decode")]


def test_fewer_cores_than_workers_the_prefill_worker_gets_a_core_and_the_rest_share_the_last():
    p = plan([0, 1], DISAGG)
    assert p.workers == {"encode-0": (1,), "prefill-0": (0,), "decode-0": (1,)}  # in start order
    assert p.control == (1,) and p.io == ()  # core 1 runs models: each worker's IO threads stay with it
    assert p.describe() == "encode-0 1, prefill-0 0, decode-0 1, coordinator/gateway 1"


def test_as_many_cores_as_workers_the_last_worker_shares_its_core_with_the_control_plane():
    p = plan([0, 1], [("unified-0", "unified"), ("unified-1", "unified")])
    assert p.workers == {"unified-0": (0,), "unified-1": (1,)} and p.control == (1,) and p.io == ()


def test_more_cores_than_workers_each_worker_its_own_and_the_control_plane_the_rest():
    p = plan([4, 5, 6, 7, 8], DISAGG)
    assert p.workers == {"encode-0": (6,), "prefill-0": (4,), "decode-0": (5,)} and p.control == (7, 8)
    assert p.io == (7, 8)  # no model runs there: every worker's IO threads go beside the control plane


def test_one_unified_worker_on_two_cores_runs_only_its_model_on_its_core():
    p = plan([0, 1], [("unified-0", "unified")])
    assert (p.workers, p.control, p.io) == ({"unified-0": (0,)}, (1,), (1,))
    assert p.describe() == "unified-0 0, coordinator/gateway 1, workers' IO threads 1"


def test_heaviest_role_first_then_start_order():
    workers = [("encode-0", "encode"), ("decode-0", "decode"), ("prefill-0", "prefill"), ("prefill-1", "prefill"),
               ("m1-unified-0", "unified")]
    p = plan(range(4), workers)
    assert p.workers == {"m1-unified-0": (0,), "prefill-0": (1,), "prefill-1": (2,), "decode-0": (3,),
                         "encode-0": (3,)}


def test_workers_with_several_threads_get_that_many_cores_each():
    p = plan(range(5), DISAGG, per_worker=2)  # two units of two cores, core 4 left over
    assert p.workers == {"encode-0": (2, 3), "prefill-0": (0, 1), "decode-0": (2, 3)} and p.control == (2, 3, 4)
    p = plan(range(7), DISAGG, per_worker=2)
    assert p.workers == {"encode-0": (4, 5), "prefill-0": (0, 1), "decode-0": (2, 3)} and p.control == (6,)
    assert p.io == (6,)
    assert plan(range(3), DISAGG, per_worker=2).workers == {}  # one unit: nothing to place


def test_one_core_or_no_workers_places_nothing():
    assert plan([3], DISAGG).workers == {} and plan([3], DISAGG).control == ()
    assert plan([0, 1], []).workers == {}
    assert plan([0], DISAGG).describe() == "not placed (one core)"


@pytest.mark.parametrize("text,cpus", [("0", (0,)), ("0-2,5", (0, 1, 2, 5)), (" 3 , 1-1", (1, 3)), ("2,2", (2,))])
def test_cpu_lists_parse_and_format_as_taskset_writes_them(text, cpus):
    assert parse_cpu_list(text) == cpus
    assert parse_cpu_list(format_cpu_list(cpus)) == cpus
    assert format_cpu_list((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"


@pytest.mark.parametrize("text,message", [("a", "not a core number"), ("3-1", "not a range"), (",", "names no core"),
                                          ("-1", "not a core number")])
def test_a_bad_cpu_list_is_refused_with_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_cpu_list(text)


def _run(args: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


def test_pin_runs_the_process_and_the_threads_it_starts_on_those_cores():
    core = max(os.sched_getaffinity(0))
    code = ("import os, threading; from mserve.common.cpu_placement import pin; pin(%r); seen = []; "
            "t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0))); t.start(); t.join(); "
            "print(sorted(os.sched_getaffinity(0)), sorted(seen[0]))" % str(core))
    out = _run(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{core}]"] * 2


def test_io_threads_run_on_the_io_cores_and_the_rest_on_the_pinned_ones():
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    model, io = cores[0], cores[-1]
    code = ("import os, threading, zmq; from mserve.common import cpu_placement as cp; cp.pin_io(%r); cp.pin(%r); "
            "seen = {}; io = threading.Thread(target=lambda: (cp.on_io_cores(), seen.update(io=os.sched_getaffinity(0)))); "
            "other = threading.Thread(target=lambda: seen.update(other=os.sched_getaffinity(0))); "
            "io.start(); other.start(); io.join(); other.join(); ctx = zmq.Context(); cp.io_zmq_context(ctx); "
            "s = ctx.socket(zmq.PAIR); s.bind('inproc://x'); "
            "import time; deadline = time.monotonic() + 30\n"  # zmq's threads name and place themselves as they start
            "while True:\n"
            "    zt = [t for t in os.listdir('/proc/self/task') if open(f'/proc/self/task/{t}/comm').read().startswith('ZMQbg')]\n"
            "    zc = {open(f'/proc/self/task/{t}/status').read().split('Cpus_allowed_list:')[1].split()[0] for t in zt}\n"
            "    if (len(zt) == 2 and zc == {%r}) or time.monotonic() > deadline: break\n"
            "    time.sleep(0.01)\n"
            "print(sorted(os.sched_getaffinity(0)), sorted(seen['io']), sorted(seen['other']), sorted(zc)); "
            "s.close(); ctx.term()" % (str(io), str(model), str(io)))
    out = _run(["-c", code])
    assert out.returncode == 0, out.stderr
    assert out.stdout.split(" ", 3) == [f"[{model}]", f"[{io}]", f"[{model}]", f"['{io}']\n"]


def test_a_core_this_process_may_not_use_is_refused_at_the_command_line():
    absent = max(os.sched_getaffinity(0)) + 1
    out = _run(["-m", "mserve.cli", "worker", "--cpus", str(absent), "--role", "decode"])
    assert out.returncode != 0
    assert f"error: CPU list '{absent}': core(s) {absent} are not among this process's cores" in out.stderr
    bad_env = _run(["-m", "mserve.cli", "coordinator"], MSERVE_CPUS="x")  # $MSERVE_CPUS when --cpus is not given
    assert bad_env.returncode != 0 and "error: CPU list 'x'" in bad_env.stderr
    bad_io = _run(["-m", "mserve.cli", "worker", "--io-cpus", str(absent), "--role", "decode"])
    assert bad_io.returncode != 0
    assert f"error: IO CPU list '{absent}': core(s) {absent} are not among this process's cores" in bad_io.stderr
