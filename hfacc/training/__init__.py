"""Training: ``TokenWeightedTrainer`` and the life of a step (arguments, window, step gate, meter, audit),
checkpoints and their hashes, exact accumulation for hand-written loops, and the online trainer (GRPO).

May use every folder below it: ``ops``, ``runtime``, ``data``, ``models``, ``generation``, ``objectives``, ``setup``.
"""
