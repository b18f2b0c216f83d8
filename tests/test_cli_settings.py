"""Every flag of `mserve worker`, `coordinator` and `gateway` reaches the process's settings.

The commands once copied flags into their settings through a list kept by hand, and `mserve worker
--attention padded` ran with `auto` without a word (so did every `@attention=padded` bench config)."""

from __future__ import annotations

import logging

import pytest

from mserve.cli import _settings_from_args, build_parser


def _subparser(name: str):
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    return parser, sub.choices[name]


@pytest.mark.parametrize("command,cls_path", [
    ("worker", "mserve.workers.settings.WorkerSettings"),
    ("coordinator", "mserve.coordinator.settings.CoordinatorSettings"),
    ("gateway", "mserve.gateway.settings.GatewaySettings"),
])
def test_every_flag_names_a_settings_field(command, cls_path):
    module, _, name = cls_path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    _, sub = _subparser(command)
    dests = {a.dest for a in sub._actions if a.dest != "help"}
    assert dests - set(cls.model_fields) == set()


@pytest.mark.parametrize("cls_path,var,field", [
    ("mserve.workers.settings.WorkerSettings", "MSERVE_DTYPE", "dtype"),
    ("mserve.coordinator.settings.CoordinatorSettings", "MSERVE_DEAD_AFTER_S", "dead_after_s"),
    ("mserve.gateway.settings.GatewaySettings", "MSERVE_ALLOW_LOOPBACK_MEDIA_FOR_TESTS", "allow_loopback_media_for_tests"),
])
def test_an_empty_variable_is_unset_not_a_value(monkeypatch, cls_path, var, field):
    """`VAR= mserve up ...` (a shell's way of clearing one) leaves the default: it was a start-up traceback
    ("Input should be a valid boolean ... input_value=''") for the gateway's flag."""
    module, _, name = cls_path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    required = {"role": "unified", "model": "m"} if name == "WorkerSettings" else {}
    monkeypatch.delenv(var, raising=False)
    default = getattr(cls(**required), field)
    monkeypatch.setenv(var, "")
    assert getattr(cls(**required), field) == default


def test_worker_flags_reach_the_worker_settings(monkeypatch):
    from mserve.workers.settings import WorkerSettings

    for var in ("MSERVE_ATTENTION", "MSERVE_DTYPE", "MSERVE_MAX_PREFILL_TOKENS"):
        monkeypatch.delenv(var, raising=False)
    parser, _ = _subparser("worker")
    args = parser.parse_args(["worker", "--role", "unified", "--model", "m", "--dtype", "bfloat16",
                              "--attention", "padded", "--max-prefill-tokens", "1024"])
    logging.getLogger("mserve").disabled = True  # the settings line it logs is not under test
    try:
        s = _settings_from_args(WorkerSettings, args)
    finally:
        logging.getLogger("mserve").disabled = False
    assert (s.dtype, s.attention, s.max_prefill_tokens) == ("bfloat16", "padded", 1024)
    assert s.exact_attention() is False


def test_the_fetch_and_redis_timeouts_are_worker_settings_and_must_be_positive(monkeypatch):
    from pydantic import ValidationError

    from mserve.workers.settings import WorkerSettings

    monkeypatch.delenv("MSERVE_FETCH_TIMEOUT_S", raising=False)
    monkeypatch.delenv("MSERVE_REDIS_TIMEOUT_S", raising=False)
    parser, _ = _subparser("worker")
    args = parser.parse_args(["worker", "--role", "decode", "--model", "m", "--fetch-timeout-s", "2.5"])
    logging.getLogger("mserve").disabled = True
    try:
        assert _settings_from_args(WorkerSettings, args).fetch_timeout_s == 2.5
    finally:
        logging.getLogger("mserve").disabled = False
    assert WorkerSettings(role="decode", model="m").fetch_timeout_s == 10.0
    with pytest.raises(ValidationError, match="fetch_timeout_s must be a number of seconds above 0, not 0"):
        WorkerSettings(role="decode", model="m", fetch_timeout_s=0)
    assert WorkerSettings(role="decode", model="m").redis_timeout_s == 0.5
    with pytest.raises(ValidationError, match="redis_timeout_s must be a number of seconds above 0, not -1"):
        WorkerSettings(role="decode", model="m", redis_timeout_s=-1)


def test_an_encoder_takes_one_image_per_forward_on_the_cpu_and_eight_on_cuda(monkeypatch):
    from pydantic import ValidationError

    from mserve.workers.settings import WorkerSettings

    for var in ("MSERVE_MAX_ENCODE_IMAGES", "MSERVE_DEVICE"):
        monkeypatch.delenv(var, raising=False)
    assert WorkerSettings(role="encode", model="m").max_encode_images == 1
    assert WorkerSettings(role="encode", model="m", device="cuda").max_encode_images == 8
    assert WorkerSettings(role="encode", model="m", max_encode_images=4).max_encode_images == 4
    monkeypatch.setenv("MSERVE_MAX_ENCODE_IMAGES", "3")
    assert WorkerSettings(role="encode", model="m", device="cuda").max_encode_images == 3
    with pytest.raises(ValidationError, match="max_encode_images"):
        WorkerSettings(role="encode", model="m", max_encode_images=0)
