"""ringbridge's parity harness, in layers whose imports point down (docs/architecture.md):

    cli.py                  argument parsing, tables, reports (``python -m parity <command>``)
    capacity/  checks/      B* and calibration · the three-way traffic verdicts
    training/  probes/      FFN training steps · scaling, determinism, notebook helpers
    runners/                Runner protocol, JAX / torch runners, torch worlds, ``check_case``
    accounting/             traffic model, HLO counter, torch tracer
    core/                   cases, mesh names, float64 oracle, inputs, numerics policy (NumPy only)

jax, flax, optax, torch, jax_impl and torch_impl are imported lazily, so either framework may be
absent."""
