"""The only place deployments are bound: settings -> Ingress + EngineReplica + CoreDirectory.

`serve run serve_app:app key=value ...` calls `app(args)`; programs call `build_app(settings)`.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from ray import serve
from ray.serve import Application

from pagedserve.replicas.model_files.default_model import check_model_dir
from pagedserve.replicas.deployment.engine_replica import EngineReplica, check_model_splits
from pagedserve.replicas.model_files.embedding_model import resolve_model_name
from pagedserve.serve_app import autoscaling as queue_depth_autoscaling
from pagedserve.serve_app.config import ServeSettings
from pagedserve.serve_app.core_directory import CoreDirectory
from pagedserve.serve_app.response_store import ResponseStore
from pagedserve.serve_app.ingress import REPLICA_DEPLOYMENT, Ingress
from pagedserve.serve_app.routing.policy import RoutingSettings

logger = logging.getLogger(__name__)

SERVE_NAMESPACE = "serve"  # the Ray namespace `serve run` starts Ray in, and Serve's own
APP_NAME = "pagedserve"
INGRESS_DEPLOYMENT = "Ingress"
DIRECTORY_DEPLOYMENT = "CoreDirectory"
RESPONSE_STORE_DEPLOYMENT = "ResponseStore"
# Ray Serve runs user code on an event loop of its own by default: every call then crosses threads
# twice. Our deployments never block their loop, so they take Ray's "throughput optimized"
# placement.
REPLICA_ENV = {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}
# The ingress allocates and frees small buffers for every request from many of Ray's threads;
# glibc's default of one malloc arena per thread (up to 8 per core) fragments them, and its RSS
# crept up under the soak's load (bench/soak.py), far less with two arenas.
INGRESS_ENV = {**REPLICA_ENV, "MALLOC_ARENA_MAX": "2"}


def replica_options(settings: ServeSettings) -> dict[str, Any]:
    """Ray Serve options of the EngineReplica deployment. Its calls are the control plane's
    (model facts, stats): no request waits behind Ray's per-replica limits."""
    options: dict[str, Any] = dict(
        name=REPLICA_DEPLOYMENT,
        max_ongoing_requests=64,
        health_check_period_s=settings.health_check_period_s,
        health_check_timeout_s=settings.health_check_timeout_s,
        graceful_shutdown_timeout_s=settings.drain_s,
        logging_config={"enable_access_log": settings.access_log},
        ray_actor_options={"num_cpus": settings.replica_cpus, "num_gpus": settings.replica_num_gpus,
                           "runtime_env": {"env_vars": REPLICA_ENV}},
    )
    bundles = settings.placement_group_bundles
    if bundles is not None:  # tensor parallelism: the replica is rank 0, in the first bundle
        options["placement_group_bundles"] = bundles
        options["placement_group_strategy"] = settings.placement_group_strategy
        options["ray_actor_options"].update(num_cpus=bundles[0]["CPU"],
                                            num_gpus=bundles[0].get("GPU", 0))
    if settings.autoscaling:
        min_replicas = settings.min_replicas if settings.min_replicas is not None else 1
        max_replicas = settings.max_replicas or max(min_replicas, settings.num_replicas)
        initial_replicas = max(min_replicas, min(settings.num_replicas,
                                                 settings.max_replicas or settings.num_replicas))
        delays = {key: getattr(settings, key) for key in ("upscale_delay_s", "downscale_delay_s")
                  if getattr(settings, key) is not None}
        if settings.autoscaling_policy:
            autoscaling: dict[str, Any] = dict(
                min_replicas=min_replicas, max_replicas=max_replicas,
                initial_replicas=initial_replicas,
                # Ray's default policy counts running + queued requests per replica.
                target_ongoing_requests=settings.engine.max_num_seqs + settings.target_queue_depth,
                policy={"policy_function": settings.autoscaling_policy}, **delays)
        else:
            autoscaling = queue_depth_autoscaling.autoscaling_config(
                min_replicas=min_replicas, max_replicas=max_replicas,
                initial_replicas=initial_replicas,
                target_queue_depth=settings.target_queue_depth, **delays)
        options["autoscaling_config"] = autoscaling
    else:
        options["num_replicas"] = settings.num_replicas
    return options


def ingress_options(settings: ServeSettings) -> dict[str, Any]:
    return dict(name=INGRESS_DEPLOYMENT, num_replicas=settings.num_ingress_replicas,
                max_ongoing_requests=settings.ingress_max_ongoing_requests,
                graceful_shutdown_timeout_s=settings.drain_s,
                user_config=settings.ingress_user_config(),
                logging_config={"enable_access_log": settings.access_log},
                ray_actor_options={"num_cpus": settings.ingress_num_cpus,
                                   "runtime_env": {"env_vars": INGRESS_ENV}})


def build_app(settings: ServeSettings | dict[str, Any] | None = None) -> Application:
    """The application: `serve.run(build_app({...}), name="pagedserve", route_prefix="/")`."""
    if not isinstance(settings, ServeSettings):
        settings = ServeSettings.from_args(settings)
    check_cluster_fits(settings)
    RoutingSettings(**settings.request_router_kwargs)  # a bad one fails the deploy, not a request
    # Its calls are long polls that a restart or a drain can cut at any time.
    directory = serve.deployment(CoreDirectory, name=DIRECTORY_DEPLOYMENT, num_replicas=1,
                                 max_ongoing_requests=100_000, graceful_shutdown_timeout_s=1.0,
                                 graceful_shutdown_wait_loop_s=0.5,
                                 logging_config={"enable_access_log": False},
                                 ray_actor_options={"num_cpus": 0}).bind()
    replica = serve.deployment(EngineReplica, **replica_options(settings)).bind(
        settings.engine.model_dump(), directory, max_requests=settings.core_max_requests,
        drain_s=settings.drain_s, stall_timeout_s=settings.engine_stall_timeout_s,
        probe_interval_s=settings.probe_interval_s, engine_process=settings.engine_process,
        engine_class=settings.engine_class)
    store = serve.deployment(ResponseStore, name=RESPONSE_STORE_DEPLOYMENT, num_replicas=1,
                             max_ongoing_requests=100_000,
                             logging_config={"enable_access_log": False},
                             ray_actor_options={"num_cpus": 0}).bind(
        settings.response_store_max_entries, settings.response_store_max_bytes,
        settings.response_store_ttl_s)
    return serve.deployment(Ingress, **ingress_options(settings)).bind(
        replica, directory, settings.ingress_settings().model_dump(), store)


def app(args: dict[str, str]) -> Application:
    """Application builder for `serve run serve_app:app key=value ...` and config files."""
    settings = start_serve_for_serve_run(checked_settings(args))
    return build_app(settings)


def checked_settings(args: dict[str, Any]) -> ServeSettings:
    """Settings from a command line (`serve run`'s or `pagedserve serve`'s), model included."""
    settings = ServeSettings.from_args(args)
    if settings.engine.model is not None:  # fail here, not in every replica's constructor
        model_dir = check_model_dir(resolve_model_name(settings.engine.model))  # a short name: unpacked
        if settings.engine.tensor_parallel_size > 1:
            check_model_splits(model_dir, settings.engine.tensor_parallel_size)
    return settings


def check_cluster_fits(settings: ServeSettings) -> None:
    """ValueError naming both numbers when one replica's ranks need more than the Ray cluster
    has (its placement group would wait forever)."""
    import ray
    bundles = settings.placement_group_bundles
    if bundles is None or not ray.is_initialized():
        return
    have = ray.cluster_resources()
    for resource in ("CPU", "GPU"):
        need = sum(b.get(resource, 0) for b in bundles)
        if need > have.get(resource, 0):
            raise ValueError(f"tensor_parallel_size ({len(bundles)}) needs {need:g} {resource}s per "
                             f"replica ({bundles[0][resource]:g} per rank) but the Ray cluster has "
                             f"{have.get(resource, 0):g}")


def start_serve(settings: ServeSettings) -> ServeSettings:
    """Start Ray Serve for these settings (Ray must be up); the settings with direct_http decided.

    Direct HTTP (the default here): the ingress replicas serve host:port and Serve runs no proxy.
    Otherwise Serve's proxy listens on host:port.
    """
    direct = settings.direct_http is not False
    if direct:
        serve.start(proxy_location="Disabled")
    else:
        serve.start(http_options={"host": settings.host, "port": settings.port})
    return settings.model_copy(update={"direct_http": direct})


def serve_run_runtime_env(params: dict[str, Any]) -> dict[str, Any]:
    """The runtime env `serve run` builds from its options: `--runtime-env` (a YAML file) or
    `--runtime-env-json`, then `--working-dir` over either."""
    runtime_env: dict[str, Any] = {}
    if params.get("runtime_env") and params.get("runtime_env_json"):
        raise ValueError("only one of --runtime-env and --runtime-env-json can be given")
    if params.get("runtime_env"):
        import yaml
        with open(params["runtime_env"]) as f:
            runtime_env = yaml.safe_load(f) or {}
    elif params.get("runtime_env_json"):
        runtime_env = json.loads(params["runtime_env_json"])
    if params.get("working_dir"):
        runtime_env["working_dir"] = params["working_dir"]
    return runtime_env


def start_serve_for_serve_run(settings: ServeSettings) -> ServeSettings:
    """Under `serve run serve_app:app ...`: start Ray and Serve here, as `serve run` would.

    `serve run <import path>` calls this builder before it starts Ray, then starts Serve with
    Ray's default HTTP options, which a running Serve keeps. So the builder starts Ray as `serve
    run` would (its address, namespace and runtime env, read from its own command line) and Serve
    for the settings (`start_serve`); `serve run` then finds both running and deploys onto them.
    Anywhere else (a config file, a program) Serve is someone else's to start: settings as given.
    """
    import click
    import ray

    context = click.get_current_context(silent=True)
    callback = getattr(context.command, "callback", None) if context else None
    if getattr(callback, "__module__", "") != "ray.serve.scripts":
        return settings
    if ray.is_initialized():
        if {"host", "port", "direct_http"} & settings.model_fields_set:
            logger.warning("host/port/direct_http take effect where pagedserve starts Ray Serve "
                           "(`pagedserve serve`, `serve run serve_app:app`); here Serve's own "
                           "http_options apply")
        return settings
    params = context.params
    ray.init(address=params.get("address"), namespace=SERVE_NAMESPACE,
             runtime_env=serve_run_runtime_env(params))
    settings = start_serve(settings)
    if settings.direct_http:
        print(f"pagedserve: the OpenAI API will be at http://{settings.host}:{settings.port}/v1",
              flush=True)
    return settings
