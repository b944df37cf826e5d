"""`pagedserve`'s argument parser, built from the settings catalog: an option per flag, its dest
the setting it fills, so the parsed flags are the flat settings dict `serve run` would pass."""
from __future__ import annotations

import argparse
import json
import sys
import typing
from typing import Any

from pagedserve import flags
from pagedserve.catalog import Option, Setting, show
from pagedserve.serve_app import APP_NAME


def usage_error(message: str) -> typing.NoReturn:
    """One line on stderr and exit status 2, as argparse does for a bad command line."""
    sys.stderr.write(" ".join(message.split()) + "\n")
    raise SystemExit(2)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage dump) that point at --help."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def value_kind(annotation: Any) -> Any:
    """bool, list, dict, a tuple of Literal choices, or str (pydantic converts the rest)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if annotation is bool or (args and all(a is bool for a in args) and origin is not list):
        return bool
    if origin is typing.Literal:
        return tuple(typing.get_args(annotation))
    if origin in (list, dict):
        return origin
    if len(args) == 1:  # X | None
        return value_kind(args[0])
    return str


def converter(convert):
    def parse(text: str):
        try:
            return convert(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def add_settings(parser: argparse.ArgumentParser, settings: list[Setting]) -> None:
    """One option per `Option`, its dest the setting's name; unset options stay unset, so
    the settings' own defaults apply."""
    groups = {"engine": parser.add_argument_group("engine (vLLM's flags where vLLM has them)"),
              "serving": parser.add_argument_group("serving (Ray Serve)")}
    for setting in settings:
        kind = value_kind(setting.annotation)
        for option in setting.options:
            help_text = f"{setting.meaning} (default: {show(setting.default)})"
            if option.note:
                help_text += f"; {option.note}"
            kwargs: dict[str, Any] = dict(dest=setting.name, default=argparse.SUPPRESS,
                                          help=help_text.replace("%", "%%"))
            if kind is bool:
                kwargs["action"] = argparse.BooleanOptionalAction
            elif kind is list and option.many:
                kwargs.update(action="extend", nargs="+")
            elif kind is list:
                kwargs["action"] = "append"
            elif kind is dict:
                kwargs["type"] = converter(json.loads)
            if isinstance(kind, tuple):
                kwargs["metavar"] = "{" + ",".join(map(str, kind)) + "}"
            elif kind is not bool:
                kwargs["metavar"] = metavar(setting, option)
            if option.convert is not None:
                kwargs["type"] = converter(option.convert)
            names = [n for n in option.names if n not in parser._option_string_actions]
            if names:
                groups[setting.layer].add_argument(*names, **kwargs)


def metavar(setting: Setting, option: Option) -> str:
    if option.convert is flags.bytes_to_gib:
        return "SIZE"
    types = [a for a in typing.get_args(setting.annotation) or (setting.annotation,)
             if a is not type(None)]
    return {int: "N", float: "X"}.get(types[0] if len(types) == 1 else None,
                                      "JSON" if value_kind(setting.annotation) is dict else "VALUE")


def add_pinned(parser: argparse.ArgumentParser) -> None:
    for names, (value, why) in flags.PINNED_VLLM_FLAGS.items():
        parser.add_argument(*names, type=int, default=argparse.SUPPRESS, dest=pinned_dest(names),
                            metavar="N", help=f"vLLM's; only {value} ({why})")


def add_always_on(parser: argparse.ArgumentParser) -> None:
    for name, (value, why) in flags.ALWAYS_ON_VLLM_FLAGS.items():
        if value is None:
            parser.add_argument(name, action="store_true", default=argparse.SUPPRESS,
                                dest=pinned_dest((name,)), help=f"vLLM's; always on ({why})")
        else:
            parser.add_argument(name, default=argparse.SUPPRESS, dest=pinned_dest((name,)),
                                metavar="NAME", help=f"vLLM's; only {value} ({why})")


def pinned_dest(names: tuple[str, ...]) -> str:
    return "pinned_" + names[0].lstrip("-").replace("-", "_")


def settings_args(ns: argparse.Namespace, settings: list[Setting]) -> dict[str, Any]:
    """The flat settings dict of the flags given (the same shape `serve run` passes)."""
    given = vars(ns)
    for names, (value, why) in flags.PINNED_VLLM_FLAGS.items():
        if given.get(pinned_dest(names), value) != value:
            usage_error(f"pagedserve: {names[0]} {given[pinned_dest(names)]} is not supported: "
                        f"{why}")
    for name, (value, why) in flags.ALWAYS_ON_VLLM_FLAGS.items():
        if value is not None and given.get(pinned_dest((name,)), value) != value:
            usage_error(f"pagedserve: {name} {given[pinned_dest((name,))]} is not supported: "
                        f"only {value} ({why})")
    args = {s.name: given[s.name] for s in settings if s.name in given}
    model_tag = given.get("model_tag")
    if model_tag is not None:
        if args.get("model", model_tag) != model_tag:
            usage_error(f"pagedserve: the model is given twice ({model_tag!r} and "
                        f"--model {args['model']!r})")
        args["model"] = model_tag
    return args


def refuse_unknown(prog: str, unknown: list[str], settings: list[Setting]) -> None:
    """A one-line refusal of the first unknown argument: vLLM flags we lack say so, and why."""
    if not unknown:
        return
    first = next((a for a in unknown if a.startswith("-")), unknown[0])
    name = first.split("=", 1)[0]
    known = {s.name for s in settings}
    pending = {n for f in flags.VLLM_FLAGS if f.setting not in known for n in f.vllm}
    if name in flags.UNSUPPORTED_VLLM_FLAGS:
        message = f"vLLM's {name} is not supported: {flags.UNSUPPORTED_VLLM_FLAGS[name]}"
    elif name in pending:
        message = f"vLLM's {name} is not supported by this pagedserve version"
    elif name.startswith("-"):
        message = f"unknown flag {name} (a vLLM flag pagedserve does not support, or a typo)"
    else:
        message = f"unexpected argument {first!r}"
    usage_error(f"{prog}: {message}; `{prog} --help` lists every flag")


def build_parser(settings: list[Setting]) -> Parser:
    parser = Parser(prog="pagedserve", allow_abbrev=False,
                    description="pagedserve's command line, with vLLM's flags: serve a model on "
                                "Ray Serve, or try one offline")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    serve = commands.add_parser(
        "serve", help="serve a model over an OpenAI-compatible API on Ray Serve",
        description="Serve MODEL on Ray Serve in the foreground (Ctrl-C stops it). Flags use "
                    "vLLM's names; any setting of `serve run serve_app:app key=value` is also "
                    "--key-name.", allow_abbrev=False,
        usage="pagedserve serve [MODEL] [--flag VALUE ...]")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL",
                       help="local HF-format checkpoint directory (the same as --model)")
    serve.add_argument("--name", default=APP_NAME,
                       help=f"Ray Serve application name (default: {APP_NAME})")
    serve.add_argument("--address", default=None,
                       help="Ray cluster to join (auto, or host:port); default: a new local one")
    add_pinned(serve)
    add_always_on(serve)
    add_settings(serve, settings)
    engine_only = [s for s in settings if s.layer == "engine"]
    for name, what in (("generate", "complete prompts offline (no server)"),
                       ("chat", "chat with a model offline in the terminal (no server)")):
        sub = commands.add_parser(name, help=what, description=what, allow_abbrev=False,
                                  usage=f"pagedserve {name} [MODEL] [--flag VALUE ...]")
        sub.add_argument("model_tag", nargs="?", metavar="MODEL", help="checkpoint directory")
        if name == "generate":
            sub.add_argument("--prompt", action="append",
                             help="a prompt (repeatable); default: one per line of stdin")
        sub.add_argument("--max-tokens", type=int, default=128, help="(default: 128)")
        sub.add_argument("--temperature", type=float, default=0.0, help="(default: 0: greedy)")
        sub.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
        add_settings(sub, engine_only)
    bench = commands.add_parser("bench", help="run a benchmark from bench/ (a source checkout)",
                                description="pagedserve bench NAME [ARGS]: python -m bench.NAME "
                                            "ARGS, from the repository root", add_help=True)
    bench.add_argument("benchmark", help="offline_throughput (throughput), serving (serve), "
                                         "serving_overhead, routing, kernels, step_overhead, ...")
    bench.add_argument("bench_args", nargs=argparse.REMAINDER, help="its own arguments")
    return parser
