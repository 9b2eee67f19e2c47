"""Tiny vision-language models of four families, each built from a config with a processor assembled here.

Each processor is the family's own processor class with the family's published chat template
(tests/chat_templates), a byte-level BPE tokenizer holding the model's special tokens, and the image processor's
defaults but for the image size (28-56 px: one or a few patches). Qwen2.5-VL's processor is built without its video
processor (:func:`hfacc.data.vision.get_image_only_processor_class`): transformers' video processors need torchvision.
The models have one layer, hidden size 32, vision towers of one layer.
"""

from __future__ import annotations

import copy
import random
from functools import cache

import torch
import transformers as T
from PIL import Image, ImageDraw

from hfacc.data.embedded import build_bpe_tokenizer
from hfacc.data.vision import get_image_only_processor_class
from tests.chat_corpus import template

FAMILIES = ("qwen2_5_vl", "idefics3", "llava_next", "gemma3")
CORPUS = [
    "What colour is the circle? How many squares? red green blue yellow 1 2 3 4 Describe both pictures. And this one?",
    "Is it the same? Yes No system user assistant model Be brief. A red circle and 2 squares.",
] * 4
TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)


def _tokenizer(special, eos, family, pad=None, bos=None, extra=None):
    return build_bpe_tokenizer(
        CORPUS,
        300,
        special,
        eos_token=eos,
        pad_token=pad or eos,
        bos_token=bos,
        chat_template=template(family),
        extra_special_tokens=extra,
    )


def _qwen2_5_vl():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    special = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tokenizer = _tokenizer(special + ["<|video_pad|>"], "<|im_end|>", "qwen2_5_vl", pad="<|endoftext|>")
    images = Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=56 * 84)  # 1x1 to 2x3 merged tokens
    processor = get_image_only_processor_class(T.Qwen2_5_VLProcessor)(
        image_processor=images, tokenizer=tokenizer, chat_template=template("qwen2_5_vl")
    )
    ids = tokenizer.convert_tokens_to_ids
    config = T.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0},
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            **TEXT,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=32,
            patch_size=14,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )
    return T.Qwen2_5_VLForConditionalGeneration, config, processor


def _idefics3():
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    special = ["<|begin_of_text|>", "<end_of_utterance>", "<image>", "<fake_token_around_image>", "<global-img>"]
    tokenizer = _tokenizer(special + tiles, "<end_of_utterance>", "idefics3")
    # Tiles of 28 px: an image up to 56 px is split into up to 2 x 2 tiles plus the whole image, 1 token each.
    images = Idefics3ImageProcessorPil(size={"longest_edge": 56}, max_image_size={"longest_edge": 28})
    processor = T.Idefics3Processor(
        image_processor=images, tokenizer=tokenizer, image_seq_len=1, chat_template=template("idefics3")
    )
    ids = tokenizer.convert_tokens_to_ids
    config = T.Idefics3Config(
        text_config=dict(
            model_type="llama",
            vocab_size=len(tokenizer),
            max_position_embeddings=512,
            pad_token_id=ids("<end_of_utterance>"),
            **TEXT,
        ),
        vision_config=dict(image_size=28, patch_size=14, **VISION),
        scale_factor=2,
        image_token_id=ids("<image>"),
        pad_token_id=ids("<end_of_utterance>"),
    )
    return T.Idefics3ForConditionalGeneration, config, processor


def _llava_next():
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    tokenizer = _tokenizer(["<s>", "</s>", "<image>"], "</s>", "llava_next", bos="<s>")
    grid = [[28, 56], [56, 28], [56, 56]]  # anyres: the image's tokens depend on its aspect ratio
    images = LlavaNextImageProcessorPil(
        size={"shortest_edge": 28}, crop_size={"height": 28, "width": 28}, image_grid_pinpoints=grid
    )
    processor = T.LlavaNextProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=14,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,  # CLIP's CLS, which the "default" strategy drops
        chat_template=template("llava_next"),
    )
    config = T.LlavaNextConfig(
        text_config=dict(model_type="llama", vocab_size=len(tokenizer), max_position_embeddings=512, **TEXT),
        vision_config=dict(model_type="clip_vision_model", image_size=28, patch_size=14, projection_dim=32, **VISION),
        image_grid_pinpoints=grid,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    )
    return T.LlavaNextForConditionalGeneration, config, processor


def _gemma3():
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

    special = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
    images = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    extra = {"boi_token": images[0], "eoi_token": images[1], "image_token": images[2]}
    tokenizer = _tokenizer(special + images, "<eos>", "gemma3", pad="<pad>", bos="<bos>", extra=extra)
    processor = T.Gemma3Processor(
        image_processor=Gemma3ImageProcessorPil(size={"height": 28, "width": 28}),
        tokenizer=tokenizer,
        chat_template=template("gemma3"),
        image_seq_length=1,
    )
    ids = tokenizer.convert_tokens_to_ids
    config = T.Gemma3Config(
        text_config=dict(
            vocab_size=len(tokenizer),
            head_dim=8,
            max_position_embeddings=512,
            sliding_window=8,
            pad_token_id=ids("<pad>"),
            **TEXT,
        ),
        vision_config=dict(image_size=28, patch_size=14, **VISION),
        mm_tokens_per_image=1,
        boi_token_index=ids("<start_of_image>"),
        eoi_token_index=ids("<end_of_image>"),
        image_token_index=ids("<image_soft_token>"),
    )
    return T.Gemma3ForConditionalGeneration, config, processor


BUILDERS = {"qwen2_5_vl": _qwen2_5_vl, "idefics3": _idefics3, "llava_next": _llava_next, "gemma3": _gemma3}


@cache
def _parts(family):
    return BUILDERS[family]()


def processor_for(family):
    """The family's processor (one per family: tests never change it)."""
    return _parts(family)[2]


def model_for(family, seed: int = 0):
    """A fresh tiny model of the family, fp32, the same weights for the same seed."""
    cls, config, _ = _parts(family)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(copy.deepcopy(config))
    return model.float()


COLOURS = {"red": (220, 30, 30), "green": (30, 180, 30), "blue": (30, 60, 220), "yellow": (230, 210, 20)}


def shape_image(rng: random.Random, size: tuple[int, int] | None = None) -> Image.Image:
    """A small picture of a circle and squares in colours, of a random size (so images expand differently)."""
    size = size or rng.choice([(28, 28), (56, 28), (28, 56), (56, 56), (42, 30)])
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    for _ in range(rng.randint(1, 3)):
        x, y = rng.randrange(0, size[0] - 8), rng.randrange(0, size[1] - 8)
        draw.rectangle([x, y, x + 7, y + 7], fill=rng.choice(list(COLOURS.values())))
    x, y = rng.randrange(0, size[0] - 10), rng.randrange(0, size[1] - 10)
    draw.ellipse([x, y, x + 9, y + 9], fill=rng.choice(list(COLOURS.values())))
    return image


def conversation_rows(family: str, n: int = 8, seed: int = 0) -> list[dict]:
    """``n`` multi-image, multi-turn conversations in TRL's format (``{"type": "image"}`` parts + ``images``),
    with answers of different lengths: 1-3 images and 1-2 assistant turns each."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        k = 1 + i % 3
        images = [shape_image(rng) for _ in range(k)]
        first = [{"type": "image"} for _ in range(k - (k > 1))] + [
            {"type": "text", "text": "What colour is the circle?"}
        ]
        messages = []
        if i % 2:
            messages.append({"role": "system", "content": [{"type": "text", "text": "Be brief."}]})
        answer = " ".join(rng.choice(list(COLOURS)) for _ in range(1 + rng.randrange(4)))
        messages += [
            {"role": "user", "content": first},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]},
        ]
        if k > 1 or i % 2:
            second = ([{"type": "image"}] if k > 1 else []) + [{"type": "text", "text": "How many squares?"}]
            messages += [
                {"role": "user", "content": second},
                {"role": "assistant", "content": [{"type": "text", "text": str(rng.randint(1, 4)) + " squares"}]},
            ]
        rows.append({"messages": messages, "images": images})
    return rows
