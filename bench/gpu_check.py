"""Launcher of the prepared GPU check (issue 24); bench/gpu_check.md says how to run it on the device.

The check itself lives in the lab, bench/lab/gpu/ (check.py and the modules it uses): it is a one-off
device script for people who work on MServe, so it is not part of the installed `mserve.bench`, which
is what a user runs. This file stays at the path the docs name and runs the lab's main from the
checkout this file sits in:

    python3 bench/gpu_check.py --device cuda --out $OUT
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    bench = Path(__file__).resolve().parent
    if not (bench / "lab" / "gpu" / "check.py").is_file():
        raise SystemExit(f"no bench/lab/gpu/ beside {__file__}: run bench/gpu_check.py from a checkout")
    sys.path.insert(0, str(bench))
    from lab.gpu.check import main

    raise SystemExit(main())
