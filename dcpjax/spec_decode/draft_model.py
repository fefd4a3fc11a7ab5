"""The draft-model proposer: a smaller model on the same mesh proposes k tokens greedily.

The draft has its own paged DCP cache with the same number of blocks as the target's, addressed
by the target's block tables: a sequence's blocks hold its target KV in the target's pools and its
draft KV in the draft's, so preemption, prefix caching and freeing need no second bookkeeping.
The proposer counts, per sequence, the tokens whose draft KV is written (its own cache, keyed by
the sequence: nothing of it is on `Sequence`).

Per step:
  - every prefill chunk the target computes, the draft computes too (`after_prefill`); a prefix
    taken from the prefix cache has its draft KV in the same blocks, written by the sequence that
    computed them;
  - for the decode rows (`propose`): one draft call catches each sequence up (its last accepted
    tokens, usually one or two) and samples d1, then k - 1 single-token calls sample d2 .. dk, each
    reading its input from the previous call's samples on the device; the host reads the k calls'
    tokens once, at the end.
After verification the draft's count rolls back with the target's: a decode row starts at the
target's computed length, and the draft catches up from the lesser of the two, so the KV of rejected
drafts is rewritten before the draft reads that position again.

Drafts are greedy (a point mass), which keeps verification exact for any sampling parameters (see
`verify`); a sampled draft would accept more often at high temperature, at the price of keeping
the draft's probabilities.
"""

from __future__ import annotations

import dataclasses
import weakref

import numpy as np
from flax import nnx

from dcpjax.loader.model_loader import load_model
from dcpjax.loader.model_source import model_source
from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.runner.kv_layout import KVCacheLayout, kv_block_layout
from dcpjax.runner.model_runner import ModelRunner
from dcpjax.runner.shape_grid import ShapeGrid
from dcpjax.runner.step_output import StepResult
from dcpjax.sequence import ScheduledRow, scheduled_call
from dcpjax.sharding.config import ParallelConfig
from dcpjax.spec_decode.config import SpeculativeConfig


@dataclasses.dataclass
class DraftModel:
    """A loaded draft model: its config, graph and sharded parameters."""

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    state: nnx.State

    def bytes_per_block(self, pc: ParallelConfig, block_size: int, dtype) -> int:
        """Its KV bytes per block and device (the cache is sized for both models together)."""
        layout = kv_block_layout(self.cfg, pc, block_size=block_size, dtype=dtype)
        return layout.bytes_per_block_per_device(self.cfg.num_kv_layers, pc.kv_head_groups)

    def proposer(self, num_speculative_tokens: int, pc: ParallelConfig, mesh, target_kv: KVCacheLayout,
                 grid: ShapeGrid, attention_backend: str, max_num_seqs: int) -> DraftModelProposer:
        """A proposer whose cache has the target's block count and block size, on the target's mesh,
        its calls on the target's grid."""
        layout = kv_block_layout(self.cfg, pc, block_size=target_kv.block_size, dtype=target_kv.dtype)
        layout.num_blocks = target_kv.num_blocks
        runner = ModelRunner(self.cfg, pc, mesh, self.graphdef, self.state, layout, grid, attention_backend,
                             max_num_seqs)
        return DraftModelProposer(runner, num_speculative_tokens)


class DraftModelProposer:
    """Greedy drafts from a draft model's runner (see the module docstring)."""

    def __init__(self, runner: ModelRunner, num_speculative_tokens: int):
        self.runner, self.k = runner, num_speculative_tokens
        # per sequence: the tokens whose draft KV is written (dropped with the sequence)
        self.computed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _launch(self, rows: list[ScheduledRow], block_tables: np.ndarray) -> list[StepResult]:
        """Greedy draft calls of `rows` (a packed call may be split in several), dispatched."""
        call = scheduled_call(rows, block_tables, greedy=True)
        return [self.runner.launch(prepared) for prepared in self.runner.prepare(call)]

    def after_prefill(self, rows: list[ScheduledRow], block_tables: np.ndarray) -> None:
        """Compute the target's prefill chunks in the draft's cache too (nothing sampled)."""
        mirrored = []
        for row in rows:
            # tokens before the chunk: mirrored earlier, or a cached prefix whose blocks hold draft KV
            self.computed[row.seq] = row.start + row.count
            mirrored.append(ScheduledRow(row.seq, row.start, row.count, samples=False, device_input=False))
        self._launch(mirrored, block_tables)

    def propose(self, rows: list[ScheduledRow], block_tables: np.ndarray) -> list[list[int]]:
        """Each decode row's drafts (at most its `lookahead`): k greedy draft calls, one read."""
        active = [row for row in rows if row.lookahead > 0]
        if not active:
            return [[] for _ in rows]
        calls = []
        # call 1: each sequence's tokens the draft has not computed yet (its newest at least) -> d1
        first = []
        for row in active:
            seq = row.seq
            start = min(self.computed.get(seq, 0), row.start)
            first.append(ScheduledRow(seq, start, seq.length - start, samples=True, device_input=False))
        calls.append((active, self._launch(first, block_tables)))
        # call j: d(j-1), from the previous call's samples on the device, at position length + j - 2 -> dj
        for j in range(2, self.k + 1):
            going = [row for row in active if row.lookahead >= j]
            if not going:
                break
            steps = [ScheduledRow(row.seq, row.seq.length + j - 2, 1, samples=True, device_input=True)
                     for row in going]
            calls.append((going, self._launch(steps, block_tables)))
        drafts = {id(row): [] for row in active}
        for going, results in calls:
            tokens = np.concatenate([r.fetch().sampled_token_ids[: len(r.request_ids)] for r in results])
            for i, row in enumerate(going):
                drafts[id(row)].append(int(tokens[i]))
        for row in active:
            # written: every token before the last draft (the last one is never fed to the draft)
            self.computed[row.seq] = row.seq.length + len(drafts[id(row)]) - 1
        return [drafts.get(id(row), []) for row in rows]


def load_draft_model(spec: SpeculativeConfig, target: ModelConfig, max_model_len: int, pc: ParallelConfig, mesh,
                     dtype, seed: int) -> DraftModel:
    """The draft model of speculative decoding, loaded on the target's mesh: same vocabulary, room
    for max_model_len, no linear-attention state (ValueError naming the draft otherwise)."""
    spec.check_draft_tp(pc.tp)
    model = spec.model
    if KVCacheGroups.of(target).windows[0] is not None:
        raise ValueError("speculative_config: a draft model shares the target's first KV cache group's blocks, and "
                         f"every layer of {target.architecture} has a sliding window (its blocks behind the window "
                         "are freed): use method 'ngram', or no speculative_config")
    source = model_source(model, pc, seed, with_tokenizer=False)
    cfg = source.config
    if cfg.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {model!r} has a vocabulary of {cfg.vocab_size} tokens, the "
                         f"target {target.vocab_size}: a draft model must share the target's tokenizer")
    if cfg.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config model {model!r} handles {cfg.max_position_embeddings} positions, "
                         f"fewer than max_model_len={max_model_len}; lower max_model_len")
    cfg.check_max_model_len(max_model_len)
    if cfg.is_hybrid:  # its state would run on past rejected drafts, and it has no state slots
        raise ValueError(f"speculative_config model {model!r} is a hybrid ({cfg.architecture}): a draft model "
                         "must keep only a KV cache; pick a Llama / Qwen / DeepSeek / Gemma-family draft")
    if KVCacheGroups.of(cfg).sliding:  # its layers would need block tables of their own (`models.kv_groups`)
        raise ValueError(f"speculative_config model {model!r} has sliding-window layers: a draft model reads the "
                         "target's full-attention block table; pick a draft without sliding windows")
    try:
        loaded = load_model(cfg, pc, mesh, dtype, source.weights, is_gguf=source.is_gguf,
                            checkpoint=source.checkpoint_quantization, label="Draft model")
    except ValueError as error:
        raise ValueError(f"speculative_config model {model!r}: {error}") from error
    return DraftModel(cfg, loaded.graphdef, loaded.state)
