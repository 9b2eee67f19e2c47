"""Sequence parallelism (DeepSpeed Ulysses through accelerate's ParallelismConfig): exact over data x sequence ranks.

One launch of accelerate_configs/deepspeed_ulysses.yaml (2 CPU processes over gloo, sp 2) runs every split of one
window and three controls, and DPO with its control (tests/sequence_parallel_check.py); the pure pieces of hfacc/runtime/sequence_parallel.py
are checked here without processes.
"""

import json
import subprocess
import sys

import pytest
import torch

from hfacc import DataCollatorForCausalLM
from hfacc.ops.loss import shift_labels
from hfacc.runtime.sequence_parallel import (
    DataCollatorForSequenceParallel,
    check_sequence_parallel_objective,
    pad_to_length,
    presharded_labels,
)
from tests.helpers import ROOT, free_port

GRAD_TOL = 1e-6
LOSS_TOL = 1e-5


def engine_shards(batch, sp):
    """What DeepSpeed's Ulysses loader gives each rank: labels shifted once over the whole row, then cut."""
    targets = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    chunk = targets.shape[-1] // sp
    return [targets[:, r * chunk : (r + 1) * chunk] for r in range(sp)]


def test_every_target_lives_on_exactly_one_shard_including_the_boundary():
    examples = [{"input_ids": list(range(1, 8)), "labels": [-100, -100, *range(3, 8)]}, {"input_ids": [4, 5, 6]}]
    examples[1]["labels"] = [4, 5, 6]
    batch = DataCollatorForSequenceParallel(DataCollatorForCausalLM(pad_token_id=0), sp_size=2)(examples)
    assert batch["input_ids"].shape[-1] == 8 and batch["position_ids"].tolist()[1] == list(range(8))
    plain = DataCollatorForCausalLM(pad_token_id=0)(examples)
    expected = shift_labels(plain["labels"], attention_mask=plain["attention_mask"])
    shards = engine_shards(batch, 2)
    assert torch.equal(torch.cat(shards, -1)[:, :7], expected)
    assert shards[0][0, -1] == 5  # position 3 predicts token 4 (5): the boundary target, on shard 0 only


def test_packed_rows_keep_their_sequences_in_the_shift():
    batch = {"labels": torch.tensor([[5, 6, 7, 8, 9, 10]]), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]])}
    shards = engine_shards({"labels": presharded_labels(batch)}, 2)
    assert torch.cat(shards, -1).tolist() == [[6, 7, -100, 9, 10, -100]]  # 8 starts a sequence: nothing predicts it


def test_padding_continues_positions_and_adds_no_target():
    batch = {"input_ids": torch.tensor([[3, 4, 5]]), "labels": torch.tensor([[3, 4, 5]]),
             "position_ids": torch.tensor([[0, 1, 0]])}  # fmt: skip
    padded = pad_to_length(batch, 6, pad_token_id=0)
    assert padded["position_ids"].tolist() == [[0, 1, 0, 1, 2, 3]] and padded["labels"].tolist()[0][3:] == [-100] * 3


@pytest.mark.parametrize("name", ["kto", "reward", "grpo", "distill"])
def test_objectives_not_reduced_over_the_sequence_group_are_refused_in_one_line(name):
    check_sequence_parallel_objective("causal_lm", 2)
    check_sequence_parallel_objective("dpo", 2)
    check_sequence_parallel_objective(name, 1)
    with pytest.raises(
        NotImplementedError, match=f"objective '{name}' with sp_size=2: .* supports causal_lm, dpo"
    ) as e:
        check_sequence_parallel_objective(name, 2)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def ulysses(tmp_path_factory):
    pytest.importorskip("deepspeed", reason="pip install deepspeed (Ulysses runs on CPU processes, over gloo)")
    out = tmp_path_factory.mktemp("ulysses") / "results.json"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               "accelerate_configs/deepspeed_ulysses.yaml", "--mixed_precision", "no", "--num_processes", "2",
               "--main_process_port", str(free_port()), "tests/sequence_parallel_check.py", str(out)]  # fmt: skip
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_every_split_on_sp2_equals_the_big_batch(ulysses):
    assert ulysses["world_size"] == 2 and ulysses["sp_size"] == 2
    assert set(ulysses["cases"]) == {"bs1 ga8", "bs2 ga4", "bs4 ga2"}
    for name, case in ulysses["cases"].items():
        assert case["steps"] == 1 and case["sp_size"] == 2 and case["fused"], name
        assert case["grad_error"] <= GRAD_TOL, (name, case)
        assert case["loss_error"] <= LOSS_TOL, (name, case)


@pytest.mark.distributed
@pytest.mark.parametrize(
    "control", ["count over data ranks only", "boundary target dropped", "boundary target counted twice"]
)
def test_each_broken_rule_misses_the_big_batch(ulysses, control):
    assert ulysses["controls"][control]["grad_error"] > 100 * GRAD_TOL


@pytest.mark.distributed
def test_dpo_on_sp2_equals_the_big_batch(ulysses):
    case = ulysses["dpo"]  # 8 pairs, bs 2 pairs, GA 4: each pair's rows cut over the 2 ranks of the sequence group
    assert case["steps"] == 1 and case["sp_size"] == 2 and case["num_pairs"] == 8, case  # each pair counted once
    assert case["grad_error"] <= GRAD_TOL and case["loss_error"] <= LOSS_TOL, case


@pytest.mark.distributed
def test_dpo_without_the_sums_reduced_before_the_sigmoid_misses_the_big_batch(ulysses):
    control = ulysses["dpo_controls"]["sums not reduced before the sigmoid"]  # each shard's sigmoid, pair per shard
    assert control["num_pairs"] == 16 and control["grad_error"] > 100 * GRAD_TOL, control


@pytest.mark.distributed
def test_hfacc_verify_reads_sp_size_from_the_accelerate_config_and_passes(ulysses):
    report = ulysses["verify"]
    assert report["exit_code"] == 0 and report["passed"] and report["sp_size"] == 2, report
    assert report["error"] <= GRAD_TOL and report["num_targets"] > 0


def test_dpo_with_precomputed_reference_columns_is_refused_under_sequence_parallelism():
    from types import SimpleNamespace

    from hfacc import DPOObjective
    from hfacc.data.preference import REF_LOGPS
    from hfacc.objectives.base import SetupContext

    accelerator = SimpleNamespace(parallelism_config=SimpleNamespace(sp_enabled=True, sp_size=2))
    context = SetupContext(model=None, batch={REF_LOGPS: torch.zeros(2)}, accelerator=accelerator)
    with pytest.raises(NotImplementedError, match="precomputed ref_chosen_logps .* sp_size > 1") as err:
        DPOObjective().setup(context)
    assert "\n" not in str(err.value)
