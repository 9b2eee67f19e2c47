"""What the GRPOTrainer tests share (tests/test_grpo.py and the two-rank tests/policy_gradient_check.py): a tiny
policy on the embedded tokenizer, prompts of the embedded tasks, reward functions, and the first step captured."""

from __future__ import annotations

import copy

import torch
from datasets import Dataset
from transformers import TrainerCallback

from hfacc import GRPOArguments, GRPOTrainer
from hfacc.data.embedded import build_default_model, build_default_tokenizer, generate_instruction_examples
from tests.helpers import flat_grad


def build_policy(seed: int = 0, hidden_size: int = 32, num_heads: int = 4):
    """A random tiny Llama that stops at EOS now and then: completions of many lengths, as a trained one samples.

    Its EOS output row points along the mean final hidden state of a prompt, so EOS gets a logit of about 4 (a
    probability of about 0.15 per token) and completions end after 1 to 12 tokens. (vLLM's CPU kernels need heads of
    32 dimensions or more: hidden_size 64 with 2 heads.)
    """
    tokenizer = build_default_tokenizer()
    model = build_default_model(tokenizer, hidden_size=hidden_size, num_layers=1, seed=seed, num_heads=num_heads)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with torch.no_grad():
        ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
        mean = model(input_ids=ids, output_hidden_states=True).hidden_states[-1][0].mean(0)
        model.get_output_embeddings().weight[tokenizer.eos_token_id] = 4.0 * mean / mean.norm() ** 2
    return model, tokenizer


def build_prompts(n: int = 32, seed: int = 5) -> Dataset:
    examples = generate_instruction_examples(n, seed=seed)
    return Dataset.from_list(
        [{"prompt": e["messages"][:-1], "answer": e["messages"][-1]["content"], "task": e["task"]} for e in examples]
    )


def brevity(prompts, completions, **kwargs):
    """Shorter is better: a reward with spread even for an untrained policy."""
    return [1.0 / (1 + len(c[0]["content"])) for c in completions]


def digits(prompts, completions, **kwargs):
    """The share of digits in the completion: a second reward with its own scale (GDPO's case)."""
    return [sum(ch.isdigit() for ch in c[0]["content"]) / (1 + len(c[0]["content"])) for c in completions]


def correct(prompts, completions, answer, **kwargs):
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]


class CaptureSteps(TrainerCallback):
    """Each optimizer step's gradient (after the ranks' all-reduce), the weights it started from, and the rollout."""

    def __init__(self, trainer):
        self.trainer, self.grads, self.rollouts, self.weights = trainer, [], [], []

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights.append({k: v.detach().clone() for k, v in self.trainer.model.state_dict().items()})

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append(flat_grad(self.trainer.model))
        self.rollouts.append(copy.deepcopy(self.trainer.rollout))


def run_grpo(
    output_dir,
    steps: int = 1,
    reward_funcs=(brevity,),
    model_seed: int = 0,
    policy=None,
    engine=None,
    resume_from_checkpoint=None,
    **settings,
):
    """A short GRPOTrainer run; returns (trainer, capture, the policy as it started). ``policy``: ``(model,
    tokenizer)`` to train (default: :func:`build_policy`); ``engine``: the generation engine to sample with."""
    model, tokenizer = policy if policy is not None else build_policy(model_seed)
    start = copy.deepcopy(model)
    values = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=12,
        max_steps=steps,
        learning_rate=1e-2,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        max_grad_norm=0.0,  # the captured gradient is the accumulated one, not a clipped one
        ddp_timeout=120,
    )
    values.update(settings)
    trainer = GRPOTrainer(
        model,
        list(reward_funcs),
        GRPOArguments(**values),
        train_dataset=build_prompts(),
        processing_class=tokenizer,
        engine=engine,
    )
    capture = CaptureSteps(trainer)
    trainer.add_callback(capture)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    return trainer, capture, start


def rollout_rows(rollout) -> list[dict]:
    return [dict(row) for row in rollout.rows]


def to_tensor_grad(grad) -> torch.Tensor:
    return grad if torch.is_tensor(grad) else torch.tensor(grad)
