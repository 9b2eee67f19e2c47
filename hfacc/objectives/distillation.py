"""Knowledge distillation: a student target token is the unit, exactly as in SFT.

Per target position t (a label != -100 after the causal shift), with the student's logits z and the teacher's u,
both divided by the temperature tau (no tau^2 factor, as TRL), s = softmax(z / tau) and q = softmax(u / tau):

    beta = 0:          D_t = KL(q || s)                                        (forward KL)
    beta = 1:          D_t = KL(s || q)                                        (reverse KL)
    otherwise:         D_t = beta * KL(q || m) + (1 - beta) * KL(s || m),  log m = logsumexp(log s + log(1 - beta),
                                                                                          log q + log beta)

TRL's generalized Jensen-Shannon divergence (Agarwal et al., 2024, eq. 1; ``GKDTrainer.generalized_jsd_loss``,
``DistillationTrainer``), so the same logits give TRL's values. The window's loss over its N target tokens on all
ranks is

    L = (1 / N) * sum_t (D_t + ce_weight * CE_t),        CE_t = -log softmax(z)[y_t]  (temperature 1)

so :class:`DistillationObjective` backpropagates, per micro-batch, its sum over the window's count, as SFT does
(:func:`hfacc.ops.loss.normalize_window_loss`). Peers do not: torchtune's KD recipes backpropagate each micro-batch's
mean and then scale by 1 / N (too small by the tokens per micro-batch, micro-batches weighed alike), TRL's
``GKDTrainer`` counts the dataset's labels after replacing them by generated ones (trl#4719), Axolotl's KD trainer
divides per rank, Liger's fused JSD by the local tokens (notebooks/08 measures what that does).

The teacher's distribution comes from a teacher model run on the same micro-batch, or from stored top-K log-probs
(:func:`hfacc.precompute_teacher_logprobs`). Over the top-K both distributions are restricted to the teacher's K
tokens and renormalized there (:func:`topk_support`): with K = V it is the divergence above, token for token.

The math is in pure functions (:func:`generalized_jsd` and its gradient :func:`generalized_jsd_grad`,
:func:`distillation_terms`, :func:`distillation_chunk`); the objective routes them: from full logits, or from both
models' final hidden states in chunks (:func:`hfacc.ops.logprobs.chunked_linear_loss`), so neither model's
``[B, T, V]`` logits exist.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from ..data.collator import TEACHER_COLUMNS
from ..models.teacher import (
    TeacherModel,
    TeacherRows,
    build_teacher,
    check_stored_columns,
    get_tokenizer_length,
    get_vocab_rows,
    read_stored_rows,
)
from ..ops.fused_loss import swap_output_head
from ..ops.logprobs import LossHead, check_fused_logprobs
from ..ops.loss import IGNORE_INDEX
from ..ops.model_io import get_base_model, get_logits, model_inputs, packed_position_ids
from ..runtime.distributed import all_ranks_agree
from .base import SetupContext
from .causal_lm import CausalLMObjective, get_batch_sequences

logger = logging.getLogger(__name__)


# ---- the loss math: pure functions of log-probs and logits -----------------------------------------------------
def generalized_jsd(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """The generalized JSD per row of log-probs ``[..., V]`` (each row a distribution over its last dimension).

    ``beta = 0``: ``KL(q || s) = sum q (log q - log s)``; ``beta = 1``: ``KL(s || q)``; otherwise
    ``beta * KL(q || m) + (1 - beta) * KL(s || m)`` with ``m = (1 - beta) s + beta q``, ``log m`` taken as a
    ``logaddexp`` (TRL's formula). s is the student's distribution, q the teacher's.

    >>> s, q = torch.tensor([[0.1, 0.9]]).log(), torch.tensor([[0.9, 0.1]]).log()
    >>> round(generalized_jsd(s, q, 1.0).item(), 5), round(generalized_jsd(s, q, 0.5).item(), 5)  # 0.8 ln 9
    (1.75778, 0.36806)
    """
    if beta == 0:
        return (teacher_logps.exp() * (teacher_logps - student_logps)).sum(-1)
    if beta == 1:
        return (student_logps.exp() * (student_logps - teacher_logps)).sum(-1)
    mixture = _mixture_logps(student_logps, teacher_logps, beta)
    teacher_term = (teacher_logps.exp() * (teacher_logps - mixture)).sum(-1)
    student_term = (student_logps.exp() * (student_logps - mixture)).sum(-1)
    return beta * teacher_term + (1 - beta) * student_term


def _mixture_logps(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    return torch.logaddexp(student_logps + math.log1p(-beta), teacher_logps + math.log(beta))


def generalized_jsd_grad(student_logps: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
    """The gradient of :func:`generalized_jsd` (per row) with respect to the student's logits ``a`` whose
    log-softmax is ``student_logps`` (the teacher fixed), ``[..., V]``:

    - ``beta = 0``: ``s - q``;
    - ``beta = 1``: ``s * (log s - log q - KL(s || q))``;
    - otherwise: ``(1 - beta) * s * (log s - log m - KL(s || m))``: the teacher term's derivative through m cancels
      against the rest of the student term's (``sum_k s_k (beta q_k + (1 - beta) s_k) / m_k = 1``).

    Evaluated centered at the student's likeliest token k: with ``g = log s - log m`` (or ``log s - log q``),
    ``g_i - KL = (g_i - g_k) - sum_j s_j (g_j - g_k)`` (``sum_j s_j = 1``). Written plainly, on a peaked row
    (``s_k = 1 - eps``) ``g_k - KL`` is a difference of two numbers of size ``g_k`` that agree but for ``O(eps)``:
    fp32 rounds them at ``1e-7 * g_k``, a digit of the gradient lost (1.2-2e-6 instead of 2-4e-7 against float64 on
    rows of logits of scale 16; tests/test_distillation.py). Centered, no term cancels. Tested against autograd
    in tests/test_distillation.py. For logits divided by a temperature tau, divide by tau.
    """
    s = student_logps.exp()
    if beta == 0:
        return s - teacher_logps.exp()
    other = teacher_logps if beta == 1 else _mixture_logps(student_logps, teacher_logps, beta)
    gap = student_logps - other
    gap = gap - gap.gather(-1, student_logps.argmax(-1, keepdim=True))  # centered at the student's likeliest token
    return (1.0 if beta == 1 else 1 - beta) * s * (gap - (s * gap).sum(-1, keepdim=True))


class _StudentDivergence(torch.autograd.Function):
    """:func:`generalized_jsd` of ``log_softmax(student_scaled)`` against fixed teacher log-probs, per row, whose
    backward is :func:`generalized_jsd_grad` (centered: autograd through ``log_softmax`` would subtract the row's
    KL plainly and lose the digit that function keeps). The unfused path's divergence, so that it rounds as the
    chunked kernel does."""

    @staticmethod
    def forward(ctx, student_scaled: torch.Tensor, teacher_logps: torch.Tensor, beta: float) -> torch.Tensor:
        student_logps = student_scaled.log_softmax(-1)
        ctx.save_for_backward(student_logps, teacher_logps)
        ctx.beta = beta
        return generalized_jsd(student_logps, teacher_logps, beta)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: torch.Tensor):
        student_logps, teacher_logps = ctx.saved_tensors
        return grad_output[..., None] * generalized_jsd_grad(student_logps, teacher_logps, ctx.beta), None, None


def topk_support(
    student_logits: torch.Tensor, teacher_ids: torch.Tensor, teacher_logprobs: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(student_logps, teacher_logps)`` ``[n, K]`` over the teacher's top-K tokens ``teacher_ids``: both
    distributions restricted to those K tokens and renormalized there, at temperature tau.

    ``log s_k = z_k / tau - logsumexp_{j in K} z_j / tau`` (z: the student's logits) and
    ``log q_k = l_k / tau - logsumexp_{j in K} l_j / tau`` (l: the stored log-probs at temperature 1). Since
    ``l = u - logsumexp(u)`` for the teacher's logits u, the constant cancels: q is exactly the teacher's
    ``softmax(u / tau)`` restricted to K and renormalized, for every tau (Axolotl's exponent trick,
    ``p^(1 / tau)`` renormalized). With K = V, both are the full distributions, and the divergence the full one.
    The student's mass outside the K tokens is not trained by the divergence (it is by ``ce_weight``'s term).
    """
    student = student_logits.gather(-1, teacher_ids) / temperature
    teacher = teacher_logprobs / temperature
    return student.log_softmax(-1), teacher.log_softmax(-1)


def cross_entropy_terms(
    logits: torch.Tensor, targets: torch.Tensor, label_smoothing: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ce, lse)`` per row of logits ``[n, V]`` (temperature 1): ``ce = (1 - eps) (lse - z_y) + eps (lse -
    mean_c z_c)``, as ``torch.nn.functional.cross_entropy(label_smoothing=eps)``."""
    lse = torch.logsumexp(logits, dim=-1)
    ce = lse - logits.gather(-1, targets[:, None]).squeeze(-1)
    if label_smoothing:
        ce = (1 - label_smoothing) * ce + label_smoothing * (lse - logits.mean(-1))
    return ce, lse


class DistillationTerms(NamedTuple):
    """Per target ``[n]``: the divergence, the cross-entropy against the label, whether the student's top-1 is the
    label (``correct``) and whether it is the teacher's top-1 (``agree``)."""

    divergence: torch.Tensor
    ce: torch.Tensor
    correct: torch.Tensor
    agree: torch.Tensor


def distillation_terms(
    student_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    teacher_logits: torch.Tensor | None = None,
    teacher_ids: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    beta: float = 1.0,
    temperature: float = 1.0,
    label_smoothing: float = 0.0,
) -> DistillationTerms:
    """:class:`DistillationTerms` of student logits ``[n, V]`` (fp32, differentiable) against the labels
    ``targets`` ``[n]`` and the teacher: its logits ``[n, V]``, or its stored top-K ``teacher_ids`` /
    ``teacher_logprobs`` ``[n, K]`` (:func:`topk_support`). The formulas are the module docstring's.

    >>> logits = torch.tensor([[2.0, 0.0, 0.0]])
    >>> terms = distillation_terms(logits, torch.tensor([0]), teacher_logits=logits)
    >>> terms.divergence.item(), round(terms.ce.item(), 4), terms.agree.item()
    (0.0, 0.2395, True)
    """
    student_scaled, teacher_logps, teacher_top = _distributions(
        student_logits, teacher_logits, teacher_ids, teacher_logprobs, temperature
    )
    divergence = _StudentDivergence.apply(student_scaled, teacher_logps.detach(), beta)
    ce, _ = cross_entropy_terms(student_logits, targets, label_smoothing)
    top = student_logits.detach().argmax(-1)
    return DistillationTerms(divergence, ce, top == targets, top == teacher_top)


def _distributions(student_logits, teacher_logits, teacher_ids, teacher_logprobs, temperature):
    """``(student_scaled, teacher_logps, teacher_top1)``: the student's logits divided by the temperature (its
    log-softmax is its tempered distribution) and the teacher's tempered log-probs, over the full vocabulary or over
    the teacher's stored top-K (:func:`topk_support`), and the teacher's likeliest token."""
    if teacher_ids is not None:
        student_scaled = student_logits.gather(-1, teacher_ids) / temperature
        teacher_logps = (teacher_logprobs.to(student_logits.dtype) / temperature).log_softmax(-1)
        return student_scaled, teacher_logps, teacher_ids.gather(-1, teacher_logprobs.argmax(-1, keepdim=True))[:, 0]
    teacher_logps = (teacher_logits.to(student_logits.dtype) / temperature).log_softmax(-1)
    return student_logits / temperature, teacher_logps, teacher_logits.argmax(-1)


def distillation_chunk(
    student_logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    teacher_logits: torch.Tensor | None = None,
    teacher_ids: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    beta: float = 1.0,
    temperature: float = 1.0,
    ce_weight: float = 0.0,
    label_smoothing: float = 0.0,
    with_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """One chunk of the chunked loss (:func:`hfacc.ops.logprobs.chunked_linear_loss`): ``(losses, grad, stats)``.

    ``losses[t] = D_t + ce_weight * CE_t`` of student logits ``[n, V]`` (fp32, unscaled); ``grad`` their gradient
    with respect to those logits, in closed form: ``generalized_jsd_grad / tau`` (scattered to the K columns for a
    top-K teacher) ``+ ce_weight * (softmax(z) - (1 - eps) onehot(y) - eps / V)``; ``stats`` ``[n, 4]``: divergence,
    CE, correct, agree (:class:`DistillationTerms`, as floats). No autograd: it runs inside the chunked kernel's
    forward.
    """
    student_scaled, teacher_logps, teacher_top = _distributions(
        student_logits, teacher_logits, teacher_ids, teacher_logprobs, temperature
    )
    student_logps = student_scaled.log_softmax(-1)
    divergence = generalized_jsd(student_logps, teacher_logps, beta)
    ce, lse = cross_entropy_terms(student_logits, targets, label_smoothing)
    top = student_logits.argmax(-1)
    stats = torch.stack([divergence, ce, (top == targets).float(), (top == teacher_top).float()], dim=-1)
    losses = divergence + ce_weight * ce
    if not with_grad:
        return losses, None, stats
    grad_support = generalized_jsd_grad(student_logps, teacher_logps, beta)
    if temperature != 1.0:
        grad_support = grad_support / temperature
    if teacher_ids is not None:
        grad = torch.zeros_like(student_logits).scatter_add_(-1, teacher_ids, grad_support)
    else:
        grad = grad_support
    if ce_weight:
        softmax = (student_logits - lse[:, None]).exp_()
        rows = torch.arange(len(targets), device=targets.device)
        softmax[rows, targets] -= 1 - label_smoothing
        if label_smoothing:
            softmax -= label_smoothing / student_logits.shape[-1]
        grad = grad.add_(softmax, alpha=ce_weight)
    return losses, grad, stats


# ---- the objective ---------------------------------------------------------------------------------------------
class DistillationSums(NamedTuple):
    """Sums over the target tokens of one micro-batch, scalars or one per sequence ``[B]``.

    Args:
        loss: ``sum_t D_t + ce_weight * CE_t`` (differentiable).
        count: target tokens.
        correct: targets where the student's top-1 is the label.
        divergence, ce: the two terms' sums (detached).
        agree: targets where the student's top-1 is the teacher's.
    """

    loss: torch.Tensor
    count: torch.Tensor
    correct: torch.Tensor
    divergence: torch.Tensor
    ce: torch.Tensor
    agree: torch.Tensor


class DistillationObjective(CausalLMObjective):
    """Knowledge distillation from a teacher, exact per student target token under every split of the window.

    Args:
        teacher_model: the teacher (a causal LM sharing the student's tokenizer), or its hub id / local directory.
            Frozen, in eval mode, placed like the student (the same device; under ZeRO-3 and FSDP2 sharded like it).
            None: the batches carry stored top-K log-probs (``target_token_ids``, ``target_logprobs``:
            :func:`hfacc.precompute_teacher_logprobs`); batches that carry them are trained from them even when a
            teacher is given.
        beta: the generalized JSD's interpolation: 0 forward KL, 1 reverse KL (TRL's ``DistillationTrainer``
            default), 0.5 the symmetric JSD.
        temperature: both models' logits are divided by it in the divergence (no tau^2 factor, as TRL).
        ce_weight: weight of the student's cross-entropy against the labels (temperature 1), per target token.
        label_smoothing: the cross-entropy term's label smoothing.
        vocab_size: the vocabulary both models share (None: the tokenizer's length, from the trainer's
            ``processing_class``, else the student's rows); logits beyond it (embedding padding) are cut.
        chunk_size: target tokens per chunk of the chunked loss (0: about 16 MiB of fp32 logits per model).

    Units: ``("targets", "sequences")`` (the student's target tokens). Logged over the interval's target tokens on all
    ranks: ``loss``, ``divergence``, ``ce_loss``, ``token_accuracy`` (against the labels) and
    ``teacher_agreement`` (the student's top-1 is the teacher's).

    >>> objective = DistillationObjective(beta=0.5, temperature=2.0, ce_weight=0.5)
    >>> batch = {"input_ids": torch.tensor([[5, 6, 7], [5, 6, 0]]),
    ...          "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]),
    ...          "labels": torch.tensor([[-100, 6, 7], [-100, 6, -100]])}
    >>> objective.count(batch)  # 3 target tokens in 2 sequences
    tensor([3, 2])
    """

    name = "distill"
    fused_description = "chunked divergence from both models' final hidden states"
    columns = TEACHER_COLUMNS
    stock_normalization = "micro_batch"  # torchtune / Liger / TRL without num_items: each micro-batch's mean

    def __init__(
        self,
        teacher_model: nn.Module | str | None = None,
        beta: float = 1.0,
        temperature: float = 1.0,
        ce_weight: float = 0.0,
        label_smoothing: float = 0.0,
        *,
        vocab_size: int | None = None,
        chunk_size: int = 0,
        fused: bool = False,
        teacher_dtype: str = "auto",
    ):
        super().__init__(label_smoothing, fused=fused, chunk_size=chunk_size)
        if not 0 <= beta <= 1:
            raise ValueError(f"beta={beta}: it must be in [0, 1] (0 forward KL, 1 reverse KL).")
        if not temperature > 0:
            raise ValueError(f"temperature={temperature}: it must be > 0.")
        if ce_weight < 0:
            raise ValueError(f"ce_weight={ce_weight}: it must be >= 0 (0: no cross-entropy term).")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing={label_smoothing}: it must be in [0, 1).")
        self.teacher_model, self.beta, self.temperature, self.ce_weight = teacher_model, beta, temperature, ce_weight
        self.vocab_size, self.teacher_dtype = vocab_size, teacher_dtype
        self.teacher: TeacherModel | None = None  # built by setup()
        self._shared_vocab = vocab_size

    # ---- once per model ----------------------------------------------------------------------------------------
    def setup(self, context: SetupContext) -> None:
        """Build the teacher, placed like the student (unless the batches carry stored top-K log-probs), check the
        vocabulary and the stored columns, and decide once, on every rank alike, whether the teacher's logits are
        chunked. Every bad input is one named error here, before the first step."""
        args, trainer = context.args, context.trainer
        if args is not None and getattr(args, "normalization", "token") == "sequence":
            raise ValueError(
                "normalization='sequence' has no meaning for distillation (its unit is the student's target token); "
                "use 'token' (exact) or 'micro_batch' (the mean of micro-batch means, for comparison)."
            )
        if self.num_virtual_tokens:
            raise ValueError(
                "DistillationObjective: PEFT prompt tuning puts virtual tokens before every row; use LoRA."
            )
        tokenizer = getattr(trainer, "processing_class", None)
        student_rows = get_vocab_rows(context.model)
        self.teacher = None  # a setup is for one model
        if context.batch.get(TEACHER_COLUMNS[0]) is not None:
            length = self.vocab_size or get_tokenizer_length(tokenizer) or student_rows
            dataset = getattr(trainer, "train_dataset", None)
            if dataset is not None and TEACHER_COLUMNS[0] in (getattr(dataset, "column_names", None) or ()):
                check_stored_columns(dataset, length)  # the vocabulary, now that it is known
            self._shared_vocab = min(length, student_rows)
            if self.teacher_model is not None:
                logger.warning(
                    "hfacc: the batches carry stored teacher log-probs (target_token_ids, target_logprobs): training "
                    "from them; the teacher_model given is not used. Drop the columns to distill from it."
                )
            return
        if self.teacher_model is None:
            raise ValueError(self._no_teacher)
        self.teacher = build_teacher(
            context.model,
            self.teacher_model,
            context.accelerator,
            tokenizer=tokenizer,
            vocab_size=self.vocab_size,
            dtype=self.teacher_dtype,
        )
        self._shared_vocab = self.teacher.vocab_size
        if isinstance(self.teacher_model, str):
            self.teacher_model = self.teacher.module  # loaded once: a later setup places the same model
        inputs, targets = self._inputs(context.batch), self._targets(context.batch)
        problem = self.teacher.check_fused(inputs, targets != IGNORE_INDEX)
        self.teacher.fused = all_ranks_agree(problem is None, context.accelerator)
        if not self.teacher.fused:
            logger.warning(
                "hfacc: the teacher's full logits at the target positions are held for each micro-batch: %s.",
                problem or "not on another rank",
            )

    def check_data(self, dataset, name: str = "the training data") -> None:
        """Stored teacher columns, where the rows have them: one ``[K]`` list per token, one K, ids in the vocabulary
        (:func:`hfacc.models.teacher.check_stored_columns`); the vocabulary is checked again once it is known."""
        columns = getattr(dataset, "column_names", None) or ()
        if dataset is not None and TEACHER_COLUMNS[0] in columns:
            check_stored_columns(dataset, self.vocab_size, name)
        elif self.teacher_model is None and "input_ids" in columns:
            raise ValueError(self._no_teacher)

    def companion_models(self) -> list[nn.Module]:
        """The teacher: it runs on every micro-batch in the student's layout, so the layout checks run it too."""
        return [self.teacher.module] if self.teacher is not None else []

    def check_fused(self, model, batch, normalization: str = "token") -> str | None:
        """Why the student's logits cannot come from its hidden states in chunks (None: they can):
        :func:`hfacc.ops.logprobs.check_fused_logprobs` on its targets."""
        if normalization == "sequence":
            return "normalization='sequence' is not supported by distillation"
        return check_fused_logprobs(model, self._inputs(batch), self._targets(batch), self.temperature)

    # ---- per micro-batch ---------------------------------------------------------------------------------------
    def __call__(self, model, batch, per_sequence=False):
        inputs, targets = self._inputs(batch), self._targets(batch)
        mask = targets != IGNORE_INDEX
        teacher = self.teacher_rows(batch, inputs, mask)
        labels = targets[mask]
        settings = dict(beta=self.beta, temperature=self.temperature, label_smoothing=self.label_smoothing)
        vocab = self._shared_vocab or get_vocab_rows(model)
        if self.fused and (model.training or self.fused_in_eval) and not (per_sequence and torch.is_grad_enabled()):

            def chunk_loss(logits, rows, with_grad):
                return distillation_chunk(
                    logits, labels[rows], **teacher.chunk(rows), ce_weight=self.ce_weight, with_grad=with_grad,
                    **settings,
                )  # fmt: skip

            head = LossHead(
                get_base_model(model).get_output_embeddings(), targets, chunk_loss, 4, self.chunk_size, vocab
            )
            with swap_output_head(model, head):
                outputs = model(**inputs)
            total, losses, stats = head.result
            returned = get_logits(outputs)
            if returned.requires_grad and returned.dim() == 0:
                total = returned  # what the model returned: FSDP2 / ZeRO-3 hooked their backward on it
            terms = DistillationTerms(stats[:, 0], stats[:, 1], stats[:, 2].bool(), stats[:, 3].bool())
        else:
            outputs = model(**inputs)
            logits = get_logits(outputs)[mask][:, :vocab].float()
            terms = distillation_terms(logits, labels, **teacher.full(), **settings)
            losses = terms.divergence + self.ce_weight * terms.ce
            total = losses.sum()
        if not per_sequence:
            sums = DistillationSums(
                total,
                mask.sum(),
                terms.correct.sum(),
                terms.divergence.detach().sum(),
                terms.ce.detach().sum(),
                terms.agree.sum(),
            )
            return outputs, sums
        sequences = get_batch_sequences(batch, targets.shape)
        if sequences is None:
            owner, n = torch.arange(mask.shape[0], device=mask.device)[:, None].expand(mask.shape)[mask], mask.shape[0]
        else:
            ids, n = sequences
            owner = ids.expand(mask.shape)[mask]

        def per(values):
            return values.new_zeros(n).index_add(0, owner, values)

        sums = DistillationSums(
            per(losses),
            torch.bincount(owner, minlength=n),
            per(terms.correct.long()),
            per(terms.divergence.detach().float()),
            per(terms.ce.detach().float()),
            per(terms.agree.long()),
        )
        return outputs, sums

    def teacher_rows(self, batch: Mapping[str, Any], inputs: Mapping[str, Any], mask: torch.Tensor) -> TeacherRows:
        """The teacher's distributions at the batch's targets: stored top-K, or the teacher run on ``inputs``."""
        if batch.get(TEACHER_COLUMNS[0]) is not None:
            return read_stored_rows(batch, mask)
        if self.teacher is None:
            raise ValueError(
                "This batch has no stored teacher log-probs (target_token_ids, target_logprobs) and no teacher model "
                "was set up: give every dataset the columns, or none of them (and pass teacher_model=...)."
            )
        return self.teacher.rows(inputs, mask)

    def metric_sums(self, sums):
        """``[..., 6]``: loss, targets, correct, divergence, CE, agree (entry 0 the loss sum)."""
        return torch.stack([t.detach().float() for t in sums], dim=-1)

    def metric_logs(self, totals, prefix: str = ""):
        loss, count, correct, divergence, ce, agree = totals[:6]
        if not count:
            return {f"{prefix}loss": math.nan, f"{prefix}num_targets": 0}
        return {
            f"{prefix}loss": loss / count,
            f"{prefix}divergence": divergence / count,
            f"{prefix}ce_loss": ce / count,
            f"{prefix}token_accuracy": correct / count,
            f"{prefix}teacher_agreement": agree / count,
            f"{prefix}num_targets": int(count),
        }

    # ---- helpers -----------------------------------------------------------------------------------------------
    _no_teacher = (
        "DistillationObjective has no teacher: pass teacher_model=<a model or its name/path>, or give the training "
        "rows the teacher's stored top-K log-probs (target_token_ids, target_logprobs columns: "
        "hfacc.precompute_teacher_logprobs(dataset, teacher, top_k=...))."
    )

    def _inputs(self, batch):
        inputs = {k: v for k, v in model_inputs(batch).items() if k not in (*TEACHER_COLUMNS, "target_mask")}
        if packed_position_ids(inputs) is not None:
            inputs["use_cache"] = False  # with a cache, transformers does not keep packed sequences apart
        return inputs

    def __repr__(self) -> str:
        where = "stored top-K" if self.teacher_model is None else "a teacher model"
        return (
            f"DistillationObjective(beta={self.beta}, temperature={self.temperature}, ce_weight={self.ce_weight}, "
            f"from {where})"
        )


__all__ = [
    "DistillationObjective",
    "DistillationSums",
    "DistillationTerms",
    "generalized_jsd",
    "generalized_jsd_grad",
    "topk_support",
    "cross_entropy_terms",
    "distillation_terms",
    "distillation_chunk",
]
