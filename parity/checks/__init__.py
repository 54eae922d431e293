"""Verdicts that combine several layers: ``traffic`` checks the accounting model against the
JAX HLO count and the torch trace for attention and the training steps (three-way, exactly).
It sits above ``runners`` and ``training`` (it runs both), so it is not part of ``accounting``,
which they import."""
