"""The model on the mesh: sharded parameters, the paged KV pools, compiled steps.

`ModelRunner.step` runs one chunk of T tokens for B sequences: the whole model
inside one `shard_map` over ("tp", "dcp"), then returns the next-token logits.
Shapes (B, T, block-table width) are the only compile keys: sequences grow
without recompiling, lengths and positions are data.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from dcpjax.config import ParallelConfig
from dcpjax.models.base import StepContext, kv_head_slots
from dcpjax.models.config import LLAMA_FAMILY, ModelConfig
from dcpjax.models.deepseek import DeepseekV3ForCausalLM
from dcpjax.models.llama import LlamaForCausalLM
from dcpjax.sharding.mesh import logical_spec

KV_POOL_SPEC = logical_spec("kv_pages", None, "kv_heads", None)  # [DCP * blocks, bs, kv_slots, d]
KV_SCALE_SPEC = logical_spec("kv_pages", None, "kv_heads")  # fp8 scales [DCP * blocks, bs, kv_slots]
FP8 = jnp.dtype(jnp.float8_e4m3fn)
MODEL_CLASSES = {arch: LlamaForCausalLM for arch in LLAMA_FAMILY} | {"DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}


def build_model(cfg: ModelConfig, pc: ParallelConfig, dtype) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's structure and its abstract (shape-only) parameters."""
    pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    model_class = MODEL_CLASSES[cfg.architecture]
    abstract = nnx.eval_shape(lambda: model_class(cfg, pc, dtype))
    return nnx.split(abstract)


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


class ModelRunner:
    def __init__(self, cfg: ModelConfig, pc: ParallelConfig, mesh: Mesh, graphdef: nnx.GraphDef,
                 state: nnx.State, kv: KVCacheLayout, attention_backend: str = "auto"):
        self.cfg, self.pc, self.mesh, self.kv_layout = cfg, pc, mesh, kv
        self.graphdef, self.state = graphdef, state
        platform = mesh.devices.flat[0].platform
        self.ctx = StepContext(pc=pc, block_size=kv.block_size, attention_backend=attention_backend, platform=platform)
        local_heads = kv.kv_slots // pc.kv_head_groups

        def zeros(shape, dtype, spec):
            # Made by a shard_map like the step's outputs, so both carry the same sharding
            # (jax drops size-1 mesh axes from shard_map outputs): one compile, not two.
            make = lambda: jnp.zeros(shape, dtype)
            return jax.jit(jax.shard_map(make, mesh=mesh, in_specs=(), out_specs=spec))()

        def pool(dim):
            data = zeros((kv.num_blocks, kv.block_size, local_heads, dim), kv.dtype, KV_POOL_SPEC)
            scales = zeros((kv.num_blocks, kv.block_size, local_heads), jnp.float32, KV_SCALE_SPEC)
            return data, scales if kv.quantized else None

        self.kv_caches = tuple(tuple(pool(d) for d in kv.pool_dims) for _ in range(cfg.num_hidden_layers))
        self._step = self._compile_step()

    def _compile_step(self):
        graphdef, ctx = self.graphdef, self.ctx
        replicated = PartitionSpec()
        pool_spec = (KV_POOL_SPEC, KV_SCALE_SPEC if self.kv_layout.quantized else None)
        cache_specs = tuple((pool_spec,) * len(self.kv_layout.pool_dims) for _ in range(self.cfg.num_hidden_layers))

        def body(state, kv_caches, tokens, positions, valid, last_index, block_tables):
            model = nnx.merge(graphdef, state)
            return model(tokens, positions, valid, last_index, kv_caches, block_tables, ctx)

        sharded = jax.shard_map(
            body,
            mesh=self.mesh,
            in_specs=(param_specs(self.state), cache_specs) + (replicated,) * 5,
            out_specs=(replicated, cache_specs),
            check_vma=False,  # Pallas kernels inside
        )
        return jax.jit(sharded, donate_argnums=(1,))

    def step(self, tokens, positions, valid, last_index, block_tables) -> jax.Array:
        """Run a chunk; returns next-token logits [B, vocab] float32 (replicated).

        tokens, positions, valid: [B, T]; last_index: [B]; block_tables: [B, P] int32.
        """
        logits, self.kv_caches = self._step(
            self.state, self.kv_caches,
            jnp.asarray(tokens, jnp.int32), jnp.asarray(positions, jnp.int32), jnp.asarray(valid, bool),
            jnp.asarray(last_index, jnp.int32), jnp.asarray(block_tables, jnp.int32),
        )
        return logits

    @property
    def compiled_step_count(self) -> int:
        """How many (B, T, P) shapes have been compiled (jit's cache size)."""
        return self._step._cache_size()


def kv_cache_layout(cfg: ModelConfig, pc: ParallelConfig, *, block_size: int, bytes_per_device: int,
                    dtype) -> KVCacheLayout:
    """Blocks that fit `bytes_per_device` of KV on each device."""
    if cfg.use_mla:  # one latent per token: the compressed KV and the shared rotary key
        slots, dims = kv_head_slots(1, pc), (cfg.latent_dim,)
    else:
        slots, dims = kv_head_slots(cfg.num_key_value_heads, pc), (cfg.head_dim, cfg.head_dim)
    layout = KVCacheLayout(0, block_size, slots, dims, jnp.dtype(dtype))
    per_block = layout.bytes_per_block_per_device(cfg.num_hidden_layers, pc.kv_head_groups)
    layout.num_blocks = int(bytes_per_device // per_block)
    if layout.num_blocks < 1:
        raise ValueError(f"kv_cache_memory_bytes={bytes_per_device} holds no block ({per_block} bytes per block "
                         f"per device); raise it")
    return layout
