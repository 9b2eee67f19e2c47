"""Sampling from a policy: rollouts (completions, rewards, group advantages), reward functions, and generation-based
evaluation (greedy answers scored by exact match).

May use: ``ops``, ``runtime``, ``data``, ``models``.
"""
