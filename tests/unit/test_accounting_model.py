"""The traffic model and the HLO counter on inputs worked by hand (no compiler, no mesh)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from parity.accounting.hlo import count_collectives
from parity.accounting.model import Traffic, attention_traffic
from parity.core.cases import Case


def test_ring_traffic_formula_by_hand():
    """Ring 4, one ring shard of K = 1·16·8·16 float32 = 8 KiB: forward 3 hops of K and V
    (6 calls, 48 KiB); backward 2 hops of K and V plus 4 hops of float32 dK and dV
    (4 + 8 calls, 32 KiB + 64 KiB)."""
    t = attention_traffic(Case(ring=4))
    kib = 1024
    assert t.rows() == {("bwd", "p2p"): (12, 96 * kib), ("fwd", "p2p"): (6, 48 * kib)}


def test_truncated_ring_traffic_by_hand():
    """Ring 4, contiguous, window (5, 0) over shards of 16 tokens: reach 1, so one forward hop of
    K and V and two float32 dK / dV hops (along the ring, then home), each carrying the last 5 of
    the shard's 16 rows (1·5·8·16 elements: 2,560 B of K in float32). Window (16, 0) reaches the
    whole previous shard: the same hops carry all 16 rows; (17, 0) reaches two shards back; with
    token indices the window truncates nothing."""
    rows = lambda n: 1 * n * 8 * 16 * 4
    t = attention_traffic(Case(ring=4, layout="contiguous", window=(5, 0)))
    assert t.rows() == {("fwd", "p2p"): (2, 2 * rows(5)), ("bwd", "p2p"): (4, 4 * rows(5))}
    whole = attention_traffic(Case(ring=4, layout="contiguous", window=(16, 0)))
    assert whole.rows() == {("fwd", "p2p"): (2, 2 * rows(16)), ("bwd", "p2p"): (4, 4 * rows(16))}
    # token indices: the window is on them, so the ring is neither truncated nor trimmed (the
    # implementations' reach_window is None then): the whole ring, as without a window
    indexed = dict(ring=4, layout="contiguous", token_index=True)
    assert attention_traffic(Case(**indexed, window=(5, 0))) == attention_traffic(Case(**indexed))
    two = attention_traffic(Case(ring=4, layout="contiguous", window=(17, 0)))
    assert two.rows() == {("fwd", "p2p"): (4, 4 * rows(16)), ("bwd", "p2p"): (2 + 6, 2 * rows(16) + 6 * rows(16))}


def test_segment_ids_gathers_by_hand():
    """Packed documents add only forward all-gathers of the int32 ids, once per call: USP r2×u2,
    b 2, 64 tokens: each device's ids are 2·16·4 = 128 B; over Ulysses (u2) 128 B, then over the
    ring to [2, 64] 256 B. The double ring ro2×ri2 (b 1): 64 B over the inner ring, 128 B outer."""
    plain, packed = attention_traffic(Case(ring=2, ulysses=2, batch=2)), attention_traffic(
        Case(ring=2, ulysses=2, batch=2, documents="mix"))
    assert packed.rows() == plain.rows() | {("fwd", "all-gather"): (2, 384)}
    double = attention_traffic(Case(ring=4, ring_outer=2, documents="one")).rows()
    assert double[("fwd", "all-gather")] == (2, 64 + 128)
    assert ("fwd", "all-gather") not in attention_traffic(Case(ring=1, documents="mix")).rows()


def test_sinks_all_reductions_by_hand():
    """Sinks: 8 heads of float32 = 32 B. JAX's backward all-reduces their cotangent (2(n-1)/n of
    the buffer): ring 4: 32 B over 4 devices, 48 B; USP d2×r2×u2: the inner attention's 4 heads
    (16 B) over the 4 data × ring devices, 24 B, then 32 B over Ulysses (2), 32 B; Ulysses 4
    alone: 32 B over 4, 48 B; one device: nothing. torch: nothing for sinks. A window moves
    nothing different; sinks without a framework is refused."""
    for case, calls, nbytes in ((Case(ring=4, sinks=True), 1, 48), (Case(ring=2, ulysses=2, data=2, batch=4, sinks=True), 2, 56),
                                (Case(ulysses=4, kv_heads=4, sinks=True), 1, 48), (Case(ring=1, sinks=True), 0, 0)):
        plain = attention_traffic(replace(case, sinks=False))
        jax, torch = (attention_traffic(case, framework=f) for f in ("jax", "torch"))
        assert torch == plain
        assert jax.rows() == plain.rows() | ({("bwd", "all-reduce"): (calls, nbytes)} if calls else {}), case.name
    assert attention_traffic(Case(ring=4, window=(5, 2), layout="stripe")) == attention_traffic(Case(ring=4, layout="stripe"))
    with pytest.raises(ValueError, match="framework must be one of"):
        attention_traffic(Case(ring=4, sinks=True))


HLO = """HloModule m

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]{1,0}) parameter(0)
  %x = f32[4,8]{1,0} get-tuple-element(%p), index=1
  %cp = f32[4,8]{1,0} collective-permute(%x), channel_id=1, source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], f32[4,8]{1,0}) tuple(%i, %cp)
}

ENTRY %main (a: f32[4,8], b: bf16[2,8]) -> f32[16,8] {
  %a2a = (f32[2,8]{1,0}, f32[2,8]{1,0}) all-to-all(%s0, %s1), channel_id=2, replica_groups={{0,1},{2,3}}
  %ag = f32[16,8]{1,0} all-gather(%a), channel_id=3, replica_groups=[1,4]<=[4], dimensions={0}
  %rs = bf16[1,8]{1,0} reduce-scatter(%b), channel_id=4, replica_groups={{0,1}}, dimensions={0}, to_apply=%add
  %ars = f32[4,8]{1,0} all-reduce-start(%a), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add
  %ard = f32[4,8]{1,0} all-reduce-done(%ars)
  %arc = (f32[4,8]{1,0}, bf16[2,8]{1,0}) all-reduce(%a, %b), channel_id=6, replica_groups={{0,1},{2,3}}, to_apply=%add
  %ar1 = f32[4,8]{1,0} all-reduce(%a), channel_id=7, replica_groups={{0},{1},{2},{3}}, to_apply=%add
  %ags = ((bf16[2,8]{1,0}), bf16[8,8]{1,0}) all-gather-start(%b), channel_id=8, replica_groups=[1,4]<=[4], dimensions={0}
  %cps = ((f32[4,8]{1,0}, f32[4,8]{1,0}), (f32[4,8]{1,0}, f32[4,8]{1,0})) collective-permute-start(%a, %a), channel_id=9, source_target_pairs={{0,1},{1,0}}
  %cpx = ((bf16[2,8]{1,0}, f32[2,8]{1,0}), (bf16[2,8]{1,0}, f32[2,8]{1,0}), u32[], u32[]) collective-permute-start(%b, %c), channel_id=11, source_target_pairs={{0,1},{1,0}}
  %cp1 = (f32[4,8]{1,0}, f32[4,8]{1,0}, u32[], u32[]) collective-permute-start(%a), channel_id=12, source_target_pairs={{0,1},{1,0}}
  %cp0 = ((f32[], f32[]), (f32[], f32[])) collective-permute-start(%z, %z), channel_id=13, source_target_pairs={{0,1},{1,0}}
  %arm = f32[4,8]{1,0} all-reduce(%a), channel_id=10, replica_groups=mesh['x'=2,'y'=4] {'y'}, to_apply=%add
  %w = (s32[], f32[4,8]{1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %r = f32[16,8]{1,0} copy(%ag)
}
"""


def test_hlo_counter_on_a_handwritten_program():
    """Each collective form sized by the contract's (docs/contract.md) rule; async done not counted; a while body
    counted trip-count times (3 collective-permutes of 128 B); a combined (tuple) all-reduce is
    one call per buffer, and so is a combined collective-permute (K and V in one instruction, as
    XLA:GPU emits), its buffers of mixed dtypes and its start's trailing context scalars (u32[])
    not counted as buffers — scalar buffers sent are; a group of one device moves nothing; async starts sized by their outputs;
    jax ≥ 0.11's mesh-form replica groups read by the named axes' sizes."""
    t = count_collectives(HLO, "fwd")
    assert t.rows() == {
        ("fwd", "p2p"): (3 + 2 + 2 + 1 + 2, 3 * 128 + 256 + (32 + 64) + 128 + 8),
        ("fwd", "all-to-all"): (1, 64),  # 128 B buffer, n = 2
        ("fwd", "all-gather"): (2, 384 + 96),  # 512 B gathered, n = 4 -> 3/4; start: 128 B output -> 96
        ("fwd", "reduce-scatter"): (1, 16),  # output 16 B, n = 2 -> input 32 B -> 1/2
        ("fwd", "all-reduce"): (4, 192 + 128 + 32 + 192),  # 128 B, n = 4 -> 2·3/4; combined 128 B + 32 B,
        # n = 2 -> 2·1/2; mesh form over 'y' (4 devices): 128 B -> 2·3/4
    }


def test_while_without_trip_count_is_refused():
    with pytest.raises(ValueError, match="known_trip_count"):
        count_collectives(HLO.replace(', backend_config={"known_trip_count":{"n":"3"}}', ""), "fwd")


def test_traffic_diff_names_the_collective():
    a, b = Traffic(), Traffic()
    a.add("fwd", "p2p", 100, 2)
    b.add("fwd", "p2p", 50, 1)
    assert a != b and a.diff(b) == "fwd p2p: model 2 calls / 100 B, measured 1 calls / 50 B"
