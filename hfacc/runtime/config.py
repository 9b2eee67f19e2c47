"""Settings from dataclasses: a YAML file gives defaults, the command line overrides, unknown keys are errors."""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import logging
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, get_type_hints

import yaml
from transformers import HfArgumentParser
from transformers.hf_argparser import string_to_bool

from .trl_names import RENAMED, UNSUPPORTED, translate_value

logger = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config file or command line that does not fit the recipe's dataclasses."""


# Settings every command shares, after a command's own in --help (lowest rank first); a class not here is the
# command's own (rank 0), a class outside hfacc (transformers' TrainingArguments) comes last.
SHARED_SETTINGS = ("ModelArguments", "DataArguments", "TokenWeightedArguments", "VLLMArguments")


def _help_rank(cls: type) -> int:
    if not cls.__module__.startswith("hfacc."):
        return len(SHARED_SETTINGS) + 1
    return SHARED_SETTINGS.index(cls.__name__) + 1 if cls.__name__ in SHARED_SETTINGS else 0


def _group_of(cls: type) -> tuple[str, str | None]:
    """A settings class's ``--help`` group: its name, and its docstring's first paragraph (hfacc's classes)."""
    if not cls.__module__.startswith("hfacc."):
        return f"{cls.__name__} ({cls.__module__.split('.')[0]})", None
    doc = re.sub(r":\w+:`", "`", (cls.__doc__ or "").strip().split("\n\n")[0].replace("``", "`"))
    return cls.__name__, " ".join(doc.split()) or None


class _ArgumentParser(HfArgumentParser):
    """The settings of ``dataclass_types`` in ``--help`` groups: ``--config`` first, then each class that declares
    fields, the command's own before the shared ones (model, data, training, vLLM) and transformers' last. argparse
    prints the usage of every setting (hundreds of lines) and exits on a bad flag; here that is a ConfigError."""

    def __init__(self, dataclass_types: Sequence[type], prog: str | None = None):
        usage = f"{prog or '%(prog)s'} [--config FILE.yaml] [--setting VALUE ...]"
        super().__init__([], prog=prog, usage=usage)
        self.add_argument(
            "--config", metavar="FILE.yaml", help="YAML file of defaults for any of the settings below (flags win)."
        )
        self.dataclass_types = list(dataclass_types)
        # The class that declares each field (a field is shown once, where it is declared last in the MRO).
        owners: dict[type, list[tuple[type, dataclasses.Field]]] = {}
        place: dict[type, tuple[int, int, int]] = {}  # shared last; else as given, each subclass before its bases
        for i, dtype in enumerate(self.dataclass_types):
            for f in dataclasses.fields(dtype):
                if f.init:
                    owner = next(c for c in dtype.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
                    owners.setdefault(owner, []).append((dtype, f))
                    place.setdefault(owner, (_help_rank(owner), i, dtype.__mro__.index(owner)))
        hints = {dtype: get_type_hints(dtype) for dtype in self.dataclass_types}
        for owner in sorted(owners, key=place.__getitem__):
            group = self.add_argument_group(*_group_of(owner))
            for dtype, f in owners[owner]:
                f.type = hints[dtype][f.name]
                self._parse_dataclass_field(group, f)

    def error(self, message: str):
        raise ConfigError(f"{message}. Run with --help for the settings.")


def get_close_name(name: str, names: Sequence[str]) -> str | None:
    """The one name of ``names`` close to ``name`` (a typo: difflib ratio >= 0.8), else None."""
    close = difflib.get_close_matches(name, list(names), n=1, cutoff=0.8)
    return close[0] if close else None


def resolve_trl_name(name: str, known: Sequence[str] | set[str], shown: str) -> str | None:
    """hfacc's setting for ``name`` when ``name`` is not one (``known``) but TRL's (``use_peft`` -> ``use_lora``);
    None when TRL has no such name either. A TRL setting hfacc does not take is a ConfigError that says why;
    ``shown`` is how the message names it (``--use_peft``, ``my.yaml: use_peft``)."""
    target = RENAMED.get(name)
    if target is not None:
        if target in known:
            return target
        raise ConfigError(f"{shown} is TRL's name for hfacc's {target}, which this command does not take.")
    if name in UNSUPPORTED:
        raise ConfigError(f"{shown} is a TRL setting that hfacc does not take: {UNSUPPORTED[name]}")
    return None


def _apply_trl_names(args: list[str], known: set[str]) -> list[str]:
    """``args`` with TRL's flags under hfacc's names (and values: ``--truncation_mode keep_end`` ->
    ``--truncation left``), said once at INFO; a TRL flag hfacc does not take is a ConfigError."""
    out = list(args)
    for i, arg in enumerate(out):
        if not arg.startswith("--") or len(arg) < 3:
            continue
        name, eq, value = arg[2:].partition("=")
        if name in known or name.replace("-", "_") in known:
            continue
        target = resolve_trl_name(name, known, f"--{name}")
        if target is None:
            continue
        logger.info("hfacc: --%s is TRL's name for --%s.", name, target)
        if eq:
            out[i] = f"--{target}={translate_value(name, value)}"
        else:
            out[i] = f"--{target}"
            if i + 1 < len(out) and not out[i + 1].startswith("--"):
                out[i + 1] = translate_value(name, out[i + 1])
    return out


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
    for key in [k for k in data if k not in known]:  # TRL's names of hfacc's settings (a YAML of a TRL script)
        target = resolve_trl_name(key, known, f"{path}: {key}")
        if target is not None:
            if target in data:
                raise ConfigError(f"{path}: {key} (TRL's name) and {target} are the same setting; keep one.")
            data[target] = translate_value(key, data.pop(key))
    unknown = sorted(set(data) - known)
    if unknown:
        hints = []
        for key in unknown:
            close = get_close_name(key, sorted(known))
            hints.append(f"'{key}'" + (f" (did you mean '{close}'?)" if close else ""))
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
    if config_path is not None:
        values = load_yaml_config(config_path, dataclass_types, ignore_types)
        parser.set_defaults(**{k: _check_yaml_value(parser, config_path, k, v) for k, v in values.items()})
    known = {f.name for cls in dataclass_types for f in dataclasses.fields(cls) if f.init}
    namespace, remaining = parser.parse_known_args(_apply_trl_names(args, known))
    if remaining:
        options = [o for o in parser._option_string_actions if o.startswith("--")]
        flags = [a.split("=", 1)[0] for a in remaining if a.startswith("--")]
        close = [c for c in (get_close_name(flag, options) for flag in flags) if c]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise ConfigError(f"unknown argument(s): {' '.join(remaining)}{hint}. Run with --help for the settings.")
    outputs = []
    values = vars(namespace)
    for cls in dataclass_types:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        try:
            outputs.append(cls(**{k: v for k, v in values.items() if k in names}))
        except ValueError as err:  # a dataclass's own check (__post_init__): the user's settings, not a bug
            raise ConfigError(str(err)) from err
    return tuple(outputs)
