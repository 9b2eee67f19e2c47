"""The logged metrics: exact token-weighted loss and accuracy over windows and ranks, in training and evaluation."""

from __future__ import annotations

import time
from typing import Any

import torch

from .distributed import count_real_rows, num_rows, reduce_sum, take_rows
from .loss import LossSums, sums_per_row


class LossMeter:
    """Token-weighted loss/accuracy bookkeeping, on device between logs (no host sync per micro-batch).

    A window's sums are staged on the window (:meth:`hfacc.window.Window.stage`) and reach the logs only when the
    step gate commits it (:meth:`commit`): a skipped window never does.
    """

    def __init__(self, device: torch.device):
        # float64: sums over thousands of micro-batches must not lose the fp32 digits that make the log exact.
        self.dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64
        self.device = device
        self.reset_run()
        self.reset_eval()

    def zeros(self) -> torch.Tensor:
        return torch.zeros(2, dtype=self.dtype, device=self.device)  # [loss sum, correct]

    def reset_run(self) -> None:
        self.run, self.run_targets = self.zeros(), 0
        self.interval, self.interval_targets = self.zeros(), 0
        self.skipped_steps = self.empty_windows = 0
        self.interval_start = time.perf_counter()
        self.extra: dict[str, float] = {}  # one-off values for the next log (e.g. the accumulation audit)

    def commit(self, window) -> None:
        """Add a window's staged sums (:class:`hfacc.window.Window`) to the metrics of the interval and the run."""
        self.interval += window.staged
        self.run += window.staged
        self.interval_targets += window.num_targets
        self.run_targets += window.num_targets

    def interval_logs(self, accelerator, with_accuracy: bool) -> dict[str, float]:
        loss_sum, correct = reduce_sum(self.interval, accelerator).tolist()
        now = time.perf_counter()
        # No loss when no window of the interval reached the weights (every step skipped): not a NaN to plot.
        logs = {"loss": loss_sum / self.interval_targets} if self.interval_targets else {}
        logs["num_targets"] = self.interval_targets
        logs["target_tokens_per_second"] = round(self.interval_targets / max(now - self.interval_start, 1e-9), 2)
        if with_accuracy and self.interval_targets:
            logs["token_accuracy"] = correct / self.interval_targets
        if self.skipped_steps:
            logs["skipped_steps"] = self.skipped_steps
        logs.update(self.extra)
        self.extra = {}
        self.interval, self.interval_targets, self.interval_start = self.zeros(), 0, now
        return logs

    def run_logs(self, accelerator, with_accuracy: bool) -> dict[str, float]:
        loss_sum, correct = reduce_sum(self.run, accelerator).tolist()
        logs = {"train_loss": loss_sum / self.run_targets} if self.run_targets else {}
        logs["train_num_targets"] = self.run_targets
        if with_accuracy and self.run_targets:
            logs["train_token_accuracy"] = correct / self.run_targets
        logs["train_skipped_steps"] = self.skipped_steps
        return logs

    def reset_eval(self) -> None:
        self.eval = torch.zeros(3, dtype=self.dtype, device=self.device)  # [loss sum, count, correct], all ranks
        self.eval_local = torch.zeros(3, dtype=self.dtype, device=self.device)  # this rank's, reduced at the end
        self.eval_seen = self.eval_local_seen = False

    def add_eval(self, sums: LossSums, accelerator) -> None:
        per_example = torch.stack([sums.loss.detach(), sums.count, sums.correct], dim=-1).to(self.dtype)
        if accelerator.num_processes > 1:
            # gather_for_metrics drops the samples the sampler repeated to even out the last batch across ranks.
            per_example = accelerator.gather_for_metrics(per_example)
        self.eval += per_example.reshape(-1, 3).sum(0)
        self.eval_seen = True

    def add_evaluation_batch(self, objective, model, inputs, packed: bool, accelerator) -> tuple[Any, LossSums]:
        """Run one evaluation batch; add its sums, without the examples accelerate repeated, to the eval totals."""
        if objective.sums_per_sequence:
            outputs, sums = objective(model, inputs, per_sequence=True)
            if packed:
                # One value per row, as gather_for_metrics expects: it drops the rows repeated across ranks.
                sums = sums_per_row(sums, inputs["position_ids"])
            self.add_eval(sums, accelerator)  # gather_for_metrics drops the repeated rows
            return outputs, sums
        outputs, sums = objective(model, inputs)
        rows = num_rows(inputs)
        real = count_real_rows(accelerator, rows)
        counted = sums
        if real < rows:  # the last batch on several ranks: count its real rows only
            counted = objective(model, take_rows(inputs, real))[1] if real else LossSums(*(t * 0 for t in sums))
        self.add_eval_local(counted.total())
        return outputs, sums

    def add_eval_local(self, sums: LossSums) -> None:
        """Sums of this rank's real examples only (objectives without per-sequence sums)."""
        self.eval_local += torch.stack([sums.loss.detach(), sums.count, sums.correct]).to(self.eval_local)
        self.eval_local_seen = True

    def eval_totals(self, accelerator=None) -> tuple[float, int, float] | None:
        if not (self.eval_seen or self.eval_local_seen):
            return None
        total = self.eval.clone()
        if self.eval_local_seen:
            total += reduce_sum(self.eval_local, accelerator) if accelerator is not None else self.eval_local
        loss_sum, count, correct = total.tolist()
        return loss_sum, int(count), correct
