"""The coordinator's settings, declared once: flags and MSERVE_* environment variables, printed at start-up.

MachineSettings are those of the request machine; CoordinatorSettings adds the sockets, Redis,
admission limits and security around them."""

from __future__ import annotations

from dataclasses import fields

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from mserve.common.policy import CLASS_AGING_S, DEFAULT_LIMITS, Limits


class MachineSettings(BaseModel):
    """The request machine's settings (coordinator/requests.py), declared here once: CoordinatorSettings
    takes them as flags and MSERVE_* variables, and a RequestMachine made without a coordinator (the
    tests) takes a MachineSettings of its own."""

    # A stage making no progress this long is re-run elsewhere (one merely queued at a live worker is not).
    stage_timeout_s: float = 60.0
    # Heartbeat silence after which a worker is declared dead. Workers beat from a thread of their
    # own, every 0.25 s whatever their engine does, so a few seconds is safe under load.
    dead_after_s: float = 5.0
    # Requests waiting for their first token, at most; past it the lowest class is shed with an
    # explicit `overloaded` error carrying a retry-after hint (never a silent drop or an unbounded queue).
    max_waiting_requests: int = 256
    max_attempts: int = 3
    # Stages the coordinator keeps assigned and unfinished at one encode, prefill or unified worker;
    # beyond it a request waits in the coordinator's class queues (priority, then interactive before
    # batch, then arrival) and binds to whichever worker frees first, so a later interactive request
    # overtakes waiting batch ones. 0: no cap, every stage is sent at once (workers order their own
    # queues). Decode is not capped: a decode worker batches whatever fits its KV pool.
    max_stages_per_worker: int = Field(0, ge=0)
    # A request waiting in those queues longer than this is served before every class (oldest first):
    # nothing starves behind a stream of higher classes.
    class_aging_s: float = Field(CLASS_AGING_S, ge=0.0)
    # A request with several images that the chosen encoder would have to encode shares them with
    # idle encode workers, which encode their parts at the same time (coordinator/dispatch.py).
    spread_encode: bool = True
    # At most one encode in flight per image in the cluster (every shard: a lease in Redis): a request for
    # an image another one is encoding waits for it and reads it back from its holder
    # (coordinator/single_flight.py); `encode_deduplicated` in the stats counts the encodes saved.
    encode_single_flight: bool = True
    # Images whose placeholders the chosen prefill worker's cached prefix holds whole are neither encoded
    # nor fetched (coordinator/dispatch.py, workers/prefix_skip.py).
    prefix_skip: bool = True
    # 0: route each stage among every worker of its role (one coordinator sees every stage it sent).
    # N >= 2: among N drawn at random plus the workers holding the request's cached images or prefix
    # ("power of two choices"): for several shards, which otherwise herd onto one "least busy" worker.
    route_choices: int = Field(0, ge=0)
    # 1: decode and unified workers report every step's tokens here, and this process streams them to
    # clients. N > 1: workers report a request's tokens every N tokens (and its first and last), and a
    # streaming client that gave a token sink (Client(direct_tokens=True)) gets them from the worker
    # directly; the coordinator's per-token work, its largest after admission, drops about N-fold.
    token_report_every: int = Field(1, ge=1)
    # Role switching: move one prefill or decode worker to the other pool when the load mix stays
    # lopsided (coordinator/role_policy.py); the worker drains first, so nothing is lost. Off: roles
    # change only by an operator's `mserve switch-role`.
    role_switching: bool = False
    # Decode workers hand a finished reply's full KV blocks back to the prefill worker that holds its
    # prompt (workers/hand_back.py): a next turn that resends prompt + reply finds both cached. Off by
    # default: it moves the reply's KV once per request, which pays only for multi-turn traffic.
    kv_hand_back: bool = False
    # Conditional disaggregation: a prefill worker with at least this many prompt tokens waiting lends
    # the next prompt to a decode worker with room and fewer waiting, which prefills it and decodes it
    # on (no KV transfer). 0: never, every prompt goes to the prefill pool.
    local_prefill_tokens: int = Field(0, ge=0)
    # Adaptive lending: lend a prompt to a decode worker only where the time it saves there exceeds the
    # time its compute costs the requests that worker holds (routing.route_lend_adaptive); overrides
    # local_prefill_tokens' fixed threshold.
    adaptive_lending: bool = False
    # Opt-in FasterVLM visual-token pruning (common/pruning.py): admission counts each image's
    # placeholders at this keep ratio; encode and unified workers must run the same one (checked at READY).
    visual_token_pruning: float | None = None

    @field_validator("visual_token_pruning", mode="before")
    @classmethod
    def _pruning_ratio(cls, v: object) -> float | None:
        from mserve.common.pruning import parse_ratio

        return parse_ratio(v)

    @field_validator("route_choices")
    @classmethod
    def _choices(cls, v: int) -> int:
        if v == 1:
            raise ValueError("route_choices must be 0 (every worker) or at least 2: one random worker ignores load")
        return v


class CoordinatorSettings(BaseSettings, MachineSettings):
    model_config = SettingsConfigDict(env_prefix="MSERVE_", extra="ignore", env_ignore_empty=True)  # VAR= is unset

    # The default model (requests that name none go to it), loaded at start-up. Workers bring every other
    # model: each READY names its model and folder, and the coordinator serves it from then on
    # (coordinator/models.py). None: every model comes with its workers.
    model: str | None = None
    model_name: str | None = None  # its served name and Redis cache key; defaults to the model path
    bind: str = "tcp://127.0.0.1:5555"  # clients connect here
    worker_bind: str = "tcp://127.0.0.1:5556"  # workers connect here
    redis: str | None = None
    # How long one Redis call may wait before Redis counts as down. The loop never waits on Redis for
    # the announcement, loads or lease writes (they run on the Redis lane, common/redis_lane.py), and
    # reads routing hints only while Redis answers (coordinator/coordinator_redis.py).
    redis_timeout_s: float = Field(0.5, gt=0.0)
    # Sharded coordinators (docs/scaling.md): this process is one of several, named so in Redis
    # (`mserve:coordinator:{shard_id}`), where workers and clients find every shard. None: the only one.
    shard_id: str | None = None
    # The addresses a shard announces when it binds a wildcard (tcp://*:5555): what others connect to.
    advertise: str | None = None
    worker_advertise: str | None = None
    # How often the worker loads are read from Redis, on top of the heartbeats that carry them (0: never;
    # with many workers and shards, heartbeats alone at 1 Hz are the cheaper source).
    load_poll_s: float = Field(0.25, ge=0.0)
    # Admission limits (common/policy.py `Limits` says what each bounds).
    max_image_bytes: int = DEFAULT_LIMITS.max_image_bytes
    max_image_pixels: int = DEFAULT_LIMITS.max_image_pixels
    max_images_per_request: int = DEFAULT_LIMITS.max_images_per_request
    max_prompt_tokens: int = DEFAULT_LIMITS.max_prompt_tokens
    max_tokens: int = DEFAULT_LIMITS.max_tokens
    max_video_frames: int = DEFAULT_LIMITS.max_video_frames
    video_fps: float = DEFAULT_LIMITS.video_fps
    max_audio_bytes: int = DEFAULT_LIMITS.max_audio_bytes
    max_audio_seconds: float = DEFAULT_LIMITS.max_audio_seconds
    max_audio_per_request: int = DEFAULT_LIMITS.max_audio_per_request
    # Security (docs/operations.md, "Security"). None: off, for one trusted host (the local demo).
    # Every GENERATE / ABORT / STATUS must carry this `api_key`; printed masked in the settings line.
    client_api_key: SecretStr | None = None
    # CURVE on the worker link: this coordinator's .key_secret file and the folder of the workers'
    # public keys (both or neither); a worker whose key is not there is refused at the handshake.
    curve_secret_key: str | None = None
    curve_authorized_keys: str | None = None
    # Opt-in SLO-adaptive pruning (coordinator/adaptive_pruning.py): per latency class, the keep ratio
    # its new requests get while the predicted TTFT breaks the class's objective in ttft_slo_ms
    # ("interactive=0.5,batch=0.25" and "interactive=2000"); lifted once the prediction stays below
    # 0.7 x the objective for adaptive_pruning_hold_s. None: off. LLaVA only; disaggregated requests only.
    adaptive_pruning: str | None = None
    ttft_slo_ms: str | None = None
    adaptive_pruning_hold_s: float = Field(2.0, ge=0.0)
    # Opt-in model-version routing (coordinator/variant_policy.py): named groups of served models,
    # smallest first ("llava=llava-small,llava-large;qwen=..."); a request naming a group goes to one
    # variant: batch to the largest live one, interactive down while the larger one's predicted TTFT
    # breaks ttft_slo_ms's interactive objective (needed), back up after variant_hold_s below 0.7 x it.
    variant_groups: str | None = None
    variant_hold_s: float = Field(2.0, ge=0.0)
    # OpenTelemetry traces to this OTLP/HTTP endpoint (common/tracing.py); None: the OTEL_* variables, else off.
    otlp_endpoint: str | None = None
    # The CPU cores this process runs on (--cpus, $MSERVE_CPUS; common/cpu_placement.py): mserve/cli.py
    # pins the process before anything starts; None: every core it may use.
    cpus: str | None = None

    @model_validator(mode="after")
    def _adaptive_pruning(self) -> CoordinatorSettings:
        self.pruning_objectives()  # refuses a bad value at start-up, naming the setting
        return self

    @model_validator(mode="after")
    def _variant_groups(self) -> CoordinatorSettings:
        self.variant_routing()  # refuses a bad group or a missing interactive objective at start-up
        return self

    def variant_routing(self) -> tuple[dict, object] | None:
        """({group name: VariantGroup}, VariantRule) of model-version routing; None when off."""
        from mserve.coordinator.adaptive_pruning import parse_per_class
        from mserve.coordinator.variant_policy import parse_variant_groups, variant_rule

        groups = parse_variant_groups(self.variant_groups)
        if not groups:
            return None
        return groups, variant_rule(parse_per_class(self.ttft_slo_ms, "ttft_slo_ms"), hold_s=self.variant_hold_s)

    def pruning_objectives(self) -> dict:
        """{class: ClassObjective} of SLO-adaptive pruning; {} when off."""
        from mserve.coordinator.adaptive_pruning import objectives, parse_per_class

        return objectives(parse_per_class(self.adaptive_pruning, "adaptive_pruning"),
                          parse_per_class(self.ttft_slo_ms, "ttft_slo_ms"), self.adaptive_pruning_hold_s)

    @field_validator("client_api_key")
    @classmethod
    def _empty_key_is_none(cls, v: SecretStr | None) -> SecretStr | None:
        return v if v is not None and v.get_secret_value() else None

    def limits(self) -> dict[str, float]:
        """The admission limits, as keyword arguments of `Limits`."""
        return {f.name: getattr(self, f.name) for f in fields(Limits)}
