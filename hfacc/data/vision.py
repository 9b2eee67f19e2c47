"""Vision-language SFT: the processor, image references, image chat rows to tokens, and the collator.

A row is a conversation whose content parts include images: ``{"type": "image"}`` placeholders with the row's
``images`` column (TRL's format), or the image in the part (``{"type": "image", "image": <PIL image, local path or
URL>}``), any number per conversation and turn. :func:`encode_vision_row` turns it into training tokens:

1. The conversation is rendered with the processor's chat template, and the assistant's characters are read off
   that rendering exactly as for text chat (:mod:`hfacc.data.chat`): assistant turns, end-of-turn marker included.
2. The template writes one placeholder per image (``<|image_pad|>``, ``<image>``, ``<start_of_image>``); the
   processor expands each into what the model reads (hundreds of image tokens, Idefics3's tile markers, Gemma 3's
   ``<start_of_image>…<end_of_image>``). The expansion depends on the image's size only, so it is computed from the
   size, which the image file's header gives: the processor's own replacement text for a blank image of that size
   (cached per size), put in place by the processor's own ``get_text_with_replacements``. No pixel is kept: the rows
   hold token ids, labels and image *references* (bytes or paths, ``datasets.Image(decode=False)``).
3. Every token of an expansion, and every image/vision special token, has label -100: never a target, never
   counted in the window's denominator.

:class:`DataCollatorForVisionLM` decodes the referenced images when a micro-batch is made and runs the processor's
image processing on them (``pixel_values``, ``image_grid_thw``, ``pixel_attention_mask``, ``image_sizes``, ...), with
the token-type ids the model reads (``mm_token_type_ids``, Gemma 3's ``token_type_ids``); it checks that each
image still expands to the tokens the row was built with.

Without torchvision, transformers cannot build the processors of the families that also take videos (Qwen2-VL,
Qwen2.5-VL, SmolVLM: their video processors need it). :func:`get_processor` then loads the same processor without
its video processor (images only, the "slow" PIL image processor), which is all image SFT needs.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..ops.loss import IGNORE_INDEX
from .chat import ChatTemplateError, get_assistant_spans
from .collator import DataCollatorForCausalLM
from .formats import DataError, get_conversation, get_span_labels
from .multimodal import IMAGE_COLUMN

logger = logging.getLogger(__name__)

URL_PREFIXES = ("http://", "https://")


# ---- the processor -----------------------------------------------------------------------------------------------
def is_vision_processor(processing_class: Any) -> bool:
    """Whether ``processing_class`` is a multimodal processor (it has a tokenizer and an image processor)."""
    return getattr(processing_class, "tokenizer", None) is not None and hasattr(processing_class, "image_processor")


def get_text_tokenizer(processing_class: Any):
    """The tokenizer of a processor (any ``ProcessorMixin``), or the tokenizer itself."""
    from transformers import ProcessorMixin

    inner = getattr(processing_class, "tokenizer", None)
    return inner if inner is not None and isinstance(processing_class, ProcessorMixin) else processing_class


def get_chat_template(processor) -> str | None:
    """The processor's chat template (its default one when it has several), else its tokenizer's."""
    template = getattr(processor, "chat_template", None)
    if isinstance(template, Mapping):
        template = template.get("default")
    return template or getattr(get_text_tokenizer(processor), "chat_template", None)


def get_processor(name_or_path: str, *, trust_remote_code: bool = False, revision: str | None = None):
    """``AutoProcessor.from_pretrained``, and the same processor without its video processor where transformers
    cannot build that one (no torchvision: Qwen2-VL, Qwen2.5-VL, SmolVLM). Gives the tokenizer a pad token."""
    from transformers import AutoProcessor
    from transformers.utils import is_torchvision_available

    kwargs = {"trust_remote_code": trust_remote_code, "revision": revision}
    try:
        processor = AutoProcessor.from_pretrained(name_or_path, **kwargs)
    except Exception as err:  # transformers' errors without torchvision are OSError, ImportError or AttributeError
        cls = None if is_torchvision_available() else _processor_class(name_or_path, kwargs)
        if cls is None or "video_processor" not in cls.get_attributes():
            raise
        processor = get_image_only_processor_class(cls).from_pretrained(name_or_path, **kwargs)
        logger.warning(
            "hfacc: torchvision is not installed, so %s is loaded without its video processor (images only; "
            "transformers' video processors need torchvision, and AutoProcessor stops with %s).",
            cls.__name__,
            type(err).__name__,
        )
    tokenizer = get_text_tokenizer(processor)
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
        logger.warning(
            "hfacc: the tokenizer had no pad token; using %r (labels of padding are -100).", tokenizer.eos_token
        )
    return processor


def _processor_class(name_or_path: str, kwargs: dict):
    """The processor class named in ``processor_config.json`` (or the model type's), or None."""
    from transformers import AutoConfig, ProcessorMixin
    from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES, processor_class_from_name

    try:
        name = ProcessorMixin.get_processor_dict(name_or_path, **kwargs)[0].get("processor_class")
    except Exception:
        name = None
    if not name:
        try:
            name = PROCESSOR_MAPPING_NAMES.get(AutoConfig.from_pretrained(name_or_path, **kwargs).model_type)
        except Exception:
            return None
    return processor_class_from_name(name) if name else None


@functools.cache
def get_image_only_processor_class(cls: type) -> type:
    """``cls`` (a processor class that takes a video processor) built without one: images only.

    transformers reads a processor's parts off its ``__init__`` signature, so the subclass's signature leaves the
    video processor out; everything else (placeholders, expansions, chat template, saving) is ``cls``'s own. It
    keeps ``cls``'s name, so a saved processor loads as ``cls`` where torchvision is installed.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        cls.__init__(
            self,
            image_processor=image_processor,
            tokenizer=tokenizer,
            video_processor=None,
            chat_template=chat_template,
            **kwargs,
        )

    qualname = f"ImageOnly{cls.__name__}"
    subclass = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": __name__, "__qualname__": qualname})
    setattr(sys.modules[__name__], qualname, subclass)  # picklable by reference (datasets hashes map functions)
    return subclass


def get_image_token_ids(processor) -> set[int]:
    """Ids of every image and vision special token of the processor: placeholders, image soft tokens, begin/end of
    image or vision markers, tile markers. None of them is ever a target (their expansion spans are masked too)."""
    if processor not in _IMAGE_TOKEN_IDS:  # read once per processor: rows are encoded one by one
        _IMAGE_TOKEN_IDS[processor] = _find_image_token_ids(processor)
    return _IMAGE_TOKEN_IDS[processor]


_IMAGE_TOKEN_IDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _find_image_token_ids(processor) -> set[int]:
    tokenizer = get_text_tokenizer(processor)
    ids = set()
    for name in dir(processor):
        if name.endswith(("_token_id", "_token_ids")) and any(
            k in name for k in ("image", "video", "vision", "boi", "eoi")
        ):
            try:
                value = getattr(processor, name)
            except Exception:
                continue
            ids.update(v for v in (value if isinstance(value, (list, tuple, set)) else [value]) if isinstance(v, int))
    for token in tokenizer.all_special_tokens + [t.content for t in tokenizer.added_tokens_decoder.values()]:
        if any(k in token.lower() for k in ("image", "img", "vision", "video")):
            ids.add(tokenizer.convert_tokens_to_ids(token))
    unk = tokenizer.unk_token_id
    return {i for i in ids if i is not None and i != unk and i >= 0}


def _image_placeholder(processor) -> str:
    token = getattr(processor, "image_token", None)
    if not token:
        raise DataError(f"{type(processor).__name__} names no image placeholder token (image_token).")
    return token


# ---- image references --------------------------------------------------------------------------------------------
def get_image_ref(value: Any, where: str) -> tuple[dict[str, Any], tuple[int, int]]:
    """``({"bytes", "path"}, (width, height))`` of an image given as a PIL image, bytes, a local path, a URL or a
    ``datasets.Image`` dict; checked now (exists, decodes), so a bad image stops the run before training.

    The size is the upright one (EXIF orientation applied, as transformers' ``load_image`` does). A local path is
    kept as an absolute path, a URL as the URL: it is downloaded now to read its size, and again when its batch is
    made (an error offline says so).
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(value, Image.Image):
        buffer = io.BytesIO()
        value.save(buffer, format="PNG")
        return {"bytes": buffer.getvalue(), "path": None}, value.size
    if isinstance(value, (bytes, bytearray)):
        value = {"bytes": bytes(value), "path": None}
    if isinstance(value, str):
        value = {"bytes": None, "path": value}
    if not isinstance(value, Mapping) or not (value.get("bytes") or value.get("path")):
        raise DataError(
            f"{where}: an image must be a PIL image, bytes, a local path or a URL (or a datasets.Image), got "
            f"{value!r:.80}."
        )
    data, path = value.get("bytes"), value.get("path")
    if not data and path.startswith(URL_PREFIXES):
        try:
            image = load_image_ref({"path": path, "bytes": None})
        except Exception as err:
            raise DataError(
                f"{where}: the image {path} cannot be downloaded ({type(err).__name__}: {str(err)[:120]}). hfacc "
                "loads URL images when their batch is made and checks each one before training; without a network, "
                "download the images and give local paths."
            ) from err
        return {"bytes": None, "path": path}, image.size
    if not data:
        if not os.path.isfile(path):
            raise DataError(
                f"{where}: the image file {path} does not exist (relative paths are read from {os.getcwd()})."
            )
        path = os.path.abspath(path)
    try:
        with Image.open(io.BytesIO(data) if data else path) as image:
            image.verify()  # reads the file through (checksums, truncation) without decoding the pixels
        with Image.open(io.BytesIO(data) if data else path) as image:  # verify() leaves the image unusable
            size = image.size
            if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # EXIF orientations that swap width and height
                size = size[::-1]
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
        raise DataError(
            f"{where}: the image {path or '(bytes)'} cannot be decoded ({type(err).__name__}: {str(err)[:120]})."
        ) from err
    return {"bytes": data or None, "path": path}, size


def load_image_ref(ref: Any):
    """The referenced image (``{"bytes", "path"}``; or a PIL image, a path or a URL), decoded, upright and RGB:
    transformers' ``load_image``, the processors' own loader."""
    from PIL import Image
    from transformers.image_utils import load_image

    if isinstance(ref, Mapping):
        ref = Image.open(io.BytesIO(ref["bytes"])) if ref.get("bytes") else ref["path"]
    return load_image(ref)


def _name(ref: Any) -> str:
    return (ref.get("path") if isinstance(ref, Mapping) else ref if isinstance(ref, str) else None) or "(in memory)"


# ---- rows to tokens ---------------------------------------------------------------------------------------------
def encode_vision_row(processor, row: Mapping[str, Any], index: Any, format: str, *, last_turn_only: bool = False):
    """One image chat row as ``(input_ids, labels, masking method, open turns, image refs, image end)``.

    ``image end`` is the token index after the row's last image token (0 without images): a cut at or after it
    leaves every image whole. See the module docstring for how the tokens and labels are made.
    """
    if format not in ("messages", "prompt_completion"):
        raise DataError(f"row {index}: a vision-language processor trains on conversations; format={format!r} is not.")
    messages, trainable, tools = get_conversation(row, index, format, last_turn_only=last_turn_only, allow_images=True)
    messages, values = _split_images(messages, row, index)
    refs, sizes = [], []
    for i, value in enumerate(values):
        ref, size = get_image_ref(value, f"row {index}, image {i}")
        refs.append(ref)
        sizes.append(size)
    tokenizer = get_text_tokenizer(processor)
    try:
        found = get_assistant_spans(tokenizer, messages, trainable, tools, chat_template=get_chat_template(processor))
    except ChatTemplateError as err:
        raise DataError(f"row {index}: {err}") from err
    placeholder = _image_placeholder(processor)
    rendered = found.text.count(placeholder)
    if rendered != len(refs):
        raise DataError(
            f"row {index}: the chat template wrote {rendered} image placeholder(s) {placeholder!r} for {len(refs)} "
            "image(s). Give each {'type': 'image'} part one image; a template may also leave out image parts where "
            "it does not render them (e.g. in assistant or system messages), and a literal placeholder in the text "
            "counts as one."
        )
    text, spans, expansions = found.text, list(found.spans), []
    if refs:
        replacements = []
        for i, size in enumerate(sizes):
            try:
                replacements.append(get_image_replacement(processor, size))
            except ValueError as err:  # the image processor refuses the size (Qwen2-VL: aspect ratio over 200)
                raise DataError(
                    f"row {index}, image {i}: {type(processor).__name__} cannot process an image of {size[0]}x"
                    f"{size[1]} pixels ({err}). Resize or pad the image, or leave the row out."
                ) from err
        expanded, offsets = processor.get_text_with_replacements([text], images_replacements=replacements)
        text, expansions = expanded[0], [tuple(o["new_span"]) for o in offsets[0]]
        spans = [(_moved(a, offsets[0]), _moved(b, offsets[0])) for a, b in spans]
    # As the processor tokenizes (ProcessorMixin.apply_chat_template): special tokens added unless the template
    # already starts with BOS.
    bos = tokenizer.bos_token
    encoding = tokenizer(text, add_special_tokens=not (bos and text.startswith(bos)), return_offsets_mapping=True)
    ids, token_offsets = list(encoding["input_ids"]), encoding["offset_mapping"]
    labels = get_span_labels(ids, token_offsets, spans)
    image_ids = get_image_token_ids(processor)
    image_end = 0
    for t, (a, b) in enumerate(token_offsets):
        in_expansion = any(a < e and s < max(b, a + 1) for s, e in expansions)
        if in_expansion or ids[t] in image_ids:
            labels[t] = IGNORE_INDEX  # an image token is never a target, whatever turn it sits in
            image_end = t + 1 if in_expansion else image_end
    return ids, labels, found.method, found.unclosed, refs, image_end


def _moved(position: int, offsets: list[dict]) -> int:
    """A character position of the rendered text, in the text whose placeholders are expanded."""
    shift = 0
    for o in offsets:
        start, end = o["span"]
        if end <= position:
            shift += (o["new_span"][1] - o["new_span"][0]) - (end - start)
    return position + shift


def _split_images(messages: list[dict], row: Mapping[str, Any], index: Any) -> tuple[list[dict], list[Any]]:
    """Messages whose image parts are bare ``{"type": "image"}`` placeholders, and the images in their order.

    A part holds its image (``image``, ``url``, ``path`` or OpenAI's ``image_url``) or takes the next one of the
    row's ``images`` column (or ``image``, a single one).
    """
    column = row.get(IMAGE_COLUMN, row.get("image"))
    column = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    given, from_column, parts = [], 0, 0
    out = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            new = []
            for part in content:
                if part.get("type") in ("image", "image_url"):
                    parts += 1
                    value = next((part[k] for k in ("image", "url", "path") if part.get(k) is not None), None)
                    if value is None and isinstance(part.get("image_url"), Mapping):
                        value = part["image_url"].get("url")
                    if value is None:
                        if from_column >= len(column):
                            raise DataError(
                                f"row {index}: the conversation has more image parts than images: part {parts} has "
                                f"no image of its own and the '{IMAGE_COLUMN}' column holds {len(column)}. Give one "
                                "image per {'type': 'image'} part."
                            )
                        value = column[from_column]
                        from_column += 1
                    given.append(value)
                    part = {"type": "image"}
                new.append(part)
            m = {**m, "content": new}
        out.append(m)
    if from_column < len(column):
        raise DataError(
            f"row {index}: {len(column)} image(s) in the '{IMAGE_COLUMN}' column but only {from_column} image "
            "part(s) take one: every image needs a {'type': 'image'} part where it belongs in the conversation."
        )
    return out, given


_REPLACEMENTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_image_replacement(processor, size: tuple[int, int]) -> str:
    """What the processor expands an image of ``size`` (width, height) into: its own replacement text, computed
    once per size on a blank image of that size (the expansion depends on the size only; the collator checks it
    against the real image)."""
    from PIL import Image

    cache = _REPLACEMENTS.setdefault(processor, {})
    if size not in cache:
        out = processor(
            text=[_image_placeholder(processor)],
            images=[Image.new("RGB", size)],
            return_text_replacement_offsets=True,
        )
        (offset,) = out["text_replacement_offsets"][0]
        cache[size] = offset["replacement"]
    return cache[size]


# ---- the collator ---------------------------------------------------------------------------------------------
@dataclass
class DataCollatorForVisionLM:
    """Pad tokenized image chat examples and decode and process their images, when the micro-batch is made.

    Args:
        processor: the model's processor (``hfacc.get_processor`` or ``AutoProcessor``), the one the examples were
            built with (:func:`hfacc.build_sft_dataset`).
        pad_to_multiple_of: round the padded length up to a multiple of this.

    The text is padded as :class:`hfacc.DataCollatorForCausalLM` pads it (packed rows included). The examples'
    ``images`` (references: bytes or paths) are decoded, in order, and processed by the processor's image processor
    as the processor itself would: the batch gets what the model reads (``pixel_values``, ``image_grid_thw``,
    ``pixel_attention_mask``, ``image_sizes``, ...) and the token-type ids the processor returns (``mm_token_type_ids``,
    Gemma 3's ``token_type_ids``). An image that no longer expands to the image tokens its example was built with
    (the file changed) is an error naming it.

    >>> collate = DataCollatorForVisionLM(processor)                          # doctest: +SKIP
    >>> batch = collate([train[0], train[1]])                                # doctest: +SKIP
    >>> sorted(batch)                                                        # doctest: +SKIP
    ['attention_mask', 'image_grid_thw', 'input_ids', 'labels', 'mm_token_type_ids', 'pixel_values']
    """

    processor: Any
    pad_to_multiple_of: int | None = None

    def __post_init__(self):
        if not is_vision_processor(self.processor):
            raise ValueError(
                f"DataCollatorForVisionLM needs a processor with an image processor, got {type(self.processor).__name__}."
            )
        tokenizer = get_text_tokenizer(self.processor)
        self._text = DataCollatorForCausalLM(tokenizer.pad_token_id, pad_to_multiple_of=self.pad_to_multiple_of)
        self._image_ids = torch.tensor(sorted(i for i in self.processor.image_token_ids if i is not None))
        self._type_key = None
        # The model reads them (mrope, Gemma 3) when the processor says so; older transformers has no such
        # attribute (5.19 has none), and its processors return them, to models that read them, unasked.
        if getattr(self.processor, "return_mm_token_type_ids", None) is not False:
            out = self.processor(text=["a"])
            self._type_key = next((k for k in ("mm_token_type_ids", "token_type_ids") if k in out), None)

    def __call__(self, examples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch = self._text(examples)
        refs = [list(e.get(IMAGE_COLUMN) or []) for e in examples]
        if any(refs):
            batch.update(self._images(refs, batch["input_ids"]))
        if self._type_key is not None:
            batch[self._type_key] = torch.tensor(
                self.processor.create_mm_token_type_ids(batch["input_ids"].tolist()), dtype=torch.long
            )
        return batch

    def _images(self, refs: list[list[Mapping[str, Any]]], input_ids: torch.Tensor) -> dict[str, Any]:
        rows = [i for i, r in enumerate(refs) if r]
        images = []
        for i in rows:
            loaded = []
            for ref in refs[i]:
                try:
                    loaded.append(load_image_ref(ref))
                except Exception as err:  # it was checked when the dataset was built: it changed since
                    raise DataError(f"the image {_name(ref)} cannot be loaded now: {err}") from err
            images.append(loaded)
        placeholder = _image_placeholder(self.processor)
        # The processor's own call, on a text of bare placeholders: its image processing and image kwargs exactly,
        # and the expanded placeholders, whose image tokens each example must hold.
        out = self.processor(
            text=[placeholder * len(r) for r in images], images=images, return_tensors="pt", padding=True
        )
        expected = torch.isin(out["input_ids"], self._image_ids).sum(-1).tolist()
        found = torch.isin(input_ids[rows], self._image_ids).sum(-1).tolist()
        for i, want, have in zip(rows, expected, found, strict=True):
            if want != have:
                names = ", ".join(_name(r) for r in refs[i])
                raise DataError(
                    f"an example's images ({names}) expand to {want} image tokens, but the example holds {have}: the "
                    "images or the processor changed since the dataset was built. Build it again (build_sft_dataset)."
                )
        drop = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids", "text_replacement_offsets")
        return {k: v for k, v in out.items() if k not in drop}


# ---- generation: exact match on held-out image conversations ------------------------------------------------------
@torch.no_grad()
def generate_vision_answers(
    model,
    processor,
    conversations: list[list[dict]],
    images: list[list[Any]],
    max_new_tokens: int = 16,
    batch_size: int = 32,
) -> list[str]:
    """Greedy answers to ``conversations`` (each ending with a user turn) with their ``images`` (PIL images), as
    the processor prepares them for generation (left padding), decoded without special tokens."""
    tokenizer = get_text_tokenizer(processor)
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"  # generation continues from the right edge of every row
    answers = []
    try:
        for i in range(0, len(conversations), batch_size):
            chunk, pictures = conversations[i : i + batch_size], images[i : i + batch_size]
            prompts = [
                processor.apply_chat_template(
                    c, tokenize=False, add_generation_prompt=True, chat_template=get_chat_template(processor)
                )
                for c in chunk
            ]
            # One list of images per prompt where each has some (Idefics3 and Gemma 3 read them so), else flat.
            given = pictures if all(pictures) else [im for group in pictures for im in group] or None
            batch = processor(text=prompts, images=given, return_tensors="pt", padding=True).to(model.device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            answers += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return [a.strip() for a in answers]


def exact_match_on_vision_rows(model, processor, rows: Sequence[Mapping[str, Any]], **kwargs) -> tuple[float, list]:
    """Exact match of the model's answer to each image chat row's last assistant turn, given the turns (and the
    images) before it. Returns ``(score, [(prompt messages, reference, answer), ...])``."""
    prompts, references, pictures = [], [], []
    for index, row in enumerate(rows):
        messages, _, _ = get_conversation(row, index, "messages", allow_images=True)
        messages, values = _split_images(messages, row, index)
        *head, last = messages
        content = last["content"]
        references.append(content if isinstance(content, str) else "".join(p.get("text", "") for p in content))
        taken = sum(
            1 for m in head if isinstance(m.get("content"), list) for p in m["content"] if p["type"] == "image"
        )
        prompts.append(head)
        pictures.append([load_image_ref(get_image_ref(v, f"row {index}")[0]) for v in values[:taken]])
    answers = generate_vision_answers(model, processor, prompts, pictures, **kwargs)
    score = sum(a == r for a, r in zip(answers, references, strict=True)) / max(len(answers), 1)
    return score, list(zip(prompts, references, answers, strict=True))


# ---- what show-mask prints ----------------------------------------------------------------------------------------
def render_vision_mask(processor, input_ids: Sequence[int], labels: Sequence[int], color: bool = True) -> str:
    """:func:`hfacc.data.formats.render_mask` for image chat: each run of image tokens shown as one mark,
    ``[image: N tokens]`` (blue with ``color``), never trained."""
    from .formats import render_mask

    tokenizer = get_text_tokenizer(processor)
    image_ids = set(i for i in processor.image_token_ids if i is not None)
    pieces, run, start = [], 0, 0
    ids, labels = list(input_ids), list(labels)

    def flush(end):
        if end > start:
            pieces.append(render_mask(tokenizer, ids[start:end], labels[start:end], color=color))

    t = 0
    while t < len(ids):
        if ids[t] in image_ids:
            flush(t)
            run = t
            while t < len(ids) and ids[t] in image_ids:
                t += 1
            mark = f"[image: {t - run} tokens]"
            pieces.append(f"\x1b[1;34m{mark}\x1b[0m" if color else mark)
            start = t
            continue
        t += 1
    flush(len(ids))
    return "".join(pieces)


__all__ = [
    "DataCollatorForVisionLM",
    "encode_vision_row",
    "get_processor",
    "get_image_only_processor_class",
    "is_vision_processor",
]
