"""The coordinator's one settings object: flags and MSERVE_* environment variables, printed at start-up."""

from __future__ import annotations

from pydantic_settings import BaseSettings, SettingsConfigDict


class CoordinatorSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MSERVE_", extra="ignore")

    model: str
    model_name: str | None = None  # key for the Redis caches; defaults to the model path
    bind: str = "tcp://127.0.0.1:5555"  # clients connect here
    worker_bind: str = "tcp://127.0.0.1:5556"  # workers connect here
    redis: str | None = None
    stage_timeout_s: float = 60.0  # a stage making no progress this long is re-run elsewhere
    # Heartbeat silence after which a worker is declared dead. Workers beat between engine steps,
    # so this must exceed the longest step a loaded CPU worker takes (big prefill batches: seconds).
    dead_after_s: float = 10.0
    max_attempts: int = 3
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 8
    max_prompt_tokens: int = 16384
    max_tokens: int = 4096

    def limits(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("max_image_bytes", "max_image_pixels", "max_images_per_request",
                                              "max_prompt_tokens", "max_tokens")}
