"""Serving settings: one pydantic model, defaults in one place, engine arguments passed through.

`serve run serve_app:app key=value ...` hands a flat dict of strings to `ServeSettings.from_args`:
keys that name an `EngineConfig` field go to the engine, the rest are serving settings. A bad key
or value fails the deploy at once with a message naming it.
"""
from __future__ import annotations

import json
import os
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pagedserve.replicas.config import EngineConfig
from pagedserve.serve_app.autoscaling import DEFAULTS as AUTOSCALING_DEFAULTS
from pagedserve.serve_app.limits import RequestLimits
from pagedserve.serve_app.response_store import DEFAULTS as RESPONSE_STORE_DEFAULTS

API_KEYS_ENV = "PAGEDSERVE_API_KEYS"
# vLLM's switch for the runtime adapter routes, honoured as the setting's default.
RUNTIME_LORA_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"

DEFAULTS = dict(
    num_replicas=1,
    num_threads=1,  # torch threads per CPU replica: 2-thread torch collapses when a core is shared
    ingress_max_ongoing_requests=4096,  # Ray Serve's default of 5 would silently cap concurrency
    max_queued_requests=1024,
    retry_after_s=1,
    health_check_period_s=2.0,
    health_check_timeout_s=30.0,
    engine_stall_timeout_s=120.0,
    graceful_shutdown_timeout_s=20.0,
    target_queue_depth=4.0,
    max_stream_delay_s=0.02,
    readiness_window_s=30.0,
)


class IngressSettings(BaseModel):
    """What the ingress replicas are built with: only what they use, so that a change to replica
    counts, autoscaling or routing is not a new ingress version (Ray Serve then updates in place
    instead of restarting the ingress and cutting its streams)."""

    model_config = ConfigDict(extra="forbid")

    # No defaults here: ServeSettings.ingress_settings() fills every field from its own.
    api_keys: list[str]
    retry_after_s: int
    max_stream_events_per_s: float | None
    max_stream_delay_s: float
    readiness_window_s: float
    request_timeout_s: float | None
    limits: RequestLimits
    # The ingress replicas' own HTTP server (serve_app/front_door.py); port None: none, HTTP comes
    # through Ray Serve's proxy.
    http_host: str
    http_port: int | None
    # The ingress replicas' gRPC server on http_host (serve_app/grpc_api/); None: none.
    grpc_port: int | None
    max_ongoing_requests: int
    lora_modules: dict[str, str]  # LoRA adapters served from the start: name -> path
    allow_runtime_lora_updating: bool


class ServeSettings(RequestLimits):
    """Everything `pagedserve.serve_app.app.build_app` needs; `engine` is handed to every replica as is.
    The request limits (`pagedserve.serve_app.limits.RequestLimits`) are fields of it too."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    engine: EngineConfig = Field(
        default_factory=lambda: EngineConfig(num_threads=DEFAULTS["num_threads"]))
    # Empty: no authentication. Read from PAGEDSERVE_API_KEYS when not given.
    api_keys: list[str] = Field(default_factory=list)
    # LoRA adapters (engine setting enable_lora) served from the start, as vLLM's --lora-modules:
    # "name=path" or JSON {"name": ..., "path": ...} each. Requests select one with model=name.
    lora_modules: list[str] = Field(default_factory=list)
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter, behind the API keys (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING, read when this is not given).
    allow_runtime_lora_updating: bool = False

    # Replicas. min/max_replicas turn on autoscaling around target_queue_depth.
    num_replicas: int = Field(DEFAULTS["num_replicas"], ge=1)
    min_replicas: int | None = Field(None, ge=0)
    max_replicas: int | None = Field(None, ge=1)
    target_queue_depth: float = Field(DEFAULTS["target_queue_depth"], gt=0)
    upscale_delay_s: float | None = Field(None, ge=0)  # None: the autoscaling policy's default
    downscale_delay_s: float | None = Field(None, ge=0)
    replica_num_cpus: float | None = Field(None, ge=0)  # None: the engine's num_threads
    replica_num_gpus: float = Field(0, ge=0)
    # Under tensor_parallel_size > 1 a replica reserves one placement-group bundle per rank (the
    # replica itself runs rank 0 in the first): STRICT_PACK keeps the ranks on one node.
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = "STRICT_PACK"
    # Requests Ray sends one replica at once; None: the engine's max_num_seqs.
    replica_max_ongoing_requests: int | None = Field(None, ge=1)
    # Requests waiting for a replica in one ingress before it answers 429 (-1: unbounded).
    max_queued_requests: int = Field(DEFAULTS["max_queued_requests"], ge=-1)
    retry_after_s: int = Field(DEFAULTS["retry_after_s"], ge=0)
    health_check_period_s: float = Field(DEFAULTS["health_check_period_s"], gt=0)
    health_check_timeout_s: float = Field(DEFAULTS["health_check_timeout_s"], gt=0)
    # A replica whose engine has work but has not stepped for this long reports itself unhealthy.
    engine_stall_timeout_s: float = Field(DEFAULTS["engine_stall_timeout_s"], gt=0)
    graceful_shutdown_timeout_s: float = Field(DEFAULTS["graceful_shutdown_timeout_s"], ge=0)
    # From arrival at the ingress to the last token; past it a request ends with a 408 (or, for a
    # stream already started, an error event) and the engine stops working on it. None: no limit.
    request_timeout_s: float | None = Field(None, gt=0)
    # /health/ready is 200 only if some engine replica sampled a token this recently; idle
    # replicas probe themselves every third of it.
    readiness_window_s: float = Field(DEFAULTS["readiness_window_s"], gt=0)

    # Ray Serve's per-request access log lines (off: logs stay quiet, and a line per call costs CPU).
    access_log: bool = False

    # The public HTTP address. With direct_http the ingress replicas serve it themselves (every
    # ingress replica on a node shares the port), so a streamed token crosses no Ray hop between
    # the ingress and the client; without, Ray Serve's proxy listens there. None: direct where
    # pagedserve starts Ray Serve (`pagedserve serve`, `serve run serve_app:app`; Serve then runs
    # no proxy), through the proxy elsewhere (a config file's `http_options`, or a program's own
    # `serve.start`, place the proxy).
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    direct_http: bool | None = None
    # The ingress replicas' own gRPC server on `host` (pagedserve.v1.Generate, health, reflection),
    # shared by every ingress replica on a node, as the HTTP port is. None: no gRPC.
    grpc_port: int | None = Field(None, ge=1, le=65535)

    # Ingress.
    num_ingress_replicas: int = Field(1, ge=1)
    ingress_num_cpus: float = Field(0, ge=0)
    ingress_max_ongoing_requests: int = Field(DEFAULTS["ingress_max_ongoing_requests"], ge=1)
    # Server-sent events per second one ingress replica sends at most, shared by its open streams
    # (serve_app/stream_pacer.py). None: measured, to keep its streaming at half a core; 0: no
    # pacing (an event per engine step and stream).
    max_stream_events_per_s: float | None = Field(None, ge=0)
    # The longest pacing holds back a stream's tokens.
    max_stream_delay_s: float = Field(DEFAULTS["max_stream_delay_s"], ge=0)
    # Stored Responses (`store: true`), shared by the ingress replicas and kept in memory
    # (serve_app/response_store.py): the least recently used go past either bound, any after
    # their time to live.
    response_store_max_entries: int = Field(RESPONSE_STORE_DEFAULTS["max_entries"], ge=0)
    response_store_max_bytes: int = Field(RESPONSE_STORE_DEFAULTS["max_bytes"], ge=0)
    response_store_ttl_s: float = Field(RESPONSE_STORE_DEFAULTS["ttl_s"], gt=0)

    # Each replica's engine steps in a process of its own (replicas/engine/core.py), where no
    # event loop competes with it for the GIL; false: in a thread of the replica's process.
    engine_process: bool = True
    # Seams: import paths ("module:attr") for a custom engine class (an LLMEngine's surface, run by
    # the engine core) and autoscaling policy function. None: LLMEngine (or the encoder's), and
    # pagedserve.serve_app.autoscaling's queue-depth policy. request_router_kwargs: the ingress's router's
    # settings (pagedserve.serve_app.routing.policy.RoutingSettings).
    engine_class: str | None = None
    request_router_kwargs: dict[str, Any] = Field(default_factory=dict)
    autoscaling_policy: str | None = None

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, value):
        if isinstance(value, str):
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @field_validator("lora_modules", mode="before")
    @classmethod
    def _split_modules(cls, value):
        if isinstance(value, str):  # one command-line value: several, space or comma separated
            return value.replace(",", " ").split()
        return value

    @property
    def lora_adapters(self) -> dict[str, str]:
        """lora_modules as name -> path."""
        adapters: dict[str, str] = {}
        for module in self.lora_modules:
            if module.lstrip().startswith("{"):
                spec = json.loads(module)
                name, path = spec.get("name"), spec.get("path")
            else:
                name, _, path = module.partition("=")
            if not name or not path:
                raise ValueError(f"lora_modules: {module!r} is not name=path or "
                                 '{"name": ..., "path": ...}')
            if name in adapters:
                raise ValueError(f"lora_modules: the name {name!r} is given twice")
            adapters[name] = path
        return adapters

    @field_validator("request_router_kwargs", mode="before")
    @classmethod
    def _parse_kwargs(cls, value):
        return json.loads(value) if isinstance(value, str) else value  # from the command line

    @model_validator(mode="after")
    def _check(self) -> "ServeSettings":
        if self.min_replicas is not None and self.max_replicas is not None \
                and self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be <= max_replicas "
                             f"({self.max_replicas})")
        adapters = self.lora_adapters
        if (adapters or self.allow_runtime_lora_updating) and not self.engine.enable_lora:
            raise ValueError("lora_modules and allow_runtime_lora_updating need enable_lora")
        for name in adapters:
            if name == (self.engine.served_model_name or self.engine.model):
                raise ValueError(f"lora_modules: {name!r} is the base model's name")
        return self

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None or self.min_replicas is not None

    @property
    def replica_cpus(self) -> float:
        if self.replica_num_cpus is not None:
            return self.replica_num_cpus
        return float(self.engine.num_threads or 1)

    @property
    def rank_cpus(self) -> float:
        """CPUs of each tensor-parallel rank's bundle: its torch threads (num_threads shared
        out, at least 1), or an equal share of replica_num_cpus where that is set."""
        tp = self.engine.tensor_parallel_size
        if self.replica_num_cpus is not None:
            return self.replica_num_cpus / tp
        return float(max(1, (self.engine.num_threads or 1) // tp))

    @property
    def placement_group_bundles(self) -> list[dict[str, float]] | None:
        """One bundle per rank under tensor parallelism (GPU replicas: a GPU each); else None."""
        tp = self.engine.tensor_parallel_size
        if tp == 1:
            return None
        bundle = {"CPU": self.rank_cpus}
        if self.replica_num_gpus or self.engine.device == "cuda":
            bundle["GPU"] = 1.0
        return [dict(bundle) for _ in range(tp)]

    @property
    def probe_interval_s(self) -> float:
        return self.readiness_window_s / 3

    def ingress_settings(self) -> IngressSettings:
        return IngressSettings(api_keys=self.api_keys, retry_after_s=self.retry_after_s,

                               max_stream_events_per_s=self.max_stream_events_per_s,
                               max_stream_delay_s=self.max_stream_delay_s,
                               readiness_window_s=self.readiness_window_s,
                               request_timeout_s=self.request_timeout_s,
                               http_host=self.host,
                               http_port=self.port if self.direct_http else None,
                               grpc_port=self.grpc_port,
                               max_ongoing_requests=self.ingress_max_ongoing_requests,
                               lora_modules=self.lora_adapters,
                               allow_runtime_lora_updating=self.allow_runtime_lora_updating,
                               limits=RequestLimits.model_validate(
                                   {k: getattr(self, k) for k in RequestLimits.model_fields}))

    def ingress_user_config(self) -> dict[str, Any]:
        """What the ingress's router, admission queue, scale from zero and drain steer by: its
        Ray Serve `user_config`, applied to running ingress replicas in place
        (`Ingress.reconfigure`)."""
        return {"routing": self.request_router_kwargs,
                "max_queued_requests": self.max_queued_requests,
                "scale_from_zero": self.autoscaling and self.min_replicas == 0,
                "drain_s": self.drain_s}

    @property
    def drain_s(self) -> float:
        """How long a stopping replica (engine or ingress: both hold streams) drains."""
        if self.autoscaling and "graceful_shutdown_timeout_s" not in self.model_fields_set:
            # A replica scaled down drains its in-flight requests: give long generations time.
            return max(self.graceful_shutdown_timeout_s,
                       AUTOSCALING_DEFAULTS["graceful_shutdown_timeout_s"])
        return self.graceful_shutdown_timeout_s

    @property
    def core_max_requests(self) -> int:
        """The most requests one engine core holds; the ingress sends more to the next replica,
        or holds them in its admission queue."""
        return self.replica_max_ongoing_requests or self.engine.max_num_seqs

    @classmethod
    def from_args(cls, args: dict[str, Any] | None = None, *, env: dict[str, str] | None = None
                  ) -> "ServeSettings":
        """Build from a flat dict (`serve run ... key=value`, a config file's `args`).

        Engine fields (`model`, `max_num_seqs`, ...) may be given flat or under `engine`.
        """
        args = dict(args or {})
        env = os.environ if env is None else env
        engine_args = dict(args.pop("engine", None) or {})
        engine_fields = set(EngineConfig.model_fields)
        serve_fields = set(cls.model_fields) - {"engine"}
        unknown = sorted(k for k in args if k not in engine_fields and k not in serve_fields)
        if unknown:
            raise ValueError(
                f"unknown setting(s) {', '.join(unknown)}. Serving settings: "
                f"{', '.join(sorted(serve_fields))}. "
                f"Engine settings: {', '.join(sorted(engine_fields))}.")
        for key in [k for k in args if k in engine_fields]:
            engine_args[key] = args.pop(key)
        engine_args.setdefault("num_threads", DEFAULTS["num_threads"])
        for key, value in list(engine_args.items()):
            if value in ("None", "none", "null", ""):  # command-line spelling of "default"
                engine_args[key] = None
        if "api_keys" not in args and env.get(API_KEYS_ENV):
            args["api_keys"] = env[API_KEYS_ENV]
        if "allow_runtime_lora_updating" not in args and env.get(RUNTIME_LORA_ENV):
            args["allow_runtime_lora_updating"] = env[RUNTIME_LORA_ENV].lower() in ("1", "true")
        try:
            engine = EngineConfig.model_validate(engine_args)
            return cls.model_validate({**args, "engine": engine})
        except ValidationError as exc:
            raise ValueError(f"invalid pagedserve setting(s):\n{_describe(exc)}") from None


def _describe(exc: ValidationError) -> str:
    lines = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"] if p != "engine") or "settings"
        given = error.get("input")
        given = "" if isinstance(given, dict) else f" (got {given!r})"
        lines.append(f"  {where}: {error['msg']}{given}")
    return "\n".join(lines)
