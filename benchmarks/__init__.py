"""Benchmarks of sequence-parallel attention on GPUs: ringbridge's two implementations and their
peers, side by side in one run (``python -m benchmarks``; see benchmarks/README.md)."""
