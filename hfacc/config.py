"""Settings from dataclasses: a YAML file gives defaults, the command line overrides, unknown keys are errors."""

from __future__ import annotations

import dataclasses
import difflib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from transformers import HfArgumentParser


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
    args = list(sys.argv[1:] if args is None else args)
    config_path = default_config
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise ConfigError("--config needs a path to a YAML file.")
        config_path = args[i + 1]
        del args[i : i + 2]
    else:
        for i, a in enumerate(args):
            if a.startswith("--config="):
                config_path = a.split("=", 1)[1]
                del args[i]
                break
    parser = _ArgumentParser(list(dataclass_types), prog=prog)
    parser.add_argument("--config", help="YAML file of defaults for any of the settings below.")
    if config_path is not None:
        parser.set_defaults(**load_yaml_config(config_path, dataclass_types, ignore_types))
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
