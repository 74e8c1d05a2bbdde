"""Transformer layers and the sampler: tensors in, tensors out, nothing of the engine (notebooks 01
and 04)."""
