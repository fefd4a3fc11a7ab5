"""The model on the mesh: sharded parameters, the paged KV pools, the compiled step.

One compiled step runs a chunk of T tokens for B sequences (the whole model inside
one `shard_map` over ("tp", "dcp")) and samples each row's next token in the same
dispatch. Its inputs arrive as one packed int32 array (one host-to-device transfer
per step); its sampled tokens also land in a device-side buffer indexed by each
sequence's slot, from which the next step reads a decode row's input, so the host
never has to see a token before the device uses it (asynchronous scheduling).

Compile keys: rows B and chunk T (each bucketed to a power of two; a verify call's T is
exactly 1 + k), block-table width P (bucketed by `width_bucket` to the longest sequence in
the batch, so a step reads only blocks its rows can reach), and the static `SamplerConfig`. Lengths,
positions and sampling values are data: sequences grow inside a bucket without recompiling.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dcpjax.config import ParallelConfig
from dcpjax.kernels import AttentionOptions, KVPools
from dcpjax.models.base import StepBatch, StepContext
from dcpjax.models.config import ModelConfig
from dcpjax.models.registry import param_specs
from dcpjax.runner import step_input
from dcpjax.runner.compile_watch import compile_watch
from dcpjax.runner.kv_layout import KVCacheLayout
from dcpjax.runner.step_output import StepResult, as_bits, pack_logprobs
from dcpjax.sampling import (
    Sampled,
    SamplerConfig,
    SamplingRows,
    logits_processors,
    pow2_at_least,
    sample,
    sampler_config,
    token_logprobs,
)
from dcpjax.sampling.verify import num_accepted, verify_drafts
from dcpjax.sequence import ScheduledRow
from dcpjax.sharding.mesh import RULES

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, mesh: Mesh, graphdef: nnx.GraphDef,
                 state: nnx.State, kv: KVCacheLayout, attention_backend: str = "auto", max_num_seqs: int = 64,
                 num_speculative_tokens: int = 0):
        self.cfg, self.pc, self.mesh, self.kv_layout = cfg, pc, mesh, kv
        self.graphdef, self.state = graphdef, state
        self.max_num_seqs = max_num_seqs
        self.verify_chunk = 1 + num_speculative_tokens  # a verify call's chunk (one extra compile key)
        options = AttentionOptions(backend=attention_backend, platform=mesh.devices.flat[0].platform)
        self.ctx = StepContext(pc=pc, attention=options)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        self.kv_caches = tuple(self._empty_cache() for _ in range(cfg.num_hidden_layers))
        # the last token sampled for each slot (a running sequence's row in this buffer)
        self.slot_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32), self.replicated)
        self.processor_state: logits_processors.ProcessorState | None = None  # made when a request first needs it
        self.requests = step_input.RequestCache()  # each request's fixed sampling values, packed once
        # the parameters as a flat tuple: jit flattens a tuple of arrays in C++, an nnx.State in Python
        leaves, self._param_tree = jax.tree.flatten(state)
        self._param_leaves = tuple(leaves)
        self._step = self._compile_step()
        self.step_shapes: set[tuple] = set()  # the compile keys dispatched so far
        self.ready = False  # set by `mark_ready`: a step compiled after it is a compile a user waits for
        self.steps_compiled_after_ready = 0

    def _empty_cache(self) -> KVPools:
        """One layer's all-zero pools, [kv_slots, DCP * num_blocks, block_size, d] over the mesh."""
        kv, pc = self.kv_layout, self.pc
        local_heads = kv.kv_slots // pc.kv_head_groups

        def zeros(shape, dtype, spec):
            # Made by a shard_map like the step's outputs, so both carry the same sharding
            # (jax drops size-1 mesh axes from shard_map outputs): one compile, not two.
            make = lambda: jnp.zeros(shape, dtype)
            return jax.jit(jax.shard_map(make, mesh=self.mesh, in_specs=(), out_specs=spec))()

        pool = lambda dim: zeros((local_heads, kv.num_blocks, kv.block_size, dim), kv.dtype, RULES.kv_pool_spec)
        scales = lambda: zeros((local_heads, kv.num_blocks, kv.block_size), jnp.float32, RULES.kv_scale_spec)
        mla = len(kv.pool_dims) == 1
        return KVPools(
            k=pool(kv.pool_dims[0]), v=None if mla else pool(kv.pool_dims[1]),
            k_scale=scales() if kv.quantized else None, v_scale=scales() if kv.quantized and not mla else None,
            v_head_dim=self.cfg.kv_lora_rank if mla else kv.pool_dims[1],
        )

    def _model(self, all_positions: bool = False):
        """The model forward inside shard_map: (state, caches, StepBatch) -> (logits [B, vocab],
        or [B, T, vocab] at all positions, float32 replicated, caches)."""
        graphdef, ctx = self.graphdef, self.ctx
        cache_specs = tuple(RULES.kv_pools_spec(pools) for pools in self.kv_caches)

        def body(state, kv_caches, batch):
            return nnx.merge(graphdef, state)(batch, kv_caches, ctx, all_positions)

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs(self.state), cache_specs, PartitionSpec()),
            out_specs=(PartitionSpec(), cache_specs),
            check_vma=False,  # Pallas kernels inside
        )

    def _compile_step(self):
        num_slots, replicated, param_tree = self.max_num_seqs, self.replicated, self._param_tree
        models = {False: self._model(), True: self._model(all_positions=True)}

        def step(param_leaves, kv_caches, slot_tokens, processor_state, packed, chunk: int, config: SamplerConfig,
                 prompt_top: int | None, verify: bool):
            state = jax.tree.unflatten(param_tree, param_leaves)
            x = step_input.unpack(packed, chunk)
            f = x.fields
            offsets = jnp.arange(chunk, dtype=jnp.int32)[None, :]
            from_device = (f.device_input > 0)[:, None] & (offsets == 0)
            batch = StepBatch(
                tokens=jnp.where(from_device, slot_tokens[jnp.clip(f.slot, 0, num_slots - 1)][:, None], x.tokens),
                positions=f.start[:, None] + offsets,
                valid=offsets < f.count[:, None],
                last_index=jnp.maximum(f.count - 1, 0),
                block_tables=x.block_tables,
            )
            logits, kv_caches = models[prompt_top is not None or verify](state, kv_caches, batch)
            prompt_out = None
            if prompt_top is not None:  # [B, T, vocab]: each position's logprob of the next prompt token
                targets = jnp.where(offsets < f.count[:, None] - 1, jnp.roll(batch.tokens, -1, axis=1), f.next[:, None])
                prompt_out = pack_logprobs(token_logprobs(logits, jnp.maximum(targets, 0), prompt_top))
                logits = jnp.take_along_axis(logits, batch.last_index[:, None, None], axis=1)[:, 0]
            sampled, last, accepted = _draw(logits, batch.tokens, f, processor_state, config, verify)
            target = jnp.where(f.samples > 0, f.slot, num_slots)  # out of range: dropped
            slot_tokens = slot_tokens.at[target].set(last, mode="drop")
            slot_tokens = jax.lax.with_sharding_constraint(slot_tokens, replicated)
            if config.processors:
                processor_state = jax.lax.with_sharding_constraint(
                    logits_processors.record(processor_state, target, last), replicated)
            out = sampled.tokens
            if config.num_top is not None:
                out = jnp.concatenate([as_bits(sampled.tokens)[..., None], pack_logprobs(sampled[1:])], axis=-1)
            return out, accepted, prompt_out, kv_caches, slot_tokens, processor_state

        return jax.jit(step, static_argnames=("chunk", "config", "prompt_top", "verify"), donate_argnums=(1, 2, 3))

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, rows: Seq[ScheduledRow], block_tables: np.ndarray,
                greedy: bool = False) -> tuple[np.ndarray, int, SamplerConfig, int | None, bool]:
        """Pack a step's rows into one int32 array on the mesh (one transfer).

        block_tables: the scheduler's host tables [slots, blocks_per_seq], indexed by slot.
        greedy: sample every row greedily and skip logprobs (a draft model's proposals).
        Returns (packed [B, T + P + F] int32 numpy (`dcpjax.runner.step_input`), T, sampler config, top prompt
        logprobs to return: None unless a row wants prompt logprobs, verify: a row carries drafts).
        """
        longest, verify = max(r.count for r in rows), any(r.drafts for r in rows)
        batch, chunk = pow2_at_least(len(rows)), pow2_at_least(longest)
        if verify and longest <= self.verify_chunk:
            chunk = self.verify_chunk  # 1 + k exactly: a power of two would pad k = 4 to 8
        width = min(block_tables.shape[1], step_input.width_bucket(max(len(r.seq.blocks) for r in rows)))
        n = len(rows)
        step = step_input.PackedStep(batch, n, chunk, width, self.max_num_seqs)
        column = lambda values: np.fromiter(values, np.int32, n)
        slots = column(r.seq.slot for r in rows)
        step.set("start", column(r.start for r in rows))
        step.set("count", column(r.count for r in rows))
        step.set("slot", slots)
        step.set("device_input", column(r.device_input for r in rows))
        step.set("samples", column(r.samples for r in rows))
        step.set_request_values(np.stack([self.requests.values(r.seq) for r in rows]))
        step.set("counter", column(r.seq.num_tokens - 1 - r.seq.num_prompt_tokens for r in rows))  # the draw's index
        step.block_tables[:n] = block_tables[slots, :width]
        prompt_tops = []
        for i, row in enumerate(rows):
            if not row.device_input:  # prefill chunks, and a first token after a preemption
                step.tokens[i, : row.count] = row.input_ids
            if row.wants_prompt_logprobs and not greedy:
                prompt_tops.append(row.seq.params.prompt_logprobs)
                end = row.start + row.count
                step.set("next", row.seq.token_ids[end] if end < row.seq.num_prompt_tokens else -1, row=i)
        if greedy:
            step.set("temperature", np.zeros(n, np.float32))
            config = SamplerConfig()
        else:
            config = sampler_config([r.seq.params for r in rows if r.samples], self.cfg.vocab_size,
                                    processors=any(r.seq.logits_spec is not None for r in rows if r.samples))
        prompt_top = min(self.cfg.vocab_size, pow2_at_least(max(max(prompt_tops), 1))) if prompt_tops else None
        return step.array, chunk, config, prompt_top, verify  # numpy: the jitted step transfers it (one copy, C++ path)

    def launch(self, rows: list[ScheduledRow], packed: np.ndarray, chunk: int, config: SamplerConfig,
               prompt_top: int | None = None, verify: bool = False) -> StepResult:
        """Dispatch the step (returns at once; the device runs it) and start copying its output home.
        Admitted rows whose requests edit their logits first get their slot's rows installed."""
        admitted = [r.seq for r in rows if r.admitted and r.seq.logits_spec is not None]
        if admitted:
            if self.processor_state is None:  # the first request that needs it
                self.processor_state = jax.device_put(
                    logits_processors.empty_state(self.max_num_seqs, self.cfg.vocab_size), self.replicated)
            self.processor_state = logits_processors.install(self.processor_state, logits_processors.make_install(
                admitted, self.max_num_seqs, self.cfg.vocab_size))
        state = self.processor_state if config.processors else None
        key = (packed.shape, chunk, config, prompt_top, verify)
        watched = self.ready and key not in self.step_shapes  # a new shape after ready: did it compile?
        self.step_shapes.add(key)
        compiled_before = compile_watch().compiled if watched else 0
        output, accepted, prompt_output, self.kv_caches, self.slot_tokens, state = self._step(
            self._param_leaves, self.kv_caches, self.slot_tokens, state, packed, chunk=chunk, config=config,
            prompt_top=prompt_top, verify=verify)  # jit compiles (or loads) a new shape here, before dispatch
        if watched and compile_watch().compiled > compiled_before:
            self._compiled_after_ready(key)
        if config.processors:
            self.processor_state = state
        for array in (output, accepted, prompt_output):
            if array is not None:
                array.copy_to_host_async()
        return StepResult(rows, output, config, prompt_output, prompt_top, accepted)

    def mark_ready(self) -> None:
        """From now on a step shape that XLA compiles (not one loaded from the persistent cache)
        is a compile while requests wait: logged as a warning and counted (`steps_compiled_after_ready`)."""
        self.ready = True

    def _compiled_after_ready(self, key: tuple) -> None:
        self.steps_compiled_after_ready += 1
        packed_shape, chunk, config, prompt_top, verify = key
        logger.warning("compiled a step after ready (rows %d, chunk %d, packed %s, %s, prompt logprobs %s, "
                       "verify %s): requests waited for it", packed_shape[0], chunk, packed_shape, config,
                       prompt_top, verify)

    @property
    def compiled_step_count(self) -> int:
        """How many (B, T, P, sampler) variants have been compiled (jit's cache size)."""
        return self._step._cache_size()


def _draw(logits: jax.Array, tokens: jax.Array, f: step_input.StepFields, processor_state,
          config: SamplerConfig, verify: bool) -> tuple[Sampled, jax.Array, jax.Array | None]:
    """Each row's draw from its logits ([B, vocab], or [B, T, vocab] when verifying drafts).

    Returns (the samples with their logprobs: [B] fields, [B, T] when verifying; each row's newest
    token [B]; when verifying, accepted [B] int32: the drafts kept, so the host need not compare
    tokens again, else None).
    """
    rows = SamplingRows(f.temperature, f.top_k, f.top_p, f.min_p, jax.lax.bitcast_convert_type(f.seed, jnp.uint32),
                        f.counter)
    if verify:  # [B, T] samples: position j draws output token counter + j (see sampling.verify)
        sampled, last = verify_drafts(logits, tokens, f.count, rows, config)
        return sampled, last, num_accepted(sampled.tokens, tokens, f.count)  # the same ops: XLA computes them once
    edited = logits
    if config.processors:  # penalties, logit_bias, ...: the logits sampled from, not those reported
        edited = logits_processors.apply(logits, processor_state, f.slot, logits_processors.ProcessorRows(
            f.uses_state > 0, f.presence, f.frequency, f.repetition, f.min_tokens, f.counter))
    sampled = sample(edited, rows, config, raw_logits=logits)
    return sampled, sampled.tokens, None
