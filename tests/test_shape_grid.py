"""The shape grid: every call rounds onto it, and it lists every shape a runner can meet."""

import pytest

from dcpjax.kernels import AttentionOptions, reads_only_visible_pages
from dcpjax.runner.shape_grid import SamplerShape, ShapeGrid
from dcpjax.runner.step_input import CallShape


def grid(**overrides):
    values = dict(max_num_seqs=6, max_num_batched_tokens=64, prompt_logprobs_tokens=16, blocks_per_seq=40,
                  block_size=4, dcp=2, whole_table=False)
    return ShapeGrid.build(**values | overrides)


def test_buckets():
    g = grid()
    # packed calls from 16 tokens (fewer cost about the same), prompt-logprobs calls up to their own budget
    assert g.rows == (1, 2, 4, 8) and g.tokens == (16, 32, 64) and g.prompt_tokens == (16,)
    assert grid(max_num_batched_tokens=8).tokens == (8,)
    # powers of two from 128 tokens per rank (32 blocks of 4) up to the table
    assert g.widths == (32, 40)
    # packed calls: up to a budget of new sequences' pages (64 / 8 + 6 rows: 14), here the table's 40
    assert g.packed_widths == (32, 40) and g.max_packed_width == 40
    assert grid(blocks_per_seq=3, max_num_batched_tokens=512).packed_widths == (32, 64, 70)
    assert grid(blocks_per_seq=1000, block_size=16).widths == (8, 16, 32, 64, 128, 256, 512, 1000)
    assert grid(whole_table=True).widths == (40,)  # a kernel that stops at each bound takes the whole table
    assert grid(whole_table=True, blocks_per_seq=3, max_num_batched_tokens=512).packed_widths == (70,)
    assert grid(blocks_per_seq=3).widths == (3,)


def test_calls_round_up_onto_the_grid():
    g = grid(blocks_per_seq=1000, block_size=16)
    assert g.rows_call(3, 9) == CallShape("decode", 4, 1, 16, 4)
    assert g.rows_call(5, 600, chunk=3, verify=True) == CallShape("verify", 8, 3, 1000, 8)
    assert g.packed_call(17, 2) == CallShape("prefill", 1, 32, 8, 8)  # R: at most the largest row bucket
    assert g.packed_call(3, 1, prompt=True) == CallShape("prompt", 1, 16, 8, 8)
    with pytest.raises(ValueError, match="65 tokens exceed the largest bucket 64"):
        g.packed_call(65, 8)
    with pytest.raises(ValueError, match="exceed the largest bucket 16"):
        g.packed_call(17, 8, prompt=True)


@pytest.mark.parametrize("blocks", [1, 3, 40, 333])
def test_a_width_reads_less_than_twice_what_the_longest_row_needs(blocks):
    g = grid(blocks_per_seq=blocks)
    floor = g.widths[0]
    for pages in range(1, blocks + 1):
        assert pages <= g.width_bucket(pages) < max(2 * pages, floor + 1)


def test_call_shapes_cover_every_reachable_call():
    g = grid(blocks_per_seq=100, num_speculative_tokens=3)
    shapes = set(g.call_shapes())
    rows_calls = {(s.kind, s.rows, s.chunk, s.width) for s in shapes if not s.packed}
    assert rows_calls == {(kind, r, c, w) for r in g.rows for w in g.widths
                          for kind, c in (("decode", 1), ("verify", 4))}
    packed = {(s.kind, s.chunk, s.width) for s in shapes if s.packed}
    # every packed call holds more than half its bucket's tokens: 33..64 tokens need 5+ blocks of 8
    for kind, tokens, width in packed:
        assert width >= -(-(tokens // 2 + 1) // g.tokens_per_block) or tokens == 16
    assert ("prefill", 64, 64) in packed and ("prompt", 16, 32) in packed and ("prefill", 16, 32) in packed
    for s in shapes:
        assert s.samples == (s.rows if not s.packed else min(s.chunk, 8))
    # a draft runner: catch-up rows of 1 + k tokens instead of verify, no prompt logprobs
    draft = set(g.call_shapes(prompt_logprobs=False, catch_up=True))
    assert {s.kind for s in draft} == {"decode", "prefill"} and any(s.chunk == 4 for s in draft if not s.packed)
    assert set(g.sampler_shapes()) == ({SamplerShape(r, 1) for r in (1, 2, 4, 8)}
                                       | {SamplerShape(r, 4) for r in (1, 2, 4, 8)})


def test_only_the_gpu_kernel_reads_just_the_pages_within_bounds():
    assert reads_only_visible_pages(AttentionOptions(platform="gpu"), 16)
    assert not reads_only_visible_pages(AttentionOptions(platform="gpu"), 8)  # the reference takes such pages
    assert not reads_only_visible_pages(AttentionOptions(platform="gpu", backend="reference"), 16)
    assert not reads_only_visible_pages(AttentionOptions(platform="tpu"), 16)  # its grid spans every page
    assert not reads_only_visible_pages(AttentionOptions(platform="cpu"), 16)
