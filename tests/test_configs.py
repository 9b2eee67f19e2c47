"""Every shipped YAML is loaded: recipe configs against the recipe's dataclasses, accelerate configs by accelerate."""

from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import ClusterConfig
from accelerate.commands.launch import launch_command_parser

from hfacc.runtime.config import ConfigError, parse_args
from tests.helpers import load_recipe, recipe_types

ROOT = Path(__file__).resolve().parents[1]
RECIPE_CONFIGS = sorted((ROOT / "recipes" / "configs").glob("*.yaml"))
ACCELERATE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("*.yaml"))


def test_there_are_configs():
    assert len(RECIPE_CONFIGS) >= 3 and len(ACCELERATE_CONFIGS) >= 6


def recipe_of(path: Path) -> str:
    """The recipe a config is for: the one its header's launch command runs (recipes/sft.py, recipes/grpo.py)."""
    import re

    return re.search(r"accelerate launch recipes/(\w+)\.py", path.read_text()).group(1)


@pytest.mark.parametrize("path", RECIPE_CONFIGS, ids=lambda p: p.name)
def test_recipe_config_parses_into_the_recipe_dataclasses(path):
    module = load_recipe(recipe_of(path))
    parsed = parse_args(recipe_types(module), ["--config", str(path)])
    raw = yaml.safe_load(path.read_text())
    for key, value in raw.items():
        got = next(getattr(obj, key) for obj in parsed if hasattr(obj, key))
        got = got.value if hasattr(got, "value") else got  # enums such as lr_scheduler_type
        assert got == value or str(got) == str(value) or (value == "none" and not got), key
    first = path.read_text().splitlines()[0]
    assert first.startswith("# "), "each config starts with a comment saying what hardware it is for"
    assert "accelerate launch" in path.read_text(), "and the command that runs it"


def test_command_line_overrides_the_yaml():
    module = load_recipe()
    config = ROOT / "recipes" / "configs" / "tiny_default.yaml"
    *_, train = parse_args(recipe_types(module), ["--config", str(config), "--learning_rate", "0.5"])
    assert train.learning_rate == 0.5
    assert train.gradient_accumulation_steps == yaml.safe_load(config.read_text())["gradient_accumulation_steps"]


def test_unknown_keys_are_errors(tmp_path):
    module = load_recipe()
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rat: 0.1\n")
    with pytest.raises(ConfigError, match="'learning_rat' \\(did you mean 'learning_rate'\\?\\)"):
        parse_args(recipe_types(module), ["--config", str(bad)])
    with pytest.raises(ConfigError, match="--no_such_flag"):
        parse_args(recipe_types(module), ["--no_such_flag", "1"])


def test_default_config_applies_only_without_a_model():
    module = load_recipe()
    assert module.default_config(["sft.py"]) == module.DEFAULT_CONFIG
    assert module.default_config(["sft.py", "--model_name_or_path", "gpt2"]) is None


@pytest.mark.parametrize("path", ACCELERATE_CONFIGS, ids=lambda p: p.name)
def test_accelerate_config_loads_and_its_keys_exist(path):
    config = ClusterConfig.from_yaml_file(str(path))  # raises on unknown top-level keys
    launch_args = launch_command_parser().parse_args(["script.py"])
    for section, prefix in (("fsdp_config", "fsdp_"), ("deepspeed_config", ""), ("parallelism_config", "")):
        for key in getattr(config, section) or {}:
            name = key if key.startswith(prefix) else prefix + key
            assert hasattr(launch_args, name), f"{path.name}: {section}.{key} is not an accelerate launch setting"
    text = path.read_text()
    assert text.startswith("# ") and "accelerate launch --config_file accelerate_configs/" in text


def test_recipe_and_hfacc_sft_share_one_definition_of_the_settings():
    """`hfacc sft`, recipes/sft.py and `hfacc verify --config` read the same dataclasses: nothing is copied."""
    import hfacc.jobs.sft

    recipe = load_recipe()
    assert recipe.SFTArguments is hfacc.jobs.sft.SFTArguments and recipe.main is hfacc.jobs.sft.main
    assert list(hfacc.jobs.sft.SFT_ARGUMENTS) == recipe_types(recipe)
