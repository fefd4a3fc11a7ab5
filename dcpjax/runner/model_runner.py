"""The model on the mesh: sharded parameters, the paged KV pools, the compiled calls.

A model call runs chunks of tokens for several sequences (the whole model inside one
`shard_map` over ("tp", "dcp")) in one of the layouts of `step_input`: B rows of one sequence
each (decode, verify) or one packed row of several sequences' prefill chunks. Its inputs arrive
as one flat int32 array (one host-to-device transfer). The call takes each sampling row's greedy
token (argmax) in the same dispatch and stores it in a device-side buffer indexed by the
sequence's slot, from which the next step reads a decode row's input, so the host never has to
see a token before the device uses it (asynchronous scheduling). When a row samples otherwise
(temperature, logprobs, logits processors), the sampler's own small program runs right after,
over the call's logits, and overwrites those tokens: the model's compile keys do not multiply
with the sampling variants.

Compile keys: the model call's `CallShape` (rounded onto the `ShapeGrid`: rows or tokens,
block-table width, layout) and the sampler's `SamplerShape` (rows, positions). Lengths,
positions and sampling values are data: sequences grow inside a bucket without recompiling.
`precompile` compiles every key of the grid before the engine says it is ready.
"""

from __future__ import annotations

import contextlib
import logging
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dcpjax.kernels import AttentionOptions, KVPools, LinearState
from dcpjax.models.base import StepBatch, StepContext
from dcpjax.models.config import ModelConfig
from dcpjax.models.gated_delta import CHUNK
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.models.registry import param_specs
from dcpjax.runner import step_input
from dcpjax.runner.call_builder import CallBuilder, PreparedCall
from dcpjax.runner.compile_watch import compile_watch
from dcpjax.runner.kv_layout import KVCacheLayout
from dcpjax.runner.messages import ScheduledCall
from dcpjax.runner.request_states import RequestStates
from dcpjax.runner.shape_grid import SamplerShape, ShapeGrid
from dcpjax.runner.step_input import CallShape
from dcpjax.runner.step_output import ModelStepOutput, SamplerStepOutput, StepResult, as_bits, pack_logprobs
from dcpjax.sampling import (
    MAX_LOGPROBS,
    Sampled,
    SamplerConfig,
    SamplingRows,
    argmax,
    full_config,
    logits_processors,
    sample,
    token_logprobs,
)
from dcpjax.sampling.verify import num_accepted, verify_drafts
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import RULES

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, mesh: Mesh, graphdef: nnx.GraphDef,
                 state: nnx.State, kv: KVCacheLayout, grid: ShapeGrid, attention_backend: str = "auto",
                 max_num_seqs: int = 64, max_logprobs: int = MAX_LOGPROBS):
        self.cfg, self.pc, self.mesh, self.kv_layout, self.grid = cfg, pc, mesh, kv, grid
        self.graphdef, self.state = graphdef, state
        self.max_num_seqs = max_num_seqs
        # the sampler of every call that is not all greedy (`sampler_config`)
        self.full_config = full_config(cfg.vocab_size, max_logprobs)
        self.prompt_top = self.full_config.num_top  # top prompt logprobs a prompt-logprobs call returns
        options = AttentionOptions(backend=attention_backend, platform=mesh.devices.flat[0].platform)
        self.ctx = StepContext(pc=pc, attention=options)
        self.replicated = NamedSharding(mesh, PartitionSpec())
        # per owner layer (`kv_groups`; every layer without sliding-window layers): the paged KV pools,
        # or a linear-attention layer's state per slot
        self.kv_groups = KVCacheGroups.of(cfg)
        self.kv_caches = tuple(self._empty_state() if cfg.is_linear(i) else self._empty_cache()
                               for i in self.kv_groups.owners)
        # the last token sampled for each slot (a running sequence's row in this buffer)
        self.slot_tokens = jax.device_put(np.zeros(max_num_seqs, np.int32), self.replicated)
        # the logits processors' rows of every slot ([max_num_seqs, vocab] x 9 bytes): always there,
        # so that the sampler has one form whatever its requests ask
        self.processor_state = jax.device_put(logits_processors.empty_state(max_num_seqs, cfg.vocab_size),
                                              self.replicated)
        self.calls = CallBuilder(grid, kv.block_size, pc.dcp, max_num_seqs, cfg.vocab_size, max_logprobs,
                                 align=CHUNK if cfg.is_hybrid else 1)
        self.requests = RequestStates()  # what it keeps of each running request, by id
        # the parameters as a flat tuple: jit flattens a tuple of arrays in C++, an nnx.State in Python
        leaves, self._param_tree = jax.tree.flatten(state)
        self._param_leaves = tuple(leaves)
        self._model_step = self._build_model_step()
        self._sampler_step = self._build_sampler_step()
        self._install = jax.jit(logits_processors.install, donate_argnums=0)
        self.seen: set = set()  # the model and sampler shapes dispatched or precompiled so far
        self._lower_lock = threading.Lock()
        self.ready = False  # set by `mark_ready`: a shape compiled after it is a compile a user waits for
        self.precompiled = False  # set by `precompile`: then a compile after ready is a bug, not a choice
        self.steps_compiled_after_ready = 0
        # prefill/decode disaggregation: the KV connector's worker side (`kv_transfer.worker_side`, set by
        # the connector, which the runner does not import): saves and loads of whole prompts' KV
        self.kv_connector = None

    def kv_cache_info(self) -> dict:
        """Its blocks (`num_blocks` of `block_size` tokens per DCP rank, each holding `layers_per_block`
        layers of one of `num_groups` KV cache groups, `models.kv_groups`), the sliding groups' windows,
        the KV dtype and the bytes per device."""
        kv, groups = self.kv_layout, self.kv_groups
        return dict(num_blocks=kv.num_blocks, block_size=kv.block_size, layers_per_block=groups.size,
                    num_groups=groups.num_groups, sliding_groups=groups.num_sliding_groups,
                    sliding_windows=groups.sliding_windows, dtype=kv.dtype,
                    bytes_per_device=kv.num_blocks * kv.bytes_per_block_per_device(groups.size, self.pc.kv_head_groups))

    def _zeros(self, shape, dtype, spec):
        """A sharded array of zeros, `shape` being each device's part. Made by a shard_map like the
        step's outputs, so both carry the same sharding (jax drops size-1 mesh axes from
        shard_map outputs): one compile, not two."""
        make = lambda: jnp.zeros(shape, dtype)
        return jax.jit(jax.shard_map(make, mesh=self.mesh, in_specs=(), out_specs=spec))()

    def _empty_state(self) -> LinearState:
        """One linear-attention layer's zero state for every slot, its heads split over all TP devices."""
        cfg, ways, spec = self.cfg, self.pc.tp, RULES.linear_state_spec
        nk, nv = cfg.linear_num_key_heads // ways, cfg.linear_num_value_heads // ways
        dk, dv, taps = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
        conv = lambda heads, d: self._zeros((self.max_num_seqs, heads, d, taps - 1), jnp.float32, spec)
        return LinearState(conv(nk, dk), conv(nk, dk), conv(nv, dv),
                           self._zeros((self.max_num_seqs, nv, dk, dv), jnp.float32, spec))

    def _empty_cache(self) -> KVPools:
        """One layer's all-zero pools, [kv_slots, DCP * num_blocks, block_size, d] over the mesh (each of
        `kv_layout.pool_names`, and their fp8 scales)."""
        kv, pc = self.kv_layout, self.pc
        local_heads = kv.kv_slots // pc.kv_head_groups
        zeros = self._zeros
        pool = lambda dim: zeros((local_heads, kv.num_blocks, kv.block_size, dim), kv.dtype, RULES.kv_pool_spec)
        scales = lambda: zeros((local_heads, kv.num_blocks, kv.block_size), jnp.float32, RULES.kv_scale_spec)
        pools = {field: pool(dim) for field, dim in zip(kv.pool_names, kv.pool_dims, strict=True)}
        if kv.quantized:
            pools |= {f"{field}_scale": scales() for field in kv.pool_names}
        dv = kv.pool_dims[1] if "v" in pools else self.cfg.kv_lora_rank  # MLA: V is the latent's first part
        return KVPools(**({"v": None} | pools), v_head_dim=dv)

    def _model(self, all_positions: bool = False):
        """The model forward inside shard_map: (state, caches, StepBatch) -> (logits [R, vocab],
        or [B, T, vocab] at all positions, float32 replicated, caches)."""
        graphdef, ctx = self.graphdef, self.ctx
        cache_specs = tuple(RULES.layer_cache_spec(cache) for cache in self.kv_caches)

        def body(state, kv_caches, batch):
            return nnx.merge(graphdef, state)(batch, kv_caches, ctx, all_positions)

        return jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs(self.state), cache_specs, PartitionSpec()),
            out_specs=(PartitionSpec(), cache_specs),
            check_vma=False,  # Pallas kernels inside
        )

    def _build_model_step(self):
        num_slots, replicated, param_tree, prompt_top = self.max_num_seqs, self.replicated, self._param_tree, \
            self.prompt_top
        models = {False: self._model(), True: self._model(all_positions=True)}

        def step(param_leaves, kv_caches, slot_tokens, flat, shape: CallShape) -> ModelStepOutput:
            """One model call of `shape` from its flat input (`step_input`)."""
            state = jax.tree.unflatten(param_tree, param_leaves)
            x = step_input.unpack(flat, shape)
            f = x.fields
            tokens = jnp.where(x.from_slot >= 0, slot_tokens[jnp.clip(x.from_slot, 0, num_slots - 1)], x.tokens)
            batch = StepBatch(tokens=tokens, positions=jnp.maximum(x.positions, 0), valid=x.positions >= 0,
                              sample_index=f.sample_at, block_tables=x.block_tables, seq_slots=x.seq_slots,
                              page_offsets=x.page_offsets)
            verify = shape.kind == "verify"
            logits, kv_caches = models[shape.kind in ("verify", "prompt")](state, kv_caches, batch)
            prompt_out = None
            if shape.kind == "prompt":  # [1, N, vocab]: each token's logprob of the prompt token after it
                prompt_out = pack_logprobs(token_logprobs(logits, jnp.maximum(x.targets, 0), prompt_top))
                logits = logits.reshape(-1, logits.shape[-1])[f.sample_at]
            greedy = argmax(logits)  # [R], or [B, T] at every position of a verify row
            accepted, last = None, greedy
            if verify:  # drafts kept while they equal the argmax (see sampling.verify)
                accepted = num_accepted(greedy, tokens, f.count)
                last = greedy[jnp.arange(greedy.shape[0]), accepted]
            target = jnp.where(f.samples > 0, f.slot, num_slots)  # out of range: dropped
            slot_tokens = jax.lax.with_sharding_constraint(slot_tokens.at[target].set(last, mode="drop"), replicated)
            meta = flat[flat.shape[0] - shape.samples * len(step_input.FIELDS):]
            return ModelStepOutput(greedy, accepted, prompt_out, logits, meta, tokens if verify else None, kv_caches,
                                   slot_tokens)

        return jax.jit(step, static_argnames=("shape",), donate_argnums=(1, 2))

    def _build_sampler_step(self):
        num_slots, replicated = self.max_num_seqs, self.replicated

        def sampler_step(logits, meta, tokens, slot_tokens, processor_state,
                         config: SamplerConfig) -> SamplerStepOutput:
            """logits [R, V] (or [B, T, V] with the verify rows' input tokens [B, T]) and the call's
            fields [R * F] -> the draws."""
            f = step_input.unpack_fields(meta)
            sampled, last, accepted = _draw(logits, tokens, f, processor_state, config)
            target = jnp.where(f.samples > 0, f.slot, num_slots)
            slot_tokens = jax.lax.with_sharding_constraint(slot_tokens.at[target].set(last, mode="drop"), replicated)
            processor_state = jax.lax.with_sharding_constraint(
                logits_processors.record(processor_state, target, last), replicated)
            out = jnp.concatenate([as_bits(sampled.tokens)[..., None], pack_logprobs(sampled[1:])], axis=-1)
            return SamplerStepOutput(out, accepted, slot_tokens, processor_state)

        # its inputs are fixed to replicated: whatever sharding the model call's outputs carry, one compile
        return jax.jit(sampler_step, static_argnums=(5,), donate_argnums=(3, 4), in_shardings=(replicated,) * 5)

    # -- one call ------------------------------------------------------------------------------
    def prepare(self, call: ScheduledCall) -> list[PreparedCall]:
        """The scheduler's message for one call, packed on the host (`CallBuilder.prepare`): one call,
        or a packed prefill split in several. Learns its new requests and forgets its finished ones first."""
        self.requests.update(call)
        return self.calls.prepare(call, self.requests) if call.chunks else []

    def launch(self, call: PreparedCall) -> StepResult:
        """Dispatch the call (returns at once; the device runs it) and start copying its output home.
        Admitted rows whose requests edit their logits first get their slot's rows installed."""
        for chunk in (c for c in call.chunks if c.admitted):
            data = self.requests[chunk.request_id].data
            if data.logits_spec is not None:
                install = logits_processors.make_install(data.logits_spec, chunk.slot, data.output_ids,
                                                         self.cfg.vocab_size)
                self.processor_state = self._install(self.processor_state, install)
        shape = call.shape
        with self._watching(shape):  # jit compiles (or loads) a new shape here, before dispatch
            out = self._model_step(self._param_leaves, self.kv_caches, self.slot_tokens, call.flat, shape=shape)
        self.kv_caches, self.slot_tokens = out.kv_caches, out.slot_tokens
        output, accepted = out.greedy, out.accepted
        if not call.config.all_greedy:
            with self._watching(SamplerShape(shape.samples, shape.chunk if shape.kind == "verify" else 1)):
                drawn = self._sampler_step(out.logits, out.fields, out.verify_tokens, self.slot_tokens,
                                           self.processor_state, call.config)
            output, self.slot_tokens, self.processor_state = drawn.sampled, drawn.slot_tokens, drawn.processor_state
            accepted = accepted if drawn.accepted is None else drawn.accepted
        for array in (output, accepted, out.prompt_logprobs):
            if array is not None:
                array.copy_to_host_async()
        return StepResult(tuple(c.request_id for c in call.chunks), tuple(c.count for c in call.chunks), output,
                          call.config, out.prompt_logprobs, self.prompt_top, accepted, call.token_offsets)

    # -- compilation ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def _watching(self, key):
        """Around one dispatch of `key`: after ready, a new key that made XLA compile is a compile
        requests waited for, counted and logged (a warning if the grid was precompiled: it escaped
        the precompile; else the eager mode's first use)."""
        watched = self.ready and key not in self.seen
        self.seen.add(key)
        before = compile_watch().compiled if watched else 0
        yield
        if watched and compile_watch().compiled > before:
            self.steps_compiled_after_ready += 1
            if self.precompiled:
                logger.warning("compiled a %s after ready: requests waited for it", key)
            else:
                logger.info("compiled a %s on first use (eager: enforce_eager=False precompiles every shape at "
                            "start-up)", key)

    def compile_call(self, shape: CallShape) -> None:
        """Compile (or load from the persistent cache) the model call of `shape` ahead of its first
        dispatch (`runner.precompile`; thread-safe): jit's `lower(...).compile()` fills the cache
        its calls use."""
        with self._lower_lock:  # tracing holds the GIL anyway; XLA's compile below runs in parallel
            lowered = self._model_step.lower(self._param_leaves, self.kv_caches, self.slot_tokens,
                                             np.zeros(shape.size, np.int32), shape=shape)
        lowered.compile()
        self.seen.add(shape)

    def compile_sampler(self, shape: SamplerShape) -> None:
        """Compile the full sampler for `shape` (R rows, T positions) ahead of its first dispatch."""
        r, t, vocab = shape.samples, shape.chunk, self.cfg.vocab_size
        spec = lambda dims, dtype: jax.ShapeDtypeStruct(dims, dtype, sharding=self.replicated)
        verify = t > 1
        with self._lower_lock:
            lowered = self._sampler_step.lower(
                spec((r, t, vocab) if verify else (r, vocab), jnp.float32),
                spec((r * len(step_input.FIELDS),), jnp.int32),
                spec((r, t), jnp.int32) if verify else None, self.slot_tokens, self.processor_state, self.full_config)
        lowered.compile()
        self.seen.add(shape)

    def compile_install(self) -> None:
        """Compile the logits processors' install (one request's rows: one shape)."""
        vocab, spec = self.cfg.vocab_size, jax.ShapeDtypeStruct
        words = (logits_processors.MAX_BAD_WORDS, logits_processors.MAX_BAD_WORD_TOKENS)
        row = logits_processors.Install(spec((), jnp.int32), spec((vocab,), jnp.float32), spec((vocab,), jnp.int8),
                                        spec((vocab,), jnp.int32), spec(words, jnp.int32),
                                        spec((words[1] - 1,), jnp.int32))
        self._install.lower(self.processor_state, row).compile()

    # -- the KV connector's messages (vLLM's worker: bind_connector_metadata, get_finished) -------
    def kv_connector_step(self, meta):
        """Hand the scheduler's `KVConnectorMetadata` to the connector's worker side, which starts
        its saves and loads; returns its `KVConnectorOutput` (what finished since the last call)."""
        return self.kv_connector.step(meta)

    def wait_for_kv_transfers(self, timeout_s: float) -> None:
        """Block until a KV transfer moves on, or timeout_s (an engine with nothing else to run)."""
        self.kv_connector.wait(timeout_s)

    def drop_kv_transfers(self) -> None:
        """Forget the loads under way (the engine failed a step and frees every block)."""
        self.kv_connector.reset()

    def write_kv_caches(self, program, *args) -> None:
        """Run a connector's jitted `program(kv_caches, *args) -> kv_caches` (a scatter of arrived KV;
        the caches donated) in order with the steps: the next call reads what it wrote."""
        self.kv_caches = program(self.kv_caches, *args)

    def mark_ready(self) -> None:
        """From now on a shape that XLA compiles (not one loaded from the persistent cache) is a
        compile while requests wait: logged as a warning and counted (`steps_compiled_after_ready`)."""
        self.ready = True

    @property
    def compiled_step_count(self) -> int:
        """How many model and sampler calls have been compiled (jit's cache sizes)."""
        return self._model_step._cache_size() + self._sampler_step._cache_size()

    def weight_bytes_by_device(self) -> dict[jax.Device, int]:
        """Bytes of the parameters' shards on each of this process's devices (scales included)."""
        held: dict[jax.Device, int] = {}
        for leaf in self._param_leaves:
            for shard in leaf.addressable_shards:
                held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
        return held


def _draw(logits: jax.Array, tokens: jax.Array | None, f: step_input.StepFields, processor_state,
          config: SamplerConfig) -> tuple[Sampled, jax.Array, jax.Array | None]:
    """Each row's draw from its logits ([R, vocab], or [B, T, vocab] with the verify rows' input
    `tokens` [B, T]).

    Returns (the samples with their logprobs: [R] fields, [B, T] when verifying; each row's newest
    token [R]; when verifying, accepted [B] int32: the drafts kept, so the host need not compare
    tokens again, else None).
    """
    rows = SamplingRows(f.temperature, f.top_k, f.top_p, f.min_p, jax.lax.bitcast_convert_type(f.seed, jnp.uint32),
                        f.counter)
    if tokens is not None:  # [B, T] samples: position j draws output token counter + j (see sampling.verify)
        sampled, last = verify_drafts(logits, tokens, f.count, rows, config)
        return sampled, last, num_accepted(sampled.tokens, tokens, f.count)  # the same ops: XLA computes them once
    edited = logits
    if config.processors:  # penalties, logit_bias, ...: the logits sampled from, not those reported
        edited = jax.lax.cond(jnp.any(f.uses_state > 0), lambda: logits_processors.apply(
            logits, processor_state, f.slot, logits_processors.ProcessorRows(
                f.uses_state > 0, f.presence, f.frequency, f.repetition, f.min_tokens, f.counter)), lambda: logits)
    sampled = sample(edited, rows, config, raw_logits=logits, wants_logprobs=f.wants_logprobs)
    return sampled, sampled.tokens, None
