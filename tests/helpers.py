"""Shared test helpers: variable-length masked data, hand-computed full-batch references, gradient capture.

The references here use plain torch ops only (no hfacc code), so a bug in hfacc's loss cannot hide in them.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

VOCAB = 64


def make_examples(n: int = 8, vocab: int = VOCAB, seed: int = 0, lengths=(5, 60)) -> list[dict]:
    """Sequences of very different lengths (5-60 tokens), each with a prompt of random length masked with -100."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.randint(*lengths)
        ids = [rng.randrange(1, vocab) for _ in range(length)]
        prompt = rng.randint(1, length - 1)
        out.append({"input_ids": ids, "labels": [-100] * prompt + ids[prompt:]})
    return out


def pad(examples: list[dict], pad_id: int = 0) -> dict[str, torch.Tensor]:
    length = max(len(e["input_ids"]) for e in examples)
    ids = torch.full((len(examples), length), pad_id)
    labels = torch.full((len(examples), length), -100)
    mask = torch.zeros((len(examples), length), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        ids[i, :n] = torch.tensor(e["input_ids"])
        labels[i, :n] = torch.tensor(e["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.detach().flatten().clone() for p in model.parameters() if p.grad is not None])


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def full_batch_causal_lm(model: nn.Module, examples: list[dict], label_smoothing: float = 0.0, mode: str = "token"):
    """Hand-computed reference: one forward/backward of the whole batch. Returns (gradient, loss, accuracy).

    mode "token": mean CE over all target tokens (labels != -100 after the shift);
    mode "sequence": mean over sequences of each sequence's mean; "micro_batch" is handled by the caller.
    """
    model.zero_grad()
    batch = pad(examples)
    logits = _logits(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]))
    logits, targets = logits[:, :-1], batch["labels"][:, 1:]
    ce = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=-100,
        reduction="none",
        label_smoothing=label_smoothing,
    ).reshape(targets.shape)
    mask = targets != -100
    if mode == "token":
        loss = ce.sum() / mask.sum()
    elif mode == "sequence":
        per_seq = ce.sum(1) / mask.sum(1).clamp(min=1)
        loss = per_seq[mask.any(1)].mean()
    else:
        raise ValueError(mode)
    loss.backward()
    grad = flat_grad(model)
    model.zero_grad()
    token_loss = (ce.sum() / mask.sum()).item()
    accuracy = ((logits.argmax(-1) == targets) & mask).sum().item() / mask.sum().item()
    return grad, token_loss, accuracy


def _logits(outputs):
    if torch.is_tensor(outputs):
        return outputs
    return outputs["logits"] if isinstance(outputs, dict) or hasattr(outputs, "keys") else outputs[0]


def family_config(family):
    """Tiny configs, of transformers' own classes, of families whose layout no signature shows (hidden 16-32, 2
    layers, vocab 64): router losses, convolutions and scans, a zero pad embedding, attention that reads the row."""
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    common.update(num_key_value_heads=2, max_position_embeddings=256)
    router = dict(output_router_logits=True, router_aux_loss_coef=0.1, num_experts_per_tok=2)
    return {
        "mixtral": lambda: transformers.MixtralConfig(**common, **router, num_local_experts=4),
        "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
            **common, **router, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=32
        ),
        "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
            **common, **router, num_experts=4, moe_intermediate_size=32, head_dim=8
        ),
        "olmoe": lambda: transformers.OlmoeConfig(**common, **router, num_experts=4, eos_token_id=VOCAB - 1),
        "granitemoe": lambda: transformers.GraniteMoeConfig(**common, **router, num_local_experts=4),
        "lfm2": lambda: transformers.Lfm2Config(**common, layer_types=["conv", "full_attention"]),
        "jamba": lambda: transformers.JambaConfig(
            **common,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=4,
        ),
        "gemma3n": lambda: transformers.Gemma3nTextConfig(
            **common,
            head_dim=8,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            altup_num_inputs=2,
            num_kv_shared_layers=0,
            layer_types=["sliding_attention", "full_attention"],
            sliding_window=16,
            activation_sparsity_pattern=[0.0, 0.0],
        ),
        # Layer 1 is a NoPE layer (temperature tuning from floor_scale on), layer 0 chunked attention.
        "llama4": lambda: transformers.Llama4TextConfig(
            **{**common, "hidden_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1},
            head_dim=8,
            intermediate_size_mlp=32,
            num_local_experts=2,
            num_experts_per_tok=1,
            interleave_moe_layer_step=2,
            no_rope_layers=[1, 0],
        ),
    }[family]()


def build_family(family, **config):
    """A family's tiny model, seeded; ``config`` overrides settings of its config."""
    torch.manual_seed(0)
    settings = family_config(family)
    for key, value in config.items():
        setattr(settings, key, value)
    return transformers.AutoModelForCausalLM.from_config(settings).float()


class CaptureGradients(TrainerCallback):
    """Copies the gradient just before each optimizer step (after the ranks' all-reduce)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.grads: list[torch.Tensor] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(flat_grad(self.model))


class PlainLM(nn.Module):
    """A custom model whose forward has no **kwargs: stock Trainer divides each micro-batch mean by k."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask=None, labels=None):
        logits = self.inner(input_ids=input_ids, attention_mask=attention_mask).logits
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


class KwargsLM(PlainLM):
    """Takes **kwargs but ignores num_items_in_batch: stock Trainer then skips the division by k entirely."""

    def forward(self, input_ids, attention_mask=None, labels=None, **kwargs):
        return super().forward(input_ids, attention_mask, labels)


def train_args(tmp_path, bs: int, ga: int, **overrides) -> TrainingArguments:
    """One optimizer step that leaves the weights alone (lr 0), unclipped, in data order."""
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=bs,
        gradient_accumulation_steps=ga,
        learning_rate=0.0,
        max_grad_norm=0.0,
        report_to=[],
        save_strategy="no",
        train_sampling_strategy="sequential",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        num_train_epochs=1,
        seed=0,
    )
    settings.update(overrides)
    cls = settings.pop("args_class", TrainingArguments)
    return cls(**settings)


def run_trainer(trainer_cls, model, examples, args, collator, **kwargs) -> tuple[Trainer, CaptureGradients]:
    from datasets import Dataset

    capture = CaptureGradients(model)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(examples),
        data_collator=collator,
        callbacks=[capture],
        **kwargs,
    )
    trainer.train()
    return trainer, capture


ROOT = Path(__file__).resolve().parents[1]


def load_recipe(name: str = "sft"):
    """Import recipes/<name>.py as a module (recipes are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(f"recipes.{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe_types(module):
    if hasattr(module, "GRPO_ARGUMENTS"):  # recipes/grpo.py
        return list(module.GRPO_ARGUMENTS)
    if hasattr(module, "DPO_ARGUMENTS"):  # recipes/dpo.py
        return list(module.DPO_ARGUMENTS)
    if hasattr(module, "DISTILL_ARGUMENTS"):  # recipes/distill.py
        return list(module.DISTILL_ARGUMENTS)
    for name in ("REWARD_ARGUMENTS", "KTO_ARGUMENTS"):  # recipes/reward.py, recipes/kto.py
        if hasattr(module, name):
            return list(getattr(module, name))
    from hfacc import TokenWeightedArguments
    from hfacc.data.sft import DataArguments
    from hfacc.models.loading import ModelArguments

    return [module.SFTArguments, ModelArguments, DataArguments, TokenWeightedArguments]


def free_port() -> int:
    """A TCP port nothing listens on now: each multi-process test gets its own rendezvous port."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(*args: str) -> list[str]:
    """The command for two CPU ranks of ``args`` (a script and its arguments, or ``-m module ...``)."""
    import sys

    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        *args,
    ]
