"""Framework runners and the one check pipeline: ``base`` (the ``Runner`` protocol,
``Unavailable``, ``load_runner``), ``jax_runner`` and ``torch_runner`` (each with a public
``make_mesh``), ``torch_world`` (the pool of gloo / NCCL worker processes) and ``pipeline``
(``check_case``). Imports ``parity.core`` and ``parity.accounting``; jax, torch, jax_impl and
torch_impl only inside the functions that run a case."""
