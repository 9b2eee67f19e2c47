"""Model loading: hub ids and local directories for real runs, tiny models built from a config for offline ones."""

from __future__ import annotations

import logging

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

logger = logging.getLogger(__name__)


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


def load_causal_lm(
    name_or_path: str,
    *,
    trust_remote_code: bool = False,
    dtype: str | torch.dtype = "auto",
    revision: str | None = None,
    attn_implementation: str | None = None,
):
    """Load a causal LM from a hub id or a local directory, safely.

    Weights load through safetensors only (``use_safetensors=True``: a repository that ships only pickled
    ``.bin`` weights is refused rather than unpickled), and ``trust_remote_code`` stays off unless asked for.
    """
    config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, revision=revision)
    kwargs = {"config": config, "trust_remote_code": trust_remote_code, "use_safetensors": True, "revision": revision}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **kwargs)
