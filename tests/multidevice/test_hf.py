"""Hugging Face transformers models trained sequence-parallel through torch_impl.hf (an
``AttentionInterface`` registration bound to a DeviceMesh), over gloo on CPU.

Why: most torch users train Hugging Face models. Registering an attention function is easy; what
goes wrong is everything around it — the model's own label shift inside a shard, RoPE positions
that follow the layout, a loss averaged per rank, a sliding window off by one. A tiny random
Llama (and a Mistral with a sliding window), the same weights, must give the same losses over two
Adam steps and the same gradients with and without sequence parallelism."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import hf_tasks

TOL = 1e-5

MESHES = [
    ("llama", (("ring", 2),), "zigzag", False),
    ("llama", (("ring", 2), ("ulysses", 2)), "stripe", False),
    ("mistral", (("ring", 4),), "contiguous", False),  # a sliding window of 5 over shards of 8 tokens
    ("llama", (("ring", 2),), "zigzag", True),  # packed documents: segment_ids vs HF's packed-sequence mask
]


def _rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.mark.parametrize("kind, axes, layout, packed", MESHES, ids=lambda x: str(x))
def test_hf_model_trains_sequence_parallel_like_the_plain_model(kind, axes, layout, packed, worlds):
    from parity.runners.torch_world import get_world

    ref_losses, ref_grads = hf_tasks.plain_task(kind, 2, packed)
    size = int(np.prod([n for _, n in axes]))
    results = get_world(size).run(hf_tasks.sequence_parallel_task, kind, axes, layout, 2, packed)
    losses, grads = results[0]
    assert _rel(np.array(losses), np.array(ref_losses)) <= TOL, (losses, ref_losses)
    worst = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    assert _rel(grads[worst], ref_grads[worst]) <= TOL, (worst, _rel(grads[worst], ref_grads[worst]))
    assert ref_losses[1] < ref_losses[0]


def test_sliding_window_maps_to_left_w_minus_one():
    """Hugging Face's sliding window of w lets query q see keys q - w < k <= q: torch_impl.hf maps it
    to ringbridge's window (w - 1, 0). Pinned against transformers' own overlay function, position
    by position, for the mapping the attention function uses."""
    from transformers.masking_utils import sliding_window_overlay

    from seqplan.validation import check_window
    from torch_impl.hf import hf_window

    assert hf_window(None) is None
    for w in (1, 2, 5):
        overlay = sliding_window_overlay(w)
        left, right = check_window(hf_window(w))
        for q in range(12):
            for k in range(q + 1):  # causal
                assert bool(overlay(0, 0, q, k)) == (q - left <= k <= q + right), (w, q, k)


def test_padding_mask_is_refused(worlds):
    from parity.runners.torch_world import get_world

    messages = get_world(2).run(hf_tasks.padding_refused_task, (("ring", 2),))
    assert all("padding mask" in m for m in messages), messages


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3", "gpt_oss")


@pytest.mark.parametrize("kind", FAMILIES)
def test_every_keyword_a_model_family_passes_is_mapped_or_known_harmless(kind):
    """A census, one process: the keywords each family's attention layers pass to an attention
    implementation (plain and packed calls), recorded from a real forward, are all in
    torch_impl.hf's MAPPED or HARMLESS — so a transformers release that adds one fails here
    instead of being dropped silently by ringbridge."""
    from transformers import AttentionInterface

    from torch_impl.hf import HARMLESS, MAPPED

    seen: set = set()

    def recorder(module, q, k, v, attention_mask, **kwargs):
        """Records the keywords; the output's values do not matter to a census (no kernel refuses)."""
        seen.update(kwargs)
        return torch.zeros_like(q).transpose(1, 2).contiguous(), None

    AttentionInterface.register("ringbridge-census", recorder)
    model = hf_tasks.tiny_model(kind)
    model.set_attn_implementation("ringbridge-census")
    ids, pos, _, _ = hf_tasks.batch(b=1, packed=True)
    model(input_ids=ids, position_ids=pos, use_cache=False)
    model(input_ids=ids, use_cache=False)
    assert seen, "the census saw no call"
    assert seen <= set(MAPPED) | set(HARMLESS), seen - set(MAPPED) - set(HARMLESS)


@pytest.mark.parametrize("kind, overrides, call, message", [
    ("llama", {}, {"some_new_keyword": 1}, "does not map"),
], ids=["unknown-keyword"])
def test_what_cannot_be_mapped_is_refused(kind, overrides, call, message, worlds):
    from parity.runners.torch_world import get_world

    messages = get_world(2).run(hf_tasks.refused_task, kind, overrides, call)
    assert all(message in m for m in messages), messages


def test_packed_batches_map_to_segment_ids_in_every_collator_mode(worlds):
    """DataCollatorWithFlattening's three ways of marking packing (restarting position_ids,
    cu_seq_lens of the global row, seq_idx) and a sharded seq_idx all give each rank's tokens the
    same documents as the true ids (the same partition; position-derived ids are document starts),
    on zigzag shards whose local positions jump at the chunk edge; unpacked positions give None."""
    from parity.runners.torch_world import get_world

    for results in get_world(2).run(hf_tasks.segment_ids_task, (("ring", 2),), "zigzag"):
        for mode, got, want in results:
            if mode == "unpacked positions":
                assert got is None, mode
                continue
            same = lambda x: x[0][:, None] == x[0][None, :]
            assert got is not None and np.array_equal(same(got), same(want)), mode


@pytest.mark.parametrize("mode", ["positions", "cu_seq_lens", "seq_idx"])
def test_packed_llama_through_each_collator_mode_trains_like_the_plain_model(mode, worlds):
    """No segment_ids keyword: a packed batch marked only as DataCollatorWithFlattening marks it —
    restarting position_ids (its default), its flash-attention keywords (cu_seq_lens / max_length
    of the one global row) or its seq_idx — must train like the plain model with Hugging Face's
    packed-sequence mask, to 1e-5 (losses of two Adam steps, the first step's weight gradients)."""
    from parity.runners.torch_world import get_world

    b = 1 if mode == "cu_seq_lens" else 2  # the collator's offsets describe one flattened row
    ref_losses, ref_grads = hf_tasks.plain_task("llama", 2, True, b=b)
    losses, grads = get_world(2).run(hf_tasks.sequence_parallel_task, "llama", (("ring", 2),), "zigzag", 2, True,
                                     mode, None, b)[0]
    assert _rel(np.array(losses), np.array(ref_losses)) <= TOL, (losses, ref_losses)
    worst = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    assert _rel(grads[worst], ref_grads[worst]) <= TOL, (worst, _rel(grads[worst], ref_grads[worst]))


def test_gemma2_with_logit_soft_capping_trains_sequence_parallel_like_the_plain_model(worlds):
    """Gemma 2 with attention-logit soft-capping (attn_logit_softcapping, Hugging Face's ``softcap``
    keyword mapped to ringbridge's softcap) over a zigzag ring of 2 gloo ranks: the losses of two
    Adam steps and the first step's weight gradients equal the plain model's (eager attention,
    which caps the scaled logits itself) to 1e-5. The cap of 0.05 bends the tiny model's logits:
    the same model uncapped differs far beyond that tolerance, so a dropped cap fails here."""
    from parity.runners.torch_world import get_world

    capped = {"attn_logit_softcapping": 0.05}
    ref_losses, ref_grads = hf_tasks.plain_task("gemma2", 2, False, capped)
    losses, grads = get_world(2).run(hf_tasks.sequence_parallel_task, "gemma2", (("ring", 2),), "zigzag", 2, False,
                                     "segment_ids", capped)[0]
    assert _rel(np.array(losses), np.array(ref_losses)) <= TOL, (losses, ref_losses)
    worst = max(ref_grads, key=lambda n: _rel(grads[n], ref_grads[n]))
    assert _rel(grads[worst], ref_grads[worst]) <= TOL, (worst, _rel(grads[worst], ref_grads[worst]))
    assert ref_losses[1] < ref_losses[0]
    _, uncapped = hf_tasks.plain_task("gemma2", 1, False, {"attn_logit_softcapping": None})
    assert max(_rel(uncapped[n], ref_grads[n]) for n in ref_grads) > 100 * TOL
