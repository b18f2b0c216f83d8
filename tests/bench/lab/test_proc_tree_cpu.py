"""lab.proc_tree_cpu counts a child process's CPU under the parent it was asked about."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from lab.proc_tree_cpu import diff, snapshot

BURN = "import sys, time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\nsys.stdin.read()\n"


def test_a_childs_cpu_is_counted_under_its_parent():
    before = {"t": time.time(), "threads": snapshot([os.getpid()])}
    child = subprocess.Popen([sys.executable, "-c", BURN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "done"  # it has used 0.3 s of CPU and waits
        after = {"t": time.time(), "threads": snapshot([os.getpid()])}
    finally:
        child.stdin.close()
        child.wait(timeout=30)
    line = next(x for x in diff(before, after).splitlines() if f"pid {child.pid} " in x)
    assert float(line.split()[0]) >= 0.25  # CPU-s, at clock-tick resolution
