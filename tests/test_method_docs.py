"""The method pages' usage sections cannot drift: each settings table (between ``<!-- settings: Config -->`` and
``<!-- /settings -->``) is the one rendered from its dataclass, and each metric list (between ``<!-- metrics: name
-->`` and ``<!-- /metrics -->``) names exactly the keys a tiny run of that method logs.

Regenerate the tables after changing a config: ``python tests/test_method_docs.py``.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from the repository root
    sys.path.insert(0, str(ROOT))

SETTINGS = re.compile(r"(<!-- settings: (\w+) -->\n)(.*?)(<!-- /settings -->)", re.S)
METRICS = re.compile(r"<!-- metrics: (\w+) -->\n(.*?)<!-- /metrics -->", re.S)
PAGES = ["sft.md", "dpo.md", "grpo.md", "distillation.md", "reward_models_and_kto.md"]
# What transformers' Trainer logs at every logging step whatever the method: not the method's own metrics.
STOCK_KEYS = {"grad_norm", "learning_rate", "epoch", "step"}


def own_fields(cls) -> list[dataclasses.Field]:
    """The config's fields that are not transformers' or hfacc's shared ones (nor its vLLM engine's), and that hfacc
    supports."""
    from hfacc import TokenWeightedArguments, VLLMArguments

    shared = {f.name for base in (TokenWeightedArguments, VLLMArguments) for f in dataclasses.fields(base)}
    keep = {"learning_rate"}  # each TRL config sets its own default
    return [
        f
        for f in dataclasses.fields(cls)
        if (f.name not in shared or f.name in keep)
        and f.init
        and not f.metadata.get("help", "").startswith("Not supported: ")
    ]


def render_settings(cls) -> str:
    rows = ["| setting | default | what it does |", "|---|---|---|"]
    for f in own_fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        text = f.metadata.get("help", "").replace("|", "\\|").replace("\n", " ")
        rows.append(f"| `{f.name}` | `{default!r}` | {text} |")
    return "\n".join(rows) + "\n"


def regenerate(path: Path) -> str:
    import hfacc

    return SETTINGS.sub(lambda m: m[1] + render_settings(getattr(hfacc, m[2])) + m[4], path.read_text())


@pytest.mark.parametrize("page", PAGES)
def test_settings_tables_are_the_dataclasses(page):
    path = ROOT / "docs" / page
    assert SETTINGS.search(path.read_text()), f"{page} has no settings table"
    assert path.read_text() == regenerate(path), f"{page}: run `python tests/test_method_docs.py` to regenerate"


def documented_metrics() -> dict[str, set[str]]:
    found = {}
    for page in PAGES:
        for name, body in METRICS.findall((ROOT / "docs" / page).read_text()):
            found[name] = set(re.findall(r"`([^`]+)`", body))
    return found


# ---- tiny runs: the keys each method logs -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import hfacc
    from hfacc.data.embedded import build_default_tokenizer

    tokenizer = build_default_tokenizer(["what is 2 + 2 ? 4 5 count to"] * 20, vocab_size=300)
    model = hfacc.build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, num_heads=2)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def conversations(kind: str, n: int = 8):
    from datasets import Dataset

    def user(a):
        return [{"role": "user", "content": f"what is {a} + {a} ?"}]

    def answer(text):
        return [{"role": "assistant", "content": text}]

    rows = {
        "sft": [{"messages": user(a) + answer(str(2 * a))} for a in range(n)],
        "pairs": [{"prompt": user(a), "chosen": answer(str(2 * a)), "rejected": answer(str(a))} for a in range(n)],
        "prompts": [{"prompt": user(a), "completion": answer(str(2 * a))} for a in range(n)],
    }[kind]
    return Dataset.from_list(rows)


def logged_keys(trainer) -> set[str]:
    trainer.train()
    keys = set().union(*(entry for entry in trainer.state.log_history if "loss" in entry))
    # A reward function's own metrics carry its name; the docs write it <func>.
    return {re.sub(r"^rewards/correct/", "rewards/<func>/", key) for key in keys - STOCK_KEYS}


def run_method(name: str, model_dir: str, out: str):
    import hfacc

    common = dict(
        output_dir=out,
        per_device_train_batch_size=4,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
    )
    if name == "sft":
        return hfacc.SFTTrainer(model_dir, args=hfacc.SFTConfig(**common), train_dataset=conversations("sft"))
    if name == "dpo":
        args = hfacc.DPOConfig(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 1.0], **common)
        return hfacc.DPOTrainer(model_dir, args=args, train_dataset=conversations("pairs"))
    if name == "reward":
        return hfacc.RewardTrainer(model_dir, args=hfacc.RewardConfig(**common), train_dataset=conversations("pairs"))
    if name == "kto":
        args = hfacc.KTOConfig(**{**common, "per_device_train_batch_size": 8})  # desirable and undesirable rows
        return hfacc.KTOTrainer(model_dir, args=args, train_dataset=conversations("pairs"))
    if name == "grpo":
        args = hfacc.GRPOConfig(num_generations=2, max_completion_length=4, **common)

        def correct(completions, **kwargs):
            return [float(len(c[0]["content"]) % 2) for c in completions]

        return hfacc.GRPOTrainer(model_dir, reward_funcs=correct, args=args, train_dataset=conversations("prompts"))
    if name == "distillation":
        args = hfacc.DistillationConfig(max_completion_length=4, teacher_model_name_or_path=model_dir, **common)
        return hfacc.DistillationTrainer(model_dir, args=args, train_dataset=conversations("prompts"))
    raise KeyError(name)


@pytest.mark.parametrize("name", ["sft", "dpo", "reward", "kto", "grpo", "distillation"])
def test_documented_metrics_are_what_a_tiny_run_logs(name, model_dir, tmp_path):
    documented = documented_metrics()
    assert name in documented, f"no <!-- metrics: {name} --> list in docs/"
    logged = logged_keys(run_method(name, model_dir, str(tmp_path)))
    assert documented[name] == logged, (
        f"{name}: documented but not logged {sorted(documented[name] - logged)}; "
        f"logged but not documented {sorted(logged - documented[name])}"
    )


if __name__ == "__main__":
    for page in PAGES:
        path = ROOT / "docs" / page
        path.write_text(regenerate(path))
