"""Loss math as pure functions and the kernels under it: sums and counts, the window normalization (``loss``), a
model's inputs and outputs (``model_io``), the precision a model computes in and the bounds of rounding
(``precision``), the fused loss and chunked log-probs from final hidden states.

The lowest layer: it imports nothing of hfacc.
"""
