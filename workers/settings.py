"""A worker's one settings object: flags and MSERVE_* environment variables, printed at start-up."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mserve.common.policy import CLASS_AGING_S, DEFAULT_ENGINE, DEFAULT_LIMITS


CPU_ENCODE_IMAGES, GPU_ENCODE_IMAGES = 1, 8  # max_encode_images' defaults


class WorkerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MSERVE_", extra="ignore", env_ignore_empty=True)  # VAR= is unset

    role: Literal["encode", "prefill", "decode", "unified"]
    model: str
    # The served name clients ask for ("model") and the Redis cache key; defaults to the model path.
    model_name: str | None = None
    coordinator: str = "tcp://127.0.0.1:5556"
    redis: str | None = None
    worker_id: str | None = None
    device: str = "cpu"
    dtype: str | None = None  # None / auto: common/serving_defaults.serving_dtype
    # Decode steps through torch.compile (EngineConfig.compile): 1.35x at batch 1 on the CPU, ~1.0x at 16,
    # and 15-50 s to compile on first use (bench/lab/NOTEBOOK.md). Off by default; refused while attention is exact.
    compile: bool = False
    # exact: attention over each request's exact key count, HF generate's bits in bf16 / float16, one
    # SDPA call per context length and layer; padded: one call per group over masked padding
    # (bench/lab/NOTEBOOK.md, "The CUDA path": 6.9x exact's decode rate for a 7B at batch 32 on an H200).
    # auto: padded (workers/paged_attention.exact_setting says why).
    attention: Literal["auto", "exact", "padded"] = "auto"
    threads: int = 1  # torch threads; 1 per worker on small hosts so pools do not fight over cores
    transfer: Literal["auto", "shm", "tcp", "torch"] = "auto"
    transfer_pool_mb: int = 1024  # bound on the shared-memory segments a sender keeps for reuse
    host: str = "127.0.0.1"  # address peers use for this worker's data plane
    num_blocks: int = DEFAULT_ENGINE.num_blocks
    block_size: int = DEFAULT_ENGINE.block_size
    max_num_seqs: int = DEFAULT_ENGINE.max_num_seqs
    max_num_batched_tokens: int = DEFAULT_ENGINE.max_num_batched_tokens
    max_prefill_tokens: int = DEFAULT_ENGINE.max_prefill_tokens  # the chunk cap (common/policy.py says why)
    class_aging_s: float = Field(CLASS_AGING_S, ge=0.0)  # a prompt queued longer: before every class
    enable_prefix_caching: bool = True
    state_snapshots: int = Field(DEFAULT_ENGINE.state_snapshots, ge=0)  # a hybrid model's prefix-hit states
    embedding_cache_mb: float = 512  # L1: this encode or unified worker's own memory
    # L2: encoded images shared by every encode and unified worker on this host (tmpfs files, outliving a
    # worker's restart); 0 turns it off. The directory defaults to /dev/shm/mserve-embeddings.
    host_embedding_cache_mb: float = 1024
    host_embedding_cache_dir: str | None = None
    # Images per vision forward on an encode worker, at most: bounds how long an interactive image
    # waits behind a batch of others (it is taken first, by class, from the queue). None: 1 on the CPU,
    # where a batch is no quicker per image (22 ms alone, 27 in a batch of 8, small LLaVA in bf16) and
    # every image of it waits for the whole forward, while one at a time lets prefill start on the first;
    # 8 on a GPU, where a batch is what fills it (bench/lab/NOTEBOOK.md, "An encode batch of one on the CPU").
    max_encode_images: int | None = Field(None, ge=1)
    heartbeat_s: float = 0.25
    # How long one Redis call may wait before Redis counts as down (its calls then skip it for a second).
    # Every call while serving runs on the worker's Redis lane (common/redis_lane.py): a slow Redis
    # delays the indexes, registration and load there, never a step or a heartbeat to the coordinator.
    redis_timeout_s: float = 0.5
    # SIGTERM drains: no new work, finish what is here, exit when the coordinator releases the worker
    # (workers/draining.py); past this many seconds it exits anyway. Keep it below the platform's kill
    # grace (Kubernetes terminationGracePeriodSeconds, compose stop_grace_period).
    drain_timeout_s: float = 25.0
    # How long a fetch of another worker's KV blocks or embeddings may wait before that request fails,
    # retryably (the coordinator runs it again). Fetches run on IO threads (workers/fetcher.py), so a
    # stalled sender delays only its own request; keep it well below the coordinator's stage timeout.
    fetch_timeout_s: float = 10.0
    max_image_bytes: int = DEFAULT_LIMITS.max_image_bytes  # checked again before an image is decoded
    max_image_pixels: int = DEFAULT_LIMITS.max_image_pixels
    # CURVE on the coordinator link and the data plane (docs/operations.md, "Security"): all three or
    # none. None: unauthenticated plaintext links, fit only for one trusted host (the local demo).
    curve_secret_key: str | None = None  # this worker's .key_secret file (`mserve keygen`)
    curve_server_key: str | None = None  # the coordinator's public .key file
    curve_authorized_keys: str | None = None  # folder of the public keys that may fetch from this worker
    # GPU partitioning (docs/gpu-partitioning.md, workers/sizing.py); unset: nothing changes.
    # This worker's share of its device: the KV pool (num_blocks) is sized to fit it beside the weights
    # and a reserve, and on CUDA torch's allocator is capped at it. Several workers may share a GPU.
    gpu_memory_fraction: float | None = None
    # The memory that fraction is of, in GiB: required on CPU; on CUDA it overrides what the device reports.
    device_memory_gb: float | None = None
    # A MIG instance's UUID (MIG-..., `nvidia-smi -L`): set as CUDA_VISIBLE_DEVICES before CUDA starts.
    mig_device: str | None = None
    # Opt-in FasterVLM visual-token pruning (common/pruning.py): the share of each image's visual
    # tokens an encoding worker (encode, unified) keeps; None = off. Must equal the coordinator's.
    visual_token_pruning: float | None = None
    # OpenTelemetry traces to this OTLP/HTTP endpoint (common/tracing.py); None: the OTEL_* variables, else off.
    otlp_endpoint: str | None = None
    # The CPU cores this process runs on (--cpus, $MSERVE_CPUS; common/cpu_placement.py): mserve/cli.py
    # pins the process before anything starts; None: every core it may use.
    cpus: str | None = None
    # The cores of its IO threads (--io-cpus, $MSERVE_IO_CPUS; common/cpu_placement.py); None: beside the model.
    io_cpus: str | None = None

    @model_validator(mode="after")
    def _encode_batch_by_device(self) -> "WorkerSettings":
        if self.max_encode_images is None:
            self.max_encode_images = CPU_ENCODE_IMAGES if self.device == "cpu" else GPU_ENCODE_IMAGES
        return self

    @field_validator("fetch_timeout_s", "redis_timeout_s")
    @classmethod
    def _positive_timeout(cls, v: float, info: ValidationInfo) -> float:
        if not v > 0:
            raise ValueError(f"{info.field_name} must be a number of seconds above 0, not {v}")
        return v

    @field_validator("visual_token_pruning", mode="before")
    @classmethod
    def _pruning_ratio(cls, v: object) -> float | None:
        from mserve.common.pruning import parse_ratio

        return parse_ratio(v)

    def resolved_id(self) -> str:
        return self.worker_id or f"{self.role}-{socket.gethostname()}-{os.getpid()}"

    def exact_attention(self) -> bool | None:
        """EngineConfig.exact_attention for `attention` (None: the engine decides by dtype)."""
        from mserve.workers.paged_attention import exact_setting

        return exact_setting(self.attention)
