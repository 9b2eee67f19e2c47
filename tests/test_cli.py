"""The `hfacc` command's front: what `import hfacc` loads, --help, --version, close names, TRL's setting names, and
the messages that name the real problem (a mistyped file, another method's data, a reward module off the path,
fp16 on a CPU). In-process through ``main(argv)`` / ``parse_args``, with one subprocess for a fresh interpreter."""

import json
import subprocess
import sys

import pytest
import torch

import hfacc
from hfacc.cli import main
from hfacc.data.formats import DataError
from hfacc.data.preference import load_preference_source
from hfacc.data.sources import get_local_data_files
from hfacc.generation.rewards import get_reward_funcs
from hfacc.jobs.dpo import DPO_ARGUMENTS
from hfacc.jobs.sft import SFT_ARGUMENTS
from hfacc.runtime.config import ConfigError, parse_args
from hfacc.runtime.trl_names import RENAMED, UNSUPPORTED
from hfacc.training.arguments import TokenWeightedArguments
from tests.helpers import ROOT


def test_import_hfacc_loads_no_module_until_a_name_is_used():
    code = "import sys, hfacc; print(sorted(m for m in sys.modules if m.startswith(('hfacc.', 'torch', 'datasets'))))"
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout == "[]\n", out.stderr[-2000:]  # not even torch
    # A name's module is imported when the name is first used; every public name is there.
    assert set(hfacc.__all__) == set(hfacc._MODULE_OF) and all(hasattr(hfacc, n) for n in hfacc.__all__)
    assert hfacc.DPOObjective.__module__ == "hfacc.objectives.preference"


def test_help_imports_no_trainer_and_no_datasets():
    """`hfacc dpo --help` needs the settings' dataclasses, not the Trainer or datasets (a second or more)."""
    code = (
        "import sys\nfrom hfacc.cli import main\ntry:\n    main(['dpo', '--help'])\nexcept SystemExit:\n    pass\n"
        "print([m for m in ('datasets', 'transformers.trainer', 'hfacc.training.trainer') if m in sys.modules])"
    )
    env = {"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "[]", out.stderr[-2000:]


def help_text(capsys, types, prog):
    with pytest.raises(SystemExit):
        parse_args(types, ["--help"], prog=prog)
    return capsys.readouterr().out.splitlines()


def test_help_puts_config_then_the_commands_own_settings_first(capsys):
    lines = help_text(capsys, DPO_ARGUMENTS, "hfacc dpo")
    assert lines[0].startswith("usage: hfacc dpo [--config FILE.yaml]")
    flags = [line.split()[0] for line in lines if line.startswith("  --")]
    assert flags[0] == "--config"
    assert flags.index("--beta") < flags.index("--model_name_or_path") < flags.index("--learning_rate")
    assert any(line.startswith("  --beta") for line in lines[:30])  # DPO's flags on the first screen
    groups = [line for line in lines if line and not line[0].isspace() and line.endswith(":")]
    assert groups[:2] == ["options:", "DPOArguments:"] and groups[-1] == "TrainingArguments (transformers):"


def test_version_and_an_unknown_command_in_one_line(capsys):
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"hfacc {hfacc.__version__}\n"
    assert main(["dpp"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no command 'dpp'. Did you mean 'dpo'?" in err
    assert main(["frobnicate"]) == 2 and "Commands: sft, dpo," in capsys.readouterr().err  # nothing close


def test_an_unknown_flag_and_yaml_key_name_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match=r"--lerning_rate 1e-5 \(did you mean --learning_rate\?\)"):
        parse_args(DPO_ARGUMENTS, ["--lerning_rate", "1e-5"])
    with pytest.raises(ConfigError, match=r"unknown argument\(s\): --zzz_qqq 1\. Run"):  # nothing close: no guess
        parse_args(DPO_ARGUMENTS, ["--zzz_qqq", "1"])
    config = tmp_path / "c.yaml"
    config.write_text("betta: 0.2\n")
    with pytest.raises(ConfigError, match="'betta' \\(did you mean 'beta'\\?\\)"):
        parse_args(DPO_ARGUMENTS, ["--config", str(config)])


def test_trl_names_are_hfaccs_settings_or_one_named_error(tmp_path):
    dpo, model, args = parse_args(
        DPO_ARGUMENTS, ["--use_peft", "--rpo_alpha", "0.5", "--truncation_mode=keep_end", "--output_dir", "o"]
    )
    assert (model.use_lora, dpo.nll_weight, dpo.truncation) == (True, 0.5, "left")
    assert parse_args(SFT_ARGUMENTS, ["--dataset_num_proc", "3", "--output_dir", "o"])[2].num_proc == 3
    config = tmp_path / "trl.yaml"  # a TRL script's YAML
    config.write_text("use_peft: true\ndataset_test_split: test\n")
    _, model, data, _ = parse_args(SFT_ARGUMENTS, ["--config", str(config), "--output_dir", "o"])
    assert model.use_lora and data.dataset_eval_split == "test"
    with pytest.raises(ConfigError, match="--load_in_4bit is a TRL setting that hfacc does not take: quantized"):
        parse_args(DPO_ARGUMENTS, ["--load_in_4bit", "true"])
    with pytest.raises(ConfigError, match="--dataset_num_proc is TRL's name for hfacc's num_proc, which this"):
        parse_args(DPO_ARGUMENTS, ["--dataset_num_proc", "4"])
    config.write_text("sync_ref_model: true\n")
    with pytest.raises(ConfigError, match="trl.yaml: sync_ref_model is a TRL setting .* stays frozen"):
        parse_args(DPO_ARGUMENTS, ["--config", str(config)])


def test_the_trl_name_map_points_at_settings_hfacc_has():
    from hfacc.jobs import distill, grpo, kto, reward, sft

    types = [*SFT_ARGUMENTS, *DPO_ARGUMENTS, *reward.REWARD_ARGUMENTS, *kto.KTO_ARGUMENTS, *grpo.GRPO_ARGUMENTS]
    names = {f.name for t in [*types, *distill.DISTILL_ARGUMENTS, *sft.SFT_ARGUMENTS] for f in fields(t)}
    assert set(RENAMED.values()) <= names
    assert not set(RENAMED) & set(UNSUPPORTED)
    # A name hfacc's own setting has (on some command) is not called unsupported there: it is its own.
    assert {"max_prompt_length", "max_completion_length", "pad_to_multiple_of"} <= names & set(UNSUPPORTED)


def fields(cls):
    import dataclasses

    return dataclasses.fields(cls)


@pytest.mark.skipif(torch.accelerator.is_available(), reason="fp16 autocasts on an accelerator")
def test_fp16_on_a_cpu_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match="fp16=True on a CPU: .* would train in fp32. Use bf16=True"):
        TokenWeightedArguments(output_dir=str(tmp_path), fp16=True, report_to=[])
    with pytest.raises(ConfigError, match="fp16=True on a CPU"):  # the command line: one message, exit 2
        parse_args(SFT_ARGUMENTS, ["--fp16", "true", "--output_dir", str(tmp_path)])


def test_a_mistyped_local_file_is_no_hub_lookup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "prefs.jsonl").write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n")
    for name in ("prefs.jsnol", "pref.jsonl", "data/prefs.jsonl"):
        with pytest.raises(DataError, match=f"dataset {name}: no such file"):
            get_local_data_files(name)
    with pytest.raises(DataError, match="no such file. Did you mean prefs.jsonl?"):
        load_preference_source("prefs.jsnol")
    assert get_local_data_files("trl-lib/ultrafeedback_binarized") == []  # a Hub id stays one


def test_another_methods_rows_are_named_before_any_row(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}] * 4
    path = tmp_path / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match="That looks like SFT data: train on it with `hfacc sft`"):
        load_preference_source(str(path))


def test_a_reward_module_off_the_path_gets_the_pythonpath_fix(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards_h6.py").write_text("def length(prompts, completions, **kw):\n    return [0.0]\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(DataError, match=r"my_rewards_h6.py is in this folder, .* PYTHONPATH=\. hfacc grpo"):
        get_reward_funcs(["my_rewards_h6:length"])
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(DataError, match="has no 'lenght'. Did you mean my_rewards_h6:length?"):
        get_reward_funcs(["my_rewards_h6:lenght"])
    assert get_reward_funcs(["my_rewards_h6:length"])[0].__name__ == "length"
