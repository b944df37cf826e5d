"""`pagedserve serve|generate|chat|bench`: vLLM's command line in front of the Ray Serve app.

`pagedserve serve MODEL --max-num-seqs 64 --port 8000` builds the same application as
`serve run serve_app:app model=MODEL max_num_seqs=64 port=8000`: the flags become the same flat
dict of settings (`pagedserve.flags`) that `ServeSettings.from_args` validates, so there is one
configuration path. It runs Ray Serve in the foreground until Ctrl-C or SIGTERM.
"""
from __future__ import annotations

import signal
import sys
from typing import Any

from pagedserve.catalog import catalog
from pagedserve.parser import build_parser, refuse_unknown, settings_args, usage_error

BENCH_ALIASES = {"throughput": "offline_throughput", "serve": "serving"}  # vLLM's bench names


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    settings = catalog()
    parser = build_parser(settings)
    ns, unknown = parser.parse_known_args(argv)
    if ns.command == "bench":
        return run_bench(ns.benchmark, ns.bench_args)
    refuse_unknown(f"pagedserve {ns.command}", unknown, settings)
    args = settings_args(ns, settings)
    if ns.command == "serve":
        return run_serve(args, ns.name, ns.address)
    from pagedserve.offline import run_offline
    return run_offline(ns, args)


def run_bench(name: str, bench_args: list[str]) -> int:
    import os
    import runpy

    module = "bench." + BENCH_ALIASES.get(name, name).replace("-", "_")
    sys.path.insert(0, os.getcwd())  # bench/ is part of the checkout, not of the package
    try:
        import importlib.util
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise SystemExit(f"pagedserve bench: no module {module}: run it from the repository root "
                         "of a source checkout (benchmarks live in bench/)")
    sys.argv = [module, *bench_args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


class Stop(Exception):
    pass


def run_serve(args: dict[str, Any], name: str, address: str | None) -> int:
    """Validate, start Ray and Serve on the settings' host/port, deploy, wait for a signal."""
    import ray
    from ray import serve

    from pagedserve.serve_app.app import build_app, checked_settings, start_serve

    try:  # every bad setting fails here, before Ray starts (ValidationError is a ValueError)
        settings = checked_settings(args)
        build_app(settings)
    except ValueError as exc:
        usage_error(f"pagedserve serve: {exc}")

    def stop(signum, frame):
        raise Stop()

    ray.init(address=address, namespace="serve")
    try:
        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        settings = start_serve(settings)
        serve.run(build_app(settings), name=name, route_prefix="/", blocking=False)
        model = settings.engine.served_model_name or settings.engine.model or "the default model"
        print(f"pagedserve: serving {model} at http://{settings.host}:{settings.port}/v1 "
              f"(application {name!r}; Ctrl-C stops it)", flush=True)
        signal.pause()
    except (Stop, KeyboardInterrupt):
        print("pagedserve: shutting down", flush=True)
    except RuntimeError as exc:  # a deployment that failed to start; Ray has logged why
        print(f"pagedserve serve: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
    return 0
