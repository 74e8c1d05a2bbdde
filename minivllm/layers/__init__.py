"""Transformer layers, exported from notebooks/01_layers.py (and attention.py from notebooks/02_model.py)."""
