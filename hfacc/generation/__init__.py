"""Sampling from a policy: the generation engine (transformers ``generate``, vLLM in the training process, or a vLLM
server beside it, kept in step with the policy's weights), rollouts (completions, rewards, group advantages), reward
functions, and generation-based evaluation (greedy answers scored by exact match).

May use: ``ops``, ``runtime``, ``data``, ``models``.
"""
