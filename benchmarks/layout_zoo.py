"""The model zoo through hfacc's layout checks: which layout each causal-LM family of transformers takes, by precision.

    python benchmarks/layout_zoo.py                         # every family transformers maps to AutoModelForCausalLM
    python benchmarks/layout_zoo.py --families ctrl,lfm2    # some of them
    python benchmarks/layout_zoo.py --curated               # and the families the tests build by hand
    python benchmarks/layout_zoo.py --baseline /tmp/main    # adds a bf16 column of another checkout (before a change)

Each family's model is built from its own config class, shrunk (hidden 32, 2 layers, 4 heads, vocab 256, experts 4;
the fields a config does not have are left alone), seeded, sdpa where the family has it. Then, for each precision —
fp32; bf16 autocast over fp32 weights (what ``bf16=True`` gives: the checks are called under autocast, as in a
``Trainer``); bf16 weights (``model.to(torch.bfloat16)``) — the once-per-model decision training takes
(:func:`hfacc.setup.layout_check.choose_padding_free`) runs on one micro-batch of 4 sequences of 5-30 tokens, with
rows checked as long as training data whose longest sequence is ``--longest`` (256) tokens lays out, and the table
says what it chose: ``one row``, ``rows`` (packed rows as wide as the longest sequence), ``padded`` (with
the first reason), ``n/a`` (the objective or the model rules padding-free out before any run), or why the family
could not be built small. A family whose bf16 path differs from its fp32 path is listed at the end: every such
difference must be the model's, not rounding's.

Encoder-only and encoder-decoder families that transformers also maps to AutoModelForCausalLM (BERT-likes as
decoders, BART, ...) are built like the others and are ``n/a`` or padded for their own reasons.
"""

import argparse
import contextlib
import importlib
import logging
import os
import random
import signal
import sys
import tempfile
import warnings
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB, HIDDEN, LAYERS, HEADS = 256, 32, 2, 4
SIZES = {  # config field -> tiny value, wherever a config has the field
    **dict.fromkeys(["vocab_size"], VOCAB),
    **dict.fromkeys(["hidden_size", "n_embd", "d_model", "dim", "embed_dim", "n_embed"], HIDDEN),
    **dict.fromkeys(["num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers"], LAYERS),
    **dict.fromkeys(["num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"], HEADS),
    **dict.fromkeys(["num_key_value_heads", "num_kv_heads", "multi_query_group_num"], 2),
    **dict.fromkeys(["intermediate_size", "n_inner", "ffn_dim", "decoder_ffn_dim", "d_ff", "ffn_hidden_size"], 64),
    **dict.fromkeys(["moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"], 32),
    **dict.fromkeys(["num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"], 4),
    **dict.fromkeys(["num_experts_per_tok", "moe_topk", "top_k", "num_experts_per_token"], 2),
    **dict.fromkeys(["max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "seq_length"], 256),
    **dict.fromkeys(["head_dim", "kv_channels", "attention_head_size"], HIDDEN // HEADS),
}
# Families whose default config leaves out the layers that make them what they are (LFM2's default is all attention).
OVERRIDES = {
    "lfm2": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": None},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "full_attn_idxs": None},
}
ZERO_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id", "cls_token_id")


def tiny_config(model_type: str):
    """``model_type``'s config with every size field that it has made tiny (lists cut to the layers kept)."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]()
    for key, value in SIZES.items():
        if (
            hasattr(config, key)
            and isinstance(getattr(config, key), int)
            and not isinstance(getattr(config, key), bool)
        ):
            setattr(config, key, value)
    for key in ZERO_IDS:  # ids the vocabulary must hold
        value = getattr(config, key, None)
        if isinstance(value, int) and value >= VOCAB:
            setattr(config, key, VOCAB - 1 - ZERO_IDS.index(key))
    for key, value in OVERRIDES.get(model_type, {}).items():
        setattr(config, key, value)
    # A hybrid's list of layer kinds: the first layer of each kind, so that 2-4 layers still hold every kind.
    for key, value in list(vars(config).items()):
        if isinstance(value, list) and key.endswith(("layer_types", "layers_block_type")) and len(value) > LAYERS:
            kinds = [v for i, v in enumerate(value) if v not in value[:i]][:4]
            kinds += [kinds[-1]] * (LAYERS - len(kinds))
            setattr(config, key, kinds)
            for layers in ("num_hidden_layers", "num_layers", "n_layer"):
                if hasattr(config, layers):
                    setattr(config, layers, len(kinds))
    return config


def build(model_type: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(tiny_config(model_type), attn_implementation="sdpa")
    except (ValueError, ImportError):  # no sdpa for this family: its default attention
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type))
    return model.float()


def padded_step(model, batch) -> None:
    model(**batch).logits.float().sum().backward()


def curated():
    """The families the tests build by hand ("name (tests)"): tests/helpers.py's family_config (router losses,
    convolutions and scans, a zero pad embedding, attention that reads the row), tests/test_padding_free.py's
    tiny_config, and tests/vision_families.py's vision-language models (with their own first micro-batch of images).
    ``{name: (build, batch or None)}``."""
    from hfacc import DataCollatorForVisionLM
    from tests.helpers import build_family
    from tests.test_padding_free import FAMILIES, tiny_config
    from tests.test_vision import examples_for
    from tests.vision_families import FAMILIES as VISION
    from tests.vision_families import model_for, processor_for

    def from_config(family):
        from transformers import AutoModelForCausalLM

        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(tiny_config(family)).float()

    found = {}
    small = first_batch(vocab=64)  # their vocabulary: tests/helpers.py's VOCAB
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "lfm2", "jamba", "gemma3n", "llama4"):
        found[f"{family} (tests)"] = (lambda f=family: build_family(f), small)
    for family in FAMILIES:
        found[f"{family} (tests, tiny_config)"] = (lambda f=family: from_config(f), small)
    for family in VISION:
        batch = DataCollatorForVisionLM(processor_for(family))(examples_for(family)[:4])
        found[f"{family} (tests, vision)"] = (lambda f=family: model_for(f), batch)
    return found


def first_batch(seed: int = 0, vocab: int = VOCAB) -> dict:
    """One micro-batch: 4 sequences of 5-30 tokens (ids 3..vocab-9, so no special id), right-padded with 0."""
    rng = random.Random(seed)
    lengths = [rng.randint(5, 30) for _ in range(4)]
    ids = torch.zeros(4, max(lengths), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.tensor([rng.randrange(3, vocab - 8) for _ in range(n)])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Said(logging.Handler):
    """The decision's log lines."""

    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def decide(package, model, batch, precision: str, longest: int = 0) -> str:
    """What ``package``'s choose_padding_free decides for ``model`` in ``precision``: a short word and a reason."""
    layout_check = importlib.import_module(f"{package}.setup.layout_check")
    objectives = importlib.import_module(f"{package}.objectives")
    said = Said()
    logger = logging.getLogger(f"{package}.setup.layout_check")
    logger.addHandler(said)
    logger.setLevel(logging.INFO)
    amp = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16 autocast" else contextlib.nullcontext()
    try:
        with amp:
            choice = layout_check.choose_padding_free(
                objectives.CausalLMObjective(),
                model,
                batch,
                SimpleNamespace(num_processes=1),
                longest_sequence=longest,
            )
    finally:
        logger.removeHandler(said)
    line = said.lines[-1] if said.lines else ""
    if choice.padding_free:
        word = "one row" if choice.one_row else "rows"
        if choice.max_row_length and "at most" in line:
            word += f" <= {choice.max_row_length}"
        return word
    if "as collated" not in line:
        return "n/a"
    return "padded: " + line.split("as collated: ", 1)[1].split(". Set padding_free", 1)[0]


def with_timeout(seconds, fn, *args):
    def stop(signum, frame):
        raise TimeoutError(f"over {seconds} s")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        return fn(*args)
    finally:
        signal.alarm(0)


def short(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3] + "..."


def main(argv=None):
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="", help="comma-separated model types (default: all)")
    parser.add_argument("--baseline", default="", help="a checkout of hfacc: its bf16-autocast decision too")
    parser.add_argument("--width", type=int, default=70, help="characters of each reason in the table")
    parser.add_argument(
        "--longest", type=int, default=256, help="the training data's longest sequence: rows checked that long"
    )
    parser.add_argument("--curated", action="store_true", help="also the families the tests build by hand")
    parser.add_argument("--quick", action="store_true", help="llama and qwen2 only, rows of 64 (the tests' run)")
    cli = parser.parse_args(argv)
    if cli.quick:
        cli.families, cli.longest = "llama,qwen2", 64
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    precisions = ["fp32", "bf16 autocast", "bf16 weights"]
    packages = [("hfacc", p) for p in precisions]
    if cli.baseline:
        folder = tempfile.mkdtemp()
        os.symlink(Path(cli.baseline).resolve() / "hfacc", Path(folder) / "hfacc_baseline")
        sys.path.insert(0, folder)
        packages.append(("hfacc_baseline", "bf16 autocast"))
    families = cli.families.split(",") if cli.families else sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    builders = {family: (lambda f=family: build(f), None) for family in families}
    if cli.curated:
        builders.update(curated())
    text_batch = first_batch()
    rows = []
    header = ["family", *[f"{p}" if k == "hfacc" else f"baseline {p}" for k, p in packages]]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    for family, (make, own_batch) in builders.items():
        batch = text_batch if own_batch is None else own_batch
        try:
            model = with_timeout(60, make)
        except Exception as err:  # noqa: BLE001 - a family that cannot be built small is reported, not fatal
            print(
                f"| {family} | not built: {short(f'{type(err).__name__}: {err}', cli.width)} |"
                + " |" * (len(packages) - 1)
            )
            continue
        try:  # a config the shrinking broke (sizes that no longer fit together) is no finding
            with_timeout(60, padded_step, model, {k: v for k, v in batch.items() if k != "labels"})
            model.zero_grad()
        except Exception as err:  # noqa: BLE001
            why = short(f"{type(err).__name__}: {err}", cli.width)
            print(f"| {family} | not built: its padded forward fails small ({why}) |" + " |" * (len(packages) - 1))
            continue
        model.eval()
        got = []
        for package, precision in packages:
            subject = model.to(torch.bfloat16) if precision == "bf16 weights" else model.float()
            try:
                got.append(with_timeout(300, decide, package, subject, batch, precision, cli.longest))
            except Exception as err:  # noqa: BLE001
                got.append(f"error: {type(err).__name__}: {err}")
        model.float()
        rows.append((family, got))
        print("| " + " | ".join([family, *[short(g, cli.width) for g in got]]) + " |", flush=True)
    decided = [(f, g) for f, g in rows if not g[0].startswith("error")]
    same = [f for f, g in decided if all(x.split(":")[0] == g[0].split(":")[0] for x in g[1:3])]
    print(
        f"\n{len(rows)} families built and checked; {len(same)} take one path in fp32, bf16 autocast and bf16 weights."
    )
    for family, got in decided:
        if family not in same:
            print(f"differs: {family}: " + " / ".join(f"{p}: {g}" for (_, p), g in zip(packages, got, strict=True)))
    tally = {}
    for _, got in decided:
        key = got[0].split(":")[0]
        tally[key] = tally.get(key, 0) + 1
    print("fp32 paths: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.items())))
    return dict(rows)


if __name__ == "__main__":
    main()
