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
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import datasets
import torch
from accelerate.utils import extract_model_from_parallel
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .arguments import TokenWeightedArguments, as_token_weighted_arguments, validate_settings
from .audit import AccumulationAuditCallback
from .batching import TokenBudgetBatchSampler, check_packing, is_packed
from .checkpoint import mark_checkpoint_complete, resolve_checkpoint, rotate_checkpoints
from .collator import warn_about_padding_labels
from .distributed import (
    all_ranks_agree,
    count_real_rows,
    get_gradient_scale,
    mark_for_deepspeed_skip,
    num_rows,
    take_rows,
    trim_repeated_examples,
)
from .loss import LossSums, sums_per_row
from .loss_path import choose_loss_path
from .meter import LossMeter
from .objective import (
    CausalLMObjective,
    LossFunctionObjective,
    ModelLossObjective,
    Objective,
    get_objective,
)
from .padding_free import check_padding_free, padding_free_problem, remove_padding, uses_one_row
from .step_gate import NonFiniteLossError, StepGate
from .window import Window, compute_micro_batch_loss, count_window

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
        self.window: Window | None = None  # the window of the optimizer step under way (hfacc/window.py)
        self._repeats_said = False
        self._eval_needs_logits = True  # evaluation_loop says when predictions are thrown away
        self._packing_checked = False
        self.padding_free = False  # decided with the objective, on the first micro-batch
        self.padding_free_one_row = True  # one row for variable-length attention kernels, else rows
        self.meter = LossMeter(self.args.device)
        if self.args.audit_every_n_steps:  # the step gate runs it first, before a skip could drop the gradient
            tolerance = self.args.audit_tolerance or None
            self.add_callback(
                AccumulationAuditCallback(self, every_n_steps=self.args.audit_every_n_steps, tolerance=tolerance)
            )
        self.step_gate = StepGate(self)  # audit -> no target -> not finite -> commit, before every optimizer step
        self.add_callback(self.step_gate)

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
        """Draw the window's micro-batches and open its :class:`~hfacc.window.Window` (one collective)."""
        batch_samples = list(islice(epoch_iterator, num_batches))
        repeated = self._drop_repeated_examples(batch_samples)
        if not self._packing_checked and batch_samples and is_packed(batch_samples[0]):
            self._check_packing(batch_samples[0])
        first = self.window is None
        self.window = self.open_window(batch_samples, device, repeated, warn=first)
        return batch_samples, self.window.num_targets

    def open_window(
        self, batch_samples: list, device: torch.device, repeated: set[int] = frozenset(), warn: bool = False
    ) -> Window:
        """The window of ``batch_samples``: its targets counted over all ranks, ready for ``compute_loss``."""
        # The Trainer holds these for the whole window anyway; the audit recomputes the window from them.
        batches = [b for j, b in enumerate(batch_samples) if j not in repeated]
        if warn:  # the first window
            warn_about_padding_labels(batches)
        counts = count_window(lambda b: self.get_objective(b).count(b), batches, self.accelerator, device)
        return Window(batches, counts, len(batch_samples), self.meter.zeros(), frozenset(repeated))

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
            if self.window is None or self.window.left <= 0:
                # compute_loss called outside the Trainer's loop (e.g. a user's own `training_step` call): the
                # micro-batch is a window of its own.
                self.window = self.open_window([inputs], self.args.device)
            window = self.window
            repeated = window.take()
            world = get_gradient_scale(self.accelerator.distributed_type, self.accelerator.num_processes)
            loss, outputs, sums = compute_micro_batch_loss(
                objective, model, inputs, window.counts, normalization=self.args.normalization, world_size=world
            )
            if repeated:  # only examples accelerate repeated: run for the all-reduce, contribute nothing
                loss, sums = loss * 0, LossSums(*(torch.zeros_like(t) for t in sums))
            window.stage(sums)
            if self.is_deepspeed_enabled and self.step_gate.deepspeed_skips_steps:
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


# Also importable from here, where they lived before (hfacc.trainer.TokenWeightedArguments, ...).
__all__ = ["TokenWeightedTrainer", "TokenWeightedArguments", "NonFiniteLossError", "get_gradient_scale"]
