"""The pure loss functions, against torch's own losses computed by hand."""

import pytest
import torch
import torch.nn.functional as F

from hfacc.ops.loss import (
    LossSums,
    WindowCounts,
    binary_cross_entropy_sums,
    causal_lm_sums,
    count_targets,
    cross_entropy_sums,
    get_sequence_ids,
    normalize_window_loss,
    shift_labels,
    squared_error_sums,
    sums_per_row,
)


def test_shift_labels_moves_left_and_masks_the_last_position():
    labels = torch.tensor([[1, 2, 3, 4], [-100, -100, 7, 8]])
    assert shift_labels(labels).tolist() == [[2, 3, 4, -100], [-100, 7, 8, -100]]


def test_count_targets_excludes_position_zero_after_the_shift():
    labels = torch.tensor([[5, -100, 7, 8], [9, 9, -100, -100]])
    # Row 0: 7 and 8 are predicted (5 is never a target). Row 1: only the second 9.
    assert count_targets(labels, shift=True).item() == 3
    assert count_targets(labels, shift=False).item() == 5


def test_the_shift_never_crosses_a_sequence_boundary():
    # Two sequences packed in one row (positions restart): nothing predicts the second one's first token, 7.
    labels = torch.tensor([[5, 6, 7, 8, 9]])
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    assert shift_labels(labels, position_ids=positions).tolist() == [[6, -100, 8, 9, -100]]
    # transformers' rule (masking_utils.find_packed_sequence_indices): any step that is not +1 starts a sequence.
    assert shift_labels(labels, position_ids=torch.tensor([[3, 4, 5, 9, 10]])).tolist() == [[6, 7, -100, 9, -100]]
    assert count_targets(labels, shift=True, position_ids=positions).item() == 3
    # Padding is never a target nor a predictor: not the pad after the last token (even when its label is not
    # -100), not the first token of a left-padded row.
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1]])
    labels = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 7, 8, 9]])
    assert shift_labels(labels, attention_mask=mask).tolist() == [[6, 7, -100, -100, -100], [-100, -100, 8, 9, -100]]


def test_targets_are_the_same_however_the_sequences_are_laid_out():
    """Right-padded, left-padded and concatenated into one row: the same sequences have the same targets."""
    seqs = [[-100, 4, 5], [7, 8, 9, 10], [11]]
    width = max(map(len, seqs))

    def layout(left):
        rows = [[0] * (width - len(x)) + x if left else x + [0] * (width - len(x)) for x in seqs]
        mask = [[0] * (width - len(x)) + [1] * len(x) if left else [1] * len(x) + [0] * (width - len(x)) for x in seqs]
        targets = shift_labels(torch.tensor(rows), attention_mask=torch.tensor(mask))
        return targets[torch.tensor(mask).bool()].tolist()

    row = torch.tensor([[y for x in seqs for y in x]])
    positions = torch.tensor([[p for x in seqs for p in range(len(x))]])
    packed = shift_labels(row, position_ids=positions)[0].tolist()
    assert layout(left=False) == layout(left=True) == packed == [4, 5, -100, 8, 9, 10, -100, -100]


def test_per_sequence_sums_of_packed_rows_count_sequences_not_rows():
    torch.manual_seed(2)
    logits = torch.randn(2, 5, 7)
    labels = torch.randint(0, 7, (2, 5))
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]])
    ids, n = get_sequence_ids(positions)
    assert n == 3 and ids.tolist() == [[0, 0, 0, 1, 1], [2, 2, 2, 2, 2]]
    targets = shift_labels(labels, position_ids=positions)
    per = cross_entropy_sums(logits, targets, per_sequence=True, sequences=(ids, n))
    assert per.count.tolist() == [2, 1, 4]
    first_alone = cross_entropy_sums(logits[:1, :3], shift_labels(labels[:1, :3]))
    torch.testing.assert_close(per.loss[0], first_alone.loss)
    rows = sums_per_row(per, positions)  # evaluation gathers one value per row
    total = cross_entropy_sums(logits, targets, per_sequence=True)
    torch.testing.assert_close(rows.loss, total.loss)
    assert rows.count.tolist() == total.count.tolist() == [3, 4]


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_causal_lm_sums_equal_torch_cross_entropy_sum(smoothing):
    torch.manual_seed(0)
    logits = torch.randn(3, 7, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 7))
    labels[0, :4] = -100
    labels[2, 5:] = -100
    sums = causal_lm_sums(logits, labels, label_smoothing=smoothing)
    expected = F.cross_entropy(
        logits[:, :-1].reshape(-1, 11),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
        reduction="sum",
        label_smoothing=smoothing,
    )
    assert sums.count.item() == (labels[:, 1:] != -100).sum().item()
    torch.testing.assert_close(sums.loss.double(), expected, rtol=1e-6, atol=0)
    correct = ((logits[:, :-1].argmax(-1) == labels[:, 1:]) & (labels[:, 1:] != -100)).sum()
    assert sums.correct.item() == correct.item()


def test_per_sequence_sums_add_up_to_the_total():
    torch.manual_seed(1)
    logits = torch.randn(4, 6, 5)
    labels = torch.randint(0, 5, (4, 6))
    labels[1] = -100  # a sequence without targets
    per = causal_lm_sums(logits, labels, per_sequence=True)
    total = causal_lm_sums(logits, labels)
    assert per.loss.shape == (4,) and per.count.tolist()[1] == 0
    torch.testing.assert_close(per.loss.sum(), total.loss)
    assert per.count.sum() == total.count and per.correct.sum() == total.correct


def test_binary_and_squared_error_sums_match_torch_means():
    torch.manual_seed(2)
    logits, labels = torch.randn(4, 3), torch.randint(0, 2, (4, 3)).float()
    bce = binary_cross_entropy_sums(logits, labels)
    torch.testing.assert_close(bce.loss / bce.count, F.binary_cross_entropy_with_logits(logits, labels))
    preds, targets = torch.randn(5, 1), torch.randn(5)
    se = squared_error_sums(preds, targets)
    torch.testing.assert_close(se.loss / se.count, F.mse_loss(preds.squeeze(), targets))
    assert se.correct.item() == 0


def _sums(loss, count):
    return LossSums(torch.tensor(loss), torch.tensor(count), torch.tensor(0))


def test_token_normalization_weights_micro_batches_by_their_counts():
    # Two micro-batches with 1 and 3 targets: the big-batch mean is (S1 + S2) / 4, not (S1/1 + S2/3) / 2.
    window = WindowCounts(num_targets=4, num_sequences=2, num_micro_batches=2)
    a, b = _sums(2.0, 1), _sums(9.0, 3)
    total = normalize_window_loss(a, window) + normalize_window_loss(b, window)
    assert total.item() == pytest.approx(11.0 / 4)
    legacy = normalize_window_loss(a, window, normalization="micro_batch") + normalize_window_loss(
        b, window, normalization="micro_batch"
    )
    assert legacy.item() == pytest.approx((2.0 / 1 + 9.0 / 3) / 2)


def test_world_size_cancels_the_ranks_average():
    window = WindowCounts(num_targets=10, num_sequences=2, num_micro_batches=1)
    rank_losses = [normalize_window_loss(_sums(s, c), window, world_size=2) for s, c in [(3.0, 2), (17.0, 8)]]
    assert (sum(rank_losses) / 2).item() == pytest.approx(20.0 / 10)  # what DDP's averaging makes of it


def test_sequence_normalization_weighs_every_sequence_equally():
    per_seq = LossSums(torch.tensor([4.0, 0.0, 9.0]), torch.tensor([2, 0, 3]), torch.zeros(3, dtype=torch.long))
    window = WindowCounts(num_targets=5, num_sequences=2, num_micro_batches=1)
    assert normalize_window_loss(per_seq, window, normalization="sequence").item() == pytest.approx((2.0 + 3.0) / 2)
    with pytest.raises(ValueError, match="per-sequence"):
        normalize_window_loss(per_seq.total(), window, normalization="sequence")


def test_a_window_without_targets_gives_zero_not_nan():
    window = WindowCounts(0, 0, 2)
    empty = cross_entropy_sums(torch.randn(2, 3, 4, requires_grad=True), torch.full((2, 3), -100))
    for mode in ("token", "micro_batch"):
        loss = normalize_window_loss(empty, window, normalization=mode)
        assert loss.item() == 0.0 and torch.isfinite(loss)


def test_unknown_normalization_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match="token"):
        normalize_window_loss(_sums(1.0, 1), WindowCounts(1, 1, 1), normalization="mean")
