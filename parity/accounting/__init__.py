"""Communication accounting: the analytical model of what each device sends (``model``), the
counter of a compiled XLA program's collectives (``hlo``) and the tracer of torch.distributed's
(``torch_trace``). Imports only ``parity.core``; torch is imported inside the tracer's functions."""
