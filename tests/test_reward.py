"""Reward models (hfacc/objectives/reward.py): exact per pair under every split of the window.

The contract (issue 31): with margins and centering, the splits bs 8 x GA 1, 2 x 4, 1 x 8, 3 x 3 (micro-batches of 3,
3 and 2 pairs), padded and padding-free (packed rows and one row, each sequence scored where the model's own pooling
reads it, pad = EOS too), give the update of a hand-written big batch (tests/reward_kto_reference.py: plain torch,
no hfacc, the model's own pooled scores) to <= 1e-6 relative, fp32; TRL's RewardTrainer gives the values of its own loss code from the same scores; a reward model that cannot be
read per position trains padded, said at WARNING; a bad model is one named error before training. Two ranks with
uneven pairs: tests/test_distributed.py (tests/reward_kto_check.py's cases). The GRPO reward model: here too.
"""

import logging
import math

import pytest
import torch
from datasets import Dataset

from hfacc import (
    DataCollatorForPreference,
    RewardObjective,
    TokenWeightedArguments,
    TokenWeightedTrainer,
    accumulation_window,
    build_default_tokenizer,
    build_preference_dataset,
    iter_windows,
)
from hfacc.data.formats import DataError
from hfacc.data.padding_free import remove_padding
from hfacc.data.shared_prompts import share_prompts
from hfacc.objectives.reward import RewardSums, bradley_terry_loss
from hfacc.ops.scores import PerPositionScores, get_sequence_scores
from hfacc.setup.layout_check import check_shared_prompts, shared_prompts_problem
from hfacc.setup.model_setup import build_model_setup
from tests.helpers import CaptureGradients, relative_error, train_args
from tests.reward_kto_reference import (
    CENTER,
    ending_in_eos,
    reward_big_batch,
    reward_pairs,
    sequence_rewards,
    tiny_reward_model,
)

TOL = 1e-6
SPLITS = [(8, 1), (2, 4), (1, 8), (3, 3)]  # (3, 3): micro-batches of 3, 3 and 2 pairs
COLLATE = DataCollatorForPreference(pad_token_id=0)

# ---- TRL's loss code on the same scores -------------------------------------------------------------------------
# TRL 1.16's RewardTrainer.compute_loss, run on a model that returns these scores as its logits (chosen rows first),
# gave the values below (benchmarks/reward_kto.py --check-losses runs TRL's code on them again).
CHOSEN = torch.tensor([1.5, -0.25, 0.75, 2.0, -1.0])
REJECTED = torch.tensor([0.5, 0.5, -1.25, 2.5, -3.0])
MARGIN = torch.tensor([0.0, 1.0, 0.5, -0.5, 2.0])
TRL_REWARD = {  # (center_rewards_coefficient, with margins) -> the batch's loss
    (None, False): 0.5356131792068481,
    (None, True): 0.7622387409210205,
    (0.01, True): 0.8433637619018555,
    (0.1, False): 1.3468632698059082,
}
TRL_REWARD_METRICS = {"min_reward": -3.0, "mean_reward": 0.225, "max_reward": 2.5, "accuracy": 0.6, "margin": 0.75}


@pytest.mark.parametrize("setting", sorted(TRL_REWARD, key=str), ids=str)
def test_the_loss_gives_trls_values(setting):
    center, with_margin = setting
    losses = bradley_terry_loss(CHOSEN, REJECTED, MARGIN if with_margin else None, center)
    assert losses.mean().item() == pytest.approx(TRL_REWARD[setting], rel=1e-6)


def test_the_logged_metrics_are_trls_over_the_same_scores():
    """TRL's metric names and definitions, from hfacc's summed metric sums of the same pairs split 2 + 3."""
    objective = RewardObjective()
    parts = []
    for part in (slice(0, 2), slice(2, 5)):
        sums = RewardSums(torch.zeros(5)[part], torch.ones(5)[part], CHOSEN[part], REJECTED[part])
        parts.append(objective.metric_sums(sums))
    # a micro-batch that only repeats examples holds nothing: its extremes must not count
    parts.append(objective.metric_sums(objective.zero_sums(sums)))
    totals = objective.reduce_metrics(torch.cat(parts).double())
    logs = objective.metric_logs(totals.tolist())
    assert {k: logs[k] for k in TRL_REWARD_METRICS} == pytest.approx(TRL_REWARD_METRICS, abs=1e-6)
    assert logs["num_pairs"] == 5


def test_settings_and_models_are_checked():
    with pytest.raises(ValueError, match="center_rewards_coefficient=-1"):
        RewardObjective(center_rewards_coefficient=-1)
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    pairs = reward_pairs(2)
    two = tiny_reward_model()
    two.config.num_labels = 2  # what the check reads (a classifier of two labels)
    with pytest.raises(ValueError, match="num_labels=2, but a reward model gives one score per sequence"):
        build_model_setup(two, COLLATE(pairs), accelerator, objective=RewardObjective(), padding_free=False)
    no_pad = tiny_reward_model()
    no_pad.config.pad_token_id = None
    with pytest.raises(ValueError, match="no pad_token_id"):
        build_model_setup(no_pad, COLLATE(pairs), accelerator, objective=RewardObjective(), padding_free=False)


def test_the_score_is_read_at_each_sequences_own_last_token():
    """Right- and left-padded, and padding-free (one row, packed rows): the same scores as the model gives each
    sequence alone (its last token: no sequence holds the pad id; with pad = EOS see the test after the fixtures)."""
    model = tiny_reward_model().eval()
    pairs = reward_pairs(3)
    batch = COLLATE(pairs)
    with torch.no_grad():
        alone = torch.stack(
            [model(input_ids=torch.tensor([x])).logits[0, 0] for side in ("chosen", "rejected") for x in
             [p[f"{side}_input_ids"] for p in pairs]]
        )  # fmt: skip
        layouts = {"right": batch, "one row": remove_padding(batch, True, keep=["margin"])}
        layouts["packed rows"] = remove_padding(batch, False, keep=["margin"])
        left = dict(batch)
        shifts = [int((m == 0).sum()) for m in batch["attention_mask"]]
        left["input_ids"] = torch.stack([r.roll(k) for r, k in zip(batch["input_ids"], shifts, strict=True)])
        left["attention_mask"] = torch.stack([m.roll(int((m == 0).sum())) for m in batch["attention_mask"]])
        layouts["left"] = left
        for name, laid in layouts.items():
            _, scores = get_sequence_scores(model, laid)
            assert relative_error(scores, alone) <= 1e-6, name


@pytest.fixture(scope="module")
def model():
    return tiny_reward_model()


@pytest.fixture(scope="module")
def pairs():
    return reward_pairs(8)


def lay_out(batch, layout):
    """``batch`` as ``layout`` says: padded, padding-free ("one row", "packed rows"), or its pairs sharing their
    prompts (hfacc.data.shared_prompts: rows as wide as the longest pair, or as wide as they come: every pair of the
    micro-batch in one row)."""
    if layout == "padded":
        return batch
    if layout.startswith("shared prompts"):
        wide = 10**9 if layout.endswith("wide rows") else 0
        laid = share_prompts(batch, pad_token_id=0, keep=["margin"], attention_width=wide)
        held = laid["layout_index"].unique().numel() - 1  # the positions that hold tokens: each prompt once
        assert held < batch["attention_mask"].sum()
        return laid
    return remove_padding(batch, layout == "one row", keep=["margin"])


def accumulate(model, objective, examples, bs, ga, accelerator, layout):
    """One window through hfacc's loop path (the window's counts, each micro-batch's share of the window loss),
    laid out as ``layout`` says; returns the accumulated gradient."""
    batches = [COLLATE(examples[i : i + bs]) for i in range(0, len(examples), bs)]
    model.zero_grad()
    for window in iter_windows(batches, ga):
        assert len(window) == len(batches)
        for mb in accumulation_window(accelerator, model, window, objective=objective):
            _, sums = objective(model, lay_out(mb.batch, layout))
            mb.scale(sums).backward()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()
    model.zero_grad()
    return grad


@pytest.mark.parametrize("center, margins", [(None, False), (CENTER, True)], ids=["plain", "margins+centering"])
def test_every_split_and_layout_gives_the_big_batch(center, margins, model, pairs):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    examples = pairs if margins else [{k: v for k, v in p.items() if k != "margin"} for p in pairs]
    want, _, _ = reward_big_batch(model, examples, center)
    objective = RewardObjective(center)
    setup = build_model_setup(model, COLLATE(examples[:2]), accelerator, objective=objective, padding_free=True)
    assert setup.padding_free and setup.shared_prompts  # the per-position scores passed the layout checks
    worst = 0.0
    for layout in ("padded", "one row", "packed rows", "shared prompts", "shared prompts, wide rows"):
        for bs, ga in SPLITS:
            error = relative_error(accumulate(model, objective, examples, bs, ga, accelerator, layout), want)
            assert error <= TOL, (layout, bs, ga, error)
            worst = max(worst, error)
    print(f"reward {center}: worst relative error {worst:.1e}")


def test_the_mean_of_micro_batch_means_is_not_it(model, pairs):
    """Negative control: TRL's RewardTrainer (each micro-batch's mean / k) misses the big batch on the ragged split."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    want, _, _ = reward_big_batch(model, pairs)
    objective = RewardObjective(CENTER)
    batches = [COLLATE(pairs[i : i + 3]) for i in range(0, 8, 3)]
    model.zero_grad()
    for mb in accumulation_window(accelerator, model, batches, objective=objective, normalization="micro_batch"):
        mb.scale(objective(model, mb.batch)[1]).backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    assert relative_error(got, want) > 1e-3


# ---- the shared-prompt layout: what its check guards against ----------------------------------------------------
def test_shared_prompts_without_their_mask_are_not_it(model, pairs):
    """Negative control: the same layout without its 4-D mask (the answers see each other, pairs the pair before them)
    misses the big batch."""
    from accelerate import Accelerator

    want, _, _ = reward_big_batch(model, pairs, CENTER)
    objective = RewardObjective(CENTER)
    model.zero_grad()
    for mb in accumulation_window(Accelerator(cpu=True), model, [COLLATE(pairs[:4]), COLLATE(pairs[4:])],
                                  objective=objective):  # fmt: skip
        laid = lay_out(mb.batch, "shared prompts, wide rows")
        del laid["attention_mask"]
        mb.scale(objective(model, laid)[1]).backward()
    got = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad()
    assert relative_error(got, want) > 1e-3


def test_shared_prompts_score_pairs_that_part_late_or_never(model):
    """Pairs whose answers part at their last token, whose chosen sequence is a prefix of the rejected one (its score
    read inside the shared part), or that are the same sequence twice, ending in EOS = pad or not: each sequence is
    scored as its own forward scores it."""
    pairs = [
        {"chosen_input_ids": [5, 6, 7, 8], "rejected_input_ids": [5, 6, 7, 9]},
        {"chosen_input_ids": [5, 6], "rejected_input_ids": [5, 6, 7, 8, 9]},
        {"chosen_input_ids": [4, 3, 2], "rejected_input_ids": [4, 3, 2]},
        {"chosen_input_ids": [9, 8, 0], "rejected_input_ids": [9, 8, 7, 0, 0]},  # 0: EOS = pad
    ]
    pairs = [{**p, "chosen_labels": p["chosen_input_ids"], "rejected_labels": p["rejected_input_ids"]} for p in pairs]
    batch = COLLATE(pairs)
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        for wide in (0, 10**9):
            laid = share_prompts(batch, pad_token_id=0, attention_width=wide)
            assert relative_error(get_sequence_scores(model, laid)[1], own) <= 1e-6, wide


def random_pair(prompt, chosen, rejected, seed, vocab=64):
    """A pair of a random prompt and two random answers of these lengths (token ids 1..vocab-1: never the pad id)."""
    g = torch.Generator().manual_seed(seed)
    p, c, r = (torch.randint(1, vocab, (n,), generator=g).tolist() for n in (prompt, chosen, rejected))
    return {"chosen_input_ids": p + c, "rejected_input_ids": p + r, "chosen_labels": p + c, "rejected_labels": p + r}


def own_scores(model, pairs):
    """Each sequence's score from its own forward, unpadded (chosen ones first)."""
    sequences = [p["chosen_input_ids"] for p in pairs] + [p["rejected_input_ids"] for p in pairs]
    with torch.no_grad():
        return torch.stack([model(input_ids=torch.tensor([s])).logits[0, 0] for s in sequences])


def tiny_decoder(config_class, model_class, **settings):
    """A one-layer reward model of another family (num_labels=1, pad id 0), seeded, scores of order 1."""
    config = config_class(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0, **settings)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = model_class(config)
        torch.nn.init.normal_(model.score.weight, std=0.5)
    return model


def test_a_sliding_window_cuts_each_sequence_as_its_own_forward(pairs):
    """Mistral, Gemma 2/3, Qwen2 and Phi-3 attend over a sliding window, which transformers does not lay over a 4-D
    mask it is given: the check's sequences (20 tokens) fit in the window and pass, longer ones would be scored over
    keys the window cuts in their own forward. A micro-batch with a sequence longer than the window keeps each
    sequence on its own (as training lays it out: packed rows), one no longer than it shares its prompts; both score
    every sequence as its own forward."""
    from accelerate import Accelerator
    from transformers import MistralConfig, MistralForSequenceClassification

    model = tiny_decoder(MistralConfig, MistralForSequenceClassification, sliding_window=24)
    setup = build_model_setup(
        model, COLLATE(pairs[:2]), Accelerator(cpu=True), objective=RewardObjective(), longest_sequence=40
    )
    assert setup.shared_prompts is not None  # the check's sequences fit in the window
    for sizes, shared in (((10, 14, 14), True), ((10, 30, 20), False)):
        examples = [random_pair(*sizes, seed=seed) for seed in range(2)]
        batch = COLLATE(examples)
        laid = setup.shared_prompts.lay_out(batch)
        assert (laid is not None) is shared, sizes
        laid = laid or remove_padding(batch, setup.one_row, setup.max_row_length)
        with torch.no_grad():
            assert relative_error(get_sequence_scores(model, laid)[1], own_scores(model, examples)) <= 1e-6, sizes


def test_a_long_filler_leaves_a_rotary_scaling_by_the_largest_position_alone():
    """Phi-3's longrope (and dynamic rotary scaling) picks its frequencies by the batch's largest position: a row's
    filler (rows wider than the longest sequence: one unit of 40 tokens, three of 4) must not raise it past every
    sequence's, or all of them are scored at the other frequencies."""
    from transformers import Phi3Config, Phi3ForSequenceClassification

    rope = {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [4.0] * 4}
    model = tiny_decoder(Phi3Config, Phi3ForSequenceClassification, max_position_embeddings=256,
                         original_max_position_embeddings=24, rope_parameters=rope)  # fmt: skip
    examples = [random_pair(4, 18, 18, seed=0)] + [random_pair(2, 1, 1, seed=seed) for seed in (1, 2, 3)]
    laid = share_prompts(COLLATE(examples), pad_token_id=0)
    assert laid["input_ids"].shape == (2, 40)  # a filler of 28 beside the three short units
    with torch.no_grad():
        assert relative_error(get_sequence_scores(model, laid)[1], own_scores(model, examples)) <= 1e-6


def test_a_model_that_scores_through_another_head_is_refused_not_misread(model, pairs):
    """A reward model whose forward scores through a head of its own (here the last position's hidden state, a
    value head) beside an unused ``score``: the layout check runs ``score`` and passes, but training's forward never
    calls it. Laid out, its one pooled value per row must be refused, not read as the sequences' scores (4 rows held
    4 pairs: an even count, so nothing else stopped it)."""
    from transformers.modeling_outputs import SequenceClassifierOutputWithPast

    class ValueHead(type(model)):
        def __init__(self, config):
            super().__init__(config)
            self.v_head = torch.nn.Linear(config.hidden_size, 1)

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
            hidden = self.model(input_ids, attention_mask, position_ids, **kwargs).last_hidden_state
            return SequenceClassifierOutputWithPast(logits=self.v_head(hidden[:, -1]))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        valued = ValueHead(model.config)
    batch = COLLATE(pairs[:4])
    assert check_shared_prompts(PerPositionScores(valued), batch, None, 0) is None
    laid = share_prompts(batch, pad_token_id=0)
    assert laid["input_ids"].shape[0] % 2 == 0
    with pytest.raises(ValueError, match="no score per position"):
        get_sequence_scores(valued, laid)


def ignoring(model, what):
    """``model`` (a copy) whose backbone drops what the shared-prompt layout needs: its 4-D mask ("mask": each row is
    then one causal sequence, as a kernel that reads a mask as padding only computes it) or its ``position_ids``
    ("positions")."""
    import copy

    model = copy.deepcopy(model)
    backbone, forward = model.model, model.model.forward

    def patched(*args, attention_mask=None, position_ids=None, **kwargs):
        if what == "mask" and torch.is_tensor(attention_mask) and attention_mask.dim() == 4:
            attention_mask = torch.ones(attention_mask.shape[0], attention_mask.shape[-1], dtype=torch.long)
        if what == "positions" and torch.is_tensor(attention_mask) and attention_mask.dim() == 4:
            position_ids = None
        return forward(*args, attention_mask=attention_mask, position_ids=position_ids, **kwargs)

    backbone.forward = patched
    return model


def test_the_shared_prompt_check_sees_what_it_guards_against(model, pairs):
    """sdpa (boolean mask) and eager attention (additive mask) pass; a backbone that drops the 4-D mask fails on the
    leak between answers and pairs, one that drops the positions (they restart after the prompt) on the values;
    attention that takes no 4-D mask is refused without a run; shared_prompts=False takes no decision."""
    import copy

    from accelerate import Accelerator

    batch = COLLATE(pairs[:2])
    assert check_shared_prompts(PerPositionScores(model), batch, None, 0) is None
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    assert check_shared_prompts(PerPositionScores(eager), batch, torch.float32, 0) is None
    leaks = check_shared_prompts(PerPositionScores(ignoring(model, "mask")), batch, None, 0)
    assert "a leak" in leaks and "reaches another answer or pair" in leaks
    assert "its values by" in check_shared_prompts(PerPositionScores(ignoring(model, "positions")), batch, None, 0)
    flex = copy.deepcopy(model)
    flex.config._attn_implementation = "flash_attention_2"
    assert "takes no 4-D mask" in shared_prompts_problem(flex, RewardObjective())
    assert shared_prompts_problem(model, RewardObjective()) is None
    # Dropout: a shared prompt would get one draw for both answers (an nn.Dropout, or attention dropout in config).
    dropped = copy.deepcopy(model)
    dropped.config.attention_dropout = 0.1
    assert "config.attention_dropout=0.1" in shared_prompts_problem(dropped, RewardObjective())
    dropped.config.attention_dropout = 0.0
    dropped.score = torch.nn.Sequential(torch.nn.Dropout(0.2), dropped.score)
    assert "one dropout draw for both answers" in shared_prompts_problem(dropped, RewardObjective())
    setup = build_model_setup(model, batch, Accelerator(cpu=True), objective=RewardObjective(), shared_prompts=False)
    assert setup.padding_free and setup.shared_prompts is None


def test_shared_prompts_are_chosen_for_a_model_whose_pad_id_is_not_0(model, pairs):
    """The shared-prompt check pads its own pairs: with 0, not the model's pad id, the model's rule read its
    padding, so every reward model whose pad_token_id is not 0 (Llama 3, Qwen, ...) was refused before training,
    blaming a "batch padded with token id 0" the run does not have (and, before that refusal, the check failed
    and the pairs were silently laid out without sharing their prompt). Collated with its pad id, it is chosen."""
    import copy

    from accelerate import Accelerator

    used = {i for p in pairs for side in ("chosen", "rejected") for i in p[f"{side}_input_ids"]}
    pad = min(set(range(1, 64)) - used)
    other = copy.deepcopy(model)
    other.config.pad_token_id = pad
    batch = DataCollatorForPreference(pad_token_id=pad)(pairs[:2])
    assert check_shared_prompts(PerPositionScores(other), batch, None, pad) is None
    setup = build_model_setup(other, batch, Accelerator(cpu=True), objective=RewardObjective())
    assert setup.shared_prompts is not None and setup.shared_prompts.pad_token_id == pad
    with torch.no_grad():
        own = other(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        shared = get_sequence_scores(other, setup.shared_prompts.lay_out(batch))[1]
    assert relative_error(shared, own) <= 1e-6


def test_a_model_that_drops_the_mask_trains_each_sequence_on_its_own_and_says_so(model, pairs, tmp_path, caplog):
    """The fallback: the check fails (said at WARNING, with the setting), the pairs' sequences are laid out on their
    own (packed rows) and the update is the big batch's."""
    broken = ignoring(model, "mask")
    want, _, _ = reward_big_batch(broken, pairs, CENTER)
    capture = CaptureGradients(broken)
    args = train_args(tmp_path, 3, 3, args_class=TokenWeightedArguments)
    trainer = TokenWeightedTrainer(model=broken, args=args, train_dataset=Dataset.from_list(pairs),
                                   data_collator=COLLATE, objective=RewardObjective(CENTER), callbacks=[capture])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer.train()
    said = [r.getMessage() for r in caplog.records if "laid out on its own" in r.getMessage()]
    assert len(said) == 1 and "a leak" in said[0] and "shared_prompts=False" in said[0]
    assert trainer.padding_free and trainer.model_setup.shared_prompts is None
    assert relative_error(capture.grads[0], want) <= TOL


# ---- the trainer ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bs, ga, padding_free", [(3, 3, True), (2, 4, False), (1, 8, True)])
def test_trainer_gives_the_big_batch_and_trls_metrics(bs, ga, padding_free, model, pairs, tmp_path):
    want, want_loss, rewards = reward_big_batch(model, pairs)
    capture = CaptureGradients(model)
    args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, padding_free=padding_free,
                      audit_every_n_steps=1)  # fmt: skip
    trainer = TokenWeightedTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_list(pairs),
        data_collator=COLLATE,
        objective=RewardObjective(CENTER),
        callbacks=[capture],
    )
    trainer.train()
    assert trainer.padding_free is padding_free
    assert (trainer.model_setup.shared_prompts is not None) is padding_free  # pairs share their prompts' forward
    assert len(capture.grads) == 1 and relative_error(capture.grads[0], want) <= TOL
    log = trainer.state.log_history[0]
    chosen, rejected = rewards[:8], rewards[8:]
    expected = {
        "loss": want_loss,
        "accuracy": (chosen > rejected).float().mean().item(),
        "margin": (chosen - rejected).mean().item(),
        "min_reward": rewards.min().item(),
        "mean_reward": rewards.mean().item(),
        "max_reward": rewards.max().item(),
    }
    assert {k: log[k] for k in expected} == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert log["num_pairs"] == 8 and "pairs_per_second" in log and log["accumulation_audit_error"] <= 1e-5


def test_padding_with_another_id_than_the_models_pad_is_refused_in_every_layout(model, pairs, tmp_path):
    """A collator padding with an id that is not the config's pad_token_id: the model's own pooling (the rightmost
    token that is not pad_token_id) would score the padding, a padding-free layout the last token: two layouts, two
    trainings, silently (found: scores differed padded vs padding-free). One named error instead, in both layouts and
    in a GRPO reward model whose tokenizer pads with another id than its config."""
    used = {i for p in pairs for side in ("chosen", "rejected") for i in p[f"{side}_input_ids"]}
    pad = min(set(range(1, 64)) - used)  # an id no sequence holds: the padding is all it marks
    other = DataCollatorForPreference(pad_token_id=pad)
    with pytest.raises(
        ValueError, match=f"padded with token id {pad}, but the reward model's config has pad_token_id=0"
    ):
        get_sequence_scores(model, other(pairs))
    _, scores = get_sequence_scores(model, remove_padding(COLLATE(pairs), True, keep=["margin"]))  # no padding: read
    assert scores.shape == (16,)
    for padding_free in (False, True):
        args = train_args(
            tmp_path / str(padding_free), 2, 2, args_class=TokenWeightedArguments, padding_free=padding_free
        )
        trainer = TokenWeightedTrainer(model=model, args=args, train_dataset=Dataset.from_list(pairs),
                                       data_collator=other, objective=RewardObjective(CENTER))  # fmt: skip
        with pytest.raises(ValueError, match=r"DataCollatorForPreference\(pad_token_id=0\)"):
            trainer.train()

    from hfacc import build_default_model
    from hfacc.generation.rewards import get_reward_function
    from hfacc.models.loading import as_reward_model

    tokenizer = build_default_tokenizer()
    reward = as_reward_model(build_default_model(tokenizer, hidden_size=32, num_layers=1), tokenizer.pad_token_id)
    score = get_reward_function(reward, tokenizer)
    prompts, completions = ["Spell cat.", "Spell a dog please."], [" C A T", " D O G"]
    assert len(score(prompts, completions)) == 2
    reward.config.pad_token_id = tokenizer.pad_token_id + 1  # refused before any step, and by each padded forward
    with pytest.raises(ValueError, match=f"Set model.config.pad_token_id = {tokenizer.pad_token_id} "):
        get_reward_function(reward, tokenizer)
    with pytest.raises(ValueError, match=f"set model.config.pad_token_id = {tokenizer.pad_token_id} "):
        score(prompts, completions)
    # an encoder whose classifier reads its pooled first token reads no pad id: its pad is not refused
    from transformers import BertConfig, BertForSequenceClassification

    bert = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        num_labels=1, pad_token_id=tokenizer.pad_token_id + 1))  # fmt: skip
    assert len(get_reward_function(bert, tokenizer)(prompts, completions)) == 2


def test_another_pad_id_is_refused_before_the_window_whatever_micro_batch_is_padded(model, pairs, tmp_path):
    """The same refusal when the first micro-batch holds no padding (its chosen and rejected answers as long, so
    nothing there says which id pads) and a later one does: padding-free, nothing else would ever refuse it (each
    micro-batch is laid out without its padding before its forward), so the run trained silently where the
    padded run refused, and which one happened hung on the data order. Refused before the window's first
    forward in every layout: no step is taken."""
    used = {i for p in pairs for side in ("chosen", "rejected") for i in p[f"{side}_input_ids"]}
    other = DataCollatorForPreference(pad_token_id=min(set(range(1, 64)) - used))
    first = {
        **pairs[0],
        "rejected_input_ids": pairs[0]["chosen_input_ids"],
        "rejected_labels": pairs[0]["chosen_labels"],
    }
    data = Dataset.from_list([first, *pairs[1:4]])
    assert not (other([first])["attention_mask"] == 0).any() and (other(pairs[1:2])["attention_mask"] == 0).any()
    for padding_free in (False, True):
        args = train_args(
            tmp_path / str(padding_free), 1, 4, args_class=TokenWeightedArguments, padding_free=padding_free
        )
        trainer = TokenWeightedTrainer(model=model, args=args, train_dataset=data, data_collator=other,
                                       objective=RewardObjective())  # fmt: skip
        with pytest.raises(ValueError, match=r"DataCollatorForPreference\(pad_token_id=0\)"):
            trainer.train()
        assert trainer.state.global_step == 0, padding_free


def test_evaluation_logs_the_metrics_over_all_pairs(model, pairs, tmp_path):
    """evaluate() in batches of 3, 3, 2 pairs: each metric over all 8 (the extremes too)."""
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments, per_device_eval_batch_size=3)
    trainer = TokenWeightedTrainer(
        model=model, args=args, eval_dataset=Dataset.from_list(pairs), data_collator=COLLATE,
        objective=RewardObjective(CENTER),
    )  # fmt: skip
    metrics = trainer.evaluate()
    _, loss, rewards = reward_big_batch(model, pairs, CENTER)
    chosen, rejected = rewards[:8], rewards[8:]
    want = {
        "eval_loss": loss,
        "eval_accuracy": (chosen > rejected).float().mean().item(),
        "eval_min_reward": rewards.min().item(),
        "eval_max_reward": rewards.max().item(),
        "eval_mean_reward": rewards.mean().item(),
    }
    assert {k: metrics[k] for k in want} == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert metrics["eval_num_pairs"] == 8


def test_a_model_without_per_position_scores_trains_padded_and_says_so(pairs, tmp_path, caplog):
    """BERT's classifier reads a pooled first token: its scores cannot be read per sequence of a packed row, so the
    layout check keeps it padded (a WARNING), and training is exact padded, on the model's own pooled score."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        num_labels=1,
        pad_token_id=0,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        initializer_range=0.5,
    )  # fmt: skip (scores of order 1: a gradient rounding cannot swamp)
    bert = BertForSequenceClassification(config)
    capture = CaptureGradients(bert)
    args = train_args(tmp_path, 3, 3, args_class=TokenWeightedArguments)
    trainer = TokenWeightedTrainer(model=bert, args=args, train_dataset=Dataset.from_list(pairs),
                                   data_collator=COLLATE, objective=RewardObjective(), callbacks=[capture])  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer.train()
    assert not trainer.padding_free
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("padded micro-batches" in m and "no per-position 'score' head" in m for m in said), said
    bert.zero_grad()
    batch = COLLATE(pairs)
    scores = bert(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    margin = torch.tensor([p["margin"] for p in pairs])
    (-torch.nn.functional.logsigmoid(scores[:8] - scores[8:] - margin)).mean().backward()
    want = torch.cat([p.grad.flatten() for p in bert.parameters() if p.grad is not None])
    assert relative_error(capture.grads[0], want) <= TOL


# ---- data: margins ride along --------------------------------------------------------------------------------------
def test_margins_are_kept_collated_and_checked():
    tokenizer = build_default_tokenizer()
    rows = [{"prompt": "2 + 2 =", "chosen": " 4", "rejected": " 5", "margin": 1.5},
            {"prompt": "Spell cat.", "chosen": " C A T", "rejected": " C T", "margin": 0}]  # fmt: skip
    built = build_preference_dataset(Dataset.from_list(rows), tokenizer)
    assert built["margin"] == [1.5, 0.0]
    batch = DataCollatorForPreference(tokenizer.pad_token_id)(built.to_list())
    assert batch["margin"].tolist() == [1.5, 0.0] and batch["input_ids"].shape[0] == 4
    with pytest.raises(DataError, match="row 1, field 'margin': 'wide' is not a finite number"):
        build_preference_dataset(
            Dataset.from_list([{**rows[0], "margin": "1.5"}, {**rows[1], "margin": "wide"}]), tokenizer
        )
    with pytest.raises(ValueError, match="some pairs of the micro-batch have a margin and others do not"):
        DataCollatorForPreference(0)([built[0], {k: v for k, v in built[1].items() if k != "margin"}])


def test_a_partly_missing_margin_is_one_named_error_before_training(tmp_path):
    """One pair of 16 without a margin (None): the trainer refuses the data when it is built, naming the column, the
    row and the fix, not a collation error mid-run."""
    tokenizer = build_default_tokenizer()
    rows = [{"prompt": f"Q{i}?", "chosen": f" a{i}", "rejected": f" b{i}", "margin": None if i == 13 else 1.0}
            for i in range(16)]  # fmt: skip
    built = build_preference_dataset(Dataset.from_list(rows), tokenizer)
    args = train_args(tmp_path, 2, 1, args_class=TokenWeightedArguments)
    collate = DataCollatorForPreference(tokenizer.pad_token_id)
    with pytest.raises(DataError, match=r"the training data, row 13, column 'margin': None, but row 0 has a value: "
                       r"give every pair a finite margin \(0: no required gap\), or drop the column"):  # fmt: skip
        TokenWeightedTrainer(model=tiny_reward_model(vocab=len(tokenizer)), args=args, train_dataset=built,
                             data_collator=collate, objective=RewardObjective())  # fmt: skip
    evaluation = Dataset.from_list(
        [{**p, "margin": float("inf") if i == 1 else 0.5} for i, p in enumerate(reward_pairs(4, margins=False))]
    )
    with pytest.raises(DataError, match="the evaluation data, row 1, column 'margin': inf is not a finite number"):
        RewardObjective().check_data(evaluation, "the evaluation data")
    RewardObjective().check_data(
        Dataset.from_list([{**p, "margin": None} for p in reward_pairs(2, margins=False)])
    )  # none: no column


# ---- a reward model as GRPO's reward ------------------------------------------------------------------------------
def test_a_reward_model_object_or_path_is_a_grpo_reward(tmp_path):
    """TRL's rule: a sequence-classification model among reward_funcs scores prompt + completion through its own
    tokenizer; a path loads one (what `hfacc reward` writes). The score is the model's own, at the last token."""
    from hfacc import build_default_model
    from hfacc.generation.rewards import get_reward_funcs, get_reward_function
    from hfacc.models.loading import as_reward_model

    tokenizer = build_default_tokenizer()
    reward = as_reward_model(build_default_model(tokenizer, hidden_size=32, num_layers=1), tokenizer.pad_token_id)
    reward.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    prompts = [[{"role": "user", "content": "What is 2 + 2?"}]] * 2 + ["Spell cat."]
    completions = [[{"role": "assistant", "content": "4"}], [{"role": "assistant", "content": "22"}], " C A T"]
    from_object = get_reward_function(reward, tokenizer)
    (from_path,) = get_reward_funcs([str(tmp_path)])
    got = from_object(prompts, completions)
    assert from_path(prompts, completions) == pytest.approx(got, rel=1e-6)
    texts = from_object.texts(prompts, completions)
    assert texts[2] == "Spell cat. C A T" and texts[0].endswith(tokenizer.apply_chat_template(
        prompts[0] + completions[0], tokenize=False)[-20:])  # fmt: skip
    with torch.no_grad():
        alone = [reward(input_ids=torch.tensor([tokenizer(t, add_special_tokens=False)["input_ids"]])).logits[0, 0]
                 for t in texts]  # fmt: skip
    assert got == pytest.approx([a.item() for a in alone], rel=1e-5) and len(set(got)) == 3
    assert math.isfinite(sum(got)) and from_object.__name__
    two = as_reward_model(build_default_model(tokenizer, hidden_size=32, num_layers=1))
    two.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=2"):
        get_reward_function(two, tokenizer)


def test_with_pad_equal_to_eos_the_score_is_the_models_own(model, pairs):
    """Pad id = EOS (TRL's default) and every answer ending in EOS: hfacc reads each score where the model's own
    pooling does (the rightmost non-pad token, the one before the EOS), padded (right, left) and padding-free, so
    the model trained here scores the same under model(**padded); and the accumulated update is the hand-written big
    batch of those scores (tests/reward_kto_reference.py: model(**padded).logits)."""
    from accelerate import Accelerator

    eos_pairs = ending_in_eos(pairs[:4])  # the pad id 0 is EOS
    batch = COLLATE(eos_pairs)
    with torch.no_grad():
        own = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
        assert relative_error(sequence_rewards(model, eos_pairs), own) <= 1e-6
        left = dict(batch)
        shifts = [int((m == 0).sum()) for m in batch["attention_mask"]]
        left["input_ids"] = torch.stack([r.roll(k) for r, k in zip(batch["input_ids"], shifts, strict=True)])
        left["attention_mask"] = torch.stack([m.roll(k) for m, k in zip(batch["attention_mask"], shifts, strict=True)])
        own_left = model(input_ids=left["input_ids"], attention_mask=left["attention_mask"]).logits[:, 0]
        layouts = {"right": (batch, own), "left": (left, own_left)}
        for one_row in (True, False):
            layouts[f"padding-free {one_row}"] = (remove_padding(batch, one_row, keep=["margin"]), own)
        layouts["shared prompts"] = (share_prompts(batch, pad_token_id=0), own)
        for name, (laid, want) in layouts.items():
            assert relative_error(get_sequence_scores(model, laid)[1], want) <= 1e-6, name
    want, _, _ = reward_big_batch(model, eos_pairs)
    objective = RewardObjective(CENTER)
    for layout, (bs, ga) in (("padded", (1, 4)), ("packed rows", (3, 2)), ("shared prompts", (3, 2))):
        got = accumulate(model, objective, eos_pairs, bs, ga, Accelerator(cpu=True), layout)
        assert relative_error(got, want) <= TOL, layout


# ---- hfacc verify --objective reward ----------------------------------------------------------------------------
def test_hfacc_verify_objective_reward_on_the_embedded_pairs(capsys):
    from hfacc.cli import main as cli_main

    # The embedded model's own size: a fresh reward head scores every sequence about alike, so the gradient is a
    # difference of near-equal terms, and a smaller model rounds it to ~1e-5 (fp32 rounding, not accumulation).
    argv = ["verify", "--objective", "reward", "--per_device_train_batch_size", "2"]
    code = cli_main(argv)
    out = capsys.readouterr().out
    assert code == 0 and "PASS" in out and "objective   reward" in out
    assert "LlamaForSequenceClassification" in out and "pairs per micro-batch (rank 0): [2, 2, 2, 2]" in out


def test_grpo_trains_on_a_reward_model_given_by_its_path(tmp_path):
    """GRPOTrainer with a reward model among reward_funcs (a path, as `hfacc grpo --reward_funcs <dir>` gives it):
    each sampled completion is rewarded with the model's score of prompt + completion, logged under its name."""
    from hfacc import build_default_model
    from hfacc.generation.rewards import RewardModelFunction
    from hfacc.models.loading import as_reward_model
    from tests.grpo_setup import run_grpo

    tokenizer = build_default_tokenizer()
    reward = as_reward_model(build_default_model(tokenizer, hidden_size=32, num_layers=1, seed=3),
                             tokenizer.pad_token_id)  # fmt: skip
    path = tmp_path / "reward-model"
    reward.save_pretrained(path)
    tokenizer.save_pretrained(path)
    trainer, capture, _ = run_grpo(tmp_path / "grpo", reward_funcs=(str(path),))
    (func,) = trainer.reward_funcs
    assert isinstance(func, RewardModelFunction) and func.__name__ == "reward-model"
    rollout = capture.rollouts[0]
    assert rollout.rewards.shape[1] == 1 and rollout.rewards.std() > 0  # scores that tell completions apart
    logged = trainer.state.log_history[0]
    assert logged["rewards/reward-model/mean"] == pytest.approx(rollout.rewards.mean().item())
    assert len(capture.grads) == 1 and capture.grads[0].norm() > 0
