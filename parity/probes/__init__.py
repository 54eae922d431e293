"""Probes beyond pass/fail: error against device count (``scaling``), run-to-run determinism per
block kernel (``determinism``) and the helpers the notebooks call (``notebook_helpers``). Built
on ``parity.runners``' one check pipeline."""
