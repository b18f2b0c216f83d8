"""The gateway's one settings object: flags and MSERVE_* environment variables, printed at start-up."""

from __future__ import annotations

from pydantic import SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mserve.common import sampling_rules
from mserve.common.documents import MAX_DOCUMENT_PAGES


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="MSERVE_", extra="ignore", env_ignore_empty=True)  # VAR= is unset

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
    # Remote media (http(s) URLs in image / video parts), fetched by gateway/media_fetch.py: only public
    # addresses, every redirect hop checked again. Hosts allowed, comma-separated: "cdn.example.com" that
    # host only, ".example.com" the names under example.com; None: every public host.
    allowed_media_domains: str | None = None
    media_max_bytes: int = 32 * 1024 * 1024  # one fetched item; reading stops past it
    media_connect_timeout_s: float = 5.0
    media_read_timeout_s: float = 10.0  # the longest wait for the next bytes
    media_total_timeout_s: float = 30.0  # one URL, redirects included
    media_max_redirects: int = 5
    media_max_concurrent_fetches: int = 16  # one more waits up to media_concurrency_wait_s, then 429
    media_concurrency_wait_s: float = 5.0
    media_cache_bytes: int = 128 * 1024 * 1024  # HTTP cache of fetched media (ETag / max-age); 0 = off
    # TEST ONLY: lets media URLs reach 127.0.0.1 (and nothing else private) so tests can serve media
    # from an in-process server. Never set it in a deployment.
    allow_loopback_media_for_tests: bool = False
    max_request_bytes: int = 64 * 1024 * 1024  # whole HTTP body, images included (base64)
    # A PDF `file` part's pages, each an image (common/documents.py): at most this many, rendered at this DPI;
    # None: at the pixel budget of the requested model's image processor (else at DEFAULT_DOCUMENT_DPI).
    max_document_pages: int = MAX_DOCUMENT_PAGES
    document_dpi: int | None = None
    # max_tokens when a request names neither max_tokens nor max_completion_tokens
    default_max_tokens: int = sampling_rules.MAX_TOKENS
    request_timeout_s: float = 600.0
    access_log: bool = False
    # The coordinator's client API key (its MSERVE_CLIENT_API_KEY), sent with every message to it; None
    # falls back to $MSERVE_CLIENT_API_KEY, else nothing. Printed as ********** in the settings line.
    coordinator_api_key: SecretStr | None = None
    # Take streamed tokens straight from the decode workers (a token sink bound on `tokens_host`, which
    # the workers must reach) instead of through the coordinator; pays with --token-report-every > 1 there.
    direct_tokens: bool = False
    tokens_host: str = "127.0.0.1"
    # Put request images, audio clips and video files in a media store bound on this address, which the
    # encode / unified workers must reach, and send the coordinator their refs, not their bytes
    # (common/media_store.py). On by default: 127.0.0.1 serves workers on this host (shm, or tcp on
    # loopback); workers on other hosts need an address of this host they reach. None ("none"): inline.
    media_store_host: str | None = "127.0.0.1"
    # OpenTelemetry traces to this OTLP/HTTP endpoint (common/tracing.py); None: the OTEL_* variables, else off.
    otlp_endpoint: str | None = None
    # The CPU cores this process runs on (--cpus, $MSERVE_CPUS; common/cpu_placement.py): mserve/cli.py
    # pins the process before anything starts; None: every core it may use.
    cpus: str | None = None

    @field_validator("media_store_host", mode="before")
    @classmethod
    def _store_off(cls, value: object) -> object:
        """--media-store-host none (or MSERVE_MEDIA_STORE_HOST=none): no store, media inline."""
        return None if isinstance(value, str) and value.strip().lower() in ("", "none", "off") else value
