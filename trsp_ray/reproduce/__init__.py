"""Reproduce the paper's tables (preset `paper`, GPU cluster) or a small version (`local`, CPU)."""
