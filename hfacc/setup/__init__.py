"""The once-per-model decisions, taken before the first window: the objective, the layout checks (padding-free
and packed rows, images), and the loss path (fused or full logits).

May use: ``ops``, ``runtime``, ``data``, ``models``, ``generation``, ``objectives``.
"""
