"""The whole-model case (NumPy only): a tiny Llama-style decoder's configuration, its weights from
one seed, a packed toy corpus generated in-repo, and the batch a sequence-parallel step is fed.

The JAX model (``parity.training.llama_jax``), the torch model (``parity.training.llama_torch``) and
the float64 non-parallel step (``parity.training.llama_oracle``) all start from these arrays, so
"the same model" means the same bytes.

Weights are stored in *math* orientation (``y = x @ W``), float32, by canonical name:

    embed            [V, D]                 final_norm       [D]
    lm_head          [D, V]  (absent when the embeddings are tied: logits = x @ embedᵀ)
    layers.{i}.attn_norm [D]      layers.{i}.wq [D, H·d]   layers.{i}.wk, wv [D, Hk·d]
    layers.{i}.wo    [H·d, D]     layers.{i}.sinks [H]     (only with ``sinks``)
    layers.{i}.mlp_norm  [D]      layers.{i}.w_gate, w_up [D, F]   layers.{i}.w_down [F, D]

Letters: B batch, T tokens (sequence), D d_model, F d_ff, H heads, Hk kv heads, d head_dim, V vocab.

The batch is built in *original* token order and permuted into the layout once, as every real
data loader must do (docs/contract.md): labels are shifted by one inside each document **before**
the permutation and the sharding, so a token at a shard's edge keeps the label of its true
successor, which lives on another device. Loss = Σ cross-entropy over labelled tokens / the number
of labelled tokens in the *global* batch (all data and sequence shards).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from seqplan.config import check_positive_ints, check_rope_heads
from seqplan.documents import one_document_per_row

from ..core.documents import lengths_to_ids, long_tailed_lengths
from ..core.mesh import MeshShape

IGNORE = -100  # the label of a token with no successor in its document (not counted in the loss)
BOS = 0  # every document starts with this token


@dataclass(frozen=True)
class LlamaConfig:
    """A tiny Llama-style decoder: RMSNorm, RoPE, GQA attention, SwiGLU.

    vocab, d_model, layers, heads, kv_heads, head_dim, d_ff: the sizes (heads % kv_heads == 0).
    rope_theta:  RoPE base; rotation by each token's position *within its document*, rotate-half
                 convention (as Hugging Face Llama).
    norm_eps:    RMSNorm epsilon.
    tie_embeddings: logits = x @ embedᵀ (no lm_head) when True.
    window:      sliding window (left, right) on original positions in every layer, or None.
    sinks:       one learned attention-sink logit per head and layer (gpt-oss) when True.
    """

    vocab: int = 48
    d_model: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    d_ff: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    window: tuple[int, int] | None = None
    sinks: bool = False

    def __post_init__(self):
        check_positive_ints(self, ("vocab", "d_model", "layers", "heads", "kv_heads", "head_dim", "d_ff"))
        check_rope_heads(self.heads, self.kv_heads, self.head_dim)
        if self.window is not None:
            object.__setattr__(self, "window", tuple(int(w) for w in self.window))


def weight_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape (math orientation), in a fixed order."""
    c = config
    shapes = {"embed": (c.vocab, c.d_model)}
    for i in range(c.layers):
        p = f"layers.{i}."
        shapes |= {p + "attn_norm": (c.d_model,), p + "wq": (c.d_model, c.heads * c.head_dim),
                   p + "wk": (c.d_model, c.kv_heads * c.head_dim), p + "wv": (c.d_model, c.kv_heads * c.head_dim),
                   p + "wo": (c.heads * c.head_dim, c.d_model)}
        if c.sinks:
            shapes[p + "sinks"] = (c.heads,)
        shapes |= {p + "mlp_norm": (c.d_model,), p + "w_gate": (c.d_model, c.d_ff), p + "w_up": (c.d_model, c.d_ff),
                   p + "w_down": (c.d_ff, c.d_model)}
    shapes["final_norm"] = (c.d_model,)
    if not c.tie_embeddings:
        shapes["lm_head"] = (c.d_model, c.vocab)
    return shapes


FSDP_UNITS = ("weight", "block")


def fsdp_groups(config: LlamaConfig, units: str) -> list[tuple[str, ...]]:
    """torch's FSDP2 units as canonical weight names, the root unit LAST (it may be empty). The
    root keeps its weights gathered from the forward to the backward (gathered once a step);
    every other unit is gathered again for its backward. A tied embedding lives in the root (it
    serves the lookup and the logits)."""
    names = list(weight_shapes(config))
    root = ("embed",) if config.tie_embeddings else ()
    if units == "weight":
        return [(n,) for n in names if n not in root] + [root]
    if units != "block":
        raise ValueError(f"fsdp_units must be one of {FSDP_UNITS}, got {units!r}")
    layers = [tuple(n for n in names if n.startswith(f"layers.{i}.")) for i in range(config.layers)]
    return ([] if root else [("embed",)]) + layers + [root + tuple(n for n in ("final_norm", "lm_head") if n in names)]


def init_weights(config: LlamaConfig, seed: int = 0) -> dict[str, np.ndarray]:
    """float32 weights from ``seed``: matrices N(0, 1/fan_in), the embedding N(0, 1), norms around 1
    (1 + N(0, 0.1²), so a wrong norm weight shows), sinks N(0, 1)."""
    rng = np.random.default_rng(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("norm"):
            w = 1.0 + 0.1 * rng.standard_normal(shape)
        elif leaf in ("embed", "sinks"):
            w = rng.standard_normal(shape)
        else:
            w = rng.standard_normal(shape) / np.sqrt(shape[0])
        weights[name] = w.astype(np.float32)
    return weights


@dataclass(frozen=True)
class TokenBatch:
    """One global batch, [B, T] int32 each, in the order its arrays were built (original or layout).

    tokens:      input token ids.
    labels:      the next token of the same document, or ``IGNORE``.
    positions:   each token's position within its document (RoPE's position ids).
    segment_ids: the document each token belongs to (packed documents).
    order:       [T] the original token index at each position (identity in original order).
    """

    tokens: np.ndarray
    labels: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    order: np.ndarray = field(default=None)

    def __post_init__(self):
        if self.order is None:
            object.__setattr__(self, "order", np.arange(self.tokens.shape[1]))

    @property
    def labelled(self) -> int:
        """The loss's denominator: tokens with a label, over the whole global batch."""
        return int((self.labels != IGNORE).sum())

    def permuted(self, perm: np.ndarray) -> TokenBatch:
        """Every array's sequence dimension reordered by ``perm`` (``x[:, perm]``)."""
        return TokenBatch(self.tokens[:, perm], self.labels[:, perm], self.positions[:, perm],
                          self.segment_ids[:, perm], self.order[perm])


def packed_corpus(config: LlamaConfig, batch: int, seq: int, seed: int = 0) -> TokenBatch:
    """A packed toy corpus in original order: each row is documents of long-tailed lengths (median
    seq/4, so documents cross shard edges), each document BOS then a noisy arithmetic sequence
    (next = prev + stride mod V, one token in eight random) — learnable, so the loss falls."""
    rng = np.random.default_rng(seed)
    tokens, ids = np.zeros((batch, seq), np.int32), np.zeros((batch, seq), np.int32)
    positions = np.zeros((batch, seq), np.int32)
    for row in range(batch):
        lengths = long_tailed_lengths(rng, seq, median=max(seq / 4, 2.0), sigma=0.8)
        ids[row] = lengths_to_ids(lengths, ids=np.cumsum(rng.integers(1, 4, len(lengths))))
        start = 0
        for length in lengths:
            stride, value = int(rng.integers(1, 4)), int(rng.integers(1, config.vocab))
            doc = [BOS]
            for _ in range(length - 1):
                doc.append(value)
                value = 1 + (value - 1 + stride) % (config.vocab - 1)
                if rng.random() < 0.125:
                    value = int(rng.integers(1, config.vocab))
            tokens[row, start:start + length] = doc
            positions[row, start:start + length] = np.arange(length)
            start += length
    return TokenBatch(tokens, next_in_document(tokens, ids), positions, ids)


def next_in_document(tokens: np.ndarray, segment_ids: np.ndarray) -> np.ndarray:
    """Labels in original order: token t+1 where it is in t's document, else ``IGNORE``."""
    labels = np.full_like(tokens, IGNORE)
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    labels[:, :-1] = np.where(same, tokens[:, 1:], IGNORE)
    return labels


@dataclass(frozen=True)
class ModelCase:
    """A whole-model training run: the model, the mesh it is sequence-parallel over, the data.

    mesh:     the attention mesh (data × ring | ulysses | both | double ring); ``MeshShape``.
    fsdp:     shard every weight (and its Adam state) over all of the mesh's devices, gathered
              for use and reduce-scattered after the backward, as torchtitan shards over
              data × context-parallel ranks; otherwise weights are replicated and gradients
              all-reduced.
    fsdp_units: torch's FSDP2 units (``fsdp_groups``): ``"weight"`` — one per weight-holding
              module, a collective per weight (the CPU checks: every weight's bytes seen alone);
              ``"block"`` — one per decoder block, the embedding, and the rest in the root, as
              torchtitan wraps a model: the same bytes in a collective per block, and FSDP's
              per-unit host work (hooks, streams, events) paid 6 times a step instead of 39 on the
              GPU model. JAX shards by annotation (XLA groups the gathers): no units, ignored.
    layout:   the sequence layout tokens are permuted into (``layout_permutation``).
    batch, seq: the global batch [B, T]; B % mesh.data == 0, T divisible by the layout's multiple.
    steps, lr: Adam steps (β 0.9/0.999, ε 1e-8) and learning rate.
    seed:     the weights' seed; the corpus uses seed + 1.
    segment_ids: the batch's segment ids given to every attention call (packed documents). False:
              none given — for batches whose rows are one document each (``llama_gpu.one_document``),
              where the causal mask is that same mask; a batch with a row of several documents is
              refused (:meth:`check_batch`). Its blocks then run the plain causal kernels (the rate
              ``llama_gpu.jax_attention_rate`` measures) and no ids are gathered.
    """

    model: LlamaConfig = LlamaConfig()
    mesh: MeshShape = MeshShape(ring=2)
    fsdp: bool = True
    layout: str = "zigzag"
    fsdp_units: str = "weight"
    batch: int = 2
    seq: int = 32
    steps: int = 2
    lr: float = 1e-2
    seed: int = 0
    segment_ids: bool = True

    def __post_init__(self):
        from ..core.names import LAYOUTS, check_choice

        check_choice("layout", self.layout, LAYOUTS)
        check_choice("fsdp_units", self.fsdp_units, FSDP_UNITS)
        if self.batch % self.mesh.data:
            raise ValueError(f"batch % data must be 0, got {self.batch} % {self.mesh.data}")
        if self.fsdp:
            for name, shape in weight_shapes(self.model).items():
                if shape[0] % self.mesh.devices:
                    raise ValueError(f"fsdp shards dim 0 over {self.mesh.devices} devices: {name} {shape}")
        self.permutation()  # the layout's own divisibility check

    @property
    def name(self) -> str:
        shard = ("fsdp" if self.fsdp_units == "weight" else "fsdp-blocks") if self.fsdp else "replicated"
        ids = "" if self.segment_ids else "-no-ids"
        return f"llama-{self.mesh.name}-{self.layout}-{shard}-b{self.batch}t{self.seq}{ids}"

    def check_batch(self, batch: TokenBatch) -> None:
        """Without segment ids every row must be one document (else the ids are not the mask the
        step computes): ValueError naming the first row that is not, before any device work."""
        ids = np.asarray(batch.segment_ids)
        if self.segment_ids or one_document_per_row(ids[None]):  # [b, t] as one shard's [1, b, t]
            return
        row = int(np.flatnonzero((ids != ids[:, :1]).any(axis=1))[0])
        raise ValueError(f"segment_ids=False takes rows of one document each (llama_gpu.one_document); row "
                         f"{row} holds several documents: give its segment ids (segment_ids=True)")

    def permutation(self) -> np.ndarray:
        """[T] original token index at each layout position over the mesh's ring × Ulysses split."""
        from ..core.reference import layout_permutation

        return layout_permutation(self.seq, self.layout, self.mesh.ring, self.mesh.ulysses)

    def inputs(self) -> tuple[dict[str, np.ndarray], TokenBatch]:
        """(weights, batch in original order)."""
        return init_weights(self.model, self.seed), packed_corpus(self.model, self.batch, self.seq, self.seed + 1)


@dataclass
class TrainResult:
    """What a whole-model run returns (every framework's ``train``, the float64 oracle's too).

    losses:  the loss of each step, at the weights before that step's update.
    grads:   the gradients of the first step, by canonical name, math orientation, float64.
    weights: the weights after the last update, by canonical name, math orientation, float64.
    """

    losses: list[float]
    grads: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]


def visible_pairs(segment_ids: np.ndarray, window: tuple[int, int] | None = None) -> int:
    """(query, key) pairs a causal attention over packed documents computes on one [T] row of
    ids in original order (each document's own triangle, cut to the window's left extent; a
    causal window's right extent is 0 in effect), counted per document without a [T, T] mask."""
    changes = np.flatnonzero(np.diff(segment_ids)) + 1
    lengths = np.diff(np.concatenate([[0], changes, [len(segment_ids)]]))
    left = None if window is None else window[0]
    total = 0
    for length in lengths.tolist():
        if left is None or left >= length - 1:
            total += length * (length + 1) // 2
        else:  # rows 0..left see i+1 keys, the rest left+1
            total += (left + 1) * (left + 2) // 2 + (length - left - 1) * (left + 1)
    return total


def step_flops(config: LlamaConfig, batch: TokenBatch) -> dict[str, int]:
    """FLOPs of one training step of the whole model on ``batch`` (original order), all devices
    together: matmuls (2 per multiply-add; the backward twice the forward) and attention over the
    visible pairs only (4·d per pair and head forward, QKᵀ and PV; the backward 2.5× the forward,
    the 3.5× convention of the benchmarks). Norms, RoPE, softmax and the loss are left out."""
    c = config
    per_token = 2 * c.d_model * (c.heads * c.head_dim * 2 + c.kv_heads * c.head_dim * 2 + 3 * c.d_ff)
    matmul_fwd = batch.tokens.size * (c.layers * per_token + 2 * c.d_model * c.vocab)
    pairs = sum(visible_pairs(row, c.window) for row in batch.segment_ids)
    attention_fwd = c.layers * 4 * c.head_dim * c.heads * pairs
    return {"matmul_fwd": matmul_fwd, "matmul_bwd": 2 * matmul_fwd, "attention_fwd": attention_fwd,
            "attention_bwd": int(2.5 * attention_fwd)}
