"""``TokenWeightedTrainer``: a drop-in ``transformers.Trainer`` whose accumulated step equals one big batch.

How it differs from the stock Trainer, hook by hook:

- ``get_batch_samples`` (once per optimizer step) opens the step's :class:`~hfacc.window.Window`: its targets
  counted with the objective and summed over all ranks in one collective. Stock Trainer counts only when the
  model's forward takes ``**kwargs`` and only sums over ranks when ``average_tokens_across_devices``.
- ``compute_loss`` takes the window's next micro-batch, runs the model *without* labels and computes the loss
  itself, ``S_j / N_window * P`` (:func:`hfacc.loss.normalize_window_loss`). Stock Trainer relies on the model to
  consume ``num_items_in_batch``; custom models, heads that ignore it and ``**kwargs`` that drop it all go wrong.
- Before the optimizer step, the :class:`~hfacc.step_gate.StepGate` audits the window, drops it (no target, or a
  non-finite loss or gradient: the parameters stay untouched) or commits its sums to the metrics.
- ``log`` / ``evaluation_loop`` report the token-weighted mean over windows and ranks (:mod:`hfacc.meter`) instead
  of the mean of micro-batch means, with token accuracy, target counts and target tokens per second.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import datasets
import torch
from torch.utils.data import DataLoader
from transformers import Trainer

from .arguments import TokenWeightedArguments, as_token_weighted_arguments, validate_settings
from .audit import AccumulationAuditCallback
from .batching import build_token_budget_loader, is_packed, require_packing_support
from .checkpoint import complete_checkpoint, get_checkpoint_dir, resolve_checkpoint
from .collator import warn_about_padding_labels
from .distributed import (
    check_data_parallel,
    get_gradient_scale,
    mark_for_deepspeed_skip,
    trim_repeated_examples,
    undo_evaluation_preparation,
)
from .meter import LossMeter
from .model_setup import ModelSetup, build_model_setup
from .objectives import OBJECTIVES, ModelLossObjective, Objective
from .padding_free import remove_padding
from .step_gate import NonFiniteLossError, StepGate
from .streaming import (
    SFTStream,
    build_stream_loader,
    check_stream_training,
    read_stream_window,
    save_stream_state,
    take_stream_position,
)
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
        model, args, *rest, **kwargs: as for ``transformers.Trainer``. ``args`` may be a plain
            ``TrainingArguments``: it is converted once to :class:`TokenWeightedArguments` (hfacc's defaults added).

    >>> trainer = TokenWeightedTrainer(model=model, args=TokenWeightedArguments(  # doctest: +SKIP
    ...     output_dir="out", per_device_train_batch_size=2, gradient_accumulation_steps=4),
    ...     train_dataset=dataset, data_collator=DataCollatorForCausalLM(tokenizer.pad_token_id))
    >>> trainer.train()  # doctest: +SKIP
    """

    # `compute_loss` already divides by the whole window's target count: the Trainer must not divide by k again.
    loss_is_scaled_for_ga = True

    args: TokenWeightedArguments

    def __init__(self, model=None, args=None, *rest, objective: Objective | str | None = None, **kwargs):
        args = as_token_weighted_arguments(args)
        if isinstance(kwargs.get("train_dataset", rest[1] if len(rest) > 1 else None), SFTStream):
            check_stream_training(args)  # before the stock __init__, whose error does not say what to set
        super().__init__(model, args, *rest, **kwargs)
        validate_settings(self.args)  # again: the arguments may have been changed since they were made
        self._objective_setting = objective if objective is not None else self.args.objective
        self.objective: Objective | None = self._objective_setting if isinstance(objective, Objective) else None
        if self.compute_loss_func is not None and self.objective is not None:
            raise ValueError(
                "Pass either compute_loss_func or an hfacc Objective, not both: each of them defines the loss. "
                "(objective='<name>' only says how targets are counted and combines with compute_loss_func.)"
            )
        check_data_parallel(self.accelerator, self.is_fsdp_enabled)
        # A plain nn.Module without a `labels` argument would have its labels column removed by the Trainer.
        if not self.label_names:
            self.label_names = ["labels"]
        self.window: Window | None = None  # the window of the optimizer step under way (hfacc/window.py)
        # Every per-model decision (objective, layout, loss path, the objective's own), taken once before the first
        # window (hfacc/model_setup.py).
        self.model_setup: ModelSetup | None = None
        self._repeats_said = False
        self._eval_needs_logits = True  # evaluation_loop says when predictions are thrown away
        self._packing_checked = False
        self.meter = LossMeter(self.args.device)
        self._stream_batches = self._stream_position = self._stream_resume = None  # a stream's reader, place, resume
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
        if isinstance(self.train_dataset, SFTStream):
            loader, self._stream_batches = build_stream_loader(
                self.train_dataset, self.data_collator, self.args, self._stream_resume
            )
            return loader
        if not budget:
            return super().get_train_dataloader()
        dataset, collator = self.train_dataset, self.data_collator
        if isinstance(dataset, datasets.Dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        measured = hasattr(getattr(collator, "data_collator", collator), "example_length")
        if not hasattr(dataset, "__getitem__") or not (measured or "input_ids" in dataset[0]):
            raise ValueError("max_tokens_per_batch needs a map-style dataset whose examples have 'input_ids'.")
        loader = build_token_budget_loader(dataset, collator, self.args)
        return self.accelerator.prepare(loader)

    # ---- counting: once per window --------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device):
        """Draw the window's micro-batches and open its :class:`~hfacc.window.Window` (one collective)."""
        if self._stream_batches is not None:  # a bad row stops every rank; the window ends at a stream position
            batch_samples = read_stream_window(epoch_iterator, num_batches, self.accelerator)
            self._stream_position = take_stream_position(batch_samples) or self._stream_position
        else:
            batch_samples = list(islice(epoch_iterator, num_batches))
        if not self._packing_checked and batch_samples and is_packed(batch_samples[0]):
            self._packing_checked = True
            require_packing_support(self.model, self._prepare_inputs(batch_samples[0]))
        if self.model_setup is None and batch_samples:  # before the first window is counted
            self.setup_model(batch_samples[0])
        # The objective says what an example of a batch is (a preference pair is two rows).
        repeated, cut = trim_repeated_examples(
            self.accelerator, batch_samples, warn=not self._repeats_said, examples=self.objective
        )
        self._repeats_said |= cut > 0
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
        if self.model_setup is None and batches:
            self.setup_model(batches[0])
        objective = self.objective
        units = len(objective.units) if objective is not None else 2
        counts = count_window(objective.count if objective else None, batches, self.accelerator, device, units)
        return Window(batches, counts, len(batch_samples), repeated=frozenset(repeated), dtype=self.meter.dtype)

    def _get_num_items_in_batch(self, batch_samples, device):
        # Replaces the stock count (and its cross-rank gather) wherever the Trainer asks for it, e.g. in
        # `prediction_step`: hfacc computes its own counts and never hands `num_items_in_batch` to the model.
        return None

    def setup_model(self, batch: Mapping[str, Any]) -> ModelSetup:
        """Take every per-model decision once, from the first micro-batch (:func:`hfacc.model_setup.build_model_setup`):
        the objective, the layout, the loss path and what the objective sets up itself."""
        self.model_setup = build_model_setup(
            self.model,
            self._prepare_inputs(batch),
            self.accelerator,
            objective=self.objective if self.objective is not None else self._objective_setting,
            padding_free=self.args.padding_free,
            fused_loss=self.args.fused_loss,
            normalization=self.args.normalization,
            chunk_size=self.args.loss_chunk_size,
            label_smoothing=self.args.label_smoothing_factor,
            compute_loss_func=self.compute_loss_func,
            args=self.args,
            trainer=self,
        )
        self.objective = self.model_setup.objective
        return self.model_setup

    def get_objective(self, batch: Mapping[str, Any]) -> Objective:
        """The objective; the per-model setup runs first if no window has run it yet (e.g. ``evaluate()`` first)."""
        if self.model_setup is None:
            self.setup_model(batch)
        return self.objective

    @property
    def padding_free(self) -> bool:
        """Whether micro-batches are laid out without their padding (decided by the per-model setup)."""
        return self.model_setup is not None and self.model_setup.padding_free

    def _set_signature_columns_if_needed(self) -> None:
        # hfacc reads sequence boundaries from these even when the model's forward does not take them (Bloom): a
        # packed dataset whose position_ids were dropped as unused would silently let its sequences attend to each
        # other. The packing check then refuses such a model. An objective given as an instance names the columns
        # it reads itself (Objective.columns).
        super()._set_signature_columns_if_needed()
        setting = self._objective_setting
        objective = self.objective if self.objective is not None else OBJECTIVES.get(setting, None)
        wanted = ("position_ids", "seq_lengths", *(objective.columns if objective is not None else ()))
        self._signature_columns += [c for c in wanted if c not in self._signature_columns]

    # ---- the loss: once per micro-batch ---------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """``S_j / N_window * P`` in training; the micro-batch's own mean in evaluation.

        With ``return_outputs`` the outputs come back as stock Trainer's ``prediction_step`` reads them: a tuple
        output starts with the loss (the model ran without labels, so hfacc puts it there), a dict has no "loss".
        """
        objective = self.get_objective(inputs)
        packed = is_packed(inputs)
        if not model.training and objective.supports_fused:
            # The fused path returns loss sums where the logits would be: only when nobody reads the logits.
            objective.fused_in_eval = not self._eval_needs_logits
        if self.padding_free and (model.training or objective.fused_in_eval):  # eval: unless logits are wanted
            inputs = remove_padding(inputs, self.model_setup.one_row, keep=objective.row_keys) or inputs
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
                loss, sums = loss * 0, objective.zero_sums(sums)
            window.stage(objective.metric_sums(sums))
            if self.is_deepspeed_enabled and self.step_gate.deepspeed_skips_steps:
                loss = mark_for_deepspeed_skip(loss, self.args.skip_nonfinite_steps, skip=window.num_targets == 0)
        else:
            outputs, sums = self.meter.add_evaluation_batch(objective, model, inputs, packed, self.accelerator)
            loss = objective.mean_loss(sums)
        if not return_outputs:
            return loss
        if not isinstance(objective, ModelLossObjective):  # that one gave the labels to the model: its own loss leads
            if torch.is_tensor(outputs):
                outputs = (loss, outputs)
            elif isinstance(outputs, (tuple, list)):
                outputs = (loss, *outputs)
        return loss, outputs

    # ---- what gets logged -----------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Replace the Trainer's mean of micro-batch means by the exact token-weighted values."""
        if "loss" in logs:
            logs.update(self.meter.interval_logs(self.accelerator, self.objective))
        if "train_loss" in logs:
            logs.update(self.meter.run_logs(self.accelerator, self.objective))
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
            output.metrics.update(self.objective.metric_logs(totals, prefix=f"{metric_key_prefix}_"))
        return output

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``; ``resume_from_checkpoint=True`` (or ``"last"``) takes the newest *complete* checkpoint."""
        resume_from_checkpoint = resolve_checkpoint(resume_from_checkpoint, self.args.output_dir)
        undo_evaluation_preparation(self.accelerator, self.model, self.model_wrapped)
        streaming = isinstance(self.train_dataset, SFTStream)
        self._stream_resume = resume_from_checkpoint if streaming else None
        skip = self.args.ignore_data_skip
        # A stream resumes from the position saved in the checkpoint, not by reading and dropping every micro-batch
        # trained before (the Trainer's skip_first_batches).
        self.args.ignore_data_skip = skip or (streaming and resume_from_checkpoint is not None)
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.ignore_data_skip, self._stream_resume = skip, None
        # The stock value is the mean of per-step means; `log` put the exact token-weighted one in the metrics.
        return output._replace(training_loss=output.metrics.get("train_loss", output.training_loss))

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
        if self._stream_batches is not None:  # each rank's own position in the stream, before the marker lists files
            checkpoint = get_checkpoint_dir(self._get_output_dir(trial=trial), self.state.global_step)
            save_stream_state(self._stream_batches, self._stream_position, checkpoint)
        # Every rank writes files of its own (its RNG state; shards under FSDP/DeepSpeed): the marker, which lists
        # the checkpoint's files, must wait until all of them are written.
        self.accelerator.wait_for_everyone()
        if self.args.should_save:
            complete_checkpoint(self._get_output_dir(trial=trial), self.state, limit)


# Also importable from here, where they lived before (hfacc.trainer.TokenWeightedArguments, ...).
__all__ = ["TokenWeightedTrainer", "TokenWeightedArguments", "NonFiniteLossError", "get_gradient_scale"]
