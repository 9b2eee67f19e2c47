"""The logged metrics: exact means over windows and ranks, each over its own unit, in training and evaluation.

What is logged is the objective's (:meth:`hfacc.Objective.metric_sums`: sums such as ``[loss sum, targets,
correct]``; :meth:`hfacc.Objective.metric_logs`: the means they give). The meter only adds the sums up — per
logging interval, per run, per evaluation — on device until a log needs them, and over all ranks when it does
(a column of extremes, such as a reward model's ``min_reward``, by its minimum or maximum instead:
:meth:`hfacc.Objective.reduce_metrics`).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..objectives import Objective
from ..ops.loss import sums_per_row
from ..runtime.distributed import count_real_rows, num_rows, reduce_sum, take_rows


class LossMeter:
    """Metric bookkeeping, on device between logs (no host sync per micro-batch).

    A window's sums are staged on the window (:meth:`hfacc.training.window.Window.stage`) and reach the logs only when
    the step gate commits it (:meth:`commit`): a skipped window never does.
    """

    def __init__(self, device: torch.device):
        # float64: sums over thousands of micro-batches must not lose the fp32 digits that make the log exact.
        self.dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64
        self.device = device
        self.reduce = _sum_rows  # how rows of logged sums combine: the objective's (Objective.reduce_metrics)
        self.reset_run()
        self.reset_eval()

    def reset_run(self) -> None:
        self.run = self.interval = None  # summed metric_sums, None until a window is committed
        self.run_targets = self.interval_targets = 0
        self.skipped_steps = self.empty_windows = 0
        self.interval_start = time.perf_counter()
        self.extra: dict[str, float] = {}  # one-off values for the next log (e.g. the accumulation audit)

    def commit(self, window) -> None:
        """Add a window's staged sums (:class:`hfacc.training.window.Window`) to the metrics of the interval and the
        run."""
        if window.staged is None:  # no micro-batch ran on this rank
            return
        staged = window.staged.to(self.dtype)
        self.interval = staged.clone() if self.interval is None else self.combine(self.interval, staged)
        self.run = staged.clone() if self.run is None else self.combine(self.run, staged)
        self.interval_targets += window.num_targets
        self.run_targets += window.num_targets

    def combine(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """Two rows of summed metric sums as one."""
        return self.reduce(torch.stack([a, b]))

    def over_ranks(self, values: torch.Tensor, accelerator) -> torch.Tensor:
        """``values`` combined over all ranks (each rank's own row; summed unless a column is an extreme)."""
        if accelerator.num_processes == 1:
            return values
        if self.reduce is _sum_rows or getattr(self.reduce, "__func__", None) is Objective.reduce_metrics:
            return reduce_sum(values, accelerator)  # plain sums: one all-reduce
        return self.reduce(accelerator.gather(values[None]))

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` of other work (an online trainer's generation) out of the interval's training rate."""
        self.interval_start += seconds

    def training_seconds(self) -> float:
        """Seconds of the interval so far that were spent training (what the logged rate divides by)."""
        return time.perf_counter() - self.interval_start

    def interval_logs(self, accelerator, objective) -> dict[str, float]:
        now = time.perf_counter()
        logs = self._logs(self.interval, accelerator, objective, "")
        logs[getattr(objective, "rate_name", "target_tokens_per_second")] = round(
            self.interval_targets / max(now - self.interval_start, 1e-9), 2
        )
        if self.skipped_steps:
            logs["skipped_steps"] = self.skipped_steps
        logs.update(self.extra)
        self.extra = {}
        self.interval, self.interval_targets, self.interval_start = None, 0, now
        return logs

    def run_logs(self, accelerator, objective) -> dict[str, float]:
        logs = self._logs(self.run, accelerator, objective, "train_")
        logs["train_skipped_steps"] = self.skipped_steps
        return logs

    def _logs(self, sums: torch.Tensor | None, accelerator, objective, prefix: str) -> dict[str, float]:
        # Every rank commits the same windows (the step gate's decisions are agreed), so all of them reduce or none.
        # No loss when no window reached the weights (every step skipped, or nothing trained): not a NaN to plot.
        if sums is None or objective is None:
            return {f"{prefix}num_targets": 0}
        return objective.metric_logs(self.over_ranks(sums, accelerator).tolist(), prefix)

    def reset_eval(self) -> None:
        self.eval = None  # summed metric_sums of all ranks (per-sequence sums, gathered without repeats)
        self.eval_local = None  # this rank's, reduced at the end (objectives without per-sequence sums)

    def add_eval(self, values: torch.Tensor, accelerator) -> None:
        """Per-example metric sums ``[B, M]`` of one batch, gathered over the ranks without accelerate's repeats."""
        values = values.to(self.dtype)
        if accelerator.num_processes > 1:
            # gather_for_metrics drops the samples the sampler repeated to even out the last batch across ranks.
            values = accelerator.gather_for_metrics(values)
        total = self.reduce(values.reshape(-1, values.shape[-1]))
        self.eval = total if self.eval is None else self.combine(self.eval, total)

    def add_evaluation_batch(self, objective, model, inputs, packed: bool, accelerator) -> tuple[Any, Any]:
        """Run one evaluation batch; add its sums, without the examples accelerate repeated, to the eval totals."""
        self.reduce = objective.reduce_metrics
        if objective.sums_per_sequence:
            outputs, sums = objective(model, inputs, per_sequence=True)
            values = objective.metric_sums(sums)
            if packed:
                # One value per row, as gather_for_metrics expects: it drops the rows repeated across ranks.
                values = sums_per_row(values, inputs["position_ids"])
            self.add_eval(values, accelerator)  # gather_for_metrics drops the repeated rows
            return outputs, sums
        outputs, sums = objective(model, inputs)
        rows = num_rows(inputs)
        real = count_real_rows(accelerator, rows)
        counted = sums
        if real < rows:  # the last batch on several ranks: count its real rows only
            counted = objective(model, take_rows(inputs, real))[1] if real else objective.zero_sums(sums)
        self.add_eval_local(objective.metric_sums(counted))
        return outputs, sums

    def add_eval_local(self, values: torch.Tensor) -> None:
        """Metric sums of this rank's real examples only (objectives without per-sequence sums)."""
        values = self.reduce(values.to(self.dtype).reshape(-1, values.shape[-1]))
        self.eval_local = values if self.eval_local is None else self.combine(self.eval_local, values)

    def eval_totals(self, accelerator=None) -> list[float] | None:
        """The evaluation's summed metric sums (all ranks), for :meth:`hfacc.Objective.metric_logs`; None if none."""
        local = self.eval_local
        if local is not None and accelerator is not None:
            local = self.over_ranks(local, accelerator)
        if self.eval is None and local is None:
            return None
        if self.eval is None:
            return local.tolist()
        return (self.eval if local is None else self.combine(self.eval, local)).tolist()


def _sum_rows(values: torch.Tensor) -> torch.Tensor:
    return values.sum(0)
