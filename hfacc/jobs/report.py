"""Run outputs people read: a loss-curve PNG and a metrics JSON."""

from __future__ import annotations

import json
from pathlib import Path


def save_loss_curve(
    log_history: list[dict],
    path: str | Path,
    title: str = "hfacc training",
    ylabel: str = "cross-entropy per target token",
) -> Path:
    """Plot training loss per logging step and evaluation loss where it was measured (and, for preference pairs,
    the evaluation's reward accuracy, or a reward model's pair accuracy, on a second axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(h["step"], h["loss"]) for h in log_history if "loss" in h and "step" in h]
    evals = [(h["step"], h["eval_loss"]) for h in log_history if "eval_loss" in h and "step" in h]
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss (token-weighted)")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o--", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    key = next((k for k in ("eval_rewards/accuracies", "eval_accuracy") if any(k in h for h in log_history)), None)
    accuracy = [(h["step"], h[key]) for h in log_history if key in h and "step" in h] if key else []
    if accuracy:  # DPO's reward accuracy, a reward model's pair accuracy
        what = "reward accuracy" if key == "eval_rewards/accuracies" else "pair accuracy"
        twin = ax.twinx()
        twin.plot(*zip(*accuracy, strict=True), "s:", color="tab:green", label=f"eval {what}")
        twin.set_ylabel(f"{what} (held-out pairs)")
        twin.set_ylim(0, 1.02)
        twin.legend(loc="center right")
    if ax.lines:  # a run shorter than its logging interval logged no loss: an empty plot, no legend warning
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def save_reward_curve(log_history: list[dict], path: str | Path, title: str = "hfacc GRPO") -> Path:
    """Plot the mean sampled reward per logging step (and each reward function's), as an online run logs them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
    keys = ["reward"] + sorted({k for h in log_history for k in h if k.startswith("rewards/") and k.endswith("/mean")})
    for key in keys:
        points = [(h["step"], h[key]) for h in log_history if key in h and "step" in h]
        if points:
            ax.plot(*zip(*points, strict=True), label=key if key != "reward" else "reward (weighted total)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the sampled completions")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:  # a run shorter than its logging interval logged no reward: an empty plot, no legend warning
        ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def write_json(data: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=str) + "\n")
    return path
