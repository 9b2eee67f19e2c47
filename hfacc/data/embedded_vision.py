"""The offline vision-language example: pictures of shapes drawn here, and a tiny Qwen2.5-VL with its processor.

``accelerate launch recipes/sft.py --config recipes/configs/tiny-vlm.yaml`` trains on this. Each picture is 56 x 56
pixels on a grey background, 4 x 4 patches of 14 pixels for the vision tower (one image token each): either one
circle of a colour ("What colour is the circle?" -> "red"; any two of the four colours differ in two of the three
channels) or 1 to 4 squares, each in a quarter of its own ("How many squares?" -> "3"). A third of the
conversations go on with a second picture in a second user turn, so rows hold one or two images and one or two
answers. The model is a Qwen2.5-VL (3-D "mrope" positions, the family users fine-tune most) built from a config,
with the family's processor: its image processor ("slow" PIL implementation, no torchvision), a byte-level BPE
tokenizer trained here holding the family's special tokens, and a chat template that renders image parts as the
published one does (``<|vision_start|><|image_pad|><|vision_end|>``, without its default system prompt).
"""

from __future__ import annotations

import random

import torch

from .embedded import build_bpe_tokenizer

IMAGE_SIZE = 56
CELL = 14  # the vision tower's patch
SQUARE = 28  # squares sit in the picture's quarters, one per quarter
# Any two colours differ in two of the three channels (corners of the RGB cube), on a grey background.
COLOURS = {"red": (230, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 230), "white": (255, 255, 255)}
BACKGROUND = (128, 128, 128)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
VIDEO_TOKEN = "<|video_pad|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
QUESTIONS = {"colour": "What colour is the circle?", "count": "How many squares?"}


def draw_shapes(rng: random.Random, task: str):
    """One picture and its answer: a circle of a colour (``task="colour"``) or 1-4 squares (``"count"``)."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    cells = [(x, y) for x in range(0, IMAGE_SIZE, SQUARE) for y in range(0, IMAGE_SIZE, SQUARE)]
    if task == "colour":
        name = rng.choice(list(COLOURS))
        radius = rng.randint(12, 20)
        cx, cy = rng.randint(radius, IMAGE_SIZE - radius), rng.randint(radius, IMAGE_SIZE - radius)
        draw.ellipse([cx - radius, cy - radius, cx + radius, cy + radius], fill=COLOURS[name])
        return image, name
    count = rng.randint(1, 4)
    colour = rng.choice(list(COLOURS.values()))
    for x, y in rng.sample(cells, count):
        draw.rectangle([x + 2, y + 2, x + SQUARE - 3, y + SQUARE - 3], fill=colour)
    return image, str(count)


def generate_shape_examples(n: int = 2000, seed: int = 0, two_turn_fraction: float = 0.33) -> list[dict]:
    """``n`` image chat rows ``{"messages", "images", "task"}`` in TRL's format, the same for the same seed.

    >>> row = generate_shape_examples(1, seed=3)[0]
    >>> row["messages"][0]["content"][0], len(row["images"])
    ({'type': 'image'}, 1)
    """
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        tasks = [rng.choice(list(QUESTIONS))]
        if rng.random() < two_turn_fraction:
            tasks.append(rng.choice(list(QUESTIONS)))
        messages, images = [], []
        for task in tasks:
            image, answer = draw_shapes(rng, task)
            images.append(image)
            messages += [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[task]}]},
                {"role": "assistant", "content": [{"type": "text", "text": answer}]},
            ]
        rows.append({"messages": messages, "images": images, "task": tasks[-1]})
    return rows


def build_tiny_vlm(hidden_size: int = 64, num_layers: int = 1, seed: int = 0, merge_size: int = 1):
    """``(model, processor)``: a tiny Qwen2.5-VL built from a config and its processor, both made here, offline.

    The vision tower has one layer (hidden ``hidden_size``, 14-pixel patches, ``merge_size`` x ``merge_size`` of
    them per image token: with 1, a 56-pixel picture is 16 image tokens, which this task learns in a few hundred
    steps; with Qwen's own 2, it is 4, and the model answered at chance for 350 steps instead of 100, measured); the
    language model ``num_layers`` layers. Deterministic for a seed, so every rank builds the same.
    """
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from .vision import get_image_only_processor_class

    if hidden_size % 16:
        raise ValueError(
            f"embedded_hidden_size={hidden_size}: the tiny Qwen2.5-VL needs a multiple of 16 (heads of 16)."
        )
    corpus = [m["content"][-1]["text"] for row in generate_shape_examples(200, seed=1) for m in row["messages"]]
    tokenizer = build_bpe_tokenizer(
        corpus + ["user", "assistant", "system"],
        320,
        SPECIAL_TOKENS + [VIDEO_TOKEN],
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=IMAGE_SIZE * IMAGE_SIZE, max_pixels=IMAGE_SIZE * IMAGE_SIZE, merge_size=merge_size
    )
    processor = get_image_only_processor_class(Qwen2_5_VLProcessor)(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE
    )
    ids = tokenizer.convert_tokens_to_ids
    heads = max(1, hidden_size // 16)
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=512,
            # head_dim 16: 8 rotary frequencies, split over temporal, height and width positions
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
            eos_token_id=ids("<|im_end|>"),
            pad_token_id=ids("<|endoftext|>"),
            tie_word_embeddings=True,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=hidden_size,
            intermediate_size=2 * hidden_size,
            num_heads=heads,
            out_hidden_size=hidden_size,
            patch_size=CELL,
            spatial_merge_size=merge_size,
            temporal_patch_size=2,
            window_size=IMAGE_SIZE,
            fullatt_block_indexes=[0],
        ),
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids(VIDEO_TOKEN),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model.float(), processor
