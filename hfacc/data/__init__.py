"""Rows to micro-batches: sources, formats and chat-template masking, SFT and preference datasets, streaming,
token budgets and packing, collators, the padding-free layout of each micro-batch, images, the embedded datasets.

May use: ``ops``, ``runtime``.
"""
