"""Transformer layers, exported from notebooks/01_layers.py."""
