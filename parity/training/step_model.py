"""The step-time model of one training step of the Llama (NumPy only): matmul FLOPs over C,
attention FLOPs over C_attn, and the bytes every memory-bound operation reads and writes over
an HBM bandwidth — measured rates, summed; no parameter is fitted to a measured step.

    T = matmul FLOPs / C  +  attention FLOPs / C_attn  +  memory bytes / W_hbm

C is a bf16 n³ matmul's rate, C_attn the fused causal block kernel's (forward + backward), W_hbm
a large elementwise copy's (``llama_gpu.hbm_bandwidth``: bytes read + written per second), all
measured in the same run as the step — and on the GPU the same copy at a ladder of sizes
(``Rates.hbm_curve``), so each memory-bound kernel is charged at the rate a copy of its own size
reached (small kernels run far below the peak). The terms are summed (``combine="sum"``, the default):
eager torch runs one kernel at a time on one stream, and XLA's fusions are sequential too, so
nothing overlaps unless a profile shows it; ``combine="max"`` (the largest term alone) is the
other bound, printed beside it.

**The memory term** (:func:`memory_passes`) lists every memory-bound kernel of the step — per
layer the RMSNorms, RoPE on q and k, SwiGLU's product, the residual adds, the casts; the
embedding; the head's float32 log-softmax and cross-entropy over [tokens, vocab]; Adam over
every parameter and its states — each as the elements it reads and writes per dtype
(:class:`Pass`). The list differs by framework, because the programs do:

- ``torch`` (eager, ``parity.training.llama_torch``: weights, gradients and Adam states in the
  model's dtype): one kernel per aten op, each reading its operands and writing its result —
  the ops the model's code dispatches, forward and autograd's backward (e.g. RMSNorm forward is
  seven kernels: the cast to float32, x², the mean, +eps, rsqrt, two products, the cast back),
  the one-device replay's glue around the fused attention kernel (float32 copies,
  concatenations), ``torch.optim.Adam``'s foreach kernels (19
  elements per parameter). Checked on the CPU against the aten ops a step dispatches
  (``parity.accounting.torch_cost``).
- ``jax`` (``parity.training.llama_jax``, jitted: float32 master weights and Adam states, the
  compute in the activation dtype): XLA fuses each chain of elementwise work into one kernel,
  so a pass per tensor the compiled program materialises — a reduction and the normalisation
  that reads it, the residuals autodiff saves for the backward (SwiGLU's sigmoid and product),
  the weight casts, optax's Adam as three passes (m, v, then the parameter). Checked on the CPU
  against the optimized HLO (``parity.accounting.hlo_cost``), which is XLA:CPU's fusion: XLA:GPU
  may fuse more, so the GPU run counts its own program too.

Attention is two numbers: the FLOPs of the visible (query, key) pairs (``llama.step_flops``:
what a fused kernel that skips masked tiles executes, the rate C_attn is measured on) and, for
the CPU check, the FLOPs the portable kernel executes (:func:`executed_attention_flops`: whole
blocks, causal diagonal blocks included).

B*: optimizer and weight-cast passes do not grow with the batch, the rest does, so the model is
T_math(B) = m + a·B (:func:`batch_coefficients`); ``parity.capacity.llama_scale`` uses it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from .llama import LlamaConfig, weight_shapes

FRAMEWORKS = ("jax", "torch")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "int64": 8}
GROUPS = ("embed", "layers", "attention_glue", "head", "loss", "optimizer")
COMBINE = ("sum", "max")


@dataclass(frozen=True)
class Pass:
    """One memory-bound kernel (``count`` identical ones): elements read and written, per dtype."""

    name: str
    group: str
    reads: tuple[tuple[str, float], ...]
    writes: tuple[tuple[str, float], ...]
    count: int = 1
    grows_with_batch: bool = True  # False: the optimizer and weight casts (no token dimension)

    @property
    def read_bytes(self) -> float:
        return self.count * sum(n * DTYPE_BYTES[dt] for dt, n in self.reads)

    @property
    def write_bytes(self) -> float:
        return self.count * sum(n * DTYPE_BYTES[dt] for dt, n in self.writes)

    @property
    def bytes(self) -> float:
        return self.read_bytes + self.write_bytes

    def by_dtype(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for dt, n in self.reads + self.writes:
            out[dt] += self.count * n * DTYPE_BYTES[dt]
        return out


def _check(config: LlamaConfig, framework: str, dtype: str, tokens: int) -> None:
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {FRAMEWORKS}, got {framework!r}")
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if config.sinks or config.tie_embeddings:
        raise ValueError("the step-time model covers untied embeddings without attention sinks")


def parameter_count(config: LlamaConfig) -> int:
    total = 0
    for shape in weight_shapes(config).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total


class _Passes:
    """A list of passes being built (helpers keep the tables below short)."""

    def __init__(self):
        self.passes: list[Pass] = []

    def add(self, name, group, reads, writes, count=1, grows=True):
        reads = tuple((dt, float(n)) for dt, n in reads if n)
        writes = tuple((dt, float(n)) for dt, n in writes if n)
        if count and (reads or writes):
            self.passes.append(Pass(name, group, reads, writes, count, grows))

    def cast(self, name, group, src, dst, n, count=1, grows=True):
        """A dtype conversion kernel; none when the dtypes are equal (``.to`` dispatches nothing)."""
        if src != dst:
            self.add(name, group, [(src, n)], [(dst, n)], count, grows)


def _dims(config: LlamaConfig, tokens: int):
    c = config
    return (tokens, c.d_model, c.d_ff, c.heads * c.head_dim, c.kv_heads * c.head_dim, c.vocab, c.head_dim,
            c.heads, c.kv_heads)


# ---- torch: eager, one kernel per aten op ---------------------------------------------------------

def _torch_norm(p: _Passes, e: str, n: int, d: int, group: str, count: int) -> None:
    """llama_torch.RMSNorm forward and autograd's backward, kernel by kernel."""
    f = "float32"
    p.cast("rmsnorm fwd: x to float32", group, e, f, n * d, count)
    p.add("rmsnorm fwd: x²", group, [(f, n * d)], [(f, n * d)], count)
    p.add("rmsnorm fwd: mean", group, [(f, n * d)], [(f, n)], count)
    p.add("rmsnorm fwd: +eps, rsqrt", group, [(f, n)], [(f, n)], 2 * count)
    p.add("rmsnorm fwd: x·rsqrt", group, [(f, n * d), (f, n)], [(f, n * d)], count)
    p.add("rmsnorm fwd: ·weight", group, [(f, n * d), (e, d)], [(f, n * d)], count)
    p.cast("rmsnorm fwd: to the model dtype", group, f, e, n * d, count)
    p.cast("rmsnorm bwd: grad to float32", group, e, f, n * d, count)
    p.add("rmsnorm bwd: grad·normed (weight grad)", group, [(f, 2 * n * d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: grad·weight", group, [(f, n * d), (e, d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: weight grad sum", group, [(f, n * d)], [(f, d)], count)
    p.cast("rmsnorm bwd: weight grad to the model dtype", group, f, e, d, count)
    p.add("rmsnorm bwd: ·x (rsqrt's grad)", group, [(f, 2 * n * d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: ·rsqrt", group, [(f, n * d), (f, n)], [(f, n * d)], count)
    p.add("rmsnorm bwd: row sum", group, [(f, n * d)], [(f, n)], count)
    p.add("rmsnorm bwd: rsqrt', mean'", group, [(f, n)], [(f, n)], 2 * count)
    p.add("rmsnorm bwd: rsqrt' product", group, [(f, 2 * n)], [(f, n)], count)
    p.add("rmsnorm bwd: mean' (expand / d)", group, [(f, n * d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: x² ' (2x)", group, [(f, n * d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: 2x·grad", group, [(f, n * d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: ·grad", group, [(f, 2 * n * d)], [(f, n * d)], count)
    p.add("rmsnorm bwd: sum of both paths", group, [(f, 2 * n * d)], [(f, n * d)], count)
    p.cast("rmsnorm bwd: grad to the model dtype", group, f, e, n * d, count)


def _torch_rope(p: _Passes, e: str, n: int, width: int, d: int, count: int) -> None:
    """torch_impl.layers.apply_rope on [n, width] (width = heads · d) and its backward."""
    f, g = "float32", "layers"
    p.add("rope fwd: positions to float32", g, [("int32", n)], [(f, n)], count)
    p.add("rope fwd: angles", g, [(f, n), (f, d // 2)], [(f, n * d // 2)], count)
    p.add("rope fwd: angles cat", g, [(f, n * d)], [(f, n * d)], count)
    p.cast("rope fwd: x to float32", g, e, f, n * width, count)
    p.add("rope fwd: -x2", g, [(f, n * width // 2)], [(f, n * width // 2)], count)
    p.add("rope fwd: rotate cat", g, [(f, n * width)], [(f, n * width)], count)
    p.add("rope fwd: cos, sin", g, [(f, n * d)], [(f, n * d)], 2 * count)
    p.add("rope fwd: x·cos, rot·sin", g, [(f, n * width), (f, n * d)], [(f, n * width)], 2 * count)
    p.add("rope fwd: add", g, [(f, 2 * n * width)], [(f, n * width)], count)
    p.cast("rope fwd: to the model dtype", g, f, e, n * width, count)
    p.cast("rope bwd: grad to float32", g, e, f, n * width, count)
    p.add("rope bwd: grad·cos, grad·sin", g, [(f, n * width), (f, n * d)], [(f, n * width)], 2 * count)
    p.add("rope bwd: slice_backward", g, [(f, n * width // 2)], [(f, n * width)], 2 * count)
    p.add("rope bwd: adds", g, [(f, 2 * n * width)], [(f, n * width)], 2 * count)
    p.add("rope bwd: neg", g, [(f, n * width // 2)], [(f, n * width // 2)], count)
    p.cast("rope bwd: grad to the model dtype", g, f, e, n * width, count)


def _torch_attention_glue(p: _Passes, e: str, n: int, q: int, k: int, heads: int, layers: int) -> None:
    """The one-device replay (``torch_impl.replay``, strategy ring 1) around the fused block kernel
    (``torch_impl.kernels.aten``, cuDNN's op on the GPU; K/V go in at their own head count, GQA
    or not, and dK/dV come back at it), the replay's float32 copies and its two concatenations
    per output (inner Ulysses, outer ring, each of one part). (The CPU op's strided lse adds one
    copy a layer that cuDNN's does not: not modelled.)"""
    f, g = "float32", "attention_glue"
    p.add("replay: cat o (twice)", g, [(e, n * q)], [(e, n * q)], 2 * layers)
    p.add("replay: cat lse (twice)", g, [(f, n * heads)], [(f, n * heads)], 2 * layers)
    p.cast("dK, dV to float32", g, e, f, n * k, 2 * layers)
    p.cast("replay: dq to float32", g, e, f, n * q, layers)
    p.cast("replay: dq back", g, f, e, n * q, layers)
    p.add("replay: cat dq (twice)", g, [(e, n * q)], [(e, n * q)], 2 * layers)
    p.add("replay: clone dK, dV sums", g, [(f, n * k)], [(f, n * k)], 2 * layers)
    p.cast("replay: dK, dV back", g, f, e, n * k, 2 * layers)
    p.add("replay: cat dK, dV (twice each)", g, [(e, n * k)], [(e, n * k)], 4 * layers)


def _torch_passes(config: LlamaConfig, tokens: int, e: str, shards: int) -> list[Pass]:
    n, dm, ff, q, k, v, hd, h, hk = _dims(config, tokens)
    L, f, p = config.layers, "float32", _Passes()
    p.add("embedding gather", "embed", [(e, n * dm), ("int32", n)], [(e, n * dm)])
    p.add("embedding backward", "embed", [(e, n * dm), ("int32", n)], [(e, v * dm)])
    _torch_norm(p, e, n, dm, "layers", 2 * L)
    _torch_rope(p, e, n, q, hd, L)
    _torch_rope(p, e, n, k, hd, L)
    _torch_attention_glue(p, e, n, q, k, h, L)
    p.add("residual adds (fwd)", "layers", [(e, 2 * n * dm)], [(e, n * dm)], 2 * L)
    p.add("gradient sums (bwd: two residuals, x into q/k/v, m into gate/up)", "layers", [(e, 2 * n * dm)],
          [(e, n * dm)], 5 * L)
    p.add("silu (fwd)", "layers", [(e, n * ff)], [(e, n * ff)], L)
    p.add("silu·up (fwd)", "layers", [(e, 2 * n * ff)], [(e, n * ff)], L)
    p.add("swiglu bwd: two products, silu_backward", "layers", [(e, 2 * n * ff)], [(e, n * ff)], 3 * L)
    _torch_norm(p, e, n, dm, "head", 1)
    p.cast("logits to float32", "loss", e, f, n * v)
    p.add("labels to int64", "loss", [("int32", n)], [("int64", n)])
    p.add("log_softmax", "loss", [(f, n * v)], [(f, n * v)])
    p.add("nll_loss (gathers one logit a row)", "loss", [(f, n), ("int64", n)], [(f, 1)])
    p.add("nll_loss backward (zeros, one -1 a row)", "loss", [("int64", n)], [(f, n * v)])
    p.add("log_softmax backward", "loss", [(f, 2 * n * v)], [(f, n * v)])
    p.cast("logits grad to the model dtype", "loss", f, e, n * v)
    params = parameter_count(config) / shards
    # torch.optim.Adam, foreach: lerp_(m, g), mul_(v), addcmul_(v, g, g), sqrt(v), div_, add_(eps),
    # addcdiv_(p, m, denom) — in the parameters' dtype
    for name, r, w in (("lerp_ m", 2, 1), ("mul_ v", 1, 1), ("addcmul_ v", 3, 1), ("sqrt v", 1, 1),
                       ("div_ denom", 1, 1), ("add_ eps", 1, 1), ("addcdiv_ p", 3, 1)):
        p.add(f"adam: {name}", "optimizer", [(e, r * params)], [(e, w * params)], grows=False)
    return p.passes


# ---- JAX: XLA's fused program -------------------------------------------------------------------

def _jax_norm(p: _Passes, e: str, n: int, d: int, group: str, parts: int, residual: bool, cpu: bool) -> None:
    """llama_jax.rms_norm and its gradient as XLA fuses them. Forward: the row reduction, then
    the normalised x (float32: autodiff saves it for the weight's gradient) and the weighted
    output, each a kernel reading x. Backward, with the incoming gradient in ``parts`` pieces
    (the input gradients of the 1 / 2 / 3 products the output feeds) and the ``residual``
    stream's gradient added: their sum (materialised when there are several), the product for
    the weight gradient, the weight gradient's and the rows' sums, the input gradient (each
    fusion re-reads the pieces it needs). ``cpu``: XLA:CPU also writes the normalised output
    transposed for the weight gradients' dot emitter."""
    f = "float32"
    p.add("rmsnorm fwd: Σx² (reduce)", group, [(e, n * d)], [(f, n)])
    p.add("rmsnorm fwd: rsqrt, 1/x", group, [(f, 2 * n)], [(f, 2 * n)])
    p.add("rmsnorm fwd: normalised x (saved)", group, [(e, n * d), (f, n)], [(f, n * d)])
    p.add("rmsnorm fwd: ·weight", group, [(e, n * d), (f, n), (f, d)], [(e, n * d)])
    if parts > 1:
        p.add("rmsnorm bwd: sum of the incoming gradients", group, [(e, parts * n * d)], [(e, n * d)])
    p.add("rmsnorm bwd: gradient·weight", group, [(e, parts * n * d)], [(f, n * d)])
    p.add("rmsnorm bwd: weight gradient (sum over rows)", group, [(f, 2 * n * d)], [(f, d)])
    p.add("rmsnorm bwd: row sums", group, [(f, 2 * n * d)], [(f, n)])
    p.add("rmsnorm bwd: input gradient", group, [(e, (parts + residual) * n * d), (f, n * d + 2 * n)], [(e, n * d)])
    if cpu:
        p.add("XLA:CPU: normalised output transposed", group, [(e, n * d)], [(e, n * d)])


def _jax_passes(config: LlamaConfig, tokens: int, e: str, shards: int, backend: str = "gpu") -> list[Pass]:
    n, dm, ff, q, k, v, hd, h, hk = _dims(config, tokens)
    L, f, p, cpu = config.layers, "float32", _Passes(), backend == "cpu"
    layer_weights = (dm * q + 2 * dm * k + q * dm + 3 * dm * ff) / shards
    if e != f:  # float32 master weights cast for use (forward) and their gradients back (backward)
        p.add("weight casts to the compute dtype", "layers", [(f, layer_weights)], [(e, layer_weights)], L, False)
        p.add("weight gradients to float32", "layers", [(e, layer_weights)], [(f, layer_weights)], L, False)
        p.add("lm_head cast", "head", [(f, dm * v / shards)], [(e, dm * v / shards)], 1, False)
        p.add("lm_head gradient to float32", "head", [(e, dm * v / shards)], [(f, dm * v / shards)], 1, False)
    p.add("embedding gather (+ cast)", "embed", [(f, n * dm), ("int32", n)], [(e, n * dm)])
    p.add("embedding gradient: zeros", "embed", [], [(f, v * dm)], grows=False)
    p.add("embedding gradient: scatter-add", "embed", [(f, v * dm + n * dm), ("int32", n)], [(f, v * dm)])
    p.add("rope angle table (once)", "layers", [("int32", n)], [(f, n * hd)])
    for _ in range(L):
        _jax_norm(p, e, n, dm, "layers", 3, True, cpu)  # attn_norm: feeds wq, wk, wv
        _jax_norm(p, e, n, dm, "layers", 2, True, cpu)  # mlp_norm: feeds w_gate, w_up
    for width in (q, k):
        p.add("rope fwd", "layers", [(e, n * width), (f, n * hd)], [(e, n * width)], L)
        p.add("rope bwd: the two rotated halves", "layers", [(e, n * width), (f, n * hd)], [(e, n * width)], 2 * L)
        p.add("rope bwd: their sum with the cos term", "layers", [(e, 3 * n * width), (f, n * hd)],
              [(e, n * width)], L)
        if cpu:
            p.add("XLA:CPU: rope gradient transposed", "layers", [(e, 3 * n * width), (f, n * hd)],
                  [(e, n * width)], L)
    if cpu:
        p.add("XLA:CPU: dV transposed", "layers", [(e, n * k)], [(e, n * k)], L)
    p.add("residual adds (fwd)", "layers", [(e, 2 * n * dm)], [(e, n * dm)], 2 * L)
    p.add("swiglu fwd: sigmoid (saved)", "layers", [(e, n * ff)], [(e, n * ff)], L)
    p.add("swiglu fwd: silu (saved)", "layers", [(e, 2 * n * ff)], [(e, n * ff)], L)
    p.add("swiglu fwd: silu·up", "layers", [(e, 2 * n * ff)], [(e, n * ff)], L)
    p.add("swiglu bwd: d(up) = g·silu", "layers", [(e, 2 * n * ff)], [(e, n * ff)], L)
    p.add("swiglu bwd: d(gate)", "layers", [(e, 4 * n * ff)], [(e, n * ff)], L)
    if cpu:
        p.add("XLA:CPU: d(up), d(gate) transposed", "layers", [(e, 6 * n * ff)], [(e, 2 * n * ff)], L)
    _jax_norm(p, e, n, dm, "head", 1, False, cpu)
    p.cast("logits to float32", "loss", e, f, n * v)
    p.add("log_softmax fwd: exp(x - max)", "loss", [(f, n * v)], [(f, n * v)])
    p.add("log_softmax fwd: row sum", "loss", [(f, n * v)], [(f, n)])
    p.add("picked logit", "loss", [(f, n * v), ("int32", n)], [(f, n)])
    p.add("loss bwd: one-hot (zeros, scatter)", "loss", [(f, n * v)], [(f, 2 * n * v)])
    p.add("log_softmax bwd: row sum", "loss", [(f, n * v)], [(f, n)])
    p.add("log_softmax bwd", "loss", [(f, 2 * n * v)], [(f, n * v)])
    if cpu:
        p.add("XLA:CPU: logits gradient transposed", "loss", [(f, 2 * n * v)], [(f, n * v)])
    p.cast("logits grad to the compute dtype", "loss", f, e, n * v)
    params = parameter_count(config) / shards
    # optax.adam as XLA fuses it: m ← (m, g); v ← (v, g); p ← (p, m, v)
    p.add("adam: m", "optimizer", [(f, 2 * params)], [(f, params)], grows=False)
    p.add("adam: v", "optimizer", [(f, 2 * params)], [(f, params)], grows=False)
    p.add("adam: p", "optimizer", [(f, 3 * params)], [(f, params)], grows=False)
    return p.passes


def _jax_gpu_passes(config: LlamaConfig, tokens: int, e: str, shards: int) -> list[Pass]:
    """The JAX step as XLA:GPU compiles it (jax 0.11, H100, GEMM autotuning on), read kernel by
    kernel from the optimized HLO of the timed steps (2026-11-25; d_model 1024 / 2048 / 4096):
    XLA:GPU fuses far more than XLA:CPU — the log-softmax reads the bf16 logits inside its
    reductions, RMSNorm's forward is two kernels (residual add with Σx², then the weighted
    output), SwiGLU's elementwise work folds into the GEMMs' neighbours, Adam is one kernel a
    parameter — so on the GPU the model lists these kernels, not the CPU's."""
    n, dm, ff, q, k, v, hd, h, hk = _dims(config, tokens)
    L, f, p = config.layers, "float32", _Passes()
    embed = v * dm / shards
    params = parameter_count(config) / shards
    matmul_weights = (L * (dm * q + 2 * dm * k + q * dm + 3 * dm * ff) + dm * v) / shards
    # the weights, once a step (do not grow with the batch)
    p.cast("weight casts to the compute dtype (every matmul weight)", "layers", f, e, matmul_weights, grows=False)
    p.add("two float32 copies of every parameter (layout copies XLA:GPU inserts)", "optimizer",
          [(f, 2 * params)], [(f, 2 * params)], grows=False)
    p.add("q, k, v weights concatenated (one GEMM)", "layers", [(e, dm * (q + 2 * k) / shards)],
          [(e, dm * (q + 2 * k) / shards)], L, False)
    # Adam, one fused kernel a parameter: reads p, m, v and the gradient (the GEMMs' in the compute
    # dtype, the embedding's float32 scatter); writes p, m, v and the float32 gradient the step returns
    p.add("adam (one kernel a parameter)", "optimizer", [(f, 3 * params + embed), (e, params - embed)],
          [(f, 4 * params - embed)], grows=False)
    # the embedding
    p.add("embedding gather", "embed", [(f, n * dm), ("int32", n)], [(e, n * dm)])
    p.add("embedding gradient: zeros", "embed", [], [(f, v * dm)], grows=False)
    p.add("embedding gradient: scatter-add", "embed", [(f, v * dm), (e, n * dm), ("int32", n)], [(f, v * dm)])
    # per layer, forward
    p.add("rmsnorm fwd: residual add and Σx²", "layers", [(e, 2 * n * dm)], [(e, n * dm), (f, n)], 2 * L)
    p.add("rmsnorm fwd: normalised ·weight", "layers", [(e, n * dm)], [(e, n * dm)], 2 * L)
    for width in (q, k):
        p.add("rope fwd", "layers", [(e, n * width), (f, 2 * n * hd)], [(e, n * width)], L)
        p.add("rope bwd", "layers", [(e, n * width), (f, 2 * n * hd)], [(e, n * width)], L)
    p.add("v sliced from the fused q, k, v product", "layers", [(e, n * k)], [(e, n * k)], L)
    p.add("swiglu fwd: silu(gate)·up", "layers", [(e, 2 * n * ff)], [(e, n * ff)], L)
    # per layer, backward
    p.add("swiglu bwd: d(up)", "layers", [(e, 2 * n * ff)], [(e, n * ff)], L)
    p.add("swiglu bwd: d(gate) through silu", "layers", [(e, 3 * n * ff)], [(e, n * ff)], L)
    p.add("dq, dk, dv concatenated (one weight-gradient GEMM)", "layers", [(e, n * (q + 2 * k))],
          [(e, n * (q + 2 * k))], L)
    p.add("rmsnorm bwd: gradient sums with the residual (two kernels)", "layers", [(e, 4 * n * dm)],
          [(e, n * dm)], 2 * L)
    p.add("rmsnorm bwd: input gradient", "layers", [(e, 3 * n * dm)], [(e, n * dm)], L)
    p.add("rmsnorm bwd: row sums", "layers", [(e, 3 * n * dm)], [(f, n)], L)
    # the head: final norm, and the loss over [tokens, vocab] (the logits stay in the compute dtype)
    p.add("final rmsnorm fwd", "head", [(e, 3 * n * dm)], [(e, 2 * n * dm)])
    p.add("final rmsnorm bwd", "head", [(e, 4 * n * dm)], [(e, n * dm)])
    p.add("log_softmax fwd: max, Σexp (two reductions over the logits)", "loss", [(e, 2 * n * v)], [(f, 2 * n)])
    p.add("picked logit", "loss", [(e, n * v), ("int32", n)], [(f, n)])
    p.add("loss bwd: zeros", "loss", [], [(f, n * v)])
    p.add("loss bwd: scatter-add of the picked gradient", "loss", [(f, n * v)], [(f, n * v)])
    p.add("log_softmax bwd: row sum", "loss", [(f, n * v)], [(f, n)])
    p.add("logits gradient (softmax − one-hot) in the compute dtype", "loss", [(f, n * v), (e, n * v)], [(e, n * v)])
    return p.passes


def memory_passes(config: LlamaConfig, tokens: int, framework: str, dtype: str = "bfloat16",
                  shards: int = 1, backend: str = "gpu") -> list[Pass]:
    """Every memory-bound kernel of one training step of ``config`` on ``tokens`` tokens (all rows
    of one device), as ``framework`` runs it in ``dtype`` (module docstring). ``shards``: FSDP
    over that many devices — Adam (and JAX's weight casts, made before the gather) on this
    device's 1/shards of the parameters; every gradient is computed whole before it is reduced.
    ``backend``: "gpu", or "cpu" for JAX's program as XLA:CPU compiles it (the check on the CPU:
    XLA:CPU also writes transposed copies for its dot emitter: the passes named "XLA:CPU: …")."""
    _check(config, framework, dtype, tokens)
    if not isinstance(shards, int) or isinstance(shards, bool) or shards < 1:
        raise ValueError(f"shards must be a positive int, got {shards!r}")
    if backend not in ("gpu", "cpu"):
        raise ValueError(f"backend must be 'gpu' or 'cpu', got {backend!r}")
    if framework == "jax":
        return (_jax_gpu_passes(config, tokens, dtype, shards) if backend == "gpu"
                else _jax_passes(config, tokens, dtype, shards, backend))
    return _torch_passes(config, tokens, dtype, shards)


def memory_bytes(passes: list[Pass]) -> dict[str, float]:
    """Bytes by group (and "total")."""
    out = {g: 0.0 for g in GROUPS}
    for p in passes:
        out[p.group] += p.bytes
    out["total"] = sum(out[g] for g in GROUPS)
    return out


def bytes_by_dtype(passes: list[Pass]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for p in passes:
        for dt, b in p.by_dtype().items():
            out[dt] += b
    return dict(out)


# ---- FLOPs ----------------------------------------------------------------------------------------

def matmul_flops(config: LlamaConfig, tokens: int) -> float:
    """Forward + backward matmul FLOPs of ``tokens`` tokens (2 per multiply-add; backward 2×)."""
    c = config
    per_token = 2 * c.d_model * (c.heads * c.head_dim * 2 + c.kv_heads * c.head_dim * 2 + 3 * c.d_ff)
    return 3.0 * tokens * (c.layers * per_token + 2 * c.d_model * c.vocab)


def attention_flops(config: LlamaConfig, pairs: float) -> float:
    """Forward + backward attention FLOPs of ``pairs`` visible (query, key) pairs over all rows:
    4·d per pair and head forward (QKᵀ, PV), the backward 2.5× (the 3.5× convention)."""
    return 3.5 * config.layers * 4 * config.head_dim * config.heads * pairs


def executed_attention_flops(config: LlamaConfig, mesh, layout: str, batch: int, seq: int) -> float:
    """Forward + backward FLOPs one device's portable kernel executes (the busiest device, as the
    HLO count takes a conditional's largest branch): whole blocks — every step of the strategy's
    schedule computes the largest block any device computes at that step, t × s of its parts in
    full (a causal diagonal block too: the kernel masks, it does not skip) — over the device's
    heads (H/U under Ulysses) and rows (B / data). Forward 4·d per pair, backward 10·d (QKᵀ again,
    dV, dP, dQ, dK)."""
    from seqplan.schedule import Exchange, make_schedule, window_reach
    from seqplan.schedule import step_plan as plan_of

    c = config
    ring, outer = mesh.ring, mesh.ring_outer
    t = seq // ring
    if mesh.kv_exchange == "allgather":
        schedule = make_schedule(Exchange.ALLGATHER, layout, True, 1, ring)
    elif outer > 1:
        schedule = make_schedule(Exchange.DOUBLE_RING, layout, True, outer, ring // outer)
    else:
        reach = window_reach(layout, True, None if c.window is None else (c.window[0], 0), t, ring) \
            if ring > 1 else None
        schedule = make_schedule(Exchange.RING, layout, True, 1, ring, reach)
    plan = plan_of(layout, True)

    def size(block) -> int:
        if block is None:
            return 0
        lo_q, hi_q = block.q_part.bounds(t)
        lo_k, hi_k = block.kv_part.bounds(t)
        return (hi_q - lo_q) * (hi_k - lo_k)

    pairs = 0
    for step in schedule.steps:
        pairs += size(plan.local) if step.local else max(size(plan.from_earlier), size(plan.from_later))
    rows = batch // mesh.data
    heads = c.heads // mesh.ulysses
    return 14.0 * c.layers * c.head_dim * heads * rows * pairs


# ---- the prediction ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Rates:
    """Measured rates: C (matmul FLOP/s), C_attn (attention FLOP/s), W_hbm (bytes/s read + written).

    ``hbm_curve``: optional ((bytes moved by one copy kernel, bytes/s), ...) ascending — the
    same elementwise copy measured at a ladder of sizes in the same run (``llama_gpu``'s
    ``copy_ladder``). A step's memory-bound kernels are mostly far smaller than the 2 GiB copy
    W_hbm is measured on, and a small kernel runs below the peak rate (its launch, its tail):
    with a curve each pass is charged at the rate a copy of its own size reached, interpolated
    log-log between the measured sizes and clamped at the ends. Without one, every byte moves at
    W_hbm."""

    matmul: float
    attention: float
    hbm: float
    source: str = ""
    hbm_curve: tuple[tuple[float, float], ...] = ()

    def __post_init__(self):
        for name in ("matmul", "attention", "hbm"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"Rates.{name} must be a positive number, got {value!r}")
        sizes = [b for b, _ in self.hbm_curve]
        if any(not (b > 0 and w > 0) for b, w in self.hbm_curve) or sizes != sorted(set(sizes)):
            raise ValueError(f"Rates.hbm_curve must be (bytes, bytes/s) pairs, both positive, bytes strictly "
                             f"ascending; got {self.hbm_curve!r}")

    def hbm_at(self, kernel_bytes: float) -> float:
        """The copy rate (bytes/s) at a kernel that moves ``kernel_bytes`` (W_hbm without a curve)."""
        curve = self.hbm_curve
        if not curve:
            return self.hbm
        if kernel_bytes <= curve[0][0]:
            return curve[0][1]
        for (b0, w0), (b1, w1) in zip(curve, curve[1:]):
            if kernel_bytes <= b1:
                f = math.log(kernel_bytes / b0) / math.log(b1 / b0)
                return math.exp(math.log(w0) + f * math.log(w1 / w0))
        return curve[-1][1]


def memory_seconds(passes: list[Pass], rates: Rates) -> float:
    """The memory term: every pass's kernels at the copy rate of their size (``Rates.hbm_at``)."""
    return sum(p.bytes / rates.hbm_at(p.bytes / p.count) for p in passes)


@dataclass
class StepPrediction:
    """The terms (seconds) of one step and how they combine."""

    matmul_s: float
    attention_s: float
    memory_s: float
    memory_bytes: dict = field(default_factory=dict)
    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    combine: str = "sum"
    host_s: float = 0.0  # the host's floor: a step the GPU cannot finish before the host has issued it

    @property
    def gpu_s(self) -> float:
        terms = (self.matmul_s, self.attention_s, self.memory_s)
        return sum(terms) if self.combine == "sum" else max(terms)

    @property
    def predicted_s(self) -> float:
        """The GPU's time, or the host's floor where that is longer (eager torch issues every
        kernel from Python: a small step waits on the host)."""
        return max(self.gpu_s, self.host_s)

    @property
    def compute_only_s(self) -> float:
        """The model without the memory term (what llama_gpu predicted before issue 39)."""
        return self.matmul_s + self.attention_s

    def as_dict(self) -> dict:
        return {"predicted_s": self.predicted_s, "matmul_s": self.matmul_s, "attention_s": self.attention_s,
                "memory_s": self.memory_s, "combine": self.combine, "compute_only_s": self.compute_only_s,
                "gpu_s": self.gpu_s, "host_s": self.host_s,
                "matmul_flops": self.matmul_flops, "attention_flops": self.attention_flops,
                "memory_bytes": self.memory_bytes}


def predict_step(config: LlamaConfig, tokens: int, pairs: float, framework: str, dtype: str, rates: Rates,
                 combine: str = "sum", shards: int = 1, host_s: float = 0.0) -> StepPrediction:
    """The model's step time on one device: ``tokens`` tokens, ``pairs`` visible attention pairs,
    the weights (and Adam's states) sharded ``shards`` ways; ``host_s``: the host's floor,
    measured (``llama_gpu``: the same torch step on a 256-token row, where the GPU's work is
    negligible and the time is the host issuing the step's kernels)."""
    if combine not in COMBINE:
        raise ValueError(f"combine must be one of {COMBINE}, got {combine!r}")
    if not isinstance(rates, Rates):
        raise TypeError(f"rates must be a Rates, got {type(rates).__name__}")
    mm, att = matmul_flops(config, tokens), attention_flops(config, pairs)
    passes = memory_passes(config, tokens, framework, dtype, shards)
    return StepPrediction(mm / rates.matmul, att / rates.attention, memory_seconds(passes, rates),
                          memory_bytes(passes), mm, att, combine, host_s)


def batch_coefficients(config: LlamaConfig, seq: int, framework: str, dtype: str, rates: Rates,
                       devices: int = 1, shards: int = 1) -> tuple[float, float]:
    """(m, a) of T_math(B) = m + a·B for B rows of ``seq`` tokens (one document each) spread over
    ``devices`` devices (each computes seq/devices tokens of every row), the weights sharded
    ``shards`` ways: a = a row's matmul, attention and token-dependent memory time per device,
    m = what does not grow with the batch (the optimizer, weight casts, the embedding's
    gradient buffer). Every pass's bytes are affine in the tokens, so two batch sizes give both
    exactly at one W_hbm; with ``rates.hbm_curve`` (rates that depend on kernel size) (m, a) is
    the secant through B = 1 and 2."""
    if seq % devices:
        raise ValueError(f"seq % devices must be 0, got {seq} % {devices}")

    def t(rows: int) -> float:
        pairs = rows * seq * (seq + 1) / 2 / devices
        return predict_step(config, rows * seq // devices, pairs, framework, dtype, rates, shards=shards).predicted_s

    t1, t2 = t(1), t(2)
    return 2 * t1 - t2, t2 - t1
