"""The gateway's one settings object: flags and MSERVE_* environment variables, printed at start-up."""

from __future__ import annotations

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from mserve.common.documents import DEFAULT_DOCUMENT_DPI, MAX_DOCUMENT_PAGES


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MSERVE_", extra="ignore")

    coordinator: str = "tcp://127.0.0.1:5555"  # the coordinator's client address
    host: str = "127.0.0.1"
    port: int = 8000
    # Bearer key every /v1 request must carry (MSERVE_API_KEY); None = no authentication (local use).
    api_key: SecretStr | None = None  # printed as ********** in the start-up settings line
    # Checkpoint folder for the tokenizer (text deltas); default: the path the coordinator serves.
    model: str | None = None
    # The name clients put in "model" and /v1/models lists; default: the coordinator's model name.
    served_model_name: str | None = None
    # Image paths and file:// URLs are read only under this folder; None refuses them all.
    allowed_media_path: str | None = None
    max_request_bytes: int = 64 * 1024 * 1024  # whole HTTP body, images included (base64)
    # A PDF `file` part's pages, each an image (common/documents.py): at most this many, rendered at this DPI.
    max_document_pages: int = MAX_DOCUMENT_PAGES
    document_dpi: int = DEFAULT_DOCUMENT_DPI
    default_max_tokens: int = 256  # when a request names neither max_tokens nor max_completion_tokens
    request_timeout_s: float = 600.0
    access_log: bool = False
    # The coordinator's client API key (its MSERVE_CLIENT_API_KEY), sent with every message to it; None
    # falls back to $MSERVE_CLIENT_API_KEY, else nothing. Printed as ********** in the settings line.
    coordinator_api_key: SecretStr | None = None
    # Take streamed tokens straight from the decode workers (a token sink bound on `tokens_host`, which
    # the workers must reach) instead of through the coordinator; pays with --token-report-every > 1 there.
    direct_tokens: bool = False
    tokens_host: str = "127.0.0.1"
    # OpenTelemetry traces to this OTLP/HTTP endpoint (common/tracing.py); None: the OTEL_* variables, else off.
    otlp_endpoint: str | None = None
    # The CPU cores this process runs on (--cpus, $MSERVE_CPUS; common/cpu_placement.py): mserve/cli.py
    # pins the process before anything starts; None: every core it may use.
    cpus: str | None = None
