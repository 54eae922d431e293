"""The sequence-parallel schedule, as data: what every device computes at every step, and where K/V and dK/dV travel.

Pure Python (no framework import), written once for both implementations. The real loops of ring,
all-gather-KV and double-ring attention walk it — JAX with traced device and step indices inside
``lax.scan`` (:meth:`Schedule.source` and :meth:`Schedule.is_earlier` use only ``+ - * // % <``),
torch with ints — and so can a one-device replay of every virtual device's work (:func:`device_visits`).

**Layouts.** ``LAYOUTS`` are the token orders of the sequence axis (``layouts.py`` builds their
permutations); each acts on the R ring shards of ``seq_len / R`` tokens.

**Block mask.** :class:`BlockMask` describes which (query, key) pairs of one block-kernel call are
visible, in the block's *local* indices (query row i, key column j):

    kind FULL:   every pair                 kind CAUSAL: j <= i          kind STRICT: j < i

It is a frozen, hashable dataclass (a compile-time constant of the schedule, never an array), so
kernels and routing can branch on it. Each further field restricts ``kind``'s pairs:

    documents=True:        also segment_ids[query] == segment_ids[key] (packed documents; the
                           kernel is given the ids as ``segments = (q_ids [b, t], kv_ids [b, s])``)
    window=(left, right):  also q_pos - left <= kv_pos <= q_pos + right on ORIGINAL positions
                           (the kernel is given ``positions = (q_pos [t], kv_pos [s])``, int32)

A block backend says which masks it takes (``BlockBackend.supports``). A window is decided per
block from the positions' ranges (:func:`window_flags`): a block out of reach is skipped, a block
the window covers entirely runs without it.

**Packed documents.** Whether a block holds any visible pair then depends on the data, so the
loops decide per block at run time, from the smallest and largest id of its query rows and of
its key columns (per batch row): :func:`document_work` says SKIP (no id range of the queries
meets the keys': no pair shares a document, nothing is computed, forward or backward), PLAIN
(queries and keys of every batch row lie in one and the same document: the block's static mask
alone, so a fused kernel without document support runs it) or DOCUMENTS (the document mask).
The test is exact when each document is one run of ids that grow along the original order and
each part is contiguous in original order (the zigzag / contiguous parts are); otherwise it is
conservative — it may compute a block whose pairs turn out all masked, never skip a visible one.

**Step plan.** :func:`step_plan` says which part of the local queries meets which part of a
visiting K/V shard under which mask: one block for the device's own shard (``local``), one for a
shard that comes earlier in the ring (``from_earlier``) and one for a later one (``from_later``);
``None`` is a fully masked block, never computed.

**Visiting order.** :class:`Schedule` lists the steps every device takes, in order, grouped into
rounds. At round j, inner step s, device r (r = o·I + i on an O x I double ring; O = 1 otherwise)
meets the K/V of shard :meth:`Schedule.source` = ((o - j) mod O)·I + (i - s) mod I, through
:meth:`Schedule.block`. How the K/V got there and where the dK/dV go:

- single ring (``Exchange.RING``; O = 1, I = R): one round of R steps. Before each step but the
  last, the K/V in hand leave by a ``RING`` hop (r -> r+1) to be the next step's; after every
  step the visited shard's float32 dK/dV accumulator follows it by a ``RING`` hop — R hops, the
  last one brings it home. The backward starts again from the K/V the forward received for
  step 1 (``backward_reuses_first_kv``), so it sends R-2 K/V hops, not R-1.
- truncated single ring (``reach`` = a < R-1: a sliding window that reaches only a shards back,
  :func:`window_reach`): one round of a+1 steps, a K/V hops; the dK/dV accumulator follows its
  shard for a hops and then goes home by one ``RETURN`` hop (r -> r-a) — a+1 hops in all.
  With a = 1 (or a ring of 2) and a window whose left reach w is shorter than a shard (``halo`` =
  w, :func:`window_halo`), every hop carries only the last w rows of the visited shard — all its
  window reads: the K/V arrive in those rows of zeros, the dK/dV in those rows of the receiver's
  own accumulator, whose other rows stay its own (the window masks them: the block there adds
  exact zeros, so the receiver's own rows wait for the ``RETURN`` hop unchanged and the sums keep
  their order).
- all-gather KV (``Exchange.ALLGATHER``): the same visiting order over one all-gather of K/V; no
  hops; the dK/dV of every shard come home by one reduce-scatter after the last step.
- double ring (``Exchange.DOUBLE_RING``; O x I): O rounds of I steps. At a round's start its
  first K/V leave by an ``OUTER`` hop ((o, i) -> (o+1, i)), where they start the next round;
  inside a round, ``INNER`` hops ((o, i) -> (o, i+1)) as on a single ring. dK/dV follow their
  shard by ``INNER`` hops, and after a round's last step by a ``DIAGONAL`` hop
  ((o, i) -> (o+1, i+1)), where that shard starts the next round — R hops in all.

Step (0, 0) is always the device's own shard (:attr:`Step.local`).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Literal, get_args

Layout = Literal["contiguous", "zigzag", "stripe"]
LAYOUTS: tuple[str, ...] = get_args(Layout)


# ---- block masks --------------------------------------------------------------------------------

class MaskKind(Enum):
    """The base pattern of a block mask, in the block's local indices (i: query row, j: key col)."""

    FULL = "full"  # every key visible
    CAUSAL = "causal"  # j <= i (the diagonal block of a causal layout)
    STRICT = "strict"  # j < i (stripe: keys from a later stripe exclude the diagonal)


@dataclass(frozen=True)
class BlockMask:
    """Which (query, key) pairs of one block are visible (see the module docstring).

    ``kind``: the base pattern; a string ("full", "causal", "strict") is accepted and converted.
    CAUSAL and STRICT need a square block. ``documents``: the kernel also compares the query's and
    the key's segment ids (given beside the block as ``segments = (q_ids [b, t], kv_ids [b, s])``).
    ``offset``: with a window, q_pos[0] - kv_pos[0] when the loop knows statically that both parts
    are contiguous runs of original positions (``seqplan.bands``: the window is then a band a fused
    kernel's own window runs), else None; it restates what ``positions`` say and changes no pair."""

    kind: MaskKind = MaskKind.FULL
    documents: bool = False
    window: tuple[int, int] | None = None
    offset: int | None = None

    def __post_init__(self):
        if not isinstance(self.kind, MaskKind):
            try:
                object.__setattr__(self, "kind", MaskKind(self.kind))
            except ValueError:
                raise ValueError(f"mask kind must be one of {[k.value for k in MaskKind]}, got {self.kind!r}") from None

    @property
    def is_full(self) -> bool:
        """Every pair of the block is visible (kernels need no mask at all)."""
        return self.kind is MaskKind.FULL and not self.documents and self.window is None

    def with_documents(self) -> BlockMask:
        """This mask restricted to pairs within one document."""
        return BlockMask(self.kind, documents=True, window=self.window, offset=self.offset)

    def with_window(self, window: tuple[int, int] | None, offset: int | None = None) -> BlockMask:
        """This mask restricted to the window ``(left, right)`` (None: no window); ``offset``:
        the parts' static position offset, when known (class docstring)."""
        return BlockMask(self.kind, documents=self.documents, window=window,
                         offset=None if window is None else offset)

    def plain(self) -> BlockMask:
        """The block's static pattern alone (no documents, no window)."""
        return BlockMask(self.kind)

    def visible(self, i: int, j: int, q_segment=None, kv_segment=None, q_pos=None, kv_pos=None) -> bool:
        """Whether local query row ``i`` sees local key column ``j`` (the definition kernels
        implement); with ``documents``, ``q_segment`` and ``kv_segment`` are their ids; with a
        ``window``, ``q_pos`` and ``kv_pos`` their original positions."""
        if self.documents and q_segment != kv_segment:
            return False
        if self.window is not None and not q_pos - self.window[0] <= kv_pos <= q_pos + self.window[1]:
            return False
        if self.kind is MaskKind.FULL:
            return True
        return j <= i if self.kind is MaskKind.CAUSAL else j < i


FULL_MASK = BlockMask(MaskKind.FULL)
CAUSAL_MASK = BlockMask(MaskKind.CAUSAL)
STRICT_MASK = BlockMask(MaskKind.STRICT)
BLOCK_MASKS = (FULL_MASK, CAUSAL_MASK, STRICT_MASK)  # every static mask a schedule produces
DOCUMENT_MASKS = tuple(m.with_documents() for m in BLOCK_MASKS)  # the same with segment_ids


class DocumentWork(Enum):
    """What a block of a packed-document call computes, decided at run time (:func:`document_work`)."""

    SKIP = 0  # no (query, key) pair can share a document: nothing computed, forward or backward
    PLAIN = 1  # every batch row's queries and keys lie in one and the same document: static mask only
    DOCUMENTS = 2  # the static mask and the document mask


def document_flags(q_lo, q_hi, kv_lo, kv_hi):
    """``(shared, one_document)`` of one block from its id ranges: ``q_lo``/``q_hi`` the smallest
    and largest segment id of each batch row's queries ([b] arrays), ``kv_lo``/``kv_hi`` the
    keys'. shared: some batch row's ranges meet (a visible pair is possible). one_document: in
    every batch row all queries and keys carry one and the same id. Written with ``<= == &`` and
    ``.any()``/``.all()`` only, so NumPy, JAX (traced) and torch arrays all work."""
    shared = ((q_lo <= kv_hi) & (kv_lo <= q_hi)).any()
    one_document = ((q_lo == q_hi) & (kv_lo == kv_hi) & (q_lo == kv_lo)).all()
    return shared, one_document


def window_flags(q_lo: int, q_hi: int, kv_lo: int, kv_hi: int, left: int, right: int) -> tuple[bool, bool]:
    """``(reachable, covered)`` of a block under the window ``(left, right)``, from the smallest
    and largest original position of its queries and of its keys: reachable — some pair may lie
    inside the window (else the block is skipped); covered — every pair does (the block runs
    without the window). Exact for parts contiguous in original order (contiguous, zigzag),
    conservative (never skips a visible pair) for stripe. Plain comparisons: ints or traced ints."""
    reachable = (kv_hi >= q_lo - left) & (kv_lo <= q_hi + right)
    covered = (kv_lo >= q_hi - left) & (kv_hi <= q_lo + right)
    return reachable, covered


def document_work(q_lo, q_hi, kv_lo, kv_hi) -> DocumentWork:
    """:class:`DocumentWork` of one block from concrete id ranges (see :func:`document_flags`)."""
    shared, one_document = document_flags(q_lo, q_hi, kv_lo, kv_hi)
    if not bool(shared):
        return DocumentWork.SKIP
    return DocumentWork.PLAIN if bool(one_document) else DocumentWork.DOCUMENTS


# ---- the step plan ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """Tokens [lo, hi) of a local shard: a block cropped to the rows or keys that take part (a
    windowed block's band, ``seqplan.bands.crop_to_band``, in both loops; torch's token-index
    blocks, ``torch_impl.loop.crop_block``); used wherever a :class:`Part` is."""

    lo: int
    hi: int

    def bounds(self, length: int) -> tuple[int, int]:
        return self.lo, self.hi


class Part(Enum):
    """Which contiguous part of a local shard along the sequence axis."""

    ALL = "all"
    FIRST_HALF = "first_half"
    SECOND_HALF = "second_half"

    def bounds(self, length: int) -> tuple[int, int]:
        half = length // 2
        return {Part.ALL: (0, length), Part.FIRST_HALF: (0, half), Part.SECOND_HALF: (half, length)}[self]


@dataclass(frozen=True)
class Block:
    """One block-kernel call: ``q[q_part]`` against ``k, v[kv_part]`` under ``mask``."""

    q_part: Part
    kv_part: Part
    mask: BlockMask


@dataclass(frozen=True)
class StepPlan:
    """What device r computes against each shard of the ring.

    ``local``: its own K/V (step 0). ``from_earlier``: K/V of a ring shard src < r.
    ``from_later``: src > r. ``None`` means the block is fully masked and skipped.
    """

    local: Block
    from_earlier: Block | None
    from_later: Block | None

    @property
    def uniform(self) -> bool:
        """True when every off-diagonal step is the same, so no per-device branch is needed."""
        return self.from_earlier == self.from_later


_ALL_FULL = Block(Part.ALL, Part.ALL, FULL_MASK)


def step_plan(layout: str, causal: bool) -> StepPlan:
    """The step plan for ``layout``.

    - non-causal: every step is one full block (all layouts compute the same).
    - contiguous: earlier shards are fully visible, later ones fully masked (skipped).
    - zigzag (shard r = chunk r ++ chunk 2R-1-r): from an earlier shard, all queries see only
      its first chunk; from a later shard, only the second query chunk sees it, entirely.
      Either way a half-size block.
    - stripe (shard r = tokens with t % R == r): keys of stripe src <= r are visible up to and
      including the same row; keys of a later stripe only strictly below it.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if not causal:
        return StepPlan(local=_ALL_FULL, from_earlier=_ALL_FULL, from_later=_ALL_FULL)
    diagonal = Block(Part.ALL, Part.ALL, CAUSAL_MASK)
    if layout == "contiguous":
        return StepPlan(local=diagonal, from_earlier=_ALL_FULL, from_later=None)
    if layout == "zigzag":
        return StepPlan(
            local=diagonal,
            from_earlier=Block(Part.ALL, Part.FIRST_HALF, FULL_MASK),
            from_later=Block(Part.SECOND_HALF, Part.ALL, FULL_MASK),
        )
    return StepPlan(local=diagonal, from_earlier=diagonal, from_later=Block(Part.ALL, Part.ALL, STRICT_MASK))


# ---- the visiting order -------------------------------------------------------------------------

class Exchange(Enum):
    """How K/V reach the devices."""

    RING = "ring"  # one ring of hops
    ALLGATHER = "allgather"  # one all-gather; dK/dV home by one reduce-scatter
    DOUBLE_RING = "double_ring"  # an outer ring of inner rings (LoongTrain)


class Hop(Enum):
    """One point-to-point shift of every device's buffer, named by where device (o, i) sends it."""

    RING = "ring"  # r -> r+1 mod R (single ring)
    INNER = "inner"  # (o, i) -> (o, i+1 mod I)
    OUTER = "outer"  # (o, i) -> (o+1 mod O, i)
    DIAGONAL = "diagonal"  # (o, i) -> (o+1 mod O, i+1 mod I)
    RETURN = "return"  # r -> r - back mod R (a truncated ring's dK/dV home; ``back``: its reach)

    def destination(self, device: int, outer: int, inner: int, back: int = 0) -> int:
        """The device that receives ``device``'s buffer, on an ``outer`` x ``inner`` ring
        (``back``: the distance of a ``RETURN`` hop, :attr:`Schedule.reach`)."""
        if self is Hop.RING:
            return (device + 1) % (outer * inner)
        if self is Hop.RETURN:
            return (device - back) % (outer * inner)
        o, i = divmod(device, inner)
        d_o, d_i = int(self in (Hop.OUTER, Hop.DIAGONAL)), int(self in (Hop.INNER, Hop.DIAGONAL))
        return (o + d_o) % outer * inner + (i + d_i) % inner


@dataclass(frozen=True)
class Step:
    """Inner step ``inner`` of round ``round``; the same on every device.

    ``kv_hop``: the hop that carries the K/V in hand on to the device where they are the next
    step's, issued before this step's compute so it overlaps it (``None``: nothing is sent).
    ``dkv_hop``: the hop the visited shard's dK/dV accumulator takes after this step, in the
    backward (``None``: it stays; all-gather reduce-scatters them at the end instead)."""

    round: int
    inner: int
    kv_hop: Hop | None
    dkv_hop: Hop | None

    @property
    def local(self) -> bool:
        """The first step: the device's own K/V, under the plan's ``local`` block."""
        return self.round == 0 and self.inner == 0

    @property
    def kind(self) -> tuple:
        """Everything but the position: steps of one kind run the same code (a loop can scan them)."""
        return (self.local, self.kv_hop, self.dkv_hop)


@dataclass(frozen=True)
class Round:
    """Round ``index``: ``kv_hop`` (double ring) sends the round's first K/V, at the round's start,
    to where they start the next round; then ``steps``."""

    index: int
    kv_hop: Hop | None
    steps: tuple[Step, ...]

    @property
    def kind(self) -> tuple:
        return (self.kv_hop, tuple(step.kind for step in self.steps))


@dataclass(frozen=True)
class Visit:
    """What a concrete ``device`` does at ``step``: the K/V of shard ``source`` under ``block``
    (``None``: fully masked, skipped — the K/V and dK/dV still move on)."""

    step: Step
    source: int
    block: Block | None


@dataclass(frozen=True)
class Schedule:
    """The visiting order of one exchange over an ``outer`` x ``inner`` ring of R = O·I devices
    (O = 1 for the single ring and all-gather). ``rounds`` is built by :func:`make_schedule`."""

    exchange: Exchange
    plan: StepPlan
    outer: int
    inner: int
    rounds: tuple[Round, ...]
    reach: int | None = None  # a truncated single ring: steps 0..reach only (module docstring)
    halo: int | None = None  # one K/V hop: the visited shard's last ``halo`` rows, all its hops carry

    @property
    def size(self) -> int:
        """R: devices on the ring (= shards of K/V)."""
        return self.outer * self.inner

    @property
    def steps(self) -> tuple[Step, ...]:
        """Every step of every round, in order (R of them; reach + 1 on a truncated ring)."""
        return tuple(step for rnd in self.rounds for step in rnd.steps)

    @property
    def backward_reuses_first_kv(self) -> bool:
        """The single ring's backward starts from the K/V its forward received for step 1 (kept),
        so its first K/V hop is not sent again. (The double ring keeps nothing: see its module.)"""
        return self.exchange is Exchange.RING and len(self.steps) > 1

    def destination(self, hop: Hop, device: int) -> int:
        """Where ``device``'s buffer goes by ``hop`` on this schedule's ring."""
        return hop.destination(device, self.outer, self.inner, back=self.reach or 0)

    def source(self, device, round, inner):
        """The shard whose K/V ``device`` meets at (``round``, ``inner``): ints or traced ints."""
        n_out, n_in = self.outer, self.inner
        return (device // n_in - round) % n_out * n_in + (device % n_in - inner) % n_in

    def is_earlier(self, device, round, inner):
        """Whether that shard comes before ``device``'s own in the ring (ints or traced ints)."""
        return self.source(device, round, inner) < device

    def block(self, device: int, step: Step) -> Block | None:
        """The block ``device`` computes at ``step`` (concrete ints)."""
        if step.local:
            return self.plan.local
        earlier = self.is_earlier(device, step.round, step.inner)
        return self.plan.from_earlier if earlier else self.plan.from_later


def return_distance(schedule: Schedule, hop: Hop | None) -> dict:
    """``{"back": reach}`` for a truncated ring's ``RETURN`` hop, else ``{}`` — the keyword
    ``Comm.shift`` takes only for that hop (so hooks written for the other hops keep working)."""
    return {"back": schedule.reach} if hop is Hop.RETURN else {}


UNBOUNDED = 2**30  # a window extent no position difference reaches (positions are int32)


def kernel_window(window: tuple[int, int] | None, causal: bool) -> tuple[int, int] | None:
    """The window as the loops and kernels apply it. Under ``causal`` no visible key comes after
    its query, so the right extent changes nothing and is made unbounded: a block whose pairs the
    left extent covers (the diagonal block of a wide window) then runs without the window — on a
    fused kernel — instead of under a window mask that masks nothing more."""
    if window is None or not causal:
        return window
    return window[0], UNBOUNDED


def token_index_window(window: tuple[int, int] | None, causal: bool) -> tuple[int, int] | None:
    """The causal and window masks of a call given explicit token indices (the ``token_index``
    argument), as one window on them: the causal mask is then no static per-block pattern but
    "key index <= query index", which is the window ``(UNBOUNDED, 0)``; with a window ``(left,
    right)`` too, ``(left, 0)``; without causal masking the window as given (None: no mask). Blocks
    then carry kind FULL and this window with ``positions`` = the token indices of their parts
    ([b, t], [b, s]): the portable kernels apply it exactly; a fused kernel takes a block only
    where the indices make it plain — the window covering it (full) or a band of the grid (causal
    runs: ``seqplan.bands``) — never by guessing from the layout."""
    if window is None:
        return (UNBOUNDED, 0) if causal else None
    return (window[0], 0) if causal else window


def by_token_index(mask: BlockMask) -> bool:
    """A block of a causal call given ``token_index`` and no window of its own: kind FULL and the
    window ``(UNBOUNDED, 0)`` — "key index <= query index" on the token indices the kernel gets
    as ``positions``. A varlen kernel can run such a block from run lists
    (``seqplan.documents.index_runs``; JAX: ``jax_impl/kernels/runs.index_segments``)."""
    return (mask.kind is MaskKind.FULL and mask.window is not None and mask.window[0] >= UNBOUNDED
            and mask.window[1] == 0)


def one_call_mask(causal: bool, window: tuple[int, int] | None, token_index: bool, documents: bool) -> BlockMask | None:
    """The document block's mask a call's kernel must take for all-gather-KV's one varlen call per
    device (``seqplan.documents.prefix_runs``), or None when the call cannot take it: causal by
    token indices (``token_index``: the config's window ``(UNBOUNDED, 0)``, not causal) — FULL
    with documents and that window — or by the layout's positions with packed documents
    (``documents``) and no window — CAUSAL with documents. A window beyond causal, or no documents
    and no token indices, walks the blocks. Both frameworks' ``allgather.prefix_eligible``."""
    if token_index and window == (UNBOUNDED, 0) and not causal:
        return BlockMask(MaskKind.FULL, documents=True, window=window)
    if causal and window is None and documents:
        return BlockMask(MaskKind.CAUSAL, documents=True)
    return None


def _looks_back_only(layout: str, causal: bool, window: tuple[int, int] | None) -> bool:
    """A window on the contiguous layout with nothing visible ahead (causal, or ``right`` = 0):
    where shard r needs only shards r-a .. r, and shard r-1 only its last ``left`` rows."""
    return window is not None and layout == "contiguous" and (causal or window[1] == 0)


def window_reach(layout: str, causal: bool, window: tuple[int, int] | None, shard_len: int, size: int) -> int | None:
    """How many ring steps past its own shard any device needs under ``window`` — the reach a
    of a truncated ring — or None when the whole ring is needed. Built where it pays and is
    simple: the contiguous layout with nothing visible ahead (causal, or ``right`` = 0), where
    device r needs shards r-a .. r only, a = ceil(left / shard_len). Zigzag and stripe spread
    every shard over the sequence (each needs almost every other), and a window reaching ahead
    would need the ring to turn both ways."""
    if not _looks_back_only(layout, causal, window):
        return None
    reach = -(-window[0] // shard_len)
    return reach if reach < size - 1 else None


def window_halo(layout: str, causal: bool, window: tuple[int, int] | None, shard_len: int, size: int) -> int | None:
    """The rows of the previous shard a window that reaches one shard back reads — its last
    ``left``: on the contiguous layout with nothing visible ahead (causal, or right 0) the first
    query of shard r (position r·t) sees keys from r·t - left on, and no query of it further back.
    Such a ring has one K/V hop (truncated to reach 1, or a ring of 2 whole). None where hops
    carry whole shards (a window reaching a whole shard back or more, another layout, no window).
    The window as the kernels see it (``kernel_window``)."""
    if not _looks_back_only(layout, causal, window) or size < 2:
        return None
    return window[0] if 0 < window[0] < shard_len else None


def make_schedule(exchange: Exchange, layout: str, causal: bool, outer: int, inner: int,
                  reach: int | None = None, halo: int | None = None) -> Schedule:
    """The schedule of ``exchange`` on ``outer`` x ``inner`` devices (see the module docstring);
    ``reach``: truncate a single ring after step ``reach`` (:func:`window_reach`); ``halo``: on a
    single ring with one K/V hop (reach 1, or a ring of 2), the rows its hops carry (:func:`window_halo`)."""
    exchange = Exchange(exchange)
    if outer < 1 or inner < 1:
        raise ValueError(f"ring sizes must be >= 1, got {outer} x {inner}")
    if exchange is not Exchange.DOUBLE_RING and outer != 1:
        raise ValueError(f"a {exchange.value} schedule has one ring (outer = 1), got outer={outer}")
    one_hop = exchange is Exchange.RING and (reach == 1 or (reach is None and inner == 2))
    if halo is not None and (not one_hop or halo < 1):
        raise ValueError(f"a halo (the rows a hop carries) needs a single ring with one K/V hop (truncated to "
                         f"reach 1, or of 2 devices) and halo >= 1; got {exchange.value}, R={outer * inner}, "
                         f"reach={reach}, halo={halo}")
    if reach is not None:
        if exchange is not Exchange.RING or not 0 <= reach < inner - 1:
            raise ValueError(f"only a single ring is truncated, to 0 <= reach < R-1; got {exchange.value} with "
                             f"reach={reach}, R={outer * inner}")
        steps = [Step(0, s, Hop.RING if s < reach else None, Hop.RING if s < reach else Hop.RETURN if reach else None)
                 for s in range(reach + 1)]
        return Schedule(exchange, step_plan(layout, causal), 1, inner, (Round(0, None, tuple(steps)),), reach, halo)
    if exchange is Exchange.ALLGATHER:
        kv_hop = dkv_hop = last_dkv_hop = outer_hop = None
    elif exchange is Exchange.RING:
        kv_hop = dkv_hop = last_dkv_hop = Hop.RING
        outer_hop = None
    else:
        kv_hop, dkv_hop, last_dkv_hop, outer_hop = Hop.INNER, Hop.INNER, Hop.DIAGONAL, Hop.OUTER
    if outer * inner == 1:
        last_dkv_hop = None  # one device: nothing travels
    rounds = tuple(
        Round(j, outer_hop if j < outer - 1 else None,
              tuple(Step(j, s, kv_hop if s < inner - 1 else None, dkv_hop if s < inner - 1 else last_dkv_hop)
                    for s in range(inner)))
        for j in range(outer))
    return Schedule(exchange, step_plan(layout, causal), outer, inner, rounds, halo=halo)


def ring_schedule(layout: str, causal: bool, size: int, reach: int | None = None, halo: int | None = None) -> Schedule:
    """The single ring of ``size`` devices (truncated after step ``reach`` when given, its hops
    carrying the last ``halo`` rows when given)."""
    return make_schedule(Exchange.RING, layout, causal, 1, size, reach, halo)


def window_ring_schedule(layout: str, causal: bool, window: tuple[int, int] | None, shard_len: int,
                         size: int) -> Schedule:
    """The single ring under ``window`` (the kernels' form): truncated to :func:`window_reach`,
    its hops trimmed to :func:`window_halo` — both frameworks' ring."""
    return ring_schedule(layout, causal, size, window_reach(layout, causal, window, shard_len, size),
                         window_halo(layout, causal, window, shard_len, size))


def allgather_schedule(layout: str, causal: bool, size: int) -> Schedule:
    """All-gather KV over ``size`` devices (the single ring's visiting order, no hops)."""
    return make_schedule(Exchange.ALLGATHER, layout, causal, 1, size)


def double_ring_schedule(layout: str, causal: bool, outer: int, inner: int) -> Schedule:
    """The double ring of ``outer`` x ``inner`` devices."""
    return make_schedule(Exchange.DOUBLE_RING, layout, causal, outer, inner)


def device_visits(schedule: Schedule, device: int) -> list[Visit]:
    """Every step of concrete ``device``, in order, with its source shard and block."""
    if not 0 <= device < schedule.size:
        raise ValueError(f"device must be in [0, {schedule.size}), got {device}")
    return [Visit(step, schedule.source(device, step.round, step.inner), schedule.block(device, step))
            for step in schedule.steps]


def runs(items) -> list[tuple[object, range]]:
    """Consecutive items of one ``kind``, as (first item, range of positions): a loop runs a
    range of one item with one scanned body, so its compiled size does not grow with R."""
    out: list[tuple[object, range]] = []
    for pos, item in enumerate(items):
        if out and out[-1][0].kind == item.kind:
            first, span = out[-1]
            out[-1] = (first, range(span.start, pos + 1))
        else:
            out.append((item, range(pos, pos + 1)))
    return out


def summation_order(schedule: Schedule, source: int) -> list[int]:
    """The ring positions whose contributions to ring shard ``source``'s dK / dV the real code
    adds, in the order it adds them — what a one-device replay must follow to match it bit for
    bit: all-gather KV sums every position in one reduce-scatter; the ring's accumulator travels
    with the K/V, so the positions that visit ``source`` in visiting order (a truncated ring, as a
    window's, has a + 1 of them)."""
    positions = range(schedule.size)
    if schedule.exchange is Exchange.ALLGATHER:
        return list(positions)
    steps = {r: n for r in positions for n, visit in enumerate(device_visits(schedule, r)) if visit.source == source}
    return sorted(steps, key=steps.__getitem__)
