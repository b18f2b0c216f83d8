"""GPU partitioning: KV pool sizing from a memory fraction or a MIG profile (workers/sizing.py), on CPU."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest

from mserve.workers import mig, sizing
from mserve.workers.settings import WorkerSettings
from mserve.workers.sizing import GIB, MIB, SizingError

REPO = Path(__file__).resolve().parents[2]

# Published config.json files, as their text_config / top level read (llava-1.5's names little more than
# model_type and vocab_size: LlamaConfig's defaults fill the rest, as transformers does on load).
LLAVA_15_7B = {"model_type": "llava", "text_config": {"model_type": "llama", "vocab_size": 32064,
                                                      "max_position_embeddings": 4096}}
QWEN2_VL_7B = {"model_type": "qwen2_vl", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
               "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064,
               "vision_config": {"hidden_size": 3584, "depth": 32}}


@pytest.fixture(scope="module")
def checkpoints(tiny_model_dirs) -> dict[str, Path]:
    """The tiny checkpoints sized here; models/tiny-llava (what `make demo` builds) when it is there."""
    class Dirs(dict):  # built on first use, like tiny_model_dirs (a plain copy would hold only those built so far)
        def __missing__(self, arch: str) -> Path:
            return tiny_model_dirs[arch]

    dirs = Dirs()
    if (REPO / "models/tiny-llava/config.json").is_file():
        dirs["llava"] = REPO / "models/tiny-llava"
    return dirs


def _settings(model: Path, **kw) -> WorkerSettings:
    return WorkerSettings(role=kw.pop("role", "decode"), model=str(model), **kw)


# --------------------------------------------------------------------------- geometry and weights


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "mistral3", "gemma3", "internvl", "smolvlm", "qwen3_vl_moe", "glm46v",
                                  "glm4v_moe"])
def test_geometry_is_the_checkpoints_text_model(checkpoints, arch):
    cfg = json.loads((checkpoints[arch] / "config.json").read_text())
    text = cfg["text_config"]  # the tiny families are saved with a nested text_config
    g = sizing.read_geometry(checkpoints[arch])
    assert (g.num_layers, g.num_kv_heads, g.hidden_size, g.intermediate_size, g.vocab_size) == (
        text["num_hidden_layers"], text["num_key_value_heads"], text["hidden_size"], text["intermediate_size"],
        text["vocab_size"])
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    assert g.head_dim == head_dim
    # 2 (K, V) × layers × kv_heads × head_dim × block_size × dtype bytes
    assert g.block_bytes(16, 4) == 2 * text["num_hidden_layers"] * text["num_key_value_heads"] * head_dim * 16 * 4
    assert g.block_bytes(32, 2) == g.block_bytes(16, 4)


def test_tiny_llava_block_by_hand(checkpoints):
    g = sizing.read_geometry(checkpoints["llava"])
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (2, 2, 16)  # make_tiny_model's llava tiny dims
    assert g.block_bytes(16, 4) == 2 * 2 * 2 * 16 * 16 * 4 == 8192


def test_published_7b_geometries_by_hand():
    llava = sizing.text_geometry(LLAVA_15_7B)
    assert (llava.num_layers, llava.num_kv_heads, llava.head_dim, llava.hidden_size, llava.vocab_size) == (
        32, 32, 128, 4096, 32064)
    assert llava.block_bytes(16, 2) == 8 * MIB  # 2·32·32·128·16·2
    qwen = sizing.text_geometry(QWEN2_VL_7B)  # the published flat layout: text keys at the top level
    assert (qwen.num_layers, qwen.num_kv_heads, qwen.head_dim, qwen.hidden_size) == (28, 4, 128, 3584)
    assert qwen.kv_bytes_per_token(2) == 56 * 1024  # 2·28·4·128·2


def test_qwen_text_config_overrides_top_level():
    cfg = dict(QWEN2_VL_7B, text_config={"num_hidden_layers": 3, "num_key_value_heads": 1})
    g = sizing.text_geometry(cfg)
    assert (g.num_layers, g.num_kv_heads, g.hidden_size) == (3, 1, 3584)


def test_text_defaults_are_transformers_defaults():
    from transformers import CONFIG_MAPPING

    for model_type, defaults in sizing.TEXT_DEFAULTS.items():
        config = CONFIG_MAPPING[model_type]()
        for key, value in defaults.items():
            assert getattr(config, key) == value, (model_type, key)
        assert getattr(config, "num_key_value_heads", config.num_attention_heads) == sizing.text_geometry(
            {"model_type": "llava", "text_config": {"model_type": model_type}}).num_kv_heads


def test_unknown_text_key_names_it():
    with pytest.raises(SizingError, match="num_hidden_layers"):
        sizing.text_geometry({"model_type": "llava", "text_config": {"model_type": "gemma", "hidden_size": 8,
                                                                     "num_attention_heads": 2}})
    with pytest.raises(SizingError, match="model_type 'bert'"):
        sizing.text_geometry({"model_type": "bert"})


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl", "mistral3", "internvl", "smolvlm", "qwen3_vl_moe", "glm46v"])
def test_weight_split_matches_what_each_role_loads(checkpoints, arch):
    """The safetensors header count per part equals the parameters load_vlm keeps for that part."""
    from mserve.workers.model_loading import load_vlm

    counts = sizing.parameter_counts(checkpoints[arch])
    assert counts["vision"] > 0 and counts["text"] > 0
    for parts, key in (("vision", "vision"), ("text", "text")):
        model = load_vlm(checkpoints[arch], "cpu", "float32", parts=parts)
        loaded = sum(p.numel() for p in model.parameters())
        assert loaded == counts[key], (arch, parts)
        assert sizing.weight_bytes(counts, parts, 4) == loaded * 4


def test_no_safetensors_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAVA_15_7B))
    with pytest.raises(SizingError, match="safetensors"):
        sizing.parameter_counts(tmp_path)


# --------------------------------------------------------------------------- the formula


def test_reserve_by_hand():
    g = sizing.text_geometry(LLAVA_15_7B)
    r = sizing.reserve_bytes(g, dtype_bytes=2, max_num_batched_tokens=2048, max_num_seqs=64, workspace_bytes=0)
    assert r == 2048 * (4 * 4096 + 3 * 11008) * 2 + 64 * 32064 * 4 * 2
    assert sizing.reserve_bytes(g, dtype_bytes=2, max_num_batched_tokens=2048, max_num_seqs=64,
                                kv=False) == sizing.WORKSPACE_BYTES


def test_plan_blocks_by_hand():
    # 8 GiB × 0.5 = 4 GiB; minus 1 GiB weights and 512 MiB reserve = 2.5 GiB; / (1 + 1/4) = 2 GiB; / 1 MiB = 2048
    plan = sizing.plan_blocks(total_bytes=8 * GIB, fraction=0.5, weights_bytes=GIB, reserve=512 * MIB,
                              block_bytes=MIB, num_layers=4)
    assert plan.num_blocks == 2048 and plan.kv_bytes == 2 * GIB and plan.budget_bytes == 4 * GIB
    assert "2048 blocks" in plan.describe()


def test_llava_7b_on_mig_profiles():
    """The worked examples of docs/gpu-partitioning.md."""
    g = sizing.text_geometry(LLAVA_15_7B)
    counts = {"text": 6_738_939_904, "vision": 324_487_168}

    def blocks(spec: str, parts: str = "text") -> int:
        return sizing.plan_blocks(
            total_bytes=mig.mig_profile(spec).memory_bytes, fraction=0.9,
            weights_bytes=sizing.weight_bytes(counts, parts, 2),
            reserve=sizing.reserve_bytes(g, dtype_bytes=2, max_num_batched_tokens=2048, max_num_seqs=64,
                                         kv=parts != "vision"),
            block_bytes=g.block_bytes(16, 2), num_layers=32, min_blocks=128, kv=parts != "vision").num_blocks

    # by hand: (0.9·40 GiB − 6738939904·2 − (512 MiB + 2048·49408·2 + 64·32064·8)) / (33/32) / 8 MiB
    by_hand = math.floor((0.9 * 40 * GIB - 6738939904 * 2 - (512 * MIB + 2048 * 49408 * 2 + 64 * 32064 * 8))
                         / (33 / 32) / (8 * MIB))
    assert blocks("A100-80GB:3g.40gb") == by_hand == 2823
    assert blocks("H100-80GB:3g.40gb") == 2823
    assert blocks("A100-80GB:2g.20gb") == 588
    assert blocks("A100-80GB:1g.10gb", "vision") == 0  # an encoder fits (no KV pool)
    with pytest.raises(SizingError, match="gpu_memory_fraction=0.9 of 10.00 GiB"):
        blocks("A100-80GB:1g.10gb")  # the 7B language model alone is 12.55 GiB


def test_errors_name_the_setting():
    kw = dict(total_bytes=8 * GIB, weights_bytes=GIB, reserve=512 * MIB, block_bytes=MIB, num_layers=4)
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(SizingError, match=rf"gpu_memory_fraction={bad} must be in \(0, 1\]"):
            sizing.plan_blocks(fraction=bad, **kw)
    with pytest.raises(SizingError, match="gpu_memory_fraction=0.1 .* does not hold the weights"):
        sizing.plan_blocks(fraction=0.1, **kw)  # 0.8 GiB < 1 GiB of weights
    with pytest.raises(SizingError, match="leaves room for 409 KV blocks .* at least 1000"):
        sizing.plan_blocks(fraction=0.25, min_blocks=1000, **kw)  # (2 GiB − 1.5 GiB) / 1.25 / 1 MiB = 409


# --------------------------------------------------------------------------- MIG profiles


def test_mig_profile_lookup():
    p = mig.mig_profile("A100-80GB:1g.10gb")
    assert (p.memory_bytes, p.compute_slices, p.memory_slices, p.max_instances) == (10 * GIB, 1, 1, 7)
    assert p.resource == "nvidia.com/mig-1g.10gb"
    assert mig.mig_profile("h100-80gb:nvidia.com/mig-3g.40gb").memory_bytes == 40 * GIB
    assert mig.mig_profile("A100-40GB:1g.10gb").memory_slices == 2  # 2/8 of a 40 GB board
    with pytest.raises(SizingError, match="name the GPU"):
        mig.mig_profile("1g.10gb")
    with pytest.raises(SizingError, match="A100-40GB has no MIG profile '3g.40gb'"):
        mig.mig_profile("A100-40GB:3g.40gb")


def test_mig_table_is_consistent():
    for gpu, profiles in mig.MIG_PROFILES.items():
        for p in profiles:
            compute, _, memory = p.name.partition("+")[0].partition(".")
            assert int(compute.rstrip("g")) == p.compute_slices, p
            assert int(memory.removesuffix("gb")) * GIB == p.memory_bytes, p  # the name says the memory
            assert p.memory_slices * p.max_instances <= 8 and p.compute_slices * p.max_instances <= 7, p


# --------------------------------------------------------------------------- a worker's settings


def test_unset_changes_nothing(checkpoints):
    s = _settings(checkpoints["llava"], num_blocks=123)
    assert s.gpu_memory_fraction is None and s.mig_device is None and s.device_memory_gb is None
    assert sizing.partition_worker(s, "text") == 123


def test_settings_from_environment(checkpoints, monkeypatch):
    monkeypatch.setenv("MSERVE_GPU_MEMORY_FRACTION", "0.25")
    monkeypatch.setenv("MSERVE_DEVICE_MEMORY_GB", "2")
    monkeypatch.setenv("MSERVE_MIG_DEVICE", "MIG-0c0ffee0-aaaa-bbbb-cccc-0123456789ab")
    s = _settings(checkpoints["llava"])
    assert (s.gpu_memory_fraction, s.device_memory_gb, s.mig_device) == (
        0.25, 2.0, "MIG-0c0ffee0-aaaa-bbbb-cccc-0123456789ab")


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])
def test_cpu_worker_sizes_against_device_memory_gb(checkpoints, arch):
    s = _settings(checkpoints[arch], gpu_memory_fraction=0.5, device_memory_gb=2.0, max_num_seqs=8, dtype="float32")
    n = sizing.partition_worker(s, "text")
    g = sizing.read_geometry(checkpoints[arch])
    counts = sizing.parameter_counts(checkpoints[arch])
    reserve = sizing.WORKSPACE_BYTES + 2048 * (4 * g.hidden_size + 3 * g.intermediate_size) * 4 + 8 * g.vocab_size * 8
    expected = int((GIB - counts["text"] * 4 - reserve) / (1 + 1 / g.num_layers)) // g.block_bytes(16, 4)
    assert n == expected > s.num_blocks  # float32; far more than the default 2048 for a tiny model
    assert sizing.partition_worker(s, "vision") == s.num_blocks  # an encoder keeps no KV pool


def test_cuda_branch_reads_the_device_and_caps_the_allocator(checkpoints, monkeypatch):
    """No GPU here: the two torch.cuda calls the CUDA branch makes stand in for one of 80 GiB."""
    import torch

    caps = []
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda f, i: caps.append((f, i)))
    s = _settings(checkpoints["llava"], device="cuda", gpu_memory_fraction=0.5, dtype="auto")
    n = sizing.partition_worker(s, "text")
    assert n == sizing.plan_for_model(checkpoints["llava"], total_bytes=80 * GIB, fraction=0.5,
                                      dtype_bytes=2).num_blocks  # auto: bfloat16 on CUDA for a float32 checkpoint
    assert caps == [(0.5, 0)]
    s = _settings(checkpoints["llava"], device="cuda:1", gpu_memory_fraction=0.5, device_memory_gb=40)
    sizing.partition_worker(s, "text")
    assert caps[-1] == (0.25, 1)  # a budget of 20 GiB on an 80 GiB device


def test_cpu_without_device_memory_refuses(checkpoints):
    s = _settings(checkpoints["llava"], gpu_memory_fraction=0.5)
    with pytest.raises(SizingError, match="gpu_memory_fraction=0.5 on device 'cpu'.*device_memory_gb"):
        sizing.partition_worker(s, "text")


def test_mig_device_checks(checkpoints, monkeypatch):
    with pytest.raises(SizingError, match="needs device=cuda"):
        sizing.partition_worker(_settings(checkpoints["llava"], mig_device="MIG-abc"), "text")
    with pytest.raises(SizingError, match="MIG instance's UUID"):
        mig.select_mig_device("0", "cuda")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    mig.select_mig_device("MIG-0c0ffee0-aaaa-bbbb-cccc-0123456789ab", "cuda")  # CUDA has not started here
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "MIG-0c0ffee0-aaaa-bbbb-cccc-0123456789ab"


def test_worker_engine_config_uses_the_plan(checkpoints):
    """The hook in Worker.engine_config: the sized pool with a fraction, --num-blocks without."""
    from mserve.workers.worker import Worker

    role = types.SimpleNamespace(PARTS="text")
    plain = _settings(checkpoints["llava"], num_blocks=77)
    assert Worker.engine_config(role, plain).num_blocks == 77
    shared = _settings(checkpoints["llava"], num_blocks=77, gpu_memory_fraction=0.5, device_memory_gb=2.0)
    assert Worker.engine_config(role, shared).num_blocks == sizing.partition_worker(shared, "text") > 77


def test_cli_flags_reach_the_settings():
    from mserve.cli import build_parser

    args = build_parser().parse_args(["worker", "--role", "decode", "--model", "m", "--gpu-memory-fraction", "0.3",
                                      "--device-memory-gb", "40", "--mig-device", "MIG-x"])
    assert (args.gpu_memory_fraction, args.device_memory_gb, args.mig_device) == (0.3, 40.0, "MIG-x")


def test_planning_command(checkpoints, capsys):
    assert sizing.main(["--model", str(checkpoints["llava"]), "--profile", "A100-80GB:1g.10gb",
                        "--fraction", "0.9"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["num_blocks"] > 0 and out["tokens"] == out["num_blocks"] * 16
    assert sizing.main(["--model", str(checkpoints["llava"]), "--memory-gb", "0.25", "--fraction", "0.5"]) == 1
    assert "gpu_memory_fraction=0.5" in capsys.readouterr().err
