"""GRPO: hfacc's GRPOTrainer vs TRL's GRPOTrainer, and how exact each one's step is on a fixed rollout; and the
generation engines (transformers generate vs vLLM).

    python benchmarks/grpo.py                 # CPU, fp32: the numbers in benchmarks/README.md
    python benchmarks/grpo.py --steps 8 --rounds 3 --device cuda
    python benchmarks/grpo.py --engines       # in the vLLM environment: generate vs vLLM (and TRL on vLLM)
    python benchmarks/grpo.py --engines --device cuda --steps 8
    python benchmarks/grpo.py --engines --server   # also a vLLM server (hfacc vllm-serve), sync and async

Part 1, speed and memory. Same model (the embedded default: Llama, 2 layers, hidden 256, the recipe's BPE
vocabulary), same prompts (the embedded tasks, as chat), num_generations 8, max_completion_length 32, 32
completions per micro-batch x GA 2 (8 prompts per step), loss 'dapo' / 'token', beta 0, Adam; each trainer runs
--steps optimizer steps per round, rounds alternate the order, the first step of a round is dropped (warm-up).
Generation time is measured the same way for both (a timer around each trainer's own generate-and-score function);
training time is the rest of the step. Reported: completion tokens trained per second of training, completion
tokens sampled per second of generation, and peak memory of one whole step (PyTorch profiler allocation events on
CPU, torch.cuda.max_memory_allocated on a GPU).

Part 3 (--engines, instead of parts 1 and 2): the same GRPO run with hfacc sampling through transformers' generate
and through a colocated vLLM engine (use_vllm=True: one engine for all rounds, as one process can hold only one; it
gets each round's policy at its first generation), and TRL 1.16 with use_vllm=True where it runs. Reported per
contender: seconds per step, completion tokens sampled per second of generation, completion tokens trained per
second of training, the largest sampler/policy log-prob difference logged, and peak memory of one whole step
(a fresh run of one step: for vLLM, with its engine's weights and KV cache).

With --server, two more contenders in the same rounds: a vLLM server in its own process (started here by ``hfacc
vllm-serve`` on the same model, before the rounds; its start is in no step), sampled synchronously
(``vllm_mode="server"``) and asynchronously (``async_generation=True``: the next generation is sampled while the
step trains, one step stale). The async gain is the overlap of generation with training: the ratio of the two
s/step figures is printed.

Part 2, normalization on a fixed rollout (8 completions of 1-14 tokens, advantages, old log-probs that clip ratios on
both sides; tests/rollouts.py builds the same kind): the gradient of bs 2 x GA 4 against the hand-written big batch,
for TRL's own loss code (GRPOTrainer._compute_loss, called per micro-batch as its training step does, with its
num_items_in_batch) and for hfacc's. Also steps_per_generation = 2 x GA: the second step of a 16-completion
generation batch, whose halves hold different numbers of tokens.
"""

import argparse
import contextlib
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import add_quick, trl_version  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from hfacc import GRPOArguments, GRPOTrainer, build_tiny_llama  # noqa: E402
from hfacc.data.embedded import build_default_model, build_default_tokenizer, generate_instruction_examples  # noqa: E402
from hfacc.runtime.memory import peak_memory  # noqa: E402

BS, GA, G, L = 32, 2, 8, 32
QUICK = False  # --quick: a tiny policy and rollout (set by main)


def policy(tokenizer, device):
    """The embedded default (Llama, 2 layers, hidden 256); --quick: hidden 32, one layer."""
    if QUICK:
        return build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=0).to(device)
    return build_default_model(tokenizer, seed=0).to(device)


def length_reward(prompts, completions, **kwargs):
    """Any reward will do for timing; this one varies, so advantages are not all zero."""
    return [len(c[0]["content"]) / 100 for c in completions]


def prompts_dataset(n):
    rows = []
    for e in generate_instruction_examples(n, seed=11):
        rows.append({"prompt": e["messages"][:-1]})
    return Dataset.from_list(rows)


class Timer(TrainerCallback):
    """Wall time of each optimizer step, and the generation time inside it (added by the wrapped generator)."""

    def __init__(self):
        self.steps, self.generation, self._start, self._gen = [], [], None, 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        # The step's rollout is drawn before on_step_begin in hfacc (get_batch_samples) and inside the step in TRL
        # (training_step): both are counted, as generation time, in the step they serve.
        if self._start is None:
            self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.steps.append(now - self._start)
        self.generation.append(self._gen)
        self._start, self._gen = now, 0.0

    def wrap(self, obj, name):
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._gen += time.perf_counter() - start

        setattr(obj, name, timed)


def completion_tokens(trainer, kind):
    """Completion tokens trained per step, as each trainer logs them."""
    history = trainer.state.log_history
    if kind == "hfacc":
        return [h["num_completion_tokens"] for h in history if "num_completion_tokens" in h]
    return [h["completions/mean_length"] * BS * GA for h in history if "completions/mean_length" in h]


def run_hfacc(model, tokenizer, prompts, steps, out, device, engine=None, **settings):
    args = GRPOArguments(
        output_dir=out, per_device_train_batch_size=BS, gradient_accumulation_steps=GA, num_generations=G,
        max_completion_length=L, max_steps=steps, learning_rate=1e-5, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=device == "cpu", disable_tqdm=True, loss_type="token", seed=0, **settings,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model, [length_reward], args, train_dataset=prompts, processing_class=tokenizer, engine=engine
    )
    timer = Timer()
    timer.wrap(trainer, "generate_micro_batches")
    trainer.add_callback(timer)
    trainer.train()
    return trainer, timer


def run_trl(model, tokenizer, prompts, steps, out, device, **settings):
    from trl import GRPOConfig
    from trl import GRPOTrainer as TRLGRPOTrainer

    settings = {"bf16": False, **settings}  # TRL's default is bf16=True: fp32 as hfacc unless asked
    args = GRPOConfig(
        output_dir=out, per_device_train_batch_size=BS, gradient_accumulation_steps=GA, num_generations=G,
        max_completion_length=L, max_steps=steps, learning_rate=1e-5, logging_steps=1, report_to=[],
        save_strategy="no", use_cpu=device == "cpu", disable_tqdm=True, loss_type="dapo", beta=0.0, seed=0,
        top_k=0, **settings,
    )  # fmt: skip
    trainer = TRLGRPOTrainer(model, [length_reward], args, train_dataset=prompts, processing_class=tokenizer)
    timer = Timer()
    timer.wrap(trainer, "_generate_and_score_completions")
    trainer.add_callback(timer)
    trainer.train()
    return trainer, timer


def speed(args):
    tokenizer = build_default_tokenizer()
    prompts = prompts_dataset(64 if QUICK else 4096)
    kinds = args.kinds
    results = {k: [] for k in kinds}
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            model = policy(tokenizer, args.device)
            run = run_hfacc if kind == "hfacc" else run_trl
            with tempfile.TemporaryDirectory() as out:
                trainer, timer = run(model, tokenizer, prompts, args.steps, out, args.device)
            tokens = completion_tokens(trainer, kind)[1:]
            steps, gen = timer.steps[1:], timer.generation[1:]
            train_time = sum(s - g for s, g in zip(steps, gen, strict=True))
            results[kind].append(
                {
                    "train_tok_s": sum(tokens) / train_time,
                    "gen_tok_s": sum(tokens) / sum(gen),
                    "step_s": sum(steps) / len(steps),
                    "gen_share": sum(gen) / sum(steps),
                }
            )
            print(f"round {r + 1} {kind:6s} " + "  ".join(f"{k} {v:.2f}" for k, v in results[kind][-1].items()))
    memory = {}
    for kind in kinds:
        model = policy(tokenizer, args.device)
        run = run_hfacc if kind == "hfacc" else run_trl
        with tempfile.TemporaryDirectory() as out:
            memory[kind] = peak_memory(
                lambda run=run, model=model, out=out: run(model, tokenizer, prompts, 1, out, args.device), args.device
            )
    print()
    print(
        f"{'contender':10s} {'train tok/s':>12s} {'gen tok/s':>10s} {'s/step':>7s} {'gen share':>9s} {'peak MiB':>9s}"
    )
    for kind in kinds[::-1]:
        rows = results[kind]
        # Each figure's median over the rounds (statistics.median: the mean of the middle two for an even count, not
        # the upper one, which would favour whoever had the noisier round).
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        print(
            f"{kind:10s} {med['train_tok_s']:12.0f} {med['gen_tok_s']:10.0f} {med['step_s']:7.2f} "
            f"{med['gen_share']:9.2f} {memory[kind] / 2**20:9.0f}"
        )


# ---- part 3: the generation engines -------------------------------------------------------------------------------
def engines(args):
    """hfacc with transformers' generate vs hfacc with vLLM (colocate), interleaved; TRL 1.16 on vLLM where it runs."""
    from hfacc.generation.vllm_engine import VLLMEngine

    tokenizer = build_default_tokenizer()
    prompts = prompts_dataset(4096)
    first = build_default_model(tokenizer, seed=0).to(args.device)
    # One engine per process: built once (its start is not in any step), each round's policy copied in at once.
    engine = VLLMEngine(first, tokenizer, max_model_len=512, max_num_seqs=BS * GA, on_cpu=args.device == "cpu")
    kinds = ["generate", "vllm"] + (["server sync", "server async"] if args.server else [])
    results = {kind: [] for kind in kinds}
    server = start_server(first, tokenizer) if args.server else None
    for r in range(args.rounds):
        for kind in kinds if r % 2 == 0 else kinds[::-1]:
            model = build_default_model(tokenizer, seed=0).to(args.device)
            settings = {}
            if kind.startswith("server"):
                settings = dict(use_vllm=True, vllm_mode="server", vllm_server_base_url=server[0],
                                vllm_server_timeout=900, async_generation=kind == "server async")  # fmt: skip
            with tempfile.TemporaryDirectory() as out:
                trainer, timer = run_hfacc(
                    model, tokenizer, prompts, args.steps, out, args.device, engine=engine if kind == "vllm" else None,
                    **settings,
                )  # fmt: skip
            results[kind].append(summarize(trainer, timer, "hfacc"))
            print(f"round {r + 1} {kind:9s} " + "  ".join(f"{k} {v:.3g}" for k, v in results[kind][-1].items()))
    memory = {}
    for kind in ("generate", "vllm"):
        model = build_default_model(tokenizer, seed=0).to(args.device)
        with tempfile.TemporaryDirectory() as out:
            memory[kind] = peak_memory(
                lambda model=model, out=out, kind=kind: run_hfacc(
                    model, tokenizer, prompts, 1, out, args.device, engine=engine if kind == "vllm" else None
                ),
                args.device,
            )
    # vLLM's own memory (weights + KV cache) is allocated when the engine starts, outside the step measured above.
    trl = "not installed in this environment"
    try:
        model = build_default_model(tokenizer, seed=0).to(args.device)
        with tempfile.TemporaryDirectory() as out:
            # TRL's colocated engine loads the model by its name: the embedded one gets a directory.
            model.save_pretrained(f"{out}/model")
            tokenizer.save_pretrained(f"{out}/model")
            model.config._name_or_path = model.name_or_path = f"{out}/model"
            trainer, timer = run_trl(model, tokenizer, prompts, args.steps, out, args.device, use_vllm=True,
                                     vllm_mode="colocate", vllm_gpu_memory_utilization=0.1)  # fmt: skip
        results["trl vllm"] = [summarize(trainer, timer, "trl")]
    except ImportError:
        pass
    except Exception as err:  # TRL's colocate path loads weights through the runner's load_weights
        trl = f"fails: {type(err).__name__}: {str(err)[:120]}"
    print()
    print(
        f"{'contender':12s} {'s/step':>7s} {'gen tok/s':>10s} {'train tok/s':>12s} {'max logp diff':>14s} {'peak MiB':>9s}"
    )
    for kind, rows in results.items():
        med = {k: statistics.median(x[k] for x in rows) for k in rows[0]}
        peak = f"{memory[kind] / 2**20:9.0f}" if kind in memory else f"{'-':>9s}"
        print(
            f"{kind:12s} {med['step_s']:7.2f} {med['gen_tok_s']:10.0f} {med['train_tok_s']:12.0f} "
            f"{med['logp_diff_max']:14.2e} {peak}"
        )
    if "trl vllm" not in results:
        print(f"trl vllm     {trl}")
    if server is not None:
        sync, overlap = (statistics.median(x["step_s"] for x in results[k]) for k in ("server sync", "server async"))
        print(f"server async / sync: {sync / overlap:.2f}x the steps per second (generation overlapped with training)")
        os.killpg(server[1].pid, signal.SIGTERM)
        server[1].wait(timeout=60)
    if engine.kv_cache_memory_bytes:  # allocated when the engine started, outside the steps measured above
        print(f"(vLLM's KV cache: {engine.kv_cache_memory_bytes / 2**20:.0f} MiB, beside its copy of the weights)")


def start_server(model, tokenizer):
    """``hfacc vllm-serve`` on ``model``'s config and tokenizer (its weights come from each run's first generation),
    on a free port of 127.0.0.1, one thread: ``(url, process)`` once ``/health`` answers."""
    from hfacc.generation.server_engine import ServerClient
    from hfacc.generation.vllm_engine import write_engine_directory

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    process = subprocess.Popen(
        [sys.executable, "-m", "hfacc.cli", "vllm-serve", "--model", write_engine_directory(model, tokenizer),
         "--port", str(port), "--max_num_seqs", str(BS * GA)],
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(root)), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    start = time.perf_counter()
    ServerClient(url, 1800).wait_until_up(1800)
    print(f"server up after {time.perf_counter() - start:.0f} s")
    return url, process


def summarize(trainer, timer, kind) -> dict:
    """Per-round figures (the first step of a round dropped: warm-up)."""
    tokens = completion_tokens(trainer, kind)[1:]
    steps, gen = timer.steps[1:], timer.generation[1:]
    train_time = sum(s - g for s, g in zip(steps, gen, strict=True))
    differences = [
        h["sampling/sampling_logp_difference/max"]
        for h in trainer.state.log_history
        if "sampling/sampling_logp_difference/max" in h
    ]
    return {
        "step_s": sum(steps) / len(steps),
        "gen_tok_s": sum(tokens) / sum(gen),
        "train_tok_s": sum(tokens) / train_time,
        "logp_diff_max": max(differences, default=float("nan")),
    }


# ---- part 2: normalization on a fixed rollout ----------------------------------------------------------------------
def fixed_rollout(model, n, seed, vocab):
    rng, noise = random.Random(seed), torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        p, c = rng.randint(2, 12), rng.randint(1, 14)
        ids = [rng.randrange(1, vocab) for _ in range(p + c)]
        with torch.no_grad():
            x = torch.tensor([ids])
            logp = model(input_ids=x).logits[0, :-1].log_softmax(-1).gather(1, x[0, 1:, None])[:, 0]
        old = (logp + 0.4 * torch.randn(logp.shape, generator=noise)).tolist()
        rows.append({"prompt": ids[:p], "completion": ids[p:], "advantage": rng.gauss(0, 1), "old": old[p - 1 :]})
    return rows


def big_batch_gradient(model, rows, eps=0.2):
    model.zero_grad()
    losses = []
    for r in rows:
        ids = torch.tensor([r["prompt"] + r["completion"]])
        logp = model(input_ids=ids).logits[0, :-1].log_softmax(-1).gather(1, ids[0, 1:, None])[:, 0]
        logp = logp[len(r["prompt"]) - 1 :]
        ratio = torch.exp(logp - torch.tensor(r["old"]))
        a = r["advantage"]
        losses.append(-torch.minimum(ratio * a, ratio.clamp(1 - eps, 1 + eps) * a))
    (torch.cat(losses).sum() / sum(len(x) for x in losses)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return grad


def trl_inputs(rows, num_items):
    """TRL's micro-batch inputs: left-padded prompts, right-padded completions, masks, advantages, old log-probs."""
    width_p, width_c = max(len(r["prompt"]) for r in rows), max(len(r["completion"]) for r in rows)
    batch = {k: torch.zeros(len(rows), w, dtype=torch.long) for k, w in
             (("prompt_ids", width_p), ("prompt_mask", width_p), ("completion_ids", width_c), ("completion_mask", width_c))}  # fmt: skip
    old = torch.zeros(len(rows), width_c)
    for i, r in enumerate(rows):
        p, c = len(r["prompt"]), len(r["completion"])
        batch["prompt_ids"][i, width_p - p :] = torch.tensor(r["prompt"])
        batch["prompt_mask"][i, width_p - p :] = 1
        batch["completion_ids"][i, :c] = torch.tensor(r["completion"])
        batch["completion_mask"][i, :c] = 1
        old[i, :c] = torch.tensor(r["old"])
    batch["advantages"] = torch.tensor([r["advantage"] for r in rows])
    batch["old_per_token_logps"] = old
    batch["num_items_in_batch"] = torch.tensor(float(num_items))
    return batch


def trl_gradient(trainer, model, rows, bs, ga, loss_type, generation_tokens):
    trainer.loss_type, trainer.args.loss_type = loss_type, loss_type
    trainer.current_gradient_accumulation_steps = ga
    model.zero_grad()
    for i in range(0, len(rows), bs):
        trainer._compute_loss(model, trl_inputs(rows[i : i + bs], generation_tokens)).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return grad


def hfacc_gradient(model, rows, bs, ga):
    from hfacc import DataCollatorForCausalLM, PolicyGradientObjective
    from hfacc.training.window import compute_micro_batch_loss, count_window

    objective = PolicyGradientObjective("token")
    collate = DataCollatorForCausalLM(0)
    examples = [
        {
            "input_ids": r["prompt"] + r["completion"],
            "labels": [-100] * len(r["prompt"]) + r["completion"],
            "advantages": r["advantage"],
            "old_logps": [0.0] * len(r["prompt"]) + r["old"],
        }
        for r in rows
    ]
    batches = [collate(examples[i : i + bs]) for i in range(0, len(examples), bs)]
    cpu = type("CPU", (), {"device": torch.device("cpu"), "num_processes": 1})
    counts = count_window(objective.count, batches, cpu, size=2)
    model.zero_grad()
    for batch in batches:
        compute_micro_batch_loss(objective, model, batch, counts)[0].backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    return grad


def trl_grpo_for_losses(model, tokenizer):
    """TRL's GRPOTrainer, for its loss code alone."""
    from trl import GRPOConfig
    from trl import GRPOTrainer as TRLGRPOTrainer

    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):
        config = GRPOConfig(
            output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=GA * 2, num_generations=2,
            max_completion_length=16, report_to=[], use_cpu=True, loss_type="bnpo", beta=0.0, epsilon=0.2,
        )  # fmt: skip
        trainer = TRLGRPOTrainer(
            model, [length_reward], config, train_dataset=prompts_dataset(16), processing_class=tokenizer
        )
    return trainer


def normalization(include_trl=True):
    """The accumulated gradient's error on a fixed rollout (TRL's loss code only where TRL is installed)."""
    tokenizer = build_default_tokenizer()
    model = build_tiny_llama(vocab_size=len(tokenizer), hidden_size=32, num_layers=1, seed=0)
    trainer = None
    if include_trl:
        trainer = trl_grpo_for_losses(model, tokenizer)
    model.train()
    rows = fixed_rollout(model, 8, seed=0, vocab=64)
    tokens = sum(len(r["completion"]) for r in rows)
    want = big_batch_gradient(model, rows)

    def error(grad):
        return ((grad - want).norm() / want.norm()).item()

    print("\nrelative error of the accumulated gradient vs the big batch, fixed rollout of 8 completions "
          f"({[len(r['completion']) for r in rows]} tokens), bs 2 x GA 4:")  # fmt: skip
    for loss_type in ("bnpo", "dapo") if trainer is not None else ():
        print(
            f"  TRL loss_type={loss_type!r:9s} {error(trl_gradient(trainer, model, rows, 2, 4, loss_type, tokens)):.2e}"
        )
    errors = {"ragged": error(hfacc_gradient(model, rows, 2, 4))}
    print(f"  hfacc loss_type='token'   {errors['ragged']:.2e}")
    # steps_per_generation = 2 x GA: 16 completions, two optimizer steps of 8 (lr 0: the same weights).
    more = fixed_rollout(model, 16, seed=1, vocab=64)
    generation_tokens = sum(len(r["completion"]) for r in more)
    second = more[8:]
    want = big_batch_gradient(model, second)
    print(f"steps_per_generation = 2 x GA, the second step ({sum(len(r['completion']) for r in second)} of "
          f"{generation_tokens} tokens):")  # fmt: skip
    if trainer is not None:
        trainer.args.steps_per_generation = 2 * 4
        trl_error = error(trl_gradient(trainer, model, second, 2, 4, "dapo", generation_tokens))
        print(f"  TRL loss_type='dapo'      {trl_error:.2e}")
    errors["second step"] = error(hfacc_gradient(model, second, 2, 4))
    print(f"  hfacc loss_type='token'   {errors['second step']:.2e}")
    return errors


def main(argv=None):
    global BS, GA, G, L, QUICK
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--skip_speed", action="store_true")
    parser.add_argument("--engines", action="store_true", help="part 3: transformers generate vs vLLM (needs vLLM)")
    parser.add_argument("--server", action="store_true", help="with --engines: a vLLM server too, sync and async")
    add_quick(parser)
    args = parser.parse_args(argv)
    if args.quick:  # two steps (the first is dropped as warm-up) of 4 completions of at most 8 tokens x GA 2
        QUICK, BS, G, L, args.steps, args.rounds = True, 4, 2, 8, 2, 1
    version = trl_version()
    args.kinds = ["hfacc", "trl"] if version else ["hfacc"]
    if not version:
        print("TRL not installed: its contenders left out")
    torch.set_num_threads(max(1, torch.get_num_threads()))  # before vLLM starts: it freezes the thread count
    if args.engines:
        engines(args)
        return None
    if not args.skip_speed:
        speed(args)
    return normalization(include_trl=version is not None)


if __name__ == "__main__":
    main()
