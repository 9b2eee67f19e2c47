"""Streaming datasets: lazy tokenization like the map-style path, exact windows on 1 and 2 ranks, exact resume from
the stream's own state, clear errors (bad row, missing max_steps), and the recipe with --streaming."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from datasets import Dataset, IterableDataset

from hfacc import DataCollatorForCausalLM
from hfacc.data.embedded import build_default_tokenizer
from hfacc.data.formats import DataError
from hfacc.data.sft import build_sft_dataset
from hfacc.data.streaming import STATE_KEY, SFTStream, StreamBatches
from hfacc.jobs.console import describe_user_error
from tests import streaming_check as check
from tests.helpers import ROOT, free_port, load_recipe, recipe_types, torchrun

TOL = 1e-6


@pytest.fixture(scope="module")
def tokenizer():
    torch.set_num_threads(1)
    return build_default_tokenizer()


@pytest.fixture(scope="module")
def rows():
    return check.make_rows()


def from_rows(rows):
    def generate():
        yield from rows

    return IterableDataset.from_generator(generate)


def test_a_stream_is_tokenized_lazily_and_like_the_map_style_path(tokenizer, rows):
    rows = rows + [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x" * 400}]}]
    for truncation in ("right", "drop"):
        stream = build_sft_dataset(from_rows(rows), tokenizer, max_length=32, truncation=truncation)
        assert isinstance(stream, SFTStream)
        mapped = build_sft_dataset(Dataset.from_list(rows), tokenizer, max_length=32, truncation=truncation)
        streamed = list(stream)
        assert [e["input_ids"] for e in streamed] == mapped["input_ids"]
        assert [e["labels"] for e in streamed] == mapped["labels"]
        assert stream.truncated > 0 and stream.dropped == len(rows) - len(mapped) > 0  # counted as map-style does


def test_a_stream_is_read_only_when_training_reads_it(tokenizer, rows):
    read = []

    def generate():
        for row in rows:
            read.append(row)
            yield row

    build_sft_dataset(IterableDataset.from_generator(generate), tokenizer, max_length=64)
    assert len(read) == 1  # the first row, to know the format


def test_stream_checks_fail_before_training(tokenizer):
    with pytest.raises(DataError, match="'messages'"):
        build_sft_dataset(from_rows([{"conversations": []}]), tokenizer)
    with pytest.raises(DataError, match="empty"):
        build_sft_dataset(from_rows([]), tokenizer)
    tokenizer_without_template = build_default_tokenizer()
    tokenizer_without_template.chat_template = None
    with pytest.raises(DataError, match="chat template"):
        build_sft_dataset(from_rows([{"messages": [{"role": "user", "content": "a"}]}]), tokenizer_without_template)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_bad_row_is_named_by_its_place_in_the_stream(tokenizer, rows, rank):
    bad = list(rows[:12])
    bad[7] = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": 4}]}
    stream = build_sft_dataset(from_rows(bad), tokenizer, max_length=64)
    batches = StreamBatches(stream, DataCollatorForCausalLM(0), batch_size=2, rank=rank, world_size=2)
    if rank == 0:  # rank 0 reads rows 0, 2, 4, ...: never the bad one
        assert len([b for _, b in zip(range(3), batches, strict=False)]) == 3
        return
    with pytest.raises(DataError) as err:
        list(zip(range(6), batches, strict=False))
    assert "row 7 of the stream" in str(err.value) and "content" in str(err.value)
    assert describe_user_error(err.value) == str(err.value)  # the console shows it as one message


def test_batches_carry_the_position_after_them_and_resume_there(tokenizer, rows):
    stream = check.make_stream(rows, tokenizer, buffer_size=8)
    collate = DataCollatorForCausalLM(tokenizer.pad_token_id)
    for budget in (0, 160):
        straight = StreamBatches(stream, collate, batch_size=2, max_tokens=budget)
        batches = [b for _, b in zip(range(12), straight, strict=False)]
        resumed = StreamBatches(stream, collate, batch_size=2, max_tokens=budget)
        resumed.load_state_dict(batches[4][STATE_KEY])
        again = [b for _, b in zip(range(7), resumed, strict=False)]
        for a, b in zip(again, batches[5:], strict=True):
            assert torch.equal(a["input_ids"], b["input_ids"]) and a[STATE_KEY] == b[STATE_KEY]
    with pytest.raises(DataError, match="as many processes"):
        StreamBatches(stream, collate, rank=0, world_size=2).load_state_dict(batches[0][STATE_KEY])


def test_a_finite_stream_starts_again_and_says_so(tokenizer, rows, caplog):
    stream = check.make_stream(rows[:6], tokenizer)
    batches = StreamBatches(stream, DataCollatorForCausalLM(tokenizer.pad_token_id), batch_size=4)
    with caplog.at_level("WARNING"):
        taken = [b for _, b in zip(range(5), batches, strict=False)]
    assert [len(b["input_ids"]) for b in taken] == [4, 2, 4, 2, 4]  # 4 + 2 examples per pass
    assert [b[STATE_KEY]["epoch"] for b in taken] == [0, 1, 1, 2, 2]  # the position after: the next pass
    assert "starts again" in caplog.text


def test_training_a_stream_needs_max_steps(tokenizer, rows, tmp_path):
    with pytest.raises(DataError, match="max_steps"):
        check.build_trainer(
            check.make_model(tokenizer), check.make_stream(rows, tokenizer), tokenizer, tmp_path, max_steps=-1
        )


@pytest.mark.parametrize("budget,packing", [(0, False), (160, False), (0, True)])
def test_one_process_window_is_the_big_batch(tokenizer, rows, tmp_path, budget, packing):
    result = check.exactness_case(
        tokenizer, rows, tmp_path, packing=packing, max_tokens_per_batch=budget, gradient_accumulation_steps=4
    )
    assert result["grad_error"] <= TOL
    seen = result["indices_per_rank"][0]
    if not (budget or packing):  # consecutive examples of the stream
        assert seen == list(range(8))
    assert result["packed_rows"] == packing and len(seen) >= 8  # packed: 2 rows of 64 tokens per micro-batch


@pytest.mark.parametrize("budget", [0, 160])
def test_one_process_resume_mid_stream_ends_with_the_same_weights(tokenizer, rows, tmp_path, budget, monkeypatch):
    encoded = []
    encode = SFTStream.encode
    monkeypatch.setattr(
        SFTStream, "encode", lambda self, row, where: encoded.append(where) or encode(self, row, where)
    )
    result = check.resume_case(tokenizer, rows, tmp_path, max_tokens_per_batch=budget)
    assert result["moved"] > 0.1  # the weights did change: the comparison can fail
    assert result["weight_error"] <= TOL and result["same_windows"] == [True]
    # The resumed run read on from the checkpoint's position, never from the stream's start: without a budget
    # from row 8 (2 steps of 2 x 2 examples); with one, from the start of the checkpoint's buffer (16 rows each).
    rows_read = [int(where.split()[0]) for where in encoded]
    second = next(i for i in range(1, len(rows_read)) if rows_read[i] < rows_read[i - 1])
    assert rows_read[second] == (0 if budget else 8)
    assert len(rows_read) - second <= 16


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("streaming2")
    proc = subprocess.run(
        torchrun("tests/streaming_check.py", str(out)), cwd=ROOT, capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.distributed
def test_two_ranks_split_the_stream_without_duplicates_or_gaps(two_ranks):
    assert two_ranks["world_size"] == 2
    rank0, rank1 = two_ranks["fixed"]["indices_per_rank"]
    assert rank0 == [0, 2, 4, 6] and rank1 == [1, 3, 5, 7]  # one shard: row by row


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["fixed", "budget", "packing"])
def test_two_ranks_window_is_the_big_batch(two_ranks, case):
    assert two_ranks[case]["grad_error"] <= TOL


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["resume", "resume budget"])
def test_two_ranks_resume_mid_stream_ends_with_the_same_weights(two_ranks, case):
    result = two_ranks[case]
    assert result["moved"] > 0.1 and result["weight_error"] <= TOL and result["same_windows"] == [True, True]


RECIPE = [
    "--streaming",
    "true",
    "--stream_eval_examples",
    "16",
    "--per_device_train_batch_size",
    "4",
    "--gradient_accumulation_steps",
    "2",
    "--eval_strategy",
    "no",
    "--save_steps",
    "2",
    "--num_exact_match_examples",
    "0",
    "--disable_tqdm",
    "true",
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_recipe_streams_a_local_jsonl_and_resumes(tmp_path, rows):
    module = load_recipe()
    from hfacc.runtime.config import parse_args

    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    common = ["--config", str(module.DEFAULT_CONFIG), *RECIPE, "--dataset_name", str(data)]
    with pytest.raises(DataError, match="max_steps"):
        module.main(*parse_args(recipe_types(module), [*common, "--output_dir", str(tmp_path / "x")]))
    full = tmp_path / "full"
    metrics = module.main(*parse_args(recipe_types(module), [*common, "--max_steps", "4", "--output_dir", str(full)]))
    assert metrics["steps"] == 4 and metrics["train"]["train_num_targets"] > 0
    assert (full / "checkpoint-2" / "stream_state_rank0.json").is_file()
    resumed = tmp_path / "resumed"
    shutil.copytree(full / "checkpoint-2", resumed / "checkpoint-2")
    argv = [*common, "--max_steps", "4", "--output_dir", str(resumed), "--resume_from_checkpoint", "last"]
    module.main(*parse_args(recipe_types(module), argv))
    from safetensors.torch import load_file

    a, b = load_file(full / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert all(torch.allclose(a[k], b[k], rtol=0, atol=1e-6) for k in a)


@pytest.mark.slow
@pytest.mark.distributed
def test_recipe_streams_on_two_processes_and_a_bad_row_is_one_message(tmp_path, rows):
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    launch += ["--main_process_port", str(free_port()), "recipes/sft.py", *RECIPE, "--dataset_name"]
    proc = subprocess.run(
        [*launch, str(data), "--max_steps", "3", "--output_dir", str(tmp_path / "out")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert saved["steps"] == 3 and saved["world_size"] == 2
    assert sorted(p.name for p in (tmp_path / "out" / "checkpoint-2").glob("stream_state_*")) == [
        "stream_state_rank0.json",
        "stream_state_rank1.json",
    ]
    bad = list(rows)
    bad[21] = {"messages": [{"role": "user", "content": "hello"}]}  # no assistant turn: nothing to train
    data = write_jsonl(tmp_path / "bad.jsonl", bad)
    quiet = [*launch[:3], "-q", *launch[3:]]  # -q: without accelerate's own CalledProcessError traceback
    proc = subprocess.run(
        [*quiet, str(data), "--max_steps", "3", "--output_dir", str(tmp_path / "bad")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode != 0
    # The rank that read it names the row; the other stops too, without waiting in a collective or a traceback.
    assert "error: row 21, field 'messages'" in proc.stderr and "another process stopped" in proc.stderr
    # No rank's traceback; torch's elastic launcher adds one of its own (ChildFailedError) even with -q.
    assert "[rank0]: Traceback" not in proc.stderr and "[rank1]: Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.count("Traceback") <= 1 and "hfacc/" not in proc.stderr.split("Traceback")[-1]


def test_a_sharded_stream_with_held_out_rows_is_split_row_by_row(tokenizer):
    """datasets shares skip(n) out among the shards each rank reads: held-out rows would be trained, others lost."""

    def generate(shards):
        for s in shards:
            for i in range(5):
                yield {"text": f"shard {s} row {i}"}

    source = IterableDataset.from_generator(generate, gen_kwargs={"shards": [0, 1, 2, 3]}).skip(3)
    for split_by_rows in (False, True):
        stream = build_sft_dataset(source, tokenizer, max_length=32)
        stream.split_by_rows = split_by_rows
        seen = []
        for rank in range(2):
            batches = StreamBatches(stream, lambda examples: {"examples": examples}, rank=rank, world_size=2)
            for batch in batches:
                if batch[STATE_KEY]["epoch"] > 0:
                    break
                seen.append(tokenizer.decode(batch["examples"][0]["input_ids"][:-1]))
        expected = [f"shard {s} row {i}" for s in range(4) for i in range(5)][3:]
        if split_by_rows:  # what load_stream_source sets for the held-out rows: none trained, none lost
            assert sorted(seen) == sorted(expected)
        else:  # whole shards per rank: datasets' skip(3) became 1 or 2 rows of each rank's shards
            assert sorted(seen) != sorted(expected)


def test_map_style_tokenization_uses_several_processes_when_large_and_says_how_long(
    tokenizer, rows, monkeypatch, caplog
):
    import hfacc.data.sft

    monkeypatch.setattr(hfacc.data.sft, "PARALLEL_ROWS", 16)  # "large", for this test
    monkeypatch.setattr(hfacc.data.sft.os, "cpu_count", lambda: 2)
    data = Dataset.from_list(rows[:32])
    with caplog.at_level("INFO", logger="hfacc.data.sft"):
        parallel = build_sft_dataset(data, tokenizer, max_length=64)
    assert "tokenized 32 messages rows in" in caplog.text and "(2 processes)" in caplog.text
    single = build_sft_dataset(data, tokenizer, max_length=64, num_proc=1)
    assert parallel["input_ids"] == single["input_ids"] and parallel["labels"] == single["labels"]
