"""``TokenWeightedTrainer``: a drop-in ``transformers.Trainer`` whose accumulated step equals one big batch.

How it differs from the stock Trainer, hook by hook:

- ``get_batch_samples`` (once per optimizer step) opens the step's :class:`~hfacc.training.window.Window`: its targets
  counted with the objective and summed over all ranks in one collective, and the objective's statistics of the whole
  step taken (:meth:`hfacc.Objective.window_statistics`: KTO's reference point; none for most objectives). Stock
  Trainer counts only when the model's forward takes ``**kwargs`` and only sums over ranks when
  ``average_tokens_across_devices``.
- ``compute_loss`` takes the window's next micro-batch, runs the model *without* labels and computes the loss
  itself, ``S_j / N_window * P`` (:func:`hfacc.ops.loss.normalize_window_loss`). Stock Trainer relies on the model to
  consume ``num_items_in_batch``; custom models, heads that ignore it and ``**kwargs`` that drop it all go wrong.
- Before the optimizer step, the :class:`~hfacc.training.step_gate.StepGate` audits the window, drops it (no target, or
  a non-finite loss or gradient: the parameters stay untouched) or commits its sums to the metrics.
- ``log`` / ``evaluation_loop`` report the token-weighted mean over windows and ranks (:mod:`hfacc.training.meter`)
  instead of the mean of micro-batch means, with token accuracy, target counts and target tokens per second.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from itertools import islice
from typing import Any

import torch
from torch.utils.data import DataLoader
from transformers import Trainer
from transformers.trainer_utils import has_length

from ..data.batching import build_token_budget_loader, get_longest_sequence, is_map_dataset, is_packed
from ..data.collator import warn_about_padding_labels
from ..data.multimodal import IMAGE_COLUMN
from ..data.padding_free import padded_neftune_noise, remove_padding
from ..data.streaming import (
    SFTStream,
    build_stream_loader,
    check_stream_training,
    holds_stream_state,
    read_stream_window,
    save_stream_state,
    take_stream_position,
)
from ..models.reference import copy_initial_policy, is_peft_model
from ..objectives import OBJECTIVES, ModelLossObjective, Objective
from ..runtime.config import ConfigError
from ..runtime.distributed import (
    all_ranks_agree,
    check_data_parallel,
    count_real_rows,
    forward_set_epoch,
    gather_objects,
    get_epoch_cursor,
    get_epoch_layout,
    get_gradient_scale,
    mark_for_deepspeed_skip,
    trim_repeated_examples,
    undo_evaluation_preparation,
)
from ..runtime.sequence_parallel import (
    DataCollatorForSequenceParallel,
    EqualLengthLoader,
    check_sequence_parallel_objective,
    fit_ulysses_attention,
    get_sequence_parallel_gradient_scale,
    get_sequence_parallel_size,
    init_deepspeed_comm,
    with_labels,
)
from ..setup.layout_check import require_packing_support
from ..setup.model_setup import ModelSetup, build_model_setup
from .arguments import TokenWeightedArguments, as_token_weighted_arguments, validate_settings
from .audit import AccumulationAuditCallback
from .checkpoint import (
    complete_checkpoint,
    describe_save_failure,
    get_checkpoint_dir,
    get_checkpoint_step,
    get_dataset_identity,
    get_run_settings,
    prepare_run,
    read_marker,
    saved_under_original_names,
    unmark_checkpoint,
)
from .hashing import hashing_writes, relative_digests
from .meter import LossMeter
from .step_gate import StepGate
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
        data_settings: the settings that built ``train_dataset`` (a job's,
            :func:`hfacc.training.checkpoint.get_data_settings`): with the rows' own identity, part of the run's
            identity in its checkpoints, so that auto-resume and ``last`` never continue another data's run.
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
    _epoch_layout = _epoch_cursor = (
        None  # where accelerate repeats examples in each epoch (hfacc/runtime/distributed.py)
    )
    _data_skipped = False  # whether this train() call resumes mid-epoch by skipping micro-batches
    _nothing_to_train = False  # a finished run was resumed: no step, no save
    _resumed_counters: dict | None = None  # the step gate's counts saved in the checkpoint resumed from
    _run_settings: dict | None = None  # what identifies this run in its checkpoints (hfacc/training/checkpoint.py)
    # The data settings that built train_dataset (a job's, get_data_settings): part of this run's identity.
    data_settings: dict | None = None
    _initial_policy = None  # a resumed run's copy of the policy before its checkpoint loaded (the reference's)

    def __init__(
        self,
        model=None,
        args=None,
        *rest,
        objective: Objective | str | None = None,
        data_settings: dict | None = None,
        **kwargs,
    ):
        args = as_token_weighted_arguments(args)
        if data_settings is not None:
            self.data_settings = dict(data_settings)
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
        # DeepSpeed Ulysses: each sequence split over sp_size ranks (hfacc/runtime/sequence_parallel.py).
        self.sp_size = get_sequence_parallel_size(self.accelerator)
        if self.sp_size > 1:
            init_deepspeed_comm()
        # A plain nn.Module without a `labels` argument would have its labels column removed by the Trainer.
        if not self.label_names:
            self.label_names = ["labels"]
        self.window: Window | None = None  # the window of the optimizer step under way (hfacc/training/window.py)
        # Every per-model decision (objective, layout, loss path, the objective's own), taken once before the first
        # window (hfacc/setup/model_setup.py).
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
        if self.objective is not None:  # what the objective reads of every row, checked before any is collated
            self.objective.check_data(self.train_dataset, "the training data")
            evaluation = self.eval_dataset if isinstance(self.eval_dataset, dict) else {"": self.eval_dataset}
            for name, dataset in evaluation.items():
                self.objective.check_data(dataset, f"the evaluation data {name}".strip())

    # ---- data: micro-batches to a token budget ----------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """Stock dataloader, or micro-batches built to ``max_tokens_per_batch`` padded tokens when it is set."""
        budget = self.args.max_tokens_per_batch
        if isinstance(self.train_dataset, SFTStream):
            loader, self._stream_batches = build_stream_loader(
                self.train_dataset, self.data_collator, self.args, self._stream_resume
            )
            return loader
        if self.sp_size > 1:  # rows cut into sp_size shards by the engine: labels shifted before the cut
            collator = self.data_collator
            pad_id = getattr(collator, "pad_token_id", None) or 0
            self.data_collator = DataCollatorForSequenceParallel(collator, self.sp_size, pad_id)
            try:
                loader = self._train_dataloader(budget)
            finally:
                self.data_collator = collator
            return EqualLengthLoader(loader, pad_id) if torch.distributed.get_backend() == "gloo" else loader
        return self._train_dataloader(budget)

    def _train_dataloader(self, budget) -> DataLoader:
        if not budget:
            loader = super().get_train_dataloader()
            if has_length(self.train_dataset):  # where accelerate's repeats are, from the sizes alone
                self._epoch_layout = get_epoch_layout(
                    self.accelerator,
                    num_examples=len(self.train_dataset),
                    batch_size=self._train_batch_size,
                    drop_last=self.args.dataloader_drop_last,
                )
            return loader
        dataset, collator = self.train_dataset, self.data_collator
        if is_map_dataset(dataset):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collator = self._get_collator_with_removed_columns(collator, description="training")
        measured = hasattr(getattr(collator, "data_collator", collator), "example_length")
        if not hasattr(dataset, "__getitem__") or not (measured or "input_ids" in dataset[0]):
            raise ValueError("max_tokens_per_batch needs a map-style dataset whose examples have 'input_ids'.")
        loader = build_token_budget_loader(dataset, collator, self.args)
        self._epoch_layout = get_epoch_layout(self.accelerator, num_batches=len(loader.batch_sampler))
        prepared = self.accelerator.prepare(loader)
        forward_set_epoch(prepared, loader.batch_sampler)
        return prepared

    # ---- counting: once per window --------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device):
        """Draw the window's micro-batches and open its :class:`~hfacc.training.window.Window` (one collective)."""
        if self._resumed_counters:  # after the step gate reset them at the start of training
            self.meter.skipped_steps = self._resumed_counters.get("skipped_steps", 0)
            self.meter.empty_windows = self._resumed_counters.get("empty_windows", 0)
            self._resumed_counters = None
        if self.state.global_step >= self.state.max_steps:
            # Only a resumed, finished run gets here (the Trainer stops at max_steps otherwise); stock Trainer would
            # train one more step on every such resume.
            self._nothing_to_train = self.control.should_training_stop = True
            return [], None
        if self._stream_batches is not None:  # a bad row stops every rank; the window ends at a stream position
            batch_samples = read_stream_window(epoch_iterator, num_batches, self.accelerator)
            self._stream_position = take_stream_position(batch_samples) or self._stream_position
        else:
            batch_samples = list(islice(epoch_iterator, num_batches))
        if self.sp_size > 1:
            batch_samples = [with_labels(b) for b in batch_samples]
        if self.sp_size > 1 and batch_samples and is_packed(batch_samples[0]):
            raise NotImplementedError(
                "packed rows with sp_size > 1: DeepSpeed Ulysses attends over a packed row as one causal sequence "
                "(sdpa drops the mask); pad the rows (DataCollatorForCausalLM without packing) or set sp_size=1."
            )
        if not self._packing_checked and batch_samples and is_packed(batch_samples[0]):
            self._packing_checked = True
            require_packing_support(self.model, self._prepare_inputs(batch_samples[0]))
        if self.model_setup is None and batch_samples:
            # Before the first window is counted, on every rank at the same window (its checks are collectives),
            # even on a rank whose only micro-batch repeats examples (they are cut below, by the objective's examples).
            self.setup_model(batch_samples[0])
        repeated = set()
        # Under sequence parallelism the engine's loader draws one batch per rank of the sequence group; the ranks
        # of a group see each other's batches, so accelerate's repeats are not where the epoch layout says.
        if batch_samples and self.accelerator.num_processes > 1 and self._stream_batches is None and self.sp_size == 1:
            # The objective says what an example of a batch is (a preference pair is two rows).
            examples = self.objective.num_examples(batch_samples[-1])
            if self._epoch_cursor is None:  # the first window of this train() call
                loader, step = self.callback_handler.train_dataloader, self.state.global_step
                accumulation = self.args.gradient_accumulation_steps
                cursor = get_epoch_cursor(self._epoch_layout, loader, step, accumulation, self._data_skipped)
                self._epoch_cursor = cursor or False
            if self._epoch_cursor:
                real = self._epoch_cursor.real_rows(epoch_iterator, batch_samples, examples)
            else:  # a loader hfacc did not build: what accelerate's loader says of itself
                real = count_real_rows(self.accelerator, examples)
            rank = self.accelerator.process_index
            repeated, cut = trim_repeated_examples(
                batch_samples, real, rank, warn=not self._repeats_said, examples=self.objective
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
        window = Window(batches, counts, len(batch_samples), repeated=frozenset(repeated), dtype=self.meter.dtype)
        if objective is not None:
            window.reduce = self.meter.reduce = objective.reduce_metrics
            # A statistic of the whole step (KTO's reference point), over every micro-batch and rank, before the first
            # backward; micro-batches of repeated examples run too (a sharded model's forwards are collectives).
            prepared = [self._prepare_inputs(b) for b in batch_samples]
            with self.compute_loss_context_manager():
                window.statistics = objective.window_statistics(
                    self.model_wrapped, prepared, self.accelerator, layout=self._layout, repeated=repeated
                )
        return window

    def _layout(self, batch: Mapping[str, Any]) -> Mapping[str, Any]:
        """``batch`` laid out as training lays out its micro-batches (padding-free where the setup decided so)."""
        if not self.padding_free:
            return batch
        setup, keep = self.model_setup, self.objective.row_keys
        if setup.shared_prompts is not None:  # pairs: each prompt once (hfacc.data.shared_prompts)
            laid = setup.shared_prompts.lay_out(batch, keep=keep)
            if laid is not None:
                return laid
        return remove_padding(batch, setup.one_row, setup.max_row_length, keep=keep) or batch

    def _get_num_items_in_batch(self, batch_samples, device):
        # Replaces the stock count (and its cross-rank gather) wherever the Trainer asks for it, e.g. in
        # `prediction_step`: hfacc computes its own counts and never hands `num_items_in_batch` to the model.
        return None

    def setup_model(self, batch: Mapping[str, Any]) -> ModelSetup:
        """Take every per-model decision once, from the first micro-batch
        (:func:`hfacc.setup.model_setup.build_model_setup`): the objective, the layout, the loss path and what the
        objective sets up itself."""
        if self.sp_size > 1:  # the engine's attention is registered by now (prepare): the reference's forwards too
            fit_ulysses_attention(lambda: self.model.training)
        self.model_setup = build_model_setup(
            self.model,
            self._prepare_inputs(batch),
            self.accelerator,
            objective=self.objective if self.objective is not None else self._objective_setting,
            # Ulysses needs every rank of a sequence group to hold the same shape: padded rows.
            padding_free=self.args.padding_free and self.sp_size == 1,
            shared_prompts=self.args.shared_prompts,
            fused_loss=self.args.fused_loss,
            normalization=self.args.normalization,
            chunk_size=self.args.loss_chunk_size,
            label_smoothing=self.args.label_smoothing_factor,
            compute_loss_func=self.compute_loss_func,
            args=self.args,
            trainer=self,
            longest_sequence=get_longest_sequence(self.train_dataset),
            initial_policy=self._initial_policy,
        )
        self._initial_policy = None  # the reference holds what it needs of it
        self.objective = self.model_setup.objective
        check_sequence_parallel_objective(self.objective.name, self.sp_size)
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
        # And the image references DataCollatorForVisionLM decodes (hfacc.data.vision): the model takes pixels, not
        # them. An objective named in the settings (objective="grpo") reads its columns too: its class says which.
        objective = self.objective if self.objective is not None else OBJECTIVES.get(self._objective_setting)
        wanted = ("position_ids", "seq_lengths", IMAGE_COLUMN, *(objective.columns if objective is not None else ()))
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
        padded = inputs
        if self.padding_free and (model.training or objective.fused_in_eval):  # eval: unless logits are wanted
            inputs = self._layout(inputs)
        if model.training:
            if self.window is None or self.window.left <= 0:
                # compute_loss called outside the Trainer's loop (e.g. a user's own `training_step` call): the
                # micro-batch is a window of its own.
                self.window = self.open_window([inputs], self.args.device)
            window = self.window
            repeated = window.take()
            if self.sp_size > 1:  # DeepSpeed averages over the data-parallel ranks only, sums over the sequence ranks
                world = get_sequence_parallel_gradient_scale(self.accelerator)
            else:
                world = get_gradient_scale(self.accelerator.distributed_type, self.accelerator.num_processes)
            with padded_neftune_noise(model, padded, inputs):  # NEFTune: stock's noise for the padded batch
                loss, outputs, sums = compute_micro_batch_loss(
                    objective,
                    model,
                    inputs,
                    window.counts,
                    normalization=self.args.normalization,
                    world_size=world,
                    statistics=window.statistics,
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
        # The meter leaves the loss out when no window reached the weights (all skipped, or nothing trained).
        if "loss" in logs:
            del logs["loss"]
            logs.update(self.meter.interval_logs(self.accelerator, self.objective))
        if "train_loss" in logs:
            del logs["train_loss"]
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
        # Evaluation before training under ZeRO-1/2: stock asks DeepSpeed for an inference engine, which exists for
        # ZeRO-3 only ("ZeRO inference only makes sense with ZeRO Stage 3"). Until train() prepares it, every rank
        # holds the whole model: it evaluates as it is, and train() then prepares it as if nothing had.
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        stage = plugin.zero_stage if self.is_deepspeed_enabled and self.deepspeed is None and plugin else None
        unprepared = stage is not None and stage < 3
        # Under ZeRO-3 stock prepares an inference engine and deletes the optimizer and scheduler from the DeepSpeed
        # config "in case the training config is re-used for inference": train() needs them back (a config's own
        # optimizer would otherwise meet the Trainer's). train() then replaces that engine (_drop_evaluation_engine).
        kept = copy.deepcopy(plugin.hf_ds_config.config) if stage == 3 and hasattr(plugin, "hf_ds_config") else None
        # Stock subtracts the time it took to prepare the model from the evaluation's runtime, and reports it, in
        # every evaluation after the one that prepared it too: later ones logged a negative runtime ("-0.4 s" after a
        # ZeRO-3 evaluation before training). Only an evaluation that prepares the model now (stock sets it anew) does.
        self.__dict__.pop("model_preparation_time", None)
        try:
            if unprepared:
                self.is_deepspeed_enabled = False
            output = super().evaluation_loop(
                dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
            )
        finally:
            if kept is not None:
                plugin.hf_ds_config.config = kept
                self._evaluation_engine = self.deepspeed  # made for this evaluation: train() replaces it
            self._eval_needs_logits = True
            if unprepared:
                self.is_deepspeed_enabled = True
                self.accelerator._models = [m for m in self.accelerator._models if m is not self.model]
                self.model._is_accelerate_prepared = False
                self.model_wrapped = self.model
        totals = self.meter.eval_totals(self.accelerator)
        if totals is not None:
            output.metrics.update(self.objective.metric_logs(totals, prefix=f"{metric_key_prefix}_"))
        return output

    def _drop_evaluation_engine(self) -> None:
        """Under ZeRO-3, ``evaluate()`` before ``train()`` leaves stock with the inference engine it prepared (no
        optimizer), and ``train()`` then trains through it: its first step has no engine to call backward on
        ("'NoneType' object has no attribute 'backward'"; `hfacc sft` with accelerate_configs/deepspeed_zero3.yaml
        stopped there). Release that engine (its ZeRO-3 hooks) so ``train()`` prepares the model with its optimizer,
        as if nothing had evaluated; the parameters stay partitioned as they were."""
        engine = getattr(self, "_evaluation_engine", None)
        self._evaluation_engine = None
        if engine is None or engine is not self.deepspeed:
            return
        engine.destroy()
        self.accelerator._models = [m for m in self.accelerator._models if m is not engine]
        self.deepspeed = None
        self.model_wrapped = self.model

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        """``Trainer.train``, after hfacc's checks of the checkpoint and the output directory (before training).

        ``resume_from_checkpoint=True`` (or ``"last"``) takes the newest *complete* checkpoint of this run (same
        settings, :func:`hfacc.training.checkpoint.get_run_settings`); a new run into a directory holding another run's
        checkpoints is refused (``overwrite_output_dir`` deletes them). Resuming a finished run trains nothing. With
        ``args.auto_resume_from_checkpoints`` and no checkpoint given, a requeued job resumes from this run's newest
        complete checkpoint if there is one, else starts afresh (and says which).
        """
        streaming = isinstance(self.train_dataset, SFTStream)
        data = {
            **(self.data_settings or {}),
            "padding_free": bool(self.args.padding_free),
            **get_dataset_identity(self.train_dataset, self.processing_class),
        }
        if streaming and (self.train_dataset.pack_length or self.args.max_tokens_per_batch):
            # The read-ahead buffer decides which rows are packed or batched together (StreamBatches.reorders).
            data["stream_buffer_size"] = self.train_dataset.buffer_size
        self._run_settings = get_run_settings(self.args, streaming, data)
        resume_from_checkpoint = prepare_run(self.args, self._run_settings, resume_from_checkpoint, self.model)
        if resume_from_checkpoint is not None and not streaming and holds_stream_state(resume_from_checkpoint):
            raise ConfigError(
                f"Cannot resume from {resume_from_checkpoint}: it was saved by a streaming run (it holds the "
                "stream's position); resume it with --streaming true and the same data, or start afresh."
            )
        undo_evaluation_preparation(self.accelerator, self.model, self.model_wrapped)
        if resume_from_checkpoint is not None and self.model_setup is None:
            self._initial_policy = self._copy_initial_policy(resume_from_checkpoint)
        self._stream_resume = resume_from_checkpoint if streaming else None
        marker = read_marker(resume_from_checkpoint) if resume_from_checkpoint else None
        self._resumed_counters = (marker or {}).get("hfacc")  # the step gate's counts go on from the checkpoint's
        self._nothing_to_train = False
        skip = self.args.ignore_data_skip
        self._epoch_cursor, self._data_skipped = None, resume_from_checkpoint is not None and not skip
        # A stream resumes from the position saved in the checkpoint, not by reading and dropping every micro-batch
        # trained before (the Trainer's skip_first_batches).
        self.args.ignore_data_skip = skip or (streaming and resume_from_checkpoint is not None)
        self._drop_evaluation_engine()
        try:
            output = super().train(resume_from_checkpoint, *args, **kwargs)
        finally:
            self.args.ignore_data_skip, self._stream_resume, self._epoch_cursor = skip, None, None
        finished = self.state.global_step >= self.state.max_steps
        if (
            finished
            and resume_from_checkpoint
            and self.state.global_step == get_checkpoint_step(resume_from_checkpoint)
        ):
            logger.warning(
                "hfacc: %s is at step %d of %d: the run is finished, nothing was trained. Raise max_steps (or "
                "num_train_epochs) to train on from it.",
                resume_from_checkpoint,
                self.state.global_step,
                self.state.max_steps,
            )
        # The stock value is the mean of per-step means; `log` put the exact token-weighted one in the metrics.
        return output._replace(training_loss=output.metrics.get("train_loss", float("nan")))

    def _copy_initial_policy(self, checkpoint) -> torch.nn.Module | None:
        """The policy as the run started, copied before the Trainer loads ``checkpoint``'s weights into it, where the
        objective's reference is such a copy (:meth:`hfacc.Objective.copies_policy`; None otherwise): a copy taken at
        the first window would be the trained policy, and the resumed run would silently train another loss."""
        objective = self.objective
        if objective is None:  # given by name: the named objective's defaults decide (e.g. 'dpo': a sigmoid loss)
            try:
                objective = OBJECTIVES[self._objective_setting]()
            except (KeyError, TypeError):
                return None
        if not objective.copies_policy() or is_peft_model(self.model):  # a PEFT base is its own reference
            return None
        initial = copy_initial_policy(self.model)
        if initial is None:
            raise ConfigError(
                f"Cannot resume from {checkpoint}: the objective's reference is a copy of the policy as training "
                "started, and DeepSpeed ZeRO-3 partitioned the policy before training, so no rank can copy it; pass "
                "ref_model=<the starting model> (or precomputed reference log-probs)."
            )
        return initial

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None) -> None:
        """Stock loading, except for weights saved under the model's checkpoints' original names (Qwen2-VL, Gemma 3,
        LLaVA-NeXT, MoE experts one by one: :func:`hfacc.training.checkpoint.saved_under_original_names`).

        The stock loader matches them by the model's own names (``strict=False``), so none would load and the run
        would go on from untrained weights. transformers' own loading maps them back, as it does for the hub's
        files; the weights are then copied in (a second copy of the model on the CPU while it loads, where the stock
        loader holds the state dict).
        """
        target = self.model if model is None else model
        sharded = self.is_fsdp_enabled or self.is_deepspeed_enabled  # their own checkpoint formats and loaders
        if not sharded and saved_under_original_names(resume_from_checkpoint, target):
            loaded = type(target).from_pretrained(resume_from_checkpoint, config=target.config, dtype=target.dtype)
            target.load_state_dict(loaded.state_dict())
            return
        super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _save_checkpoint(self, model, trial) -> None:
        """The stock checkpoint hashed as it is written, then a completion marker, then rotation: a crash mid-save
        never costs the last good checkpoint, and never makes the incomplete one look complete.

        Stock Trainer rotates old checkpoints inside the save; with ``save_total_limit=1`` a crash right after could
        leave only a half-written checkpoint. Here rotation waits until the new checkpoint is marked complete.
        """
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = get_checkpoint_dir(run_dir, self.state.global_step)
        if self._nothing_to_train:  # a finished run resumed: the checkpoint it resumed from is this one
            return
        if self.args.should_save:  # written again (a run restarted in its directory): incomplete until marked anew
            unmark_checkpoint(checkpoint)
        limit, failure = self.args.save_total_limit, None
        self.args.save_total_limit = None
        try:
            with hashing_writes() as digests:
                super()._save_checkpoint(model, trial)
                if self._stream_batches is not None:  # each rank's own position in the stream
                    save_stream_state(self._stream_batches, self._stream_position, checkpoint)
        except Exception as err:  # raised below, on every rank, once the ranks know (none waits for a failed one)
            failure = err
        finally:
            self.args.save_total_limit = limit
        # Every rank writes files of its own (its RNG state; shards under FSDP/DeepSpeed): the marker, which lists
        # them with their hashes, waits until all ranks have written theirs, and is never written if one failed.
        if not all_ranks_agree(failure is None, self.accelerator):
            error = describe_save_failure(failure, checkpoint)
            if error is failure:
                raise failure
            raise error from failure
        digests = gather_objects(relative_digests(digests, checkpoint), self.accelerator)
        if self.args.should_save:
            counters = {"skipped_steps": self.meter.skipped_steps, "empty_windows": self.meter.empty_windows}
            try:
                complete_checkpoint(
                    run_dir, self.state, limit, {k: v for d in digests for k, v in d.items()},
                    run=self._run_settings, hfacc=counters,
                )  # fmt: skip
            except OSError as err:
                raise describe_save_failure(err, checkpoint) from err


__all__ = ["TokenWeightedTrainer"]
