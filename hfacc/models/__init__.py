"""Models: loading models and tokenizers (hub ids, local directories, tiny ones from a config), LoRA, and the
frozen reference of preference and KL-regularized losses with its log-probs, live or precomputed once.

May use: ``ops``, ``runtime``, ``data``.
"""
