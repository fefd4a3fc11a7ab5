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

import dataclasses
from collections.abc import Sequence as Seq

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dcpjax import step_input
from dcpjax.config import ParallelConfig
from dcpjax.kernels import AttentionOptions, KVCache
from dcpjax.kernels.kv_cache import FP8
from dcpjax.models.base import StepBatch, StepContext
from dcpjax.models.config import LLAMA_FAMILY, ModelConfig
from dcpjax.models.deepseek import DeepseekV3ForCausalLM
from dcpjax.models.layers import unsplittable_dims
from dcpjax.models.llama import LlamaForCausalLM
from dcpjax.sampling import (
    SamplerConfig,
    SamplingRows,
    logits_processors,
    pow2_at_least,
    sample,
    sampler_config,
    token_logprobs,
)
from dcpjax.sampling.verify import verify_drafts
from dcpjax.sequence import ScheduledRow
from dcpjax.sharding.mesh import KV_POOL_SPEC, KV_SCALE_SPEC, kv_cache_spec, kv_head_slots, logical_spec

MODEL_CLASSES = {arch: LlamaForCausalLM for arch in LLAMA_FAMILY} | {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}


def _abstract_model(cfg: ModelConfig, pc: ParallelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    model_class = MODEL_CLASSES[cfg.architecture]
    return nnx.split(nnx.eval_shape(lambda: model_class(cfg, pc, dtype)))


def layout_problems(cfg: ModelConfig, pc: ParallelConfig, state: nnx.State | None = None) -> list[str]:
    """Why this model cannot run on `pc`'s mesh, one sentence each (empty: it can): the TP/DCP
    rules, then any parameter dimension the mesh cannot split (of `state`, the abstract model,
    built here if not given). The one check of `build_model` and the planner, so a layout
    reported valid also loads."""
    broken = pc.model_rule_violations(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    if broken:
        return broken
    return unsplittable_dims(state if state is not None else _abstract_model(cfg, pc, jnp.float32)[1], pc)


def build_model(cfg: ModelConfig, pc: ParallelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its abstract (shape-only) parameters, checked against the mesh
    before any weight is read (ValueError names the rule, with the DCP sizes that would be
    valid, or the dimension)."""
    pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    graphdef, state = _abstract_model(cfg, pc, dtype)
    problems = layout_problems(cfg, pc, state)
    if problems:
        raise ValueError(f"tensor_parallel_size={pc.tp}, decode_context_parallel_size={pc.dcp} cannot hold this "
                         f"model: " + "; ".join(problems))
    return graphdef, state


def param_specs(state: nnx.State):
    """PartitionSpec per parameter, from its logical axes."""
    return jax.tree.map(
        lambda var: logical_spec(*var.logical_axes), state, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )


@dataclasses.dataclass
class KVCacheLayout:
    """Sizes of the paged KV pools (per layer, per DCP rank)."""

    num_blocks: int  # physical blocks per rank; block ids are shared by all ranks
    block_size: int
    kv_slots: int  # KV heads as stored (repeated over "tp" groups when needed)
    pool_dims: tuple[int, ...]  # last dim of each pool of a layer: (dk, dv), or (latent,) for MLA
    dtype: jnp.dtype  # float8_e4m3fn: quantised, with a float32 scale per token and head

    @property
    def quantized(self) -> bool:
        return jnp.dtype(self.dtype) == FP8

    def bytes_per_block_per_device(self, num_layers: int, tp_groups: int) -> int:
        local_heads = self.kv_slots // tp_groups
        per_token_head = sum(self.pool_dims) * jnp.dtype(self.dtype).itemsize + (4 * len(self.pool_dims) if self.quantized else 0)
        return num_layers * self.block_size * local_heads * per_token_head


def width_bucket(pages: int) -> int:
    """The block-table width a step with rows of up to `pages` blocks compiles for: a power of
    two up to 8, then 8, 12, 16, 24, 32, 48, ... (2^k and 1.5 x 2^k). Attention reads every page
    of the width: powers of two alone read up to twice what the rows hold, these steps less than
    1.5 times, for one extra compile per octave."""
    pow2 = pow2_at_least(pages)
    return pow2 * 3 // 4 if pow2 >= 16 and pages <= pow2 * 3 // 4 else pow2


def _as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.float32)


def _pack_logprobs(values) -> jax.Array:
    """(logprob [...], rank [...], top_ids [..., k], top_logprobs [..., k]) -> [..., 2 + 2k] float32."""
    logprob, rank, top_ids, top_logprobs = values
    return jnp.concatenate([logprob[..., None], _as_bits(rank)[..., None], _as_bits(top_ids), top_logprobs], axis=-1)


@dataclasses.dataclass
class StepResult:
    """A dispatched step: its rows, and its sampled output still on (or coming from) the device."""

    rows: list[ScheduledRow]
    output: jax.Array  # [B] int32 tokens, or [B, 3 + 2 * num_top] float32 with logprobs ([B, T, ...] if verify)
    config: SamplerConfig
    prompt_output: jax.Array | None = None  # [B, T, 2 + 2 * prompt_top] float32: prompt logprobs
    prompt_top: int | None = None
    verify: bool = False  # output has a chunk axis: [B, T(, ...)], the samples at every position

    def fetch(self) -> dict[str, np.ndarray]:
        """Block until the step is done; tokens [B], and with logprobs: logprobs, ranks, top_ids,
        top_logprobs; with prompt logprobs "prompt": the same per chunk position, [B, T(, k)]."""
        out = np.asarray(self.output)
        values = {"tokens": out} if self.config.num_top is None else _unpack_logprobs(out, self.config.num_top)
        if self.prompt_output is not None:
            values["prompt"] = _unpack_logprobs(np.asarray(self.prompt_output), self.prompt_top, has_token=False)
        return values


def _unpack_logprobs(out: np.ndarray, k: int, has_token: bool = True) -> dict[str, np.ndarray]:
    """[..., (token,) logprob, rank, top_ids * k, top_logprobs * k] float32 (ints bit-cast) -> named arrays."""
    as_int = lambda x: np.ascontiguousarray(x).view(np.int32)
    values = {"tokens": as_int(out[..., 0])} if has_token else {}
    out = out[..., 1:] if has_token else out
    return values | {"logprobs": out[..., 0], "ranks": as_int(out[..., 1]), "top_ids": as_int(out[..., 2 : 2 + k]),
                     "top_logprobs": out[..., 2 + k :]}


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

    def _empty_cache(self) -> KVCache:
        """One layer's all-zero pools, [kv_slots, DCP * num_blocks, block_size, d] over the mesh."""
        kv, pc = self.kv_layout, self.pc
        local_heads = kv.kv_slots // pc.kv_head_groups

        def zeros(shape, dtype, spec):
            # Made by a shard_map like the step's outputs, so both carry the same sharding
            # (jax drops size-1 mesh axes from shard_map outputs): one compile, not two.
            make = lambda: jnp.zeros(shape, dtype)
            return jax.jit(jax.shard_map(make, mesh=self.mesh, in_specs=(), out_specs=spec))()

        pool = lambda dim: zeros((local_heads, kv.num_blocks, kv.block_size, dim), kv.dtype, KV_POOL_SPEC)
        scales = lambda: zeros((local_heads, kv.num_blocks, kv.block_size), jnp.float32, KV_SCALE_SPEC)
        mla = len(kv.pool_dims) == 1
        return KVCache(
            k=pool(kv.pool_dims[0]), v=None if mla else pool(kv.pool_dims[1]),
            k_scale=scales() if kv.quantized else None, v_scale=scales() if kv.quantized and not mla else None,
            v_head_dim=self.cfg.kv_lora_rank if mla else kv.pool_dims[1],
        )

    def _model(self, all_positions: bool = False):
        """The model forward inside shard_map: (state, caches, StepBatch) -> (logits [B, vocab],
        or [B, T, vocab] at all positions, float32 replicated, caches)."""
        graphdef, ctx = self.graphdef, self.ctx
        cache_specs = tuple(kv_cache_spec(cache) for cache in self.kv_caches)

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
                prompt_out = _pack_logprobs(token_logprobs(logits, jnp.maximum(targets, 0), prompt_top))
                logits = jnp.take_along_axis(logits, batch.last_index[:, None, None], axis=1)[:, 0]
            rows = SamplingRows(f.temperature, f.top_k, f.top_p, f.min_p, jax.lax.bitcast_convert_type(f.seed, jnp.uint32),
                                f.counter)
            if verify:  # [B, T] samples: position j draws output token counter + j (see sampling.verify)
                sampled, last = verify_drafts(logits, batch.tokens, f.count, rows, config)
            else:
                edited = logits
                if config.processors:  # penalties, logit_bias, ...: the logits sampled from, not those reported
                    edited = logits_processors.apply(logits, processor_state, f.slot, logits_processors.ProcessorRows(
                        f.uses_state > 0, f.presence, f.frequency, f.repetition, f.min_tokens, f.counter))
                sampled = sample(edited, rows, config, raw_logits=logits)
                last = sampled.tokens
            target = jnp.where(f.samples > 0, f.slot, num_slots)  # out of range: dropped
            slot_tokens = slot_tokens.at[target].set(last, mode="drop")
            slot_tokens = jax.lax.with_sharding_constraint(slot_tokens, replicated)
            if config.processors:
                processor_state = jax.lax.with_sharding_constraint(
                    logits_processors.record(processor_state, target, last), replicated)
            if config.num_top is None:
                return sampled.tokens, prompt_out, kv_caches, slot_tokens, processor_state
            out = jnp.concatenate([_as_bits(sampled.tokens)[..., None], _pack_logprobs(sampled[1:])], axis=-1)
            return out, prompt_out, kv_caches, slot_tokens, processor_state

        return jax.jit(step, static_argnames=("chunk", "config", "prompt_top", "verify"), donate_argnums=(1, 2, 3))

    # -- one step ------------------------------------------------------------------------------
    def prepare(self, rows: Seq[ScheduledRow], block_tables: np.ndarray,
                greedy: bool = False) -> tuple[np.ndarray, int, SamplerConfig, int | None, bool]:
        """Pack a step's rows into one int32 array on the mesh (one transfer).

        block_tables: the scheduler's host tables [slots, blocks_per_seq], indexed by slot.
        greedy: sample every row greedily and skip logprobs (a draft model's proposals).
        Returns (packed [B, T + P + F] int32 numpy (`dcpjax.step_input`), T, sampler config, top prompt
        logprobs to return: None unless a row wants prompt logprobs, verify: a row carries drafts).
        """
        longest, verify = max(r.count for r in rows), any(r.drafts for r in rows)
        batch, chunk = pow2_at_least(len(rows)), pow2_at_least(longest)
        if verify and longest <= self.verify_chunk:
            chunk = self.verify_chunk  # 1 + k exactly: a power of two would pad k = 4 to 8
        width = min(block_tables.shape[1], width_bucket(max(len(r.seq.blocks) for r in rows)))
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
        output, prompt_output, self.kv_caches, self.slot_tokens, state = self._step(
            self._param_leaves, self.kv_caches, self.slot_tokens, state, packed, chunk=chunk, config=config,
            prompt_top=prompt_top, verify=verify)
        if config.processors:
            self.processor_state = state
        output.copy_to_host_async()
        if prompt_output is not None:
            prompt_output.copy_to_host_async()
        return StepResult(rows, output, config, prompt_output, prompt_top, verify)

    @property
    def compiled_step_count(self) -> int:
        """How many (B, T, P, sampler) variants have been compiled (jit's cache size)."""
        return self._step._cache_size()


def kv_block_layout(cfg: ModelConfig, pc: ParallelConfig, *, block_size: int, dtype) -> KVCacheLayout:
    """The shape of one model's KV blocks (num_blocks still 0)."""
    if cfg.use_mla:  # one latent per token: the compressed KV and the shared rotary key
        slots, dims = kv_head_slots(1, pc), (cfg.latent_dim,)
    else:
        slots, dims = kv_head_slots(cfg.num_key_value_heads, pc), (cfg.head_dim, cfg.head_dim)
    return KVCacheLayout(0, block_size, slots, dims, jnp.dtype(dtype))


def kv_cache_layout(cfg: ModelConfig, pc: ParallelConfig, *, block_size: int, bytes_per_device: int,
                    dtype, extra_bytes_per_block: int = 0) -> KVCacheLayout:
    """Blocks that fit `bytes_per_device` of KV on each device (`extra_bytes_per_block`: what
    another cache with the same block ids, a draft model's, takes per block)."""
    layout = kv_block_layout(cfg, pc, block_size=block_size, dtype=dtype)
    per_block = layout.bytes_per_block_per_device(cfg.num_hidden_layers, pc.kv_head_groups) + extra_bytes_per_block
    layout.num_blocks = int(bytes_per_device // per_block)
    if layout.num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={bytes_per_device} holds no block ({per_block} bytes per block "
                         f"per device); raise it")
    return layout
