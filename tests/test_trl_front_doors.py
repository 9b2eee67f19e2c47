"""TRL's call shapes on hfacc's trainers: a model given by name, no processing_class, peft_config, TRL's config
fields (and one named error for those hfacc does not support), reward functions called with TRL's keywords.
The three TRL scripts themselves run in tests/test_docs.py (docs/from_trl.md)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset

import hfacc
from hfacc.generation.rollout import RewardFunctionError, score_completions
from hfacc.models.model_init import get_model_and_tokenizer

COMMON = dict(per_device_train_batch_size=2, max_steps=1, report_to="none", save_strategy="no")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny causal LM and its chat tokenizer saved to a local directory: what a hub id loads."""
    from hfacc.data.embedded import build_default_tokenizer

    tokenizer = build_default_tokenizer(["what is 2 + 2 ? 4 5 count to"] * 20, vocab_size=300)
    model = hfacc.build_tiny_llama(vocab_size=len(tokenizer), hidden_size=16, num_layers=1, num_heads=2)
    model.config.pad_token_id, model.config.eos_token_id = tokenizer.pad_token_id, tokenizer.eos_token_id
    path = tmp_path_factory.mktemp("tiny-model")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def pairs(n: int = 4) -> Dataset:
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"what is {a} + {a} ?"}],
                "chosen": [{"role": "assistant", "content": str(2 * a)}],
                "rejected": [{"role": "assistant", "content": str(2 * a + 1)}],
            }
            for a in range(n)
        ]
    )


def test_grpo_trainer_takes_a_model_name_and_loads_its_tokenizer(model_dir, tmp_path):
    prompts = Dataset.from_list([{"prompt": f"count to {a}"} for a in range(4)])
    args = hfacc.GRPOConfig(output_dir=str(tmp_path), num_generations=2, max_completion_length=4, **COMMON)
    trainer = hfacc.GRPOTrainer(model=model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                                args=args, train_dataset=prompts)  # fmt: skip
    assert isinstance(trainer.model, torch.nn.Module)
    assert trainer.processing_class.pad_token_id is not None
    assert trainer.args.loss_type in ("dapo", "token") and trainer.args.learning_rate == 1e-6  # TRL's defaults


def test_a_trl_style_reward_function_gets_keywords():
    seen = {}

    def reward_len(completions, **kwargs):  # TRL's documented signature: completions first, prompts in kwargs
        seen.update(kwargs)
        return [float(len(c)) for c in completions]

    rewards = score_completions([reward_len], ["p1", "p2"], ["a", "bbb"], {"answer": ["x", "y"]})
    assert rewards[:, 0].tolist() == [1.0, 3.0]
    assert seen["prompts"] == ["p1", "p2"] and seen["answer"] == ["x", "y"]

    def positional(p, c, **columns):  # hfacc's positional call stays for functions that do not name completions
        return [0.5] * len(c)

    assert score_completions([positional], ["p"], ["c"]).item() == 0.5
    with pytest.raises(RewardFunctionError, match="reward_len"):
        score_completions([reward_len], ["p"], [None])


def test_model_name_with_model_init_kwargs_and_peft_config(model_dir):
    from peft import LoraConfig, PeftModel

    model, tokenizer = get_model_and_tokenizer(
        model_dir,
        model_init_kwargs={"dtype": "bfloat16"},
        peft_config=LoraConfig(r=2, lora_alpha=4, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    assert isinstance(model, PeftModel) and tokenizer.pad_token_id is not None
    assert next(model.base_model.model.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"model_init_kwargs \['device_map'\]"):
        get_model_and_tokenizer(model_dir, model_init_kwargs={"device_map": "auto"})
    unnamed = hfacc.build_tiny_llama(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2)
    with pytest.raises(ValueError, match="pass processing_class"):
        get_model_and_tokenizer(unnamed)


@pytest.mark.parametrize(
    "config, field, value",
    [
        ("SFTConfig", "packing", True),
        ("SFTConfig", "loss_type", "dft"),
        ("DPOConfig", "use_weighting", True),
        ("DPOConfig", "sync_ref_model", True),
        ("RewardConfig", "pad_token", "<pad>"),
        ("KTOConfig", "loss_type", "apo_zero_unpaired"),
        ("GRPOConfig", "importance_sampling_level", "sequence"),
        ("GRPOConfig", "mask_truncated_completions", True),
        ("DistillationConfig", "generation_kwargs", {"do_sample": False}),
    ],
)
def test_an_unsupported_trl_field_is_one_named_error(config, field, value, tmp_path):
    cls = getattr(hfacc, config)
    assert getattr(cls(output_dir=str(tmp_path)), field) != value  # TRL's default is accepted
    with pytest.raises(ValueError, match=rf"^{config}\.{field}=.*hfacc does not support it"):
        cls(output_dir=str(tmp_path), **{field: value})


def test_dpo_loss_list_maps_to_hfacc_losses(tmp_path):
    config = hfacc.DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    assert config.get_losses() == ("sigmoid", 0.5)
    assert hfacc.DPOConfig(output_dir=str(tmp_path), loss_type="ipo").get_losses() == ("ipo", 0.0)
    with pytest.raises(ValueError, match="one preference loss"):
        hfacc.DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "ipo"])
    with pytest.raises(ValueError, match="truncation_mode"):
        hfacc.DPOConfig(output_dir=str(tmp_path), truncation_mode="keep_middle")


def test_dpo_trainer_builds_the_objective_and_data_from_trl_fields(model_dir, tmp_path):
    args = hfacc.DPOConfig(
        output_dir=str(tmp_path), loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.25], beta=0.2, **COMMON
    )
    trainer = hfacc.DPOTrainer(model=model_dir, args=args, train_dataset=pairs())
    assert isinstance(trainer.objective, hfacc.DPOObjective)
    assert (trainer.objective.beta, trainer.objective.nll_weight) == (0.2, 0.25)
    assert "chosen_input_ids" in trainer.train_dataset.column_names
    assert all(m.p == 0 for m in trainer.model.modules() if isinstance(m, torch.nn.Dropout))  # disable_dropout


def test_reward_and_kto_trainers_take_a_model_name(model_dir, tmp_path):
    reward = hfacc.RewardTrainer(model=model_dir, args=hfacc.RewardConfig(output_dir=str(tmp_path), **COMMON),
                                 train_dataset=pairs())  # fmt: skip
    assert reward.model.config.num_labels == 1 and reward.model.config.pad_token_id is not None
    kto = hfacc.KTOTrainer(model=model_dir, args=hfacc.KTOConfig(output_dir=str(tmp_path), desirable_weight=2.0,
                           **COMMON), train_dataset=pairs())  # fmt: skip
    assert kto.objective.desirable_weight == 2.0
    assert len(kto.train_dataset) == 8  # each pair unpaired into a desirable and an undesirable row


def test_dpo_trainer_accumulates_to_the_big_batch(model_dir, tmp_path):
    """The front door keeps hfacc's window: 8 pairs as (8, 1), (2, 4) and ragged (3, 3) give one update."""

    def update(batch: int, accumulation: int, normalization: str = "token") -> torch.Tensor:
        args = hfacc.DPOConfig(
            output_dir=str(tmp_path / f"{batch}x{accumulation}{normalization}"),
            normalization=normalization,
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            max_steps=1,
            learning_rate=1.0,
            optim="sgd",
            lr_scheduler_type="constant",
            loss_type=["sigmoid", "sft"],
            report_to="none",
            save_strategy="no",
        )
        trainer = hfacc.DPOTrainer(model=model_dir, args=args, train_dataset=pairs(8))
        before = torch.cat([p.detach().flatten().clone() for p in trainer.model.parameters()])
        trainer.train()
        return torch.cat([p.detach().flatten() for p in trainer.model.parameters()]) - before

    big = update(8, 1)
    assert big.norm() > 0
    for batch, accumulation in [(2, 4), (3, 3)]:
        assert ((update(batch, accumulation) - big).norm() / big.norm()).item() < 1e-6
    # Negative control: the mean of micro-batch means (TRL's) is off on the ragged split.
    assert ((update(3, 3, "micro_batch") - big).norm() / big.norm()).item() > 1e-3
