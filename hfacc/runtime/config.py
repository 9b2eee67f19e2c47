"""Settings from dataclasses: a YAML file gives defaults, the command line overrides, unknown keys are errors."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool


class ConfigError(ValueError):
    """A config file or command line that does not fit the recipe's dataclasses."""


class _ArgumentParser(HfArgumentParser):
    """argparse prints the usage of every setting (hundreds of lines) and exits; here a bad flag is a ConfigError."""

    def error(self, message: str):
        raise ConfigError(f"{message}. Run with --help for the settings.")


def load_yaml_config(
    path: str | Path, dataclass_types: Sequence[type], ignore_types: Sequence[type] = ()
) -> dict[str, Any]:
    """Read a YAML mapping of settings and check every key against the fields of ``dataclass_types``.

    Keys that are fields of ``ignore_types`` only are dropped (a tool that reads a recipe's config uses part of it).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file.")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of setting: value, got {type(data).__name__}.")
    known = {f.name for cls in dataclass_types for f in dataclasses.fields(cls) if f.init}
    ignored = {f.name for cls in ignore_types for f in dataclasses.fields(cls)} - known
    data = {k: v for k, v in data.items() if k not in ignored}
    unknown = sorted(set(data) - known)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(known), n=1)
            hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ConfigError(f"{path}: unknown setting(s) {', '.join(hints)}. Remove or correct them.")
    return data


_NEGATIVE_NUMBER = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")


def _join_negative_values(args: list[str]) -> list[str]:
    """``--flag -1e-2`` as ``--flag=-1e-2``: argparse takes ``-1e-2`` (unlike ``-2``) for an option and answers
    "expected one argument"."""
    out = []
    for a in args:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_NUMBER.match(a):
            out[-1] = f"{out[-1]}={a}"
        else:
            out.append(a)
    return out


def _check_yaml_value(parser: argparse.ArgumentParser, path: str | Path, key: str, value: Any) -> Any:
    """A YAML value as the command line would take it: converted by the setting's type (``1e-4`` is a string to
    YAML), and a ConfigError naming the file and key when it is of another kind (a list for a number, ``2.5`` for a
    whole number, a value not among the choices). Settings of other types are passed on as they are."""
    action = parser._option_string_actions.get(f"--{key}")
    if action is None or value is None:
        return value
    if action.nargs in ("+", "*"):
        items = value if isinstance(value, list) else [value]
        return [_convert(action, path, key, item) for item in items]
    return _convert(action, path, key, value)


def _convert(action: argparse.Action, path: str | Path, key: str, value: Any) -> Any:
    kind = action.type
    expected = {int: "a whole number", float: "a number"}.get(kind)
    if kind is string_to_bool:
        expected = "true or false"
    if expected is not None:
        wrong_bool = kind is string_to_bool and not isinstance(value, (bool, str))
        if wrong_bool or isinstance(value, (list, dict)) or (isinstance(value, bool) and kind is not string_to_bool):
            raise ConfigError(f"{path}: {key}: expected {expected}, got {value!r:.60}.")
        if kind is int and isinstance(value, float):
            if not value.is_integer():
                raise ConfigError(f"{path}: {key}: expected {expected}, got {value}.")
            value = int(value)
        if isinstance(value, str) or (kind is float and isinstance(value, int)):
            try:
                value = kind(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError):
                raise ConfigError(f"{path}: {key}: expected {expected}, got {value!r:.60}.") from None
    if action.choices is not None and value not in action.choices:
        choices = [getattr(c, "value", c) for c in action.choices]
        raise ConfigError(f"{path}: {key}: {value!r} is not one of {choices}.")
    return value


def get_default_config(argv: Sequence[str], default: str | Path) -> str | Path | None:
    """A recipe's tiny default YAML (``default``), which applies only when the command line names no model (a
    ``--config`` given there is read by :func:`parse_args` itself, over the default)."""
    return None if any(a.startswith("--model_name_or_path") for a in argv) else default


def parse_args(
    dataclass_types: Sequence[type],
    args: Sequence[str] | None = None,
    default_config: str | Path | None = None,
    ignore_types: Sequence[type] = (),
    prog: str | None = None,
) -> tuple:
    """Parse ``args`` (default: ``sys.argv[1:]``) into one instance of each of ``dataclass_types``.

    ``--config FILE.yaml`` sets defaults (``default_config`` when none is given); flags on the command line win.
    Unknown YAML keys and unknown flags are errors that name them; YAML keys of ``ignore_types`` are skipped.
    Every problem with the settings (a bad value, a failed check in a dataclass) raises :class:`ConfigError`.
    """
    args = _join_negative_values(list(sys.argv[1:] if args is None else args))
    config_path = default_config
    given = [i for i, a in enumerate(args) if a == "--config" or a.startswith("--config=")]
    if len(given) > 1:
        paths = [args[i].split("=", 1)[1] if "=" in args[i] else (args[i + 1 : i + 2] or ["?"])[0] for i in given]
        raise ConfigError(
            f"--config is given {len(given)} times ({', '.join(paths)}); give one YAML file, and override its "
            "settings with flags."
        )
    if given:
        i = given[0]
        if "=" in args[i]:
            config_path = args.pop(i).split("=", 1)[1]
        elif i + 1 >= len(args):
            raise ConfigError("--config needs a path to a YAML file.")
        else:
            config_path = args[i + 1]
            del args[i : i + 2]
    parser = _ArgumentParser(list(dataclass_types), prog=prog)
    parser.add_argument("--config", help="YAML file of defaults for any of the settings below.")
    if config_path is not None:
        values = load_yaml_config(config_path, dataclass_types, ignore_types)
        parser.set_defaults(**{k: _check_yaml_value(parser, config_path, k, v) for k, v in values.items()})
    namespace, remaining = parser.parse_known_args(args)
    if remaining:
        raise ConfigError(f"unknown argument(s): {' '.join(remaining)}. Run with --help for the settings.")
    outputs = []
    values = vars(namespace)
    for cls in dataclass_types:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        try:
            outputs.append(cls(**{k: v for k, v in values.items() if k in names}))
        except ValueError as err:  # a dataclass's own check (__post_init__): the user's settings, not a bug
            raise ConfigError(str(err)) from err
    return tuple(outputs)
