"""Vision-language SFT on tiny models of four families (tests/vision_families.py): Qwen2.5-VL, Idefics3, LLaVA-NeXT,
Gemma 3, with multi-image, multi-turn conversations.

For each family: the tokens are the processor's own; no image token is a target (token by token); the trained
characters are exactly each assistant answer with its end-of-turn marker; bs 8 x GA 1, 2 x 4, 1 x 8, padding-free
(one row and rows), packed rows and 2 ranks all give the hand-written big-batch gradient to 1e-6. Then the checks
that decide padding-free see what they guard against, bad input stops with one named error before training, a
processor loads without torchvision, and the recipe, ``hfacc verify`` and ``hfacc show-mask`` run on a VLM.
"""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
from functools import cache

import datasets
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from hfacc import DataCollatorForVisionLM, TokenWeightedArguments, TokenWeightedTrainer, build_sft_dataset
from hfacc.data.batching import pack_examples
from hfacc.data.formats import DataError
from hfacc.data.multimodal import with_packed_positions
from hfacc.data.padding_free import remove_padding
from hfacc.data.vision import get_image_token_ids, get_processor
from hfacc.ops.loss import IGNORE_INDEX, shift_labels
from hfacc.setup.layout_check import check_image_layout, require_packing_support
from tests.helpers import ROOT, flat_grad, free_port, relative_error, run_trainer, train_args
from tests.vision_families import FAMILIES, conversation_rows, model_for, processor_for

TOL = 1e-6
# The embedded tiny Qwen2.5-VL and its pictures of shapes, as the recipe and the CLI take them.
VLM = ["--embedded_model", "qwen2_5_vl", "--embedded_dataset", "shapes", "--embedded_hidden_size", "32"]
# What each family's published template has the model write for an answer: its text and end-of-turn marker.
ANSWER = {
    "qwen2_5_vl": "{}<|im_end|>",
    "idefics3": " {}<end_of_utterance>",  # "Assistant:" is the generation prompt: the space is the model's
    "llava_next": " {}</s>",  # " text</s> ": the leading space is trained, the trailing one is scaffolding
    "gemma3": "{}<end_of_turn>",
}


@cache
def built(family):
    rows = conversation_rows(family, 8)
    return rows, build_sft_dataset(datasets.Dataset.from_list(rows), processor_for(family))


def examples_for(family) -> list[dict]:
    """The family's 8 tokenized examples (image references, not pixels), as plain dicts."""
    return built(family)[1].to_list()


def collate(family, examples):
    return DataCollatorForVisionLM(processor_for(family))(examples)


def reference_gradient(family, examples) -> torch.Tensor:
    """One forward/backward of the whole batch, padded, with plain torch ops: the mean CE over its targets."""
    model = model_for(family)
    batch = collate(family, examples)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    targets = batch["labels"][:, 1:]
    ce = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
    (ce / (targets != -100).sum()).backward()
    return flat_grad(model)


def trained_runs(tokenizer, ids, labels) -> list[str]:
    runs, current = [], []
    for token, label in zip(ids, labels, strict=True):
        if label != IGNORE_INDEX:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def with_images_in_parts(row):
    """The row with each image inside its part, as model cards write them (``{"type": "image", "image": ...}``)."""
    images = iter(row["images"])
    return [
        {
            **m,
            "content": [{"type": "image", "image": next(images)} if p["type"] == "image" else p for p in m["content"]],
        }
        for m in row["messages"]
    ]


# ---- tokens, masks and image inputs, per family -----------------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_tokens_and_image_inputs_are_the_processors_own(family):
    processor = processor_for(family)
    rows, dataset = built(family)
    assert sorted(dataset.column_names) == ["attention_mask", "images", "input_ids", "labels"]
    assert dataset.features["images"].feature == datasets.Image(decode=False)  # references, never pixels
    for i in (0, 2, 5):  # 1, 3 and 3 images; one and two assistant turns
        reference = processor.apply_chat_template(with_images_in_parts(rows[i]), tokenize=True, return_dict=True)
        assert dataset[i]["input_ids"] == reference["input_ids"][0]
    # The collated micro-batch holds what the processor itself gives for these conversations, padded the same way.
    examples = examples_for(family)[:3]
    batch = collate(family, examples)
    texts = [processor.apply_chat_template(r["messages"], tokenize=False) for r in rows[:3]]
    images = [r["images"] for r in rows[:3]]
    own = processor(text=texts, images=images, return_tensors="pt", padding=True)
    assert torch.equal(batch["input_ids"], own["input_ids"])
    for key in own:
        if key not in ("input_ids", "attention_mask"):
            assert torch.equal(batch[key], own[key]), key
    image_keys = {"pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes"} & set(own)
    assert image_keys and set(batch) == set(own) | {"labels"}


@pytest.mark.parametrize("family", FAMILIES)
def test_no_image_token_is_a_target_and_only_answers_are_trained(family):
    processor = processor_for(family)
    rows, dataset = built(family)
    image_ids = get_image_token_ids(processor)
    for row, example in zip(rows, dataset, strict=True):
        ids, labels = example["input_ids"], example["labels"]
        own = processor.apply_chat_template(with_images_in_parts(row), tokenize=True, return_dict=True)
        types = own.get("mm_token_type_ids", own.get("token_type_ids"))
        image_positions = [t for t, i in enumerate(ids) if i in image_ids or (types is not None and types[0][t])]
        assert len(image_positions) >= 2 * len(row["images"])  # hundreds in real models: a few here
        assert all(labels[t] == IGNORE_INDEX for t in image_positions)  # token by token
        # Character by character: exactly each answer with its end-of-turn marker, nothing else.
        answers = [m["content"][0]["text"] for m in row["messages"] if m["role"] == "assistant"]
        assert trained_runs(processor.tokenizer, ids, labels) == [ANSWER[family].format(a) for a in answers]
        targets = sum(y != IGNORE_INDEX for y in labels[1:])
        assert targets == sum(
            len(processor.tokenizer(ANSWER[family].format(a), add_special_tokens=False)["input_ids"]) for a in answers
        )


def test_images_given_in_their_parts_paths_or_bytes_give_the_same_rows(tmp_path):
    processor = processor_for("qwen2_5_vl")
    rows, dataset = built("qwen2_5_vl")
    row = rows[2]
    paths = []
    for j, image in enumerate(row["images"]):
        paths.append(str(tmp_path / f"image{j}.png"))
        image.save(paths[-1])
    variants = [
        {"messages": with_images_in_parts(row)},  # PIL images in the parts
        {"messages": with_images_in_parts({**row, "images": paths})},  # local paths in the parts
        {"messages": row["messages"], "images": paths},  # paths in the images column
    ]
    built_again = [build_sft_dataset(datasets.Dataset.from_list([v]), processor)[0] for v in variants]
    for example in built_again:
        assert (example["input_ids"], example["labels"]) == (dataset[2]["input_ids"], dataset[2]["labels"])
    # Paths stay paths (absolute); in-memory images become bytes.
    assert built_again[1]["images"][0]["path"] == paths[0] and built_again[0]["images"][0]["bytes"]
    assert built_again[2]["images"] == built_again[1]["images"]


def test_a_streamed_image_dataset_gives_the_same_examples():
    """Streaming: each row is tokenized when read, with its image references, as the map-style build does."""
    rows, dataset = built("gemma3")
    stream = build_sft_dataset(datasets.IterableDataset.from_generator(lambda: iter(rows)), processor_for("gemma3"))
    streamed = list(stream)
    assert [e["input_ids"] for e in streamed] == dataset["input_ids"]
    assert [e["labels"] for e in streamed] == dataset["labels"]
    batch = collate("gemma3", streamed[:3])
    assert torch.equal(batch["pixel_values"], collate("gemma3", examples_for("gemma3")[:3])["pixel_values"])


# ---- exactness: every split, padding-free, packed, per family ---------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_every_split_and_padding_free_give_the_big_batch_update(tmp_path, family, monkeypatch, caplog):
    examples = examples_for(family)
    reference = reference_gradient(family, examples)
    collator = DataCollatorForVisionLM(processor_for(family))
    errors = {}
    # Padded and padding-free both ways: sdpa's rows of the longest sequence, flash/flex attention's one row.
    splits = [(2, 4, None), (1, 8, None), (8, 1, "one_row"), (3, 3, "rows")]
    for bs, ga, layout in splits:  # (3, 3): ragged, micro-batches of 3, 3 and 2
        # (one row forced here: flash and flex attention need CUDA for their backward)
        monkeypatch.setattr(
            "hfacc.setup.layout_check.uses_one_row", lambda model, one_row=layout == "one_row": one_row
        )
        args = train_args(tmp_path, bs, ga, args_class=TokenWeightedArguments, padding_free=layout is not None)
        with caplog.at_level(logging.INFO, logger="hfacc"):
            trainer, capture = run_trainer(TokenWeightedTrainer, model_for(family), examples, args, collator)
        assert trainer.padding_free is (layout is not None), caplog.text
        assert trainer.objective.fused  # the fused loss runs on the VLM's language-model head
        errors[(bs, ga, layout)] = relative_error(capture.grads[0], reference)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("family", FAMILIES)
def test_padding_free_lays_out_images_in_order(family):
    batch = collate(family, examples_for(family))
    for one_row in (True, False):
        laid = remove_padding(batch, one_row)
        assert laid is not None and "attention_mask" not in laid
        for key in ("pixel_values", "image_grid_thw", "image_sizes", "pixel_attention_mask"):
            if key in batch:
                assert laid[key] is batch[key]
        # Sequences stay in order, so the i-th run of image tokens is still image i's.
        owners = laid["sequence_ids"].flatten()
        real = owners[owners >= 0]
        assert real.tolist() == sorted(real.tolist())
        # The targets are the padded batch's, in the same order.
        padded = shift_labels(batch["labels"], attention_mask=batch["attention_mask"])
        targets = shift_labels(laid["labels"], position_ids=laid["position_ids"]).flatten()
        assert targets[targets != IGNORE_INDEX].tolist() == padded[padded != IGNORE_INDEX].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_repeats_cut_from_a_last_batch_leave_each_example_its_images(family):
    """On 2 ranks with an odd number of examples accelerate repeats one in the last batch, which hfacc cuts. Before:
    rows were cut with every entry of the batch's size, so image entries (per image, or per patch) lost some images
    or none, and training stopped with a size mismatch (Qwen2.5-VL: "The size of tensor a (32) must match the size
    of tensor b (16)"). Now the examples kept count and train what they do alone."""
    from hfacc.objectives import CausalLMObjective
    from hfacc.runtime.distributed import trim_repeated_examples

    examples = examples_for(family)[:3]
    batches, objective, model = [collate(family, examples)], CausalLMObjective(), model_for(family)
    assert trim_repeated_examples(batches, 2, rank=1, warn=False, examples=objective) == (set(), 1)
    alone = collate(family, examples[:2])
    with torch.no_grad():
        (_, cut), (_, want) = objective(model, batches[0]), objective(model, alone)
    assert cut.count.item() == want.count.item() == objective.count(alone)[0].item()
    assert cut.loss.item() == pytest.approx(want.loss.item(), rel=1e-5)


def test_mrope_positions_of_packed_rows_are_each_sequences_own():
    """Qwen2.5-VL laid out in one row: the 3-D positions are what the model computes for each padded row, the text
    channel restarts per sequence, and the one target definition reads the boundaries from it."""
    model = model_for("qwen2_5_vl")
    batch = collate("qwen2_5_vl", examples_for("qwen2_5_vl"))
    padded, _ = model.model.get_rope_index(
        batch["input_ids"],
        mm_token_type_ids=batch["mm_token_type_ids"],
        image_grid_thw=batch["image_grid_thw"],
        attention_mask=batch["attention_mask"],
    )
    laid = remove_padding(batch, one_row=True)
    positions = with_packed_positions(model, {k: v for k, v in laid.items() if k != "labels"})["position_ids"]
    assert positions.shape == (4, 1, int(batch["attention_mask"].sum()))
    real = batch["attention_mask"].bool()
    assert torch.equal(positions[1:, 0], padded[:, real])  # row-major real positions = the one row, in order
    assert torch.equal(positions[0], laid["position_ids"])
    assert not torch.equal(positions[1], positions[2])  # images have 2-D positions: the channels differ
    targets = shift_labels(laid["labels"], position_ids=positions)
    assert torch.equal(targets, shift_labels(laid["labels"], position_ids=laid["position_ids"]))
    assert (targets != IGNORE_INDEX).sum() == (
        shift_labels(batch["labels"], attention_mask=batch["attention_mask"]) != IGNORE_INDEX
    ).sum()


def test_the_image_layout_check_sees_positions_and_order(monkeypatch):
    """Negative controls: without per-sequence mrope positions, or with the sequences reordered, the padding-free
    check that runs the first micro-batch's images both ways finds the difference (so training stays padded)."""
    model = model_for("qwen2_5_vl")
    batch = collate("qwen2_5_vl", examples_for("qwen2_5_vl"))
    assert check_image_layout(model, batch, remove_padding(batch, one_row=False)) is None
    monkeypatch.setattr("hfacc.setup.layout_check.with_packed_positions", lambda model, inputs: inputs)
    assert "differ from the padded ones" in check_image_layout(model, batch, remove_padding(batch, one_row=True))
    monkeypatch.undo()
    from hfacc.data.batching import best_fit_decreasing

    model, batch = model_for("llava_next"), collate("llava_next", examples_for("llava_next"))
    monkeypatch.setattr("hfacc.data.padding_free.get_ordered_rows", best_fit_decreasing)  # longest first
    assert "differ from the padded ones" in check_image_layout(model, batch, remove_padding(batch, one_row=False))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_packed_rows_with_images_give_the_big_batch_update(tmp_path, family):
    examples = examples_for(family)
    reference = reference_gradient(family, examples)
    rows = pack_examples(examples, max_length=max(len(e["input_ids"]) for e in examples) * 2)
    assert len(rows) < len(examples) and sum(len(r["images"]) for r in rows) == sum(len(e["images"]) for e in examples)
    collator = DataCollatorForVisionLM(processor_for(family))
    model = model_for(family)
    require_packing_support(model, collator(rows))  # every packed row against its sequences padded
    args = train_args(tmp_path, 2, 2, args_class=TokenWeightedArguments)
    _, capture = run_trainer(TokenWeightedTrainer, model, rows, args, collator)
    assert relative_error(capture.grads[0], reference) <= TOL


def test_packing_check_refuses_rows_without_per_sequence_positions(monkeypatch):
    rows = pack_examples(examples_for("qwen2_5_vl"), max_length=256)
    batch = DataCollatorForVisionLM(processor_for("qwen2_5_vl"))(rows)
    monkeypatch.setattr("hfacc.setup.layout_check.with_packed_positions", lambda model, inputs: inputs)
    with pytest.raises(RuntimeError, match="differ from the padded ones"):
        require_packing_support(model_for("qwen2_5_vl"), batch)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("vision-dist") / "results.json"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", "accelerate_configs/ddp.yaml"]
    launch += ["--main_process_port", str(free_port()), "tests/vision_distributed_check.py", str(out)]
    proc = subprocess.run(launch, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.distributed
@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_give_the_big_batch_update(two_ranks, family):
    assert two_ranks["world_size"] == 2
    case = two_ranks["cases"][f"{family} padding_free=True"]
    assert case["grad_error"] <= TOL and case["padding_free"], case


# ---- bad input: one named error before training -----------------------------------------------------------------
def bad_rows(tmp_path, case):
    rows, _ = built("qwen2_5_vl")
    row = dict(rows[0])  # one image
    user = "What colour is the circle?"
    if case == "missing file":
        return [{**row, "images": [str(tmp_path / "nowhere.png")]}]
    if case == "undecodable file":
        (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not an image")
        return [{**row, "images": [str(tmp_path / "broken.png")]}]
    if case == "truncated file":
        buffer = io.BytesIO()
        row["images"][0].save(buffer, format="PNG")
        (tmp_path / "cut.png").write_bytes(buffer.getvalue()[:-20])
        return [{**row, "images": [str(tmp_path / "cut.png")]}]
    if case == "more placeholders than images":
        return [{**row, "images": []}]
    if case == "more images than placeholders":
        return [{**row, "images": row["images"] * 2}]
    if case == "a literal placeholder in the text":
        messages = [dict(m) for m in row["messages"]]
        messages[0] = {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": user + "<|image_pad|>"}],
        }
        return [{**row, "messages": messages}]
    if case == "a URL offline":
        return [{**row, "images": ["https://hfacc.invalid/circle.png"]}]
    if case == "an image the processor refuses":  # before: Qwen2-VL's raw ValueError (a traceback in the recipe)
        return [{**row, "images": [Image.new("RGB", (1, 300), "red")]}]
    raise ValueError(case)


BAD = {
    "missing file": r"row 0, image 0: the image file .*nowhere.png does not exist",
    "undecodable file": r"row 0, image 0: the image .*broken.png cannot be decoded",
    "truncated file": r"row 0, image 0: the image .*cut.png cannot be decoded",
    "more placeholders than images": r"row 0: the conversation has more image parts than images",
    "more images than placeholders": r"row 0: 2 image\(s\) in the 'images' column but only 1 image part",
    "a literal placeholder in the text": r"row 0: the chat template wrote 2 image placeholder\(s\) '<\|image_pad\|>' for 1",
    "a URL offline": r"row 0, image 0: the image https://hfacc.invalid/circle.png cannot be downloaded",
    "an image the processor refuses": r"row 0, image 0: .*Processor cannot process an image of 1x300 pixels "
    r"\(absolute aspect ratio must be smaller than 200",
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_image_input_is_one_named_error_before_training(tmp_path, case):
    with pytest.raises(DataError, match=BAD[case]):
        build_sft_dataset(datasets.Dataset.from_list(bad_rows(tmp_path, case)), processor_for("qwen2_5_vl"))


def test_an_image_for_a_processor_without_an_image_processor_is_refused():
    from transformers import ProcessorMixin

    class TextOnlyProcessor(ProcessorMixin):  # a processor with a tokenizer and nothing for images
        def __init__(self, tokenizer=None, chat_template=None):
            super().__init__(tokenizer, chat_template=chat_template)

    rows, _ = built("qwen2_5_vl")
    tokenizer = processor_for("qwen2_5_vl").tokenizer
    for given in (tokenizer, TextOnlyProcessor(tokenizer, chat_template=tokenizer.chat_template)):
        with pytest.raises(DataError, match=r"row 0.*an image, but the tokenizer \(or processor\) given has no image"):
            build_sft_dataset(datasets.Dataset.from_list(rows[:1]), given)


def test_the_recipe_stops_on_a_bad_image_with_one_message(tmp_path, capsys):
    rows = [{"messages": conversation_rows("qwen2_5_vl", 1)[0]["messages"][:2], "images": ["nowhere.png"]}] * 3
    path = tmp_path / "images.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from hfacc.jobs.sft import cli

    with pytest.raises(SystemExit) as stop:
        cli([*VLM, "--dataset_name", str(path), "--max_steps", "1", "--output_dir", str(tmp_path / "out")])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "error: row " in err and ", image 0: the image file nowhere.png does not exist" in err
    assert "Traceback" not in err


def test_a_changed_image_is_named_when_its_batch_is_made(tmp_path):
    path = tmp_path / "picture.png"
    Image.new("RGB", (28, 28), "red").save(path)
    rows, _ = built("qwen2_5_vl")
    dataset = build_sft_dataset(
        datasets.Dataset.from_list([{**rows[0], "images": [str(path)]}]), processor_for("qwen2_5_vl")
    )
    Image.new("RGB", (56, 84), "red").save(path)  # more image tokens now
    with pytest.raises(DataError, match=r"picture.png\) expand to 6 image tokens, but the example holds 1"):
        collate("qwen2_5_vl", dataset.to_list())


# ---- a processor without torchvision; the recipe, verify and show-mask on a VLM ----------------------------------
def test_qwen_processor_loads_without_torchvision(tmp_path):
    """A Qwen2.5-VL checkpoint as the hub has it: AutoProcessor needs torchvision (for the video processor);
    hfacc.get_processor loads the same processor, images only, and it renders and expands images the same way."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    processor = processor_for("qwen2_5_vl")
    processor.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    assert config["processor_class"] == "Qwen2_5_VLProcessor"  # what a real checkpoint names
    if not is_torchvision_available():
        with pytest.raises(Exception):  # noqa: B017 (transformers' own error, whatever its type)
            AutoProcessor.from_pretrained(tmp_path)
    loaded = get_processor(str(tmp_path))
    assert type(loaded).__mro__[1].__name__ == "Qwen2_5_VLProcessor" and not hasattr(loaded, "video_processor")
    rows, dataset = built("qwen2_5_vl")
    again = build_sft_dataset(datasets.Dataset.from_list(rows[:3]), loaded)
    assert again["input_ids"] == dataset["input_ids"][:3] and again["labels"] == dataset["labels"][:3]
    # The recipe's loader (--model_name_or_path <VLM>) picks the model's image-text class and its processor.
    from hfacc.models.loading import ModelArguments, load_model_and_tokenizer

    model_for("qwen2_5_vl").save_pretrained(tmp_path)
    model, processor = load_model_and_tokenizer(ModelArguments(model_name_or_path=str(tmp_path)))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert processor.image_processor.size == loaded.image_processor.size


def test_the_tiny_vlm_recipe_runs_a_few_steps(tmp_path, caplog):
    """recipes/configs/tiny-vlm.yaml, shortened for CI and packed (rows of several conversations and their
    pictures, checked against their sequences padded): the tiny Qwen2.5-VL trains on pictures and answers held-out
    pictures (the full run, padding-free: docs/vision.md)."""
    from hfacc.runtime.config import parse_args
    from tests.helpers import load_recipe, recipe_types

    module = load_recipe()
    short = [
        "--max_steps",
        "3",
        "--num_embedded_examples",
        "96",
        "--num_exact_match_examples",
        "4",
        "--packing",
        "true",
    ]
    short += ["--per_device_train_batch_size", "4", "--output_dir", str(tmp_path), "--disable_tqdm", "true"]
    parsed = parse_args(recipe_types(module), ["--config", str(ROOT / "recipes/configs/tiny-vlm.yaml"), *short])
    with caplog.at_level(logging.WARNING, logger="hfacc"):
        metrics = module.main(*parsed)
    assert metrics["steps"] == 3 and metrics["eval_loss_after"] < metrics["eval_loss_before"]
    # Packed rows are the collator's layout: no false "padded micro-batches" warning about them (review of #25).
    assert "padded micro-batches" not in caplog.text
    assert len(metrics["samples"]) == 4 and metrics["samples"][0]["prompt"].startswith("<image>")
    assert {"colour", "count"} >= set(metrics["exact_match_by_task"])
    for name in ("model.safetensors", "processor_config.json", "chat_template.jinja", "metrics.json"):
        assert (tmp_path / name).is_file(), name


def test_verify_and_show_mask_on_a_vlm(capsys):
    from hfacc.cli import main as cli_main

    argv = [*VLM, "--num_embedded_examples", "64"]
    assert cli_main(["verify", *argv]) == 0
    report = capsys.readouterr().out
    assert "Qwen2_5_VLForConditionalGeneration" in report and "PASS" in report
    assert cli_main(["show-mask", *argv, "--count", "2", "--color", "false"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("[image: 16 tokens]") >= 2  # a 56-pixel picture: 4 x 4 patches, one token each
    assert "[[" in shown and "<|im_end|>]]" in shown  # the answer and its end-of-turn token are trained
    trained = [part.split("]]")[0] for part in shown.split("[[")[1:]]
    assert not any("image" in t for t in trained)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "gemma3"])
def test_a_vlm_checkpoint_is_the_models_own(tmp_path, family):
    """Qwen2.5-VL, Gemma 3 and LLaVA-NeXT are saved under their checkpoints' original names, which the stock
    Trainer's resume does not map back (it would go on from untrained weights). Before: refused as "its weights are
    another model's", for the very model that saved them. Now they are recognized, and loaded through transformers'
    conversion (TokenWeightedTrainer._load_from_checkpoint; tests/test_resume.py resumes a Mixtral exactly so)."""
    from hfacc.training.checkpoint import check_checkpoint_weights, saved_under_original_names

    model = model_for(family)
    model.save_pretrained(tmp_path / "checkpoint-1")
    check_checkpoint_weights(tmp_path / "checkpoint-1", model)
    assert saved_under_original_names(tmp_path / "checkpoint-1", model)
    loaded = type(model).from_pretrained(tmp_path / "checkpoint-1", config=model.config, dtype=model.dtype)
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
