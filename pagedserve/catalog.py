"""Every setting of the engine and serving models, with its default, meaning and flags.

Read from the pydantic models at run time (`pagedserve.replicas.config.EngineConfig`,
`pagedserve.serve_app.config.ServeSettings`), so settings added there appear here, in `pagedserve serve
--help` and in the README's configuration reference without a change to this package.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.flags import MEANINGS, VLLM_FLAGS


@dataclass(frozen=True)
class Option:
    """One argparse option: its names, the setting it fills, how a value converts."""

    setting: str
    names: tuple[str, ...]
    convert: Callable[[str], Any] | None = None
    vllm_names: tuple[str, ...] = ()  # those of the names that are vLLM's
    note: str = ""
    many: bool = False


def own_flag(setting: str) -> str:
    return "--" + setting.replace("_", "-")


def options_for(setting: str) -> list[Option]:
    """The flags that fill one setting: vLLM's (in vLLM's units) and its own name."""
    options = [Option(flag.setting, flag.vllm, flag.convert, flag.vllm, flag.note, flag.many)
               for flag in VLLM_FLAGS if flag.setting == setting]
    own = own_flag(setting)
    taken = {name for option in options for name in option.names}
    keep_own = all(flag.own for flag in VLLM_FLAGS if flag.setting == setting)
    if keep_own and own not in taken:
        if options and options[0].convert is None:  # the same units: one option, more names
            first = options[0]
            options[0] = Option(setting, (own,) + first.names, None, first.vllm_names, first.note,
                                first.many)
        else:
            options.append(Option(setting, (own,)))
    return options


@dataclass
class Setting:
    """One row of the configuration reference."""

    name: str
    layer: str  # "engine" (replicas/config.py) or "serving" (serve_app/config.py)
    default: Any
    annotation: Any
    meaning: str
    options: list[Option] = field(default_factory=list)

    @property
    def vllm_names(self) -> list[str]:
        return [name for option in self.options for name in option.vllm_names
                if name.startswith("--")]

    @property
    def flag_names(self) -> list[str]:
        return [name for option in self.options for name in option.names]


def show(value: Any) -> str:
    """A value as it is typed on the command line."""
    if value is None or value == [] or value == {}:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, dict):
        return json.dumps(value)
    if isinstance(value, list):
        return ",".join(map(str, value))
    return str(value)


def catalog() -> list[Setting]:
    """Every setting of both models, with its effective default (as `serve run` builds it)."""
    from pydantic import BaseModel

    from pagedserve.replicas.config import EngineConfig
    from pagedserve.serve_app.config import ServeSettings

    defaults = ServeSettings.from_args({}, env={})
    rows = []
    layers: list[tuple[str, type[BaseModel], BaseModel]] = [
        ("engine", EngineConfig, defaults.engine), ("serving", ServeSettings, defaults)]
    for layer, model, values in layers:
        for name, info in model.model_fields.items():
            if name == "engine":
                continue
            meaning = info.description or MEANINGS.get(name) or field_comment(model, name)
            rows.append(Setting(name, layer, getattr(values, name), info.annotation, meaning,
                                options_for(name)))
    return rows


def field_comment(model: type, name: str) -> str:
    """The first sentence of the comment beside or above a field in its class's source."""
    import inspect

    owner = next((cls for cls in model.__mro__ if name in cls.__dict__.get("__annotations__", {})),
                 model)
    try:
        lines, _ = inspect.getsourcelines(owner)
    except (OSError, TypeError):
        return ""
    for index, line in enumerate(lines):
        if re.match(rf"\s+{name}\s*:", line):
            if "  # " in line:
                text = line.split("  # ", 1)[1]
            else:
                above = []
                for previous in reversed(lines[:index]):
                    if not previous.strip().startswith("#"):
                        break
                    above.insert(0, previous.strip().lstrip("#").strip())
                text = " ".join(above)
            sentence = re.split(r"(?<=\.)\s|\.$", text.strip())[0].rstrip(".")
            return sentence[:1].upper() + sentence[1:]
    return ""
