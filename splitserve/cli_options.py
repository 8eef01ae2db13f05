"""CLI flags generated from the configuration model: a flag names a spec field path; its help, type, choices and
default come from the field. Values given on the command line override the file (`-f/--config`) and are
validated by the model, so a bad flag gets the same one-line error as a bad file key, naming the flag.
"""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import click
from pydantic.fields import FieldInfo

from splitserve.common.config import ClusterResource
from splitserve.common.config_file import ConfigError, load, spec_field


@dataclass(frozen=True)
class Flag:
    """`--name` sets spec field `path` (several paths: the same value for each, e.g. both roles' engines)."""

    name: str
    paths: tuple[str, ...]
    help: str | None = None  # None: the field's own docstring

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")


def flag(name: str, *paths: str, help: str | None = None) -> Flag:
    return Flag(name, paths, help)


def _click_type(info: FieldInfo) -> tuple[Any, bool]:
    """(click type, is_flag) for a field's annotation."""
    ann = info.annotation
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        ann = next(a for a in typing.get_args(ann) if a is not type(None))
    while typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) is Literal:
        values = typing.get_args(ann)
        if all(isinstance(v, int) for v in values):
            return click.Choice([str(v) for v in values]), False
        return click.Choice(list(values)), False
    if ann is bool:
        return bool, True
    if ann in (int, float, str):
        return ann, False
    if typing.get_origin(ann) is list:
        return str, False  # comma-separated on the command line
    raise TypeError(f"no CLI type for {info.annotation!r}")


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None or info.default is None:
        return ""
    return f" [default: {info.default}]"


def _option(f: Flag) -> Callable:
    _, info = spec_field(f.paths[0])
    ctype, is_flag = _click_type(info)
    help_text = (f.help or info.description or "").rstrip(".") + _default_text(info)
    if is_flag:
        return click.option(f"--{f.name}/--no-{f.name}", f.dest, default=None, help=help_text)
    return click.option(f"--{f.name}", f.dest, type=ctype, default=None, help=help_text)


def _coerce(path: str, value: Any) -> Any:
    _, info = spec_field(path)
    ann = info.annotation
    if typing.get_origin(ann) is list and isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if typing.get_origin(ann) is Literal and all(isinstance(v, int) for v in typing.get_args(ann)):
        return int(value)  # a Choice of numbers arrives as text
    return value


def config_command(flags: list[Flag], file_option: str = "--config") -> Callable:
    """Decorate a click command: adds `-f/--config FILE` and `flags`; the command receives `resource`
    (the validated ClusterResource) instead of them. Errors are one line naming the file key or the flag."""

    def decorate(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> Any:
            path = kwargs.pop("config_file", None)
            overrides: dict[str, Any] = {}
            names: dict[str, str] = {}
            for f in flags:
                value = kwargs.pop(f.dest, None)
                if value is None:
                    continue
                for p in f.paths:
                    overrides[p] = _coerce(p, value)
                    names[p] = f"--{f.name}"
            try:
                resource = load(path, overrides, names)
            except ConfigError as e:
                raise click.UsageError(str(e)) from None
            return fn(resource=resource, **kwargs)

        for f in reversed(flags):
            wrapper = _option(f)(wrapper)
        return click.option("-f", file_option, "config_file", type=click.Path(dir_okay=False),
                            help="a SplitServeCluster YAML file (flags override its values)")(wrapper)

    return decorate


__all__ = ["ClusterResource", "Flag", "config_command", "flag"]
