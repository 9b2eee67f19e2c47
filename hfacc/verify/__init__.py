"""``hfacc verify``: one window's accumulated gradient against one big batch's, on the user's own model and data,
and a diagnosis of what breaks the equivalence (batch statistics, randomness, per-micro-batch auxiliary losses).

May use every folder below it, up to ``training``.
"""
