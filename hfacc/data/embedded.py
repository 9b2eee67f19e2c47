"""The embedded default: an instruction dataset, a tokenizer and a tiny Llama, all made here, offline.

``accelerate launch recipes/sft.py`` with no arguments trains on this. The dataset is generated deterministically
from a seed: six small tasks whose answers range from one token to about thirty (adding digits with a two-turn
"Now double it." follow-up, counting down, repeating, reversing and spelling words, writing numbers in words), in
chat format with a system prompt on some conversations, so that assistant-only masking and token weighting both
matter. The tokenizer is a byte-level BPE
trained with ``tokenizers`` on the project's own corpus, with a ChatML chat template.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# ChatML. With ``tools`` a system turn of its own before the conversation lists them, one line each (name, parameter
# names, description: short, for a tokenizer of 320 tokens), and an assistant turn's ``tool_calls`` are written as
# ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` after its text (the Hermes / Qwen JSON format, which
# hfacc.generation.tools parses); a ``tool`` message is a turn like any other. Without tools and tool calls it
# renders exactly what it rendered before they existed (the default run's tokens).
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\nTools:' }}"
    "{% for tool in tools %}{% set t = tool['function'] if tool.get('function') else tool %}"
    "{{ '\n' + t['name'] + '(' + (t.get('parameters', {}).get('properties', {}) | join(', ')) + '): ' }}"
    "{{ t.get('description', '') }}{% endfor %}{{ '<|im_end|>\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message.get('tool_calls') %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') }}"
    "{% for call in message['tool_calls'] %}{% set f = call['function'] if call.get('function') else call %}"
    "{{ '<tool_call>{\"name\": \"' + f['name'] + '\", \"arguments\": ' }}"
    "{% if f['arguments'] is string %}{{ f['arguments'] }}{% else %}{{ f['arguments'] | tojson }}{% endif %}"
    "{{ '}</tool_call>' }}{% endfor %}{{ '<|im_end|>' + '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|pad|>", "<|im_start|>", "<|im_end|>"]
SYSTEM_PROMPT = "Answer briefly."

WORDS = (
    "apple river planet garden window silver yellow orange pencil rocket candle forest market button dragon "
    "castle winter summer spring autumn ocean island bridge guitar violin coffee butter shadow mirror wizard "
    "pirate robot spider turtle rabbit monkey tiger zebra camel eagle falcon parrot lemon cherry grape melon "
    "paper ladder engine basket jacket helmet anchor harbor meadow valley canyon desert glacier thunder cloud "
    "storm sunset marble copper velvet cotton puzzle riddle legend story poem song dance music light stone"
).split()
SHORT_WORDS = [w for w in WORDS if len(w) <= 5]
ONES = "zero one two three four five six seven eight nine".split()
TEENS = "ten eleven twelve thirteen fourteen fifteen sixteen seventeen eighteen nineteen".split()
TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_to_words(n: int) -> str:
    """English words for 0 <= n < 10000.

    >>> number_to_words(342)
    'three hundred forty-two'
    """
    if not 0 <= n < 10000:
        raise ValueError(f"number_to_words handles 0..9999, got {n}")
    if n < 10:
        return ONES[n]
    if n < 20:
        return TEENS[n - 10]
    if n < 100:
        return TENS[n // 10] + ("-" + ONES[n % 10] if n % 10 else "")
    if n < 1000:
        rest = f" {number_to_words(n % 100)}" if n % 100 else ""
        return f"{ONES[n // 100]} hundred{rest}"
    rest = f" {number_to_words(n % 1000)}" if n % 1000 else ""
    return f"{ONES[n // 1000]} thousand{rest}"


# Tasks a 2-layer model learns within the default run's 950 steps on 2 CPU cores, with answers from 1 token to
# about 30 (the varied lengths are what make token weighting matter). The tasks dropped for this (two-digit
# arithmetic, counting up to a number, sorting digits, capitalizing words) stayed near 0 exact match.
def _arithmetic(rng):
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    # Restating the sum puts both digits a few tokens before the result, where two layers of attention find them.
    return f"What is {a} + {b}?", f"{a} + {b} = {a + b}", a + b


def _countdown(rng):
    n = rng.randint(3, 12)
    return f"Count down from {n} to 0.", " ".join(str(i) for i in range(n, -1, -1)), None


def _reverse(rng):
    word = rng.choice(SHORT_WORDS)
    return f"Reverse the letters of '{word}'.", word[::-1], None


def _spell(rng):
    word = rng.choice(WORDS)
    return f"Spell '{word}' letter by letter.", " ".join(word.upper()), None


def _words(rng):
    n = rng.choice([rng.randint(0, 99), rng.randint(0, 99), rng.randint(100, 999)])
    return f"Write {n} in words.", number_to_words(n), None


def _repeat(rng):
    word, k = rng.choice(WORDS), rng.randint(1, 4)
    return f"Repeat '{word}' {'once' if k == 1 else f'{k} times'}.", " ".join([word] * k), None


TASKS: dict[str, Callable] = {
    "arithmetic": _arithmetic,
    "countdown": _countdown,
    "repeat": _repeat,
    "reverse": _reverse,
    "spell": _spell,
    "words": _words,
}
# A sum has one or two hard tokens (the rest of "9 + 4 = 13" is copied): drawn twice as often, the sums get a share
# of the (token-weighted) gradient that lets them be learned in the same run. Other tasks weigh 1.
TASK_WEIGHTS: dict[str, float] = {"arithmetic": 2.0}


def generate_instruction_examples(n: int = 4000, seed: int = 0, two_turn_fraction: float = 0.3) -> list[dict]:
    """``n`` chat examples ``{"messages": [...], "task": name}``, the same for the same seed.

    About ``two_turn_fraction`` of the arithmetic examples get a follow-up turn ("Now double it.") whose answer
    needs the first one; a third of the conversations start with a system prompt.

    >>> generate_instruction_examples(1, seed=3)[0]["messages"][-1]
    {'role': 'assistant', 'content': '8 + 2 = 10'}
    """
    rng = random.Random(seed)
    names = list(TASKS)
    weights = [TASK_WEIGHTS.get(name, 1.0) for name in names]
    out = []
    for _ in range(n):
        name = rng.choices(names, weights)[0]
        question, answer, value = TASKS[name](rng)
        messages = [{"role": "system", "content": SYSTEM_PROMPT}] if rng.random() < 1 / 3 else []
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        if value is not None and rng.random() < two_turn_fraction:
            messages += [
                {"role": "user", "content": "Now double it."},
                {"role": "assistant", "content": str(2 * value)},
            ]
        out.append({"messages": messages, "task": name})
    return out


def build_default_tokenizer(
    corpus: list[str] | None = None, vocab_size: int = 320, save_dir: str | Path | None = None
):
    """The default run's tokenizer: byte-level BPE on ``corpus`` (default: the generated dataset), ChatML template.

    ``<|im_end|>`` is both the end-of-turn and the EOS token; ``<|pad|>`` pads. Saved to ``save_dir`` when given.
    """
    if corpus is None:
        corpus = [m["content"] for ex in generate_instruction_examples(4000, seed=1234) for m in ex["messages"]]
    tokenizer = build_bpe_tokenizer(
        corpus + ["user", "assistant", "system"],
        vocab_size,
        SPECIAL_TOKENS,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        tokenizer.save_pretrained(save_dir)
    return tokenizer


def build_bpe_tokenizer(
    corpus: list[str],
    vocab_size: int,
    special_tokens: list[str],
    *,
    eos_token: str,
    pad_token: str | None = None,
    bos_token: str | None = None,
    chat_template: str | None = None,
    extra_special_tokens: dict[str, str] | None = None,
):
    """A byte-level BPE tokenizer trained with ``tokenizers`` on ``corpus``; byte-level, so no text is unknown.

    ``special_tokens`` are kept whole (never split or merged) and must include the EOS/pad/BOS tokens named, and
    those of ``extra_special_tokens``: named model-specific ones (Gemma 3's ``{"image_token": ...}``).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    # Digits one by one (as Llama-3 and Qwen tokenizers do): arithmetic and counting see every digit.
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=eos_token,
        pad_token=pad_token,
        bos_token=bos_token,
        unk_token=None,
        **({"extra_special_tokens": extra_special_tokens} if extra_special_tokens else {}),
    )
    tokenizer.padding_side = "right"
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def build_default_model(tokenizer, hidden_size: int = 256, num_layers: int = 2, seed: int = 0, num_heads: int = 4):
    """The tiny Llama of the default run, sized to the tokenizer."""
    model = build_tiny_llama(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        seed=seed,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model


def build_tiny_llama(
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    **config_overrides,
) -> LlamaForCausalLM:
    """A randomly initialised Llama-style causal LM, built from a config (no download), fp32, deterministic.

    >>> model = build_tiny_llama(vocab_size=64)
    >>> model(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 64])
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **config_overrides,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()
