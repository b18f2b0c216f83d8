"""The bench Target interface: make_target picks the target from the URL, and both targets implement it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from mserve.bench.http_target import HttpTarget
from mserve.bench.targets import Target, make_target
from mserve.bench.zmq_target import ZmqTarget


@pytest.mark.parametrize("url, cls, address", [
    ("zmq://127.0.0.1:5555", ZmqTarget, "tcp://127.0.0.1:5555"),
    ("tcp://127.0.0.1:5555", ZmqTarget, "tcp://127.0.0.1:5555"),
    ("ipc:///tmp/mserve.sock", ZmqTarget, "ipc:///tmp/mserve.sock"),
    ("http://127.0.0.1:8000/v1", HttpTarget, None),
    ("https://example.com/v1/", HttpTarget, None),
])
def test_make_target_picks_the_target_by_scheme(url, cls, address) -> None:
    target = make_target(url, "m", ignore_eos=True, timeout_s=5.0)
    assert type(target) is cls and isinstance(target, Target)
    if address is not None:
        assert target.address == address
    else:
        assert target.base_url == url.rstrip("/") and target.opts.extra_body == {"ignore_eos": True}


@pytest.mark.parametrize("url, model, message", [
    ("http://127.0.0.1:8000/v1", None, "--model NAME is required"),
    ("ftp://127.0.0.1/v1", "m", "expected zmq://HOST:PORT or http://HOST:PORT/v1"),
])
def test_make_target_refuses(url, model, message) -> None:
    with pytest.raises(SystemExit, match=message):
        make_target(url, model, ignore_eos=False, timeout_s=5.0)


def test_zmq_target_records_an_unreachable_coordinator_as_a_timeout() -> None:
    """Nothing listens: the request times out and is recorded, never raised; open/close pair up."""
    from mserve.bench.serve import new_record
    from mserve.bench.traces import make_trace

    req = make_trace("text", 1, seed=0, max_tokens=2, prompt_tokens=4)[0]

    async def go():
        target = ZmqTarget("zmq://127.0.0.1:1", ignore_eos=False, timeout_s=0.3)
        await target.open()
        try:
            rec = new_record(req)
            await target.run(req, target.prepare(req), rec)
            return rec
        finally:
            await target.close()

    rec = asyncio.run(go())
    assert rec.error_type == "RequestTimeout" and rec.end_s >= rec.start_s and not rec.token_times_s


def test_targets_module_is_stdlib_only() -> None:
    code = ("import sys, mserve.bench.targets, mserve.bench.serve\n"
            "heavy = [m for m in ('numpy', 'zmq', 'torch') if m in sys.modules]\n"
            "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr
