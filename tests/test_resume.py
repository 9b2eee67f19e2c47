"""Resume and checkpoints: exact from every checkpoint on 1 and 2 ranks (map-style, token budget, stream, with row
counts that leave the epoch's last global batch partial), a kill at any point of a save never makes `last` take an
incomplete or corrupted checkpoint, and the resumes that used to go silently wrong are refused or exact.
docs/reliability.md ("Interruption and checkpoints") lists these cases."""

import hashlib
import itertools
import json
import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import BatchSampler, SequentialSampler

from hfacc.jobs.console import describe_user_error
from hfacc.runtime.config import ConfigError
from hfacc.runtime.distributed import get_epoch_layout
from hfacc.training import checkpoint as checkpoints
from hfacc.training.checkpoint import (
    MARKER,
    RUN_RECORD,
    checkpoint_problem,
    get_last_complete_checkpoint,
    resolve_checkpoint,
)
from hfacc.training.hashing import hashing_writes, relative_digests
from tests import resume_check as check
from tests import resume_objectives_check as objectives
from tests.helpers import ROOT, torchrun

TOL = 1e-6
ONE_EPOCH = dict(rows=13, settings=dict(max_steps=3, lr_scheduler_type="constant"))  # 4 windows; 3 of them trained


# ---- where accelerate repeats examples -----------------------------------------------------------------------------
class VaryingBatches:
    """A batch sampler of varying batch sizes (as hfacc's token budget), without a batch_size attribute."""

    def __init__(self, sizes):
        self.sizes = sizes

    def __iter__(self):
        for i, n in enumerate(self.sizes):
            yield list(range(sum(self.sizes[:i]), sum(self.sizes[:i]) + n))

    def __len__(self):
        return len(self.sizes)


def real_rows(make, world, num_examples):
    """accelerate's own sharding: each rank's batches and, per batch, how many rows are real (in round-major order
    the first ``num_examples`` rows are the epoch's; the rest are its repeats)."""
    per_rank = [list(make(rank)) for rank in range(world)]
    position, real = 0, [[] for _ in range(world)]
    for step in range(max(len(b) for b in per_rank)):
        for rank in range(world):
            if step < len(per_rank[rank]):
                batch = per_rank[rank][step]
                real[rank].append(sum(position + i < num_examples for i in range(len(batch))))
                position += len(batch)
    return per_rank, real


def test_the_layout_of_repeats_is_accelerates_own():
    """get_epoch_layout (from sizes alone) against accelerate's BatchSamplerShard, over every small configuration."""
    grid = itertools.product(range(1, 23), (1, 2, 3, 4), (1, 2, 3), (False, True), (False, True), (True, False))
    for n, b, world, drop_last, split, even in grid:
        if split and b % world:
            continue

        def make(rank, n=n, b=b, world=world, drop_last=drop_last, split=split, even=even):
            inner = BatchSampler(SequentialSampler(range(n)), b, drop_last)
            return BatchSamplerShard(inner, world, rank, split, even) if world > 1 else inner

        batches, real = real_rows(make, world, n)
        for rank in range(world):
            accelerator = SimpleNamespace(
                num_processes=world, process_index=rank, even_batches=even, split_batches=split
            )
            layout = get_epoch_layout(accelerator, num_examples=n, batch_size=b, drop_last=drop_last)
            case = (n, b, world, drop_last, split, even, rank)
            assert layout.micro_batches == len(make(rank)), case  # the length the Trainer sees
            if not (split and not even):  # accelerate's own length and iteration disagree there
                assert [layout.real_rows(i, len(x)) for i, x in enumerate(batches[rank])] == real[rank], case
    for sizes, world, even in itertools.product(([3], [2, 1], [1, 4, 2], [2, 2, 2, 1, 3]), (1, 2, 3), (True, False)):

        def make(rank, sizes=sizes, world=world, even=even):
            return (
                BatchSamplerShard(VaryingBatches(sizes), world, rank, False, even)
                if world > 1
                else VaryingBatches(sizes)
            )

        batches, real = real_rows(make, world, sum(sizes))
        for rank in range(world):
            accelerator = SimpleNamespace(
                num_processes=world, process_index=rank, even_batches=even, split_batches=False
            )
            layout = get_epoch_layout(accelerator, num_batches=len(sizes))
            assert [layout.real_rows(i, len(x)) for i, x in enumerate(batches[rank])] == real[rank], (sizes, world)


# ---- exact from every checkpoint -----------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["map", "budget", "stream"])
def test_one_process_resumes_exactly_from_every_checkpoint(tmp_path, case):
    # One process has twice the windows per epoch of two: 5 steps still cross into the second epoch.
    settings = {**check.CASES[case]["settings"], "max_steps": 5}
    result = check.resume_every_checkpoint(tmp_path, case, {**check.CASES[case], "settings": settings})
    assert len(result["errors"]) == result["steps"] >= 4
    assert all(error <= TOL for error in result["errors"].values()), result["errors"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """One launch: the three cases on 2 ranks, then rank 1 killed in the middle of a save (which ends the launch)."""
    out = tmp_path_factory.mktemp("resume2")
    proc = subprocess.run(
        torchrun("tests/resume_check.py", str(out), "map", "budget", "stream", "death"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert (out / "results.json").is_file(), proc.stderr[-4000:]
    assert proc.returncode != 0  # the killed rank ends the launch
    return out, json.loads((out / "results.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["map", "budget", "stream"])
def test_two_ranks_resume_exactly_from_every_checkpoint(two_ranks, case):
    """Before: rel 1.3e-1 (map, from checkpoint-1) and 1.2e-1 (budget): the resumed epoch's repeats were trained."""
    _, results = two_ranks
    assert results["world_size"] == 2
    result = results[case]
    assert len(result["errors"]) == result["steps"] >= 4
    assert all(error <= TOL for error in result["errors"].values()), result["errors"]
    if case != "stream":  # the epoch's last global batch is partial: accelerate repeated examples, hfacc cut them
        assert result["repeat_warnings"] > 0


@pytest.mark.distributed
def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(two_ranks):
    out = two_ranks[0] / "death"
    half = out / "checkpoint-2"
    # The kill came after rank 0 wrote trainer_state.json (a stock checkpoint's last file), before rank 1's RNG state.
    assert (half / "trainer_state.json").is_file() and not (half / "rng_state_1.pth").exists()
    assert not (half / MARKER).exists()
    assert resolve_checkpoint("last", out) == str(out / "checkpoint-1")
    assert "cut short" in checkpoint_problem(half, stock_ok=False)
    said = json.loads((out / "death.json").read_text())["said"] if (out / "death.json").is_file() else None
    assert said is None or said.startswith("another process of this run is gone")  # if rank 0 lived to say it


# ---- every objective: exact from every checkpoint ------------------------------------------------------------------
# Bit for bit (0.0), not only within TOL: a resumed run loads the weights, the optimizer, scheduler and RNG states and
# the data position exactly, and takes its per-model decisions (objective, padding-free layout, loss path, the frozen
# reference copy) from the run's settings and data, not from the micro-batch it happens to start with; on a fixed
# machine and thread count each resumed step then computes what the uninterrupted step did, operation for operation.
# Any difference is something a resume did not restore. (Before the padding-free row length was read from every
# *_input_ids column, DPO and reward-model runs resumed on 2 ranks ended 5e-9 off: rows laid out from another first
# micro-batch.) The controls restore one thing less and must end elsewhere.
def assert_resumes_exactly(result, case):
    assert len(result["errors"]) == result["steps"] == objectives.STEPS
    assert all(error == 0.0 for error in result["errors"].values()), (case, result["errors"])
    wanted = {"data position", *objectives.CONTROLS.get(case, ())}
    assert set(result["controls"]) == wanted
    assert all(error > 1e-3 for error in result["controls"].values()), (case, result["controls"])


@pytest.mark.parametrize("case", list(objectives.CASES))
def test_every_objective_resumes_exactly_from_every_checkpoint(tmp_path, case):
    assert_resumes_exactly(objectives.run_case(tmp_path, case), case)


@pytest.fixture(scope="module")
def objectives_on_two_ranks(tmp_path_factory):
    """One launch: every objective's case on 2 ranks (the last global batch of each epoch partial)."""
    out = tmp_path_factory.mktemp("objectives2")
    proc = subprocess.run(
        torchrun("tests/resume_objectives_check.py", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("case", list(objectives.CASES))
def test_every_objective_resumes_exactly_from_every_checkpoint_on_two_ranks(objectives_on_two_ranks, case):
    """Before: the vision case stopped on rank 1 (its repeat cut from the last batch left Qwen2.5-VL's image entries
    of another size); DPO (each reference) and the reward model ended 5e-9 off from checkpoints 1 and 2."""
    assert objectives_on_two_ranks["world_size"] == 2
    result = objectives_on_two_ranks[case]
    assert_resumes_exactly(result, case)
    assert result["repeat_warnings"] > 0  # accelerate repeated examples in the last batch, hfacc cut them


# ---- a kill at any point of a save ---------------------------------------------------------------------------------
class Killed(Exception):
    """The process died here (a kill -9 at this point leaves what was written before it)."""


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run killed after checkpoint-2, and what the uninterrupted 3-step run ends with."""
    root = tmp_path_factory.mktemp("kills")
    trainer, model = check.make_trainer(root / "full", ONE_EPOCH)
    trainer.train()
    shutil.copytree(root / "full", root / "base")
    shutil.rmtree(root / "base" / "checkpoint-3")
    return root, check.weights(model)


def dies(method, checkpoint: Path | None = None, half_of: str | None = None):
    """``method`` that dies: before doing anything, or after writing, leaving only half of the file ``half_of``."""

    def dying(*args, **kwargs):
        if half_of is None:
            raise Killed
        method(*args, **kwargs)
        data = (checkpoint / half_of).read_bytes()
        (checkpoint / half_of).write_bytes(data[: len(data) // 2])
        raise Killed

    return dying


def kill(point, trainer, checkpoint, monkeypatch):
    """Make checkpoint-3's save die at ``point``."""
    if point == "model weights half written":
        trainer.save_model = dies(trainer.save_model, checkpoint, "model.safetensors")
    elif point == "optimizer half written":
        trainer._save_optimizer_and_scheduler = dies(trainer._save_optimizer_and_scheduler, checkpoint, "optimizer.pt")
    elif point == "before the RNG state":
        trainer._save_rng_state = dies(trainer._save_rng_state)
    elif point == "after trainer_state.json, before the marker":
        monkeypatch.setattr(checkpoints, "mark_checkpoint_complete", dies(None))
    elif point == "marker written, not yet renamed":
        replace = os.replace
        monkeypatch.setattr(os, "replace", lambda a, b: dies(None)() if str(b).endswith(MARKER) else replace(a, b))
    else:  # "after the marker, rotating"
        monkeypatch.setattr(checkpoints, "rotate_checkpoints", dies(None))


KILL_POINTS = [
    "model weights half written",
    "optimizer half written",
    "before the RNG state",
    "after trainer_state.json, before the marker",
    "marker written, not yet renamed",
    "after the marker, rotating",
]


@pytest.mark.parametrize("point", KILL_POINTS)
def test_a_kill_at_any_point_of_a_save_never_makes_last_take_a_broken_checkpoint(
    two_checkpoints, tmp_path, point, monkeypatch
):
    """Before: killed after trainer_state.json, the half-written checkpoint was taken for a stock one."""
    root, full = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "base", out)
    trainer, _ = check.make_trainer(out, ONE_EPOCH)
    kill(point, trainer, out / "checkpoint-3", monkeypatch)
    with pytest.raises(Killed):
        trainer.train(resume_from_checkpoint="last")  # from checkpoint-2: step 3 and its save, killed
    monkeypatch.undo()
    if point == "after the marker, rotating":  # checkpoint-3 was complete: it is the one to take
        assert resolve_checkpoint("last", out) == str(out / "checkpoint-3")
        return
    assert checkpoint_problem(out / "checkpoint-3", stock_ok=False) is not None
    assert resolve_checkpoint("last", out) == str(out / "checkpoint-2")
    trainer, model = check.make_trainer(out, ONE_EPOCH)  # relaunched: resumes from checkpoint-2, exactly
    trainer.train(resume_from_checkpoint="last")
    assert check.relative_error(check.weights(model), full) <= TOL


# ---- requeued jobs: the same command, relaunched until it finishes --------------------------------------------------
REQUEUED = {**ONE_EPOCH, "settings": {**ONE_EPOCH["settings"], "auto_resume_from_checkpoints": True}}


def count_micro_batches(trainer) -> list[int]:
    """A one-item list counting the micro-batches ``trainer`` trains from now on."""
    count, step = [0], trainer.training_step

    def counted(*args, **kwargs):
        count[0] += 1
        return step(*args, **kwargs)

    trainer.training_step = counted
    return count


def test_a_requeued_job_resumes_its_own_last_checkpoint_or_starts_afresh(two_checkpoints, tmp_path, monkeypatch):
    """A scheduler relaunches the same command after every kill: before the first complete checkpoint (afresh),
    between checkpoints (from the newest complete one) and after the last (nothing to train); each launch says which
    it did, and the run ends with the uninterrupted run's weights. Before: `--resume_from_checkpoint last` stopped
    the first relaunch with "no complete checkpoint in ..." (as stock does)."""
    _, full = two_checkpoints
    out = tmp_path / "run"
    monkeypatch.setattr(checkpoints, "_said_auto", set())
    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("hfacc").addHandler(handler)
    try:
        # Launch 1: killed while saving checkpoint-1, before its RNG state: no complete checkpoint yet.
        trainer, _ = check.make_trainer(out, REQUEUED)
        trainer._save_rng_state = dies(trainer._save_rng_state)
        with pytest.raises(Killed):
            trainer.train()
        assert (out / "checkpoint-1").is_dir() and not (out / "checkpoint-1" / MARKER).is_file()
        # Launch 2: afresh; killed while saving checkpoint-3, after trainer_state.json, before the marker.
        mark = checkpoints.mark_checkpoint_complete

        def dying_mark(checkpoint, *args, **kwargs):
            if Path(checkpoint).name == "checkpoint-3":
                raise Killed
            return mark(checkpoint, *args, **kwargs)

        monkeypatch.setattr(checkpoints, "mark_checkpoint_complete", dying_mark)
        trainer, _ = check.make_trainer(out, REQUEUED)
        with pytest.raises(Killed):
            trainer.train()
        monkeypatch.setattr(checkpoints, "mark_checkpoint_complete", mark)
        assert any(f"no complete checkpoint of this run in {out}: starting afresh" in m for m in said), said
        assert any("skipping" in m and "checkpoint-1" in m for m in said), said
        # Launch 3: from checkpoint-2 (checkpoint-3 is incomplete), to the end.
        trainer, model = check.make_trainer(out, REQUEUED)
        trained = count_micro_batches(trainer)
        trainer.train()
        assert any(f"resuming from {out / 'checkpoint-2'} (step 2)" in m for m in said), said
        assert trained == [2]  # step 3 only: one window of 2 micro-batches
        assert check.relative_error(check.weights(model), full) <= TOL
        finished = check.weights(model)
        # Launch 4, requeued after the run ended: from checkpoint-3, nothing trained, launch 3's weights exactly
        # (launch 3 itself matches the uninterrupted run within TOL: its resumed step may round differently).
        trainer, model = check.make_trainer(out, REQUEUED)
        trained = count_micro_batches(trainer)
        trainer.train()
        assert trained == [0]
        assert any(f"resuming from {out / 'checkpoint-3'} (step 3)" in m for m in said), said
        assert any("the run is finished, nothing was trained" in m for m in said), said
        assert torch.equal(check.weights(model), finished)
    finally:
        logging.getLogger("hfacc").removeHandler(handler)


def test_a_requeued_job_never_takes_another_runs_checkpoints(two_checkpoints, tmp_path, caplog):
    """Relaunched into a directory of another run's checkpoints: refused, as a new run there is (never continued)."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    other = {**REQUEUED, "settings": {**REQUEUED["settings"], "learning_rate": 1e-3}}
    trainer, _ = check.make_trainer(out, other)
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run .*learning_rate 0.02 there, 0.001 here"):
        trainer.train()
    with pytest.raises(ValueError, match="auto_resume_from_checkpoints and overwrite_output_dir"):
        check.make_trainer(out, {**other, "settings": {**other["settings"], "overwrite_output_dir": True}})


def _said(caplog, needle: str) -> int:
    return sum(needle in r.getMessage() for r in caplog.records)


def test_a_run_on_other_data_never_takes_the_checkpoints_of_the_run_it_shares_a_directory_with(
    two_checkpoints, tmp_path, caplog
):
    """Before: run B (other rows) in run A's directory resumed A's checkpoint as its own and exited 0; A's requeue
    then took B's. Now B is refused with one line naming what differs and the fix, for auto-resume and `last`
    alike, and A's requeue afterwards resumes its own checkpoint-2 to the uninterrupted weights."""
    root, full = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "base", out)
    other = {**REQUEUED, "rows": 14}
    trainer, _ = check.make_trainer(out, other)
    with pytest.raises(
        ConfigError, match=r"holds checkpoints of another run .*data.num_rows 13 there, 14 here"
    ) as err:
        trainer.train()
    assert "--resume_with_changed_data true" in str(err.value) and "--output_dir" in str(err.value)
    trainer, _ = check.make_trainer(out, {**ONE_EPOCH, "rows": 14})
    with pytest.raises(ConfigError, match=r"no checkpoint of this run .*data.num_rows 13 there, 14 here"):
        trainer.train(resume_from_checkpoint="last")
    # Same number of rows, other contents: the rows' hash differs.
    trainer, _ = check.make_trainer(out, REQUEUED)
    trainer.train_dataset = trainer.train_dataset.map(lambda row: {"input_ids": row["input_ids"][:-1]})
    with pytest.raises(ConfigError, match=r"data.rows_sha256 '\w+' there, '\w+' here"):
        trainer.train()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    trainer, model = check.make_trainer(out, REQUEUED)  # A's requeue
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer.train()
    assert check.relative_error(check.weights(model), full) <= TOL
    assert _said(caplog, "saved before hfacc recorded") == 0


def test_other_preprocessing_settings_are_another_run(two_checkpoints, tmp_path):
    """A job's data settings (here max_length, then packing) are part of the run: another value is refused."""
    from hfacc.data.sft import DataArguments
    from hfacc.training.checkpoint import get_data_settings

    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "base", out)
    for path in out.glob("checkpoint-*"):  # as a job with the default data settings saved them
        marker = json.loads((path / MARKER).read_text())
        marker["run"].update({f"data.{k}": v for k, v in get_data_settings(DataArguments()).items()})
        (path / MARKER).write_text(json.dumps(marker))
    for change, line in [
        (dict(max_length=512), "data.max_length 1024 there, 512 here"),
        (dict(packing=True), "data.packing False there, True here"),
    ]:
        trainer, _ = check.make_trainer(out, REQUEUED)
        trainer.data_settings = get_data_settings(DataArguments(**change))
        with pytest.raises(ConfigError, match=line):
            trainer.train()
    trainer, _ = check.make_trainer(out, REQUEUED)
    trainer.data_settings = get_data_settings(DataArguments())
    assert trainer.train().global_step == 3  # the same settings: its own run


def test_a_deliberate_change_of_data_resumes_with_the_override_and_says_so(two_checkpoints, tmp_path, caplog):
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "base", out)
    changed = {"rows": 14, "settings": {**REQUEUED["settings"], "resume_with_changed_data": True}}
    trainer, _ = check.make_trainer(out, changed)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trained = count_micro_batches(trainer)
        trainer.train()
    assert trained == [2]  # step 3 only, from A's checkpoint-2
    assert _said(caplog, "resume_with_changed_data: a checkpoint in") == 1
    saved = json.loads((out / "checkpoint-3" / MARKER).read_text())["run"]
    assert saved["data.num_rows"] == 14  # the new checkpoint records the data it was trained on


def test_a_checkpoint_saved_before_data_was_recorded_is_taken_with_a_warning(two_checkpoints, tmp_path, caplog):
    root, full = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "base", out)
    for path in out.glob("checkpoint-*"):
        marker = json.loads((path / MARKER).read_text())
        marker["run"] = {k: v for k, v in marker["run"].items() if not k.startswith("data.")}
        (path / MARKER).write_text(json.dumps(marker))
    trainer, model = check.make_trainer(out, REQUEUED)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer.train()
    assert _said(caplog, "saved before hfacc recorded a run's data") == 1
    assert check.relative_error(check.weights(model), full) <= TOL


CORRUPTIONS = {
    "flipped byte in model.safetensors": ("model.safetensors", "flip"),
    "flipped byte in optimizer.pt": ("optimizer.pt", "flip"),
    "edited trainer_state.json": ("trainer_state.json", "edit"),
    "marker not JSON": (MARKER, "garble"),
    "marker without files": (MARKER, "no files"),
    "rng state missing": ("rng_state.pth", "delete"),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_a_damaged_checkpoint_is_skipped_with_a_warning_naming_it(two_checkpoints, tmp_path, corruption, caplog):
    """Before: flipped bytes of the same size trained on (weights 6.7e27), a mangled marker raised inside hfacc."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    name, how = CORRUPTIONS[corruption]
    path = out / "checkpoint-3" / name
    data = path.read_bytes()
    if how == "flip":
        path.write_bytes(data[:-200] + bytes([data[-200] ^ 0xFF]) + data[-199:])
    elif how == "edit":
        path.write_bytes(data.replace(b'"global_step": 3', b'"global_step": 9'))
    elif how == "garble":
        path.write_bytes(data[: len(data) // 2])
    elif how == "no files":
        path.write_text(json.dumps({"format": 2}))
    else:
        path.unlink()
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        assert resolve_checkpoint("last", out) == str(out / "checkpoint-2")
    said = next(r.getMessage() for r in caplog.records if "skipping" in r.getMessage())
    assert f"checkpoint-3: {name if how != 'garble' and how != 'no files' else 'its ' + MARKER}" in said, said
    with pytest.raises(ConfigError, match="Cannot resume from .*checkpoint-3.*newest complete one is .*checkpoint-2"):
        resolve_checkpoint(str(out / "checkpoint-3"), out)


def test_hashes_are_taken_while_writing_not_read_back(tmp_path, monkeypatch):
    """torch.save and safetensors files get their sha256 from the bytes written; only small files are read back."""
    model = check.build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2)
    with hashing_writes() as digests:
        model.save_pretrained(tmp_path)
        torch.save({"state": [torch.randn(50, 50)]}, tmp_path / "optimizer.pt")
    for name in ("model.safetensors", "optimizer.pt"):
        assert digests[str(tmp_path / name)] == hashlib.sha256((tmp_path / name).read_bytes()).hexdigest(), name
    read_back = []
    hash_file = checkpoints.hash_file
    monkeypatch.setattr(checkpoints, "hash_file", lambda p: read_back.append(p.name) or hash_file(p))
    checkpoints.mark_checkpoint_complete(tmp_path, relative_digests(digests, tmp_path))
    assert read_back == ["config.json", "generation_config.json"]  # the small files nobody hashed while writing
    marker = json.loads((tmp_path / MARKER).read_text())
    assert marker["files"]["optimizer.pt"]["sha256"] == digests[str(tmp_path / "optimizer.pt")]
    assert torch.save is not None and torch.save.__module__ == "torch.serialization"  # swapped back


# ---- resumes that went silently wrong -----------------------------------------------------------------------------
def test_resuming_a_finished_run_trains_nothing_and_says_so(two_checkpoints, tmp_path, caplog):
    """Before: step 4/3 on every such resume (stock transformers 5.24), weights moved."""
    root, full = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    trainer, model = check.make_trainer(out, ONE_EPOCH)
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        result = trainer.train(resume_from_checkpoint="last")
    assert trainer.state.global_step == 3 and "the run is finished, nothing was trained" in caplog.text
    assert check.relative_error(check.weights(model), full) == 0.0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert result.training_loss != result.training_loss  # NaN: nothing was trained, and no loss is logged
    assert "train_loss" not in trainer.state.log_history[-1]


def test_another_runs_checkpoints_are_refused_or_skipped_never_continued(two_checkpoints, tmp_path, caplog):
    """Before: a new run (other learning rate) killed and resumed with `last` continued the old run's checkpoint-20."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    other = dict(rows=13, settings=dict(max_steps=3, lr_scheduler_type="constant", learning_rate=1e-3, seed=1))
    trainer, _ = check.make_trainer(out, other)
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run .*learning_rate 0.02 there, 0.001 here"):
        trainer.train()
    # The other run's old checkpoint-20 next to this run's checkpoint-2: `last` takes this run's, and says why.
    shutil.copytree(out / "checkpoint-3", out / "checkpoint-20")
    marker = json.loads((out / "checkpoint-20" / MARKER).read_text())
    marker["run"].update(learning_rate=1e-3, seed=1)
    (out / "checkpoint-20" / MARKER).write_text(json.dumps(marker))
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        assert resolve_checkpoint("last", out, marker["run"]) == str(out / "checkpoint-20")
        run = json.loads((out / "checkpoint-2" / MARKER).read_text())["run"]
        assert resolve_checkpoint("last", out, run) == str(out / "checkpoint-3")
    assert (
        "checkpoint-20: it was saved by another run (learning_rate 0.001 there, 0.02 here; seed 1 there, 0 here)"
        in caplog.text
    )
    # overwrite_output_dir: the other run's checkpoints are deleted, and it is said.
    trainer, _ = check.make_trainer(out, {**other, "settings": {**other["settings"], "overwrite_output_dir": True}})
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer.train()
    assert "deleted the 4 checkpoint(s)" in caplog.text
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]


def test_a_checkpoint_of_another_number_of_processes_is_not_taken_for_this_runs(two_checkpoints, tmp_path):
    """Before: the marker did not record the number of processes, so `last` continued a 1-process checkpoint on 2
    (or the reverse) without a word: another global batch, and the Trainer skips the resumed epoch's micro-batches
    per process, so examples were trained twice or never. Nor did it record settings such as bf16 or the token
    budget's length_group_size."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    saved = json.loads((out / "checkpoint-3" / MARKER).read_text())["run"]
    assert saved["world_size"] == 1 and {"bf16", "length_group_size", "dataloader_drop_last"} <= set(saved)
    with pytest.raises(ConfigError, match=r"no checkpoint of this run .*world_size 1 there, 2 here") as refused:
        resolve_checkpoint("last", out, {**saved, "world_size": 2})
    # Before: "were saved by another run (it was saved by another run (world_size ...))".
    assert "were saved by another run (world_size 1 there, 2 here)." in str(refused.value)
    with pytest.raises(ConfigError, match=r"holds checkpoints of another run .*bf16 False there, True here"):
        checkpoints.check_output_dir(out, {**saved, "bf16": True}, resuming=False)
    # A marker of an older hfacc, without the settings recorded since, is still this run's.
    older = {k: v for k, v in saved.items() if k not in ("world_size", "bf16")}
    checkpoints.check_output_dir(out, {**older, "world_size": 1, "bf16": False}, resuming=False)


def test_a_named_checkpoint_with_another_learning_rate_says_that_it_keeps_the_saved_one(
    two_checkpoints, tmp_path, caplog
):
    """Before: "it continues with this run's" settings, while the restored optimizer and scheduler states kept the
    checkpoint's learning rate and weight decay (0.02 and 0.0 trained on, 0.001 and 0.5 asked for)."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "base", out)
    settings = dict(max_steps=3, lr_scheduler_type="constant", learning_rate=1e-3, weight_decay=0.5)
    trainer, _ = check.make_trainer(out, dict(rows=13, settings=settings))
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert [g["lr"] for g in trainer.optimizer.param_groups] == [0.02, 0.02]
    assert "learning_rate, weight_decay stay the checkpoint's" in caplog.text
    assert "continues with this run's" not in caplog.text


def test_a_streaming_checkpoint_is_refused_to_a_map_style_run_and_the_reverse(two_checkpoints, tmp_path):
    """Before: a streaming checkpoint resumed without --streaming trained on map-style (exit 0, rel 7.7e-3)."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    checkpoint = out / "checkpoint-2"
    marker = json.loads((checkpoint / MARKER).read_text())
    marker["run"]["streaming"] = True
    (checkpoint / MARKER).write_text(json.dumps(marker))
    with pytest.raises(ConfigError, match=r"saved by a streaming run \(--streaming true\); resume it the same way"):
        resolve_checkpoint(str(checkpoint), out, {**marker["run"], "streaming": False})
    (checkpoint / "stream_state_rank0.json").write_text("{}")  # what a streaming run saves, whatever the marker says
    marker["run"]["streaming"] = False
    (checkpoint / MARKER).write_text(json.dumps(marker))
    trainer, _ = check.make_trainer(out, ONE_EPOCH)
    with pytest.raises(ConfigError, match="saved by a streaming run .*resume it with --streaming true"):
        trainer.train(resume_from_checkpoint=str(checkpoint))
    shutil.rmtree(out / "checkpoint-3")
    stream = dict(rows=21, stream=True, settings=dict(max_steps=3, overwrite_output_dir=True))
    trainer, _ = check.make_trainer(out / "stream", stream)
    with pytest.raises(ConfigError, match="saved by a map-style run"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-1"))


def test_a_checkpoint_of_another_model_size_is_refused_before_loading(two_checkpoints, tmp_path):
    """Before: a size-mismatch traceback (other hidden size), or layers left at random with a log line."""
    root, _ = two_checkpoints
    trainer, _ = check.make_trainer(tmp_path, ONE_EPOCH)
    trainer.model = check.build_tiny_llama(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2)
    with pytest.raises(ConfigError, match=r"its weights are another model's: .*lacks 9 weight\(s\) of this model"):
        trainer.train(resume_from_checkpoint=str(root / "full" / "checkpoint-2"))


def test_a_checkpoint_saved_under_original_names_resumes_exactly(tmp_path):
    """transformers saves Mixtral's experts one by one (Qwen2-VL, Gemma 3, LLaVA-NeXT: under their original module
    names), and the stock Trainer's resume loads by the model's own names: not one of those weights loads, and it
    goes on from untrained weights. Before: refused as "its weights are another model's" (review of issue 22); the
    stock loader alone: the weights below would differ. Now they load through transformers' conversion: the resumed
    run ends where the uninterrupted one does. A checkpoint of another size is still another model's."""
    import transformers
    from datasets import Dataset
    from safetensors.torch import load_file

    from hfacc import DataCollatorForCausalLM, TokenWeightedTrainer
    from tests.helpers import make_examples, train_args

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.MixtralConfig(num_local_experts=2, num_experts_per_tok=1, num_key_value_heads=2, **small)

    def train(out, resume=None):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config)
        args = train_args(out, 2, 2, learning_rate=0.05, max_steps=4, save_strategy="steps", save_steps=2)
        data = Dataset.from_list(make_examples(16))
        trainer = TokenWeightedTrainer(
            model=model, args=args, train_dataset=data, data_collator=DataCollatorForCausalLM(0)
        )
        trainer.train(resume_from_checkpoint=resume)
        return model

    whole = train(tmp_path / "whole")
    saved = tmp_path / "whole" / "checkpoint-2"
    state = load_file(saved / "model.safetensors")
    unloaded = set(state) - set(whole.state_dict())  # what the stock loader (by the model's own names) would skip
    assert any("experts.0.w1" in k for k in unloaded) and checkpoints.saved_under_original_names(saved, whole)
    checkpoints.check_checkpoint_weights(saved, whole)  # the model's own weights: no error
    shutil.copytree(tmp_path / "whole", tmp_path / "resumed")
    resumed = train(tmp_path / "resumed", resume=str(tmp_path / "resumed" / "checkpoint-2"))
    for (name, a), b in zip(whole.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.allclose(a, b, atol=TOL, rtol=0), name
    bigger = transformers.AutoModelForCausalLM.from_config(
        transformers.MixtralConfig(**{**config.to_dict(), "hidden_size": 64})
    )
    with pytest.raises(ConfigError, match="its weights are another model's"):
        checkpoints.check_checkpoint_weights(saved, bigger)


def test_a_stock_checkpoint_counts_only_where_no_hfacc_run_wrote(two_checkpoints, tmp_path):
    """Before: any checkpoint with trainer_state.json and no marker was a stock one, also a half-written hfacc one."""
    root, _ = two_checkpoints
    out = tmp_path / "run"
    shutil.copytree(root / "full", out)
    (out / "checkpoint-3" / MARKER).unlink()  # cut short after trainer_state.json
    assert resolve_checkpoint("last", out) == str(out / "checkpoint-2")
    for path in out.glob(f"checkpoint-*/{MARKER}"):
        path.unlink()
    (out / RUN_RECORD).unlink()  # now: a stock Trainer's output dir
    assert resolve_checkpoint("last", out) == str(out / "checkpoint-3")
    (out / "checkpoint-3" / "trainer_state.json").write_text("{broken")
    assert resolve_checkpoint("last", out) == str(out / "checkpoint-2")
    with pytest.raises(ConfigError, match="trainer_state.json is not valid JSON"):
        resolve_checkpoint(str(out / "checkpoint-3"), out)
    with pytest.raises(ConfigError, match="it is an output directory, not a checkpoint: name one of its"):
        resolve_checkpoint(str(out), out)


def test_the_skipped_step_count_goes_on_after_a_resume(tmp_path):
    """Before: max_skipped_steps counted from 0 again after every resume."""
    out = tmp_path / "run"
    case = dict(rows=13, settings=dict(max_steps=3, lr_scheduler_type="constant", max_skipped_steps=3))
    trainer, _ = check.make_trainer(out, case)
    trainer.train()
    marker = json.loads((out / "checkpoint-2" / MARKER).read_text())
    assert marker["hfacc"] == {"skipped_steps": 0, "empty_windows": 0}
    marker["hfacc"]["skipped_steps"] = 2  # as if two steps of the first two had been skipped
    (out / "checkpoint-2" / MARKER).write_text(json.dumps(marker))
    shutil.rmtree(out / "checkpoint-3")
    trainer, _ = check.make_trainer(out, case)
    trainer.train(resume_from_checkpoint="last")
    assert trainer.state.log_history[-1]["train_skipped_steps"] == 2
    assert json.loads((out / "checkpoint-3" / MARKER).read_text())["hfacc"]["skipped_steps"] == 2


def test_a_full_disk_while_saving_is_one_message_and_keeps_the_last_checkpoint(tmp_path):
    """Before: torch's "unexpected pos ..." traceback, no word of the disk. /dev/full answers every write ENOSPC."""
    out = tmp_path / "run"
    trainer, _ = check.make_trainer(out, ONE_EPOCH)
    (out / "checkpoint-2").mkdir(parents=True)
    os.symlink("/dev/full", out / "checkpoint-2" / "optimizer.pt")
    with pytest.raises(ConfigError) as err:
        trainer.train()
    assert describe_user_error(err.value).startswith("no space left on the device while writing")
    assert "--resume_from_checkpoint last resumes from it" in str(err.value)
    assert get_last_complete_checkpoint(out) == str(out / "checkpoint-1")
