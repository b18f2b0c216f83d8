"""The prepared GPU check (issue 24): check.py runs it, bench/gpu_check.md says how on the device machine."""
