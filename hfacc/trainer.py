"""``TokenWeightedTrainer``: a drop-in ``transformers.Trainer`` whose accumulated step equals one big batch.

How it differs from the stock Trainer, hook by hook:

- ``get_batch_samples`` (runs once per optimizer step, on the micro-batches of the window): counts the window's
  targets with the objective and sums the count over all ranks in one collective. Stock Trainer counts only when
  the model's forward takes ``**kwargs`` and only sums over ranks when ``average_tokens_across_devices``.
- ``compute_loss``: runs the model *without* labels and computes the loss from the logits itself, as
  ``S_j / N_window * P`` (see :func:`hfacc.loss.normalize_window_loss`). Stock Trainer relies on the model to
  consume ``num_items_in_batch``; custom models, heads that ignore it and ``**kwargs`` that drop it all go wrong.
- ``log`` / ``evaluation_loop``: replace the logged mean of micro-batch means with the token-weighted mean over
  windows and ranks, and add token accuracy, target counts and target tokens per second.
- A private callback checks every window before the optimizer step: a window without targets, or with a
  non-finite loss or gradient, leaves the parameters untouched.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import datasets
import torch
from accelerate.utils import DistributedType, extract_model_from_parallel
from torch.utils.data import DataLoader
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .arguments import TokenWeightedArguments, as_token_weighted_arguments, validate_settings
from .batching import TokenBudgetBatchSampler, check_packing, is_packed
from .checkpoint import mark_checkpoint_complete, resolve_checkpoint, rotate_checkpoints
from .distributed import (
    all_ranks_agree,
    count_real_rows,
    deepspeed_overflow_problem,
    get_gradient_scale,
    mark_for_deepspeed_skip,
    num_rows,
    reduce_sum,
    take_rows,
    trim_repeated_examples,
)
from .loss import IGNORE_INDEX, LossSums, WindowCounts, sums_per_row
from .loss_path import choose_loss_path
from .objective import (
    CausalLMObjective,
    LossFunctionObjective,
    ModelLossObjective,
    Objective,
    compute_micro_batch_loss,
    get_objective,
)
from .padding_free import check_padding_free, padding_free_problem, remove_padding, uses_one_row

logger = logging.getLogger(__name__)


class TokenWeightedTrainer(Trainer):
    """A ``transformers.Trainer`` whose accumulated gradient equals the gradient of one big batch, exactly.

    Per micro-batch j of a window (on every rank) it backpropagates ``S_j / N * P``: ``S_j`` the summed loss over
    j's targets, ``N`` the targets of the whole window summed over all P ranks. After accumulation and the ranks'
    gradient averaging, that is ``g = sum_j (n_j / N) g_j`` — the gradient of the mean loss over all N targets.
    It holds for any model that returns logits (transformers heads, PEFT models, plain ``nn.Module``) whatever
    ``average_tokens_across_devices`` says, since hfacc computes the loss itself.

    Args:
        objective: an :class:`hfacc.Objective` or its name; overrides ``args.objective``. Needed only for losses
            hfacc cannot infer from the model head.
        *args, **kwargs: as for ``transformers.Trainer``. ``args`` may be a plain ``TrainingArguments`` or a
            :class:`TokenWeightedArguments`.

    >>> trainer = TokenWeightedTrainer(model=model, args=TokenWeightedArguments(  # doctest: +SKIP
    ...     output_dir="out", per_device_train_batch_size=2, gradient_accumulation_steps=4),
    ...     train_dataset=dataset, data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id))
    >>> trainer.train()  # doctest: +SKIP
    """

    # `compute_loss` already divides by the whole window's target count: the Trainer must not divide by k again.
    loss_is_scaled_for_ga = True

    args: TokenWeightedArguments

    def __init__(self, model=None, args=None, *rest, objective: Objective | str | None = None, **kwargs):
        super().__init__(model, as_token_weighted_arguments(args), *rest, **kwargs)
        validate_settings(self.args)  # again: the arguments may have been changed since they were made
        self._objective_setting = objective if objective is not None else self.args.objective
        self.objective: Objective | None = self._objective_setting if isinstance(objective, Objective) else None
        if self.compute_loss_func is not None and self.objective is not None:
            raise ValueError(
                "Pass either compute_loss_func or an hfacc Objective, not both: each of them defines the loss. "
                "(objective='<name>' only says how targets are counted and combines with compute_loss_func.)"
            )
        pc = getattr(self.accelerator, "parallelism_config", None)
        if pc is not None and any(getattr(pc, f"{kind}_enabled", False) for kind in ("tp", "cp", "sp")):
            raise NotImplementedError(
                "hfacc counts targets per data-parallel rank; tensor, context and sequence parallelism are not "
                "supported yet. Remove parallelism_config or use the stock Trainer."
            )
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.accelerator.num_processes:
            raise RuntimeError(
                f"{launched} processes were launched (WORLD_SIZE) but this one trains alone (world size "
                f"{self.accelerator.num_processes}), so every process would train its own copy. On a machine without "
                "GPUs pass use_cpu=True (TokenWeightedArguments does this by itself) so the processes join over gloo."
            )
        if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true" and not self.is_fsdp_enabled:
            # accelerate enables FSDP only for GPU-like distributed types (state.py); CPU processes get DDP silently.
            logger.warning(
                "hfacc: the accelerate config asks for FSDP, but accelerate shards only on GPUs (and XPU/NPU/...): "
                "these %d CPU processes train as plain data parallel (DDP), each holding the whole model. The update "
                "is the same; the memory saving is not there.",
                self.accelerator.num_processes,
            )
        # A plain nn.Module without a `labels` argument would have its labels column removed by the Trainer.
        if not self.label_names:
            self.label_names = ["labels"]
        self.window: WindowCounts | None = None
        self.window_batches: list = []
        self._repeated_batches: set[int] = set()  # micro-batches of the window that only repeat examples
        self._repeats_said = False
        self._eval_needs_logits = True  # evaluation_loop says when predictions are thrown away
        self._packing_checked = False
        self.padding_free = False  # decided with the objective, on the first micro-batch
        self.padding_free_one_row = True  # one row for variable-length attention kernels, else rows
        self._window_left = 0
        self._deepspeed_skips_steps = True  # whether DeepSpeed's overflow check is on (known at train start)
        self.meter = LossMeter(self.args.device)
        if self.args.audit_every_n_steps:
            from .verify import AccumulationAuditCallback

            # Before the guard: the audit must see the window's gradient before a skip could drop it.
            tolerance = self.args.audit_tolerance or None
            self.add_callback(
                AccumulationAuditCallback(self, every_n_steps=self.args.audit_every_n_steps, tolerance=tolerance)
            )
        self.add_callback(_WindowGuard(self))

    # ---- data: micro-batches to a token budget ----------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """Stock dataloader, or micro-batches built to ``max_tokens_per_batch`` padded tokens when it is set."""
        budget = self.args.max_tokens_per_batch
        if not budget:
            return super().get_train_dataloader()
        dataset, collator = self.train_dataset, self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        if not hasattr(dataset, "__getitem__") or "input_ids" not in dataset[0]:
            raise ValueError("max_tokens_per_batch needs a map-style dataset whose examples have 'input_ids'.")
        lengths = dataset["input_ids"] if isinstance(dataset, datasets.Dataset) else [e["input_ids"] for e in dataset]
        sampler = TokenBudgetBatchSampler(
            [len(x) for x in lengths],
            budget,
            shuffle=self.args.train_sampling_strategy != "sequential",
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            group_size=self.args.length_group_size,
        )
        logger.info(
            "hfacc: %d micro-batches of <= %d padded tokens per epoch (%.1f %% padding).",
            len(sampler),
            budget,
            100 * sampler.padding_fraction,
        )
        loader = DataLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=collator,
            num_workers=self.args.dataloader_num_workers,
            pin_memory=self.args.dataloader_pin_memory,
            persistent_workers=self.args.dataloader_persistent_workers and self.args.dataloader_num_workers > 0,
        )
        return self.accelerator.prepare(loader)

    # ---- counting: once per window --------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device):
        """Collect the window's micro-batches and count their targets over all ranks (one collective)."""
        batch_samples = list(islice(epoch_iterator, num_batches))
        self._repeated_batches = self._drop_repeated_examples(batch_samples)
        # The Trainer holds these for the whole window anyway; the audit recomputes the window from them.
        self.window_batches = [b for j, b in enumerate(batch_samples) if j not in self._repeated_batches]
        if not self._packing_checked and batch_samples and is_packed(batch_samples[0]):
            self._check_packing(batch_samples[0])
        if self.window is None:  # the first window
            warn_about_padding_labels(self.window_batches)
        self.window = self.count_window(self.window_batches, device)
        self._window_left = len(batch_samples)
        self.meter.start_window()
        return batch_samples, self.window.num_targets

    def _drop_repeated_examples(self, batch_samples: list) -> set[int]:
        """Keep the examples accelerate repeats out of the window (:func:`hfacc.distributed.trim_repeated_examples`)."""
        repeated, cut = trim_repeated_examples(self.accelerator, batch_samples)
        if cut and not self._repeats_said:
            self._repeats_said = True
            logger.warning(
                "hfacc: the last batch of the epoch on rank %d holds %d example(s) that accelerate repeats so that "
                "every rank gets a full batch (even_batches); hfacc neither counts nor trains them, so the last step "
                "is the exact mean over the real examples (stock Trainer trains them twice).",
                self.accelerator.process_index,
                cut,
            )
        return repeated

    def _get_num_items_in_batch(self, batch_samples, device):
        # Replaces the stock count (and its cross-rank gather) wherever the Trainer asks for it, e.g. in
        # `prediction_step`: hfacc computes its own counts and never hands `num_items_in_batch` to the model.
        return None

    def _check_packing(self, batch) -> None:
        self._packing_checked = True
        problem = check_packing(self.model, self._prepare_inputs(batch))
        if problem:
            raise RuntimeError(
                f"hfacc: {problem}. Turn packing off (recipe: --packing false), or use a model and attention "
                "implementation that keep packed sequences apart (attn_implementation='sdpa' or "
                "'flash_attention_2' on a model whose forward takes position_ids)."
            )
        logger.info("hfacc: packed rows checked: each sequence's logits match its unpacked run.")

    def count_window(self, batch_samples: list[Mapping[str, Any]], device: torch.device) -> WindowCounts:
        """:class:`WindowCounts` of ``batch_samples`` summed over all data-parallel ranks."""
        counts = torch.zeros(2, dtype=torch.long, device=device)
        for batch in batch_samples:
            counts += self.get_objective(batch).count(batch).to(device)
        if self.accelerator.num_processes > 1:
            counts = self.accelerator.reduce(counts, reduction="sum")
        num_targets, num_sequences = counts.tolist()
        return WindowCounts(num_targets, num_sequences, len(batch_samples))

    def get_objective(self, batch: Mapping[str, Any]) -> Objective:
        """The objective, resolved from the model and the first batch it sees."""
        if self.objective is None:
            self.objective = get_objective(
                self.model, batch, name=self._objective_setting, label_smoothing=self.args.label_smoothing_factor
            )
            if self.compute_loss_func is not None:
                # The user's loss, with hfacc's count of the targets: exact if it divides by num_items_in_batch.
                # Padded micro-batches: the user's function shifts the labels itself, across any packed boundary.
                self.objective = LossFunctionObjective(self.compute_loss_func, counter=self.objective)
            else:
                self._setup_padding_free(self.objective, batch)
            if isinstance(self.objective, CausalLMObjective):
                self._setup_fused_loss(self.objective, batch)
            logger.info("hfacc: objective %s, normalization %r", self.objective, self.args.normalization)
            if isinstance(self.objective, ModelLossObjective) and self.args.normalization != "micro_batch":
                logger.warning("hfacc: with objective 'model_loss', every micro-batch counts as one target.")
        return self.objective

    def _setup_padding_free(self, objective: Objective, batch: Mapping[str, Any]) -> None:
        if not self.args.padding_free:
            return
        problem = padding_free_problem(self.model, objective)
        if problem is None:
            self.padding_free_one_row = uses_one_row(self.model)
            problem = check_padding_free(self.model, self._prepare_inputs(batch), self.padding_free_one_row)
            self.padding_free = all_ranks_agree(problem is None, self.accelerator)
        if self.padding_free:
            logger.info(
                "hfacc: padding-free micro-batches (%s): checked, logits match the padded run.",
                "one row" if self.padding_free_one_row else "packed in rows as wide as the longest sequence",
            )
        elif isinstance(objective, CausalLMObjective):
            logger.warning(
                "hfacc: padded micro-batches, as collated: %s. Set padding_free=False to skip the check.",
                problem or "another rank could not go padding-free",
            )
        else:
            logger.info("hfacc: padded micro-batches: %s.", problem)

    def _set_signature_columns_if_needed(self) -> None:
        # hfacc reads sequence boundaries from these even when the model's forward does not take them (Bloom): a
        # packed dataset whose position_ids were dropped as unused would silently let its sequences attend to each
        # other. The packing check then refuses such a model.
        super()._set_signature_columns_if_needed()
        self._signature_columns += [c for c in ("position_ids", "seq_lengths") if c not in self._signature_columns]

    def _setup_fused_loss(self, objective: CausalLMObjective, batch: Mapping[str, Any]) -> None:
        problem = choose_loss_path(
            objective,
            self.model,
            self._prepare_inputs(batch),
            self.accelerator,
            fused_loss=self.args.fused_loss,
            normalization=self.args.normalization,
            chunk_size=self.args.loss_chunk_size,
        )
        if objective.fused:
            logger.info("hfacc: fused chunked cross-entropy: the full logits are never materialized.")
        elif self.args.fused_loss:
            logger.warning("hfacc: plain loss path (full logits): %s.", problem)

    # ---- the loss: once per micro-batch ---------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``S_j / N_window * P`` in training; the micro-batch's own mean in evaluation.

        With ``return_outputs`` the outputs come back as stock Trainer's ``prediction_step`` reads them: a tuple
        output starts with the loss (the model ran without labels, so hfacc puts it there), a dict has no "loss".
        """
        objective = self.get_objective(inputs)
        packed = is_packed(inputs)
        if not model.training and isinstance(objective, CausalLMObjective):
            # The fused path returns loss sums where the logits would be: only when nobody reads the logits.
            objective.fused_in_eval = not self._eval_needs_logits
        if self.padding_free and (model.training or objective.fused_in_eval):  # eval: unless logits are wanted
            inputs = remove_padding(inputs, self.padding_free_one_row) or inputs
        if model.training:
            window, repeated = self._take_window_slot(inputs)
            world = get_gradient_scale(self.accelerator.distributed_type, self.accelerator.num_processes)
            loss, outputs, sums = compute_micro_batch_loss(
                objective, model, inputs, window, normalization=self.args.normalization, world_size=world
            )
            if repeated:  # only examples accelerate repeated: run for the all-reduce, contribute nothing
                loss, sums = loss * 0, LossSums(*(torch.zeros_like(t) for t in sums))
            self.meter.add_micro_batch(sums)
            if self.is_deepspeed_enabled and self._deepspeed_skips_steps:
                loss = mark_for_deepspeed_skip(loss, self.args.skip_nonfinite_steps, skip=window.num_targets == 0)
        else:
            outputs, sums = self._evaluation_sums(objective, model, inputs, packed)
            loss = sums.loss.sum() / sums.count.sum().clamp(min=1)
        if not return_outputs:
            return loss
        if not isinstance(objective, ModelLossObjective):  # that one gave the labels to the model: its own loss leads
            if torch.is_tensor(outputs):
                outputs = (loss, outputs)
            elif isinstance(outputs, (tuple, list)):
                outputs = (loss, *outputs)
        return loss, outputs

    def _evaluation_sums(self, objective: Objective, model, inputs, packed: bool) -> tuple[Any, LossSums]:
        """Run one evaluation batch; add its sums, without the examples accelerate repeated, to the meter."""
        if objective.sums_per_sequence:
            outputs, sums = objective(model, inputs, per_sequence=True)
            if packed:
                # One value per row, as gather_for_metrics expects: it drops the rows repeated across ranks.
                sums = sums_per_row(sums, inputs["position_ids"])
            self.meter.add_eval(sums, self.accelerator)  # gather_for_metrics drops the repeated rows
            return outputs, sums
        outputs, sums = objective(model, inputs)
        rows = num_rows(inputs)
        real = count_real_rows(self.accelerator, rows)
        counted = sums
        if real < rows:  # the last batch on several ranks: count its real rows only
            counted = objective(model, take_rows(inputs, real))[1] if real else LossSums(*(t * 0 for t in sums))
        self.meter.add_eval_local(counted.total())
        return outputs, sums

    def _take_window_slot(self, inputs) -> tuple[WindowCounts, bool]:
        if self._window_left <= 0:
            # compute_loss called outside the Trainer's loop (e.g. a user's own `training_step` call): the
            # micro-batch is a window of its own.
            self.window = self.count_window([inputs], self.args.device)
            self._window_left = 1
            self._repeated_batches = set()
            self.meter.start_window()
        index = self.window.num_micro_batches + len(self._repeated_batches) - self._window_left
        self._window_left -= 1
        return self.window, index in self._repeated_batches

    # ---- what gets logged -----------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Replace the Trainer's mean of micro-batch means by the exact token-weighted values."""
        if "loss" in logs:
            logs.update(self.meter.interval_logs(self.accelerator, self._has_accuracy()))
        if "train_loss" in logs:
            logs.update(self.meter.run_logs(self.accelerator, self._has_accuracy()))
        super().log(logs, start_time)

    def evaluation_loop(
        self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"
    ):
        """The stock loop; its ``{prefix}_loss`` (a mean of batch means) becomes the token-weighted mean.

        Predictions are what stock returns (the model's logits); the fused loss, which never builds them, runs
        only where stock throws them away: ``prediction_loss_only``, and ``evaluate()`` without ``compute_metrics``.
        """
        self.meter.reset_eval()
        loss_only = prediction_loss_only if prediction_loss_only is not None else self.args.prediction_loss_only
        self._eval_needs_logits = not loss_only
        try:
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        finally:
            self._eval_needs_logits = True
        totals = self.meter.eval_totals(self.accelerator)
        if totals is not None:
            loss_sum, count, correct = totals
            output.metrics[f"{metric_key_prefix}_loss"] = loss_sum / max(count, 1)
            output.metrics[f"{metric_key_prefix}_num_targets"] = int(count)
            if self._has_accuracy():
                output.metrics[f"{metric_key_prefix}_token_accuracy"] = correct / max(count, 1)
        return output

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` (or ``"last"``) takes the newest *complete* checkpoint."""
        resume_from_checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        self._undo_evaluation_preparation()
        output = super().train(resume_from_checkpoint, *args, **kwargs)
        # The stock value is the mean of per-step means; `log` put the exact token-weighted one in the metrics.
        return output._replace(training_loss=output.metrics.get("train_loss", output.training_loss))

    def _undo_evaluation_preparation(self) -> None:
        """Let ``train()`` wrap the model for data parallelism after an ``evaluate()`` that came first.

        The stock evaluation loop prepares a bare model in evaluation mode (no DDP wrapper), and accelerate marks it
        prepared; ``train()``'s own prepare then returns it unwrapped, so on several ranks each rank steps with its
        own gradient, never all-reduced (transformers 5.24 with accelerate 1.15; the recipe evaluates first).
        """
        model = self.model
        if (
            self.accelerator.num_processes > 1
            and not (self.is_deepspeed_enabled or self.is_fsdp_enabled)  # those prepare fully in evaluation too
            and self.model_wrapped is model
            and getattr(model, "_is_accelerate_prepared", False)
        ):
            extract_model_from_parallel(model, keep_fp32_wrapper=False)  # prepare() puts the autocast wrapper back
            model._is_accelerate_prepared = False
            self.accelerator._models = [m for m in self.accelerator._models if m is not model]

    def _save_checkpoint(self, model, trial) -> None:
        """The stock checkpoint, then a completion marker, then rotation: a crash mid-save never costs the last good one.

        Stock Trainer rotates old checkpoints inside the save; with ``save_total_limit=1`` a crash right after could
        leave only a half-written checkpoint. Here rotation waits until the new checkpoint is marked complete.
        """
        limit = self.args.save_total_limit
        self.args.save_total_limit = None
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self.args.save_total_limit = limit
        run_dir = self._get_output_dir(trial=trial)
        # Every rank writes files of its own (its RNG state; shards under FSDP/DeepSpeed): the marker, which lists
        # the checkpoint's files, must wait until all of them are written.
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            mark_checkpoint_complete(os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"))
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )

    def _has_accuracy(self) -> bool:
        return self.objective is not None and self.objective.has_accuracy


def warn_about_padding_labels(batches: list[Mapping[str, Any]]) -> None:
    """Say once when a collator left labels on padding: padding is never a target (:func:`hfacc.loss.shift_labels`).

    Stock ``Trainer`` would train them (the last token learns to predict the pad, pads predict pads); hfacc does not,
    padded or padding-free, so the two give the same update.
    """
    found = 0
    for batch in batches:
        labels, mask = batch.get("labels"), batch.get("attention_mask")
        if torch.is_tensor(labels) and torch.is_tensor(mask) and mask.shape == labels.shape:
            found += int(((labels != IGNORE_INDEX) & (mask == 0)).sum())
    if found:
        logger.warning(
            "hfacc: %d labels at padding positions (attention_mask 0) are not -100 in the first window; padding is "
            "never a target, so they are ignored. To train an end-of-sequence token, put it in the examples.",
            found,
        )


class LossMeter:
    """Token-weighted loss/accuracy bookkeeping, on device between logs (no host sync per micro-batch).

    A window's sums are *staged* until its optimizer step is taken; a skipped window never reaches the logs.
    """

    def __init__(self, device: torch.device):
        # float64: sums over thousands of micro-batches must not lose the fp32 digits that make the log exact.
        self.dtype = torch.float32 if torch.device(device).type == "mps" else torch.float64
        self.device = device
        self.reset_run()
        self.reset_eval()
        self.start_window()

    def _zeros(self) -> torch.Tensor:
        return torch.zeros(2, dtype=self.dtype, device=self.device)  # [loss sum, correct]

    def reset_run(self) -> None:
        self.run, self.run_targets = self._zeros(), 0
        self.interval, self.interval_targets = self._zeros(), 0
        self.skipped_steps = self.empty_windows = 0
        self.interval_start = time.perf_counter()
        self.extra: dict[str, float] = {}  # one-off values for the next log (e.g. the accumulation audit)

    def start_window(self) -> None:
        self.staged = self._zeros()
        self.staged_losses: list[torch.Tensor] = []

    def add_micro_batch(self, sums: LossSums) -> None:
        loss = sums.loss.detach().sum()
        self.staged_losses.append(loss)
        self.staged += torch.stack([loss.to(self.dtype), sums.correct.sum().to(self.dtype)])

    def commit_window(self, window: WindowCounts) -> None:
        self.interval += self.staged
        self.run += self.staged
        self.interval_targets += window.num_targets
        self.run_targets += window.num_targets
        self.start_window()

    def interval_logs(self, accelerator, with_accuracy: bool) -> dict[str, float]:
        loss_sum, correct = reduce_sum(self.interval, accelerator).tolist()
        now = time.perf_counter()
        logs = {
            "loss": loss_sum / self.interval_targets if self.interval_targets else float("nan"),
            "num_targets": self.interval_targets,
            "target_tokens_per_second": round(self.interval_targets / max(now - self.interval_start, 1e-9), 2),
        }
        if with_accuracy and self.interval_targets:
            logs["token_accuracy"] = correct / self.interval_targets
        if self.skipped_steps:
            logs["skipped_steps"] = self.skipped_steps
        logs.update(self.extra)
        self.extra = {}
        self.interval, self.interval_targets, self.interval_start = self._zeros(), 0, now
        return logs

    def run_logs(self, accelerator, with_accuracy: bool) -> dict[str, float]:
        loss_sum, correct = reduce_sum(self.run, accelerator).tolist()
        logs = {"train_loss": loss_sum / self.run_targets if self.run_targets else float("nan")}
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


class _WindowGuard(TrainerCallback):
    """Before each optimizer step: decide whether the window may update the weights.

    A window with zero targets on every rank has a zero gradient, but an optimizer step would still move the weights
    (Adam's momentum, weight decay). A non-finite loss or gradient would poison them. Either way the gradients are
    dropped, so ``optimizer.step()`` leaves every parameter as it was; the learning-rate schedule still advances.
    """

    def __init__(self, trainer: TokenWeightedTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer.meter.reset_run()
        if self.trainer.is_deepspeed_enabled:
            problem = deepspeed_overflow_problem(self.trainer.model_wrapped)
            # Without the check, a window made to overflow would be applied: NaN weights. Never poison it then.
            self.trainer._deepspeed_skips_steps = problem is None
            if problem and self.trainer.args.skip_nonfinite_steps:
                raise ValueError(
                    f"hfacc: skip_nonfinite_steps=True needs DeepSpeed to skip a step with inf/NaN gradients (its "
                    f"optimizer step runs inside the last micro-batch's backward, before hfacc can act), but {problem}. "
                    "Change the DeepSpeed config as said, or pass skip_nonfinite_steps=False to let such steps through."
                )

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        trainer, meter, window = self.trainer, self.trainer.meter, self.trainer.window
        if window is None:
            return
        if window.num_targets == 0:
            meter.empty_windows += 1
            logger.warning(
                "hfacc: step %d: no target in the whole window (every label is -100 on every rank); the step is "
                "skipped and the weights are unchanged (%d such windows so far).",
                state.global_step + 1,
                meter.empty_windows,
            )
            _drop_gradients(trainer)
            meter.start_window()
            return
        if trainer.args.skip_nonfinite_steps and not _window_is_finite(trainer, meter):
            meter.skipped_steps += 1
            culprits = [i for i, loss in enumerate(meter.staged_losses) if not torch.isfinite(loss)]
            where = (
                f"non-finite loss in micro-batch(es) {culprits} of {window.num_micro_batches} on rank "
                f"{trainer.accelerator.process_index}"
                if culprits
                else "non-finite gradient (the loss was finite on this rank)"
            )
            logger.warning(
                "hfacc: step %d skipped: %s. The weights were not updated (%d skipped so far).",
                state.global_step + 1,
                where,
                meter.skipped_steps,
            )
            _drop_gradients(trainer)
            meter.start_window()
            if trainer.args.max_skipped_steps and meter.skipped_steps >= trainer.args.max_skipped_steps:
                raise NonFiniteLossError(
                    f"{meter.skipped_steps} optimizer steps had a non-finite loss or gradient (limit "
                    f"max_skipped_steps={trainer.args.max_skipped_steps}); training stopped. The weights were never updated "
                    "with NaN/inf. Lower the learning rate, check the data the log names, or use bf16 instead of fp16."
                )
            return
        meter.commit_window(window)


class NonFiniteLossError(RuntimeError):
    """Too many optimizer steps had a non-finite loss or gradient."""


def _window_is_finite(trainer: TokenWeightedTrainer, meter: LossMeter) -> bool:
    if trainer.is_deepspeed_enabled and trainer.optimizer.step_was_skipped:
        return False  # DeepSpeed found inf/NaN in the gradients (its flag is already agreed over the ranks)
    grads = [p.grad for group in trainer.optimizer.param_groups for p in group["params"] if p.grad is not None]
    total = meter.staged[0].float()
    if grads:
        total = total + torch.nn.utils.get_total_norm(grads, norm_type=2.0, error_if_nonfinite=False).float()
    # Sharded (FSDP) gradients differ per rank: every rank must take the same decision.
    return all_ranks_agree(bool(torch.isfinite(total)), trainer.accelerator)


def _drop_gradients(trainer: TokenWeightedTrainer) -> None:
    if trainer.accelerator.distributed_type == DistributedType.DEEPSPEED:
        # The step already ran, inside the last backward. The window was made to overflow (mark_for_deepspeed_skip),
        # so DeepSpeed's own check must have skipped it and zeroed the gradients; if it did not, say so loudly.
        if not trainer._deepspeed_skips_steps:  # skip_nonfinite_steps=False with DeepSpeed's check off
            logger.warning(
                "hfacc: DeepSpeed's overflow check is off, so this step could not be skipped: it was taken."
            )
        elif not trainer.optimizer.step_was_skipped:
            raise NonFiniteLossError(
                "hfacc: DeepSpeed applied the update of a window that had to be skipped (no targets, or an inf/NaN "
                "loss): its overflow check is off. Enable it (bf16.check_grad_overflow: true, or "
                "zero_optimization.compute_grad_norm: true) or pass skip_nonfinite_steps=False."
            )
        return
    params = [p for group in trainer.optimizer.param_groups for p in group["params"]]
    if getattr(trainer.accelerator, "scaler", None) is not None:
        # fp16's GradScaler refuses a step without gradients; an inf makes it skip the step (and halve its scale).
        for p in params:
            if p.grad is not None:
                p.grad.fill_(float("inf"))
        return
    # torch optimizers leave a parameter whose .grad is None untouched: no update, no momentum, no weight decay.
    for p in params:
        p.grad = None
