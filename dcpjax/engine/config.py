"""An engine's configuration as objects: `EngineConfig`, everything `LLM` takes (vLLM's
`VllmConfig`), and `SchedulerConfig`, what the engine loop and the scheduler take (vLLM's
`SchedulerConfig`, with the KV block size and the speculative lookahead they also need)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dcpjax.kernels import check_attention_backend
from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.loader.quantized_source import QUANTIZATIONS
from dcpjax.sharding import layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.spec_decode.config import SpeculativeConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16,
          "half": jnp.float16, "float": jnp.float32}  # vLLM's aliases
KV_CACHE_DTYPES = {"fp8": jnp.float8_e4m3fn, "fp8_e4m3": jnp.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class SchedulerConfig:
    """One engine's batching configuration (see `LLM` for each field's meaning).

    max_model_len: longest prompt + output; block_size: tokens per KV block on each DCP rank;
    num_lookahead_tokens: room for speculative drafts on each decode row (0: none).
    """

    max_model_len: int
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 256
    async_scheduling: bool = True
    enable_prefix_caching: bool = True
    num_lookahead_tokens: int = 0

    def __post_init__(self) -> None:
        check_max_num_batched_tokens(self.max_num_batched_tokens)


def check_quantization(quantization: str | None) -> None:
    """One of `QUANTIZATIONS` (or None: "auto"), before anything is loaded."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} (or None: as the checkpoint holds), "
                         f"got {quantization!r}")


def check_max_num_batched_tokens(tokens: int) -> None:
    """The token budget: any value >= 1, as vLLM takes it. A step schedules at most this many tokens;
    its model call is padded up to the shape grid's next bucket (a power of two: 40 -> 64)."""
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be an integer >= 1, got {tokens!r}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """One engine's whole configuration (vLLM's `VllmConfig`): what `LLM(...)` takes, checked and
    grouped, made by `LLM` from its keyword arguments or by `EngineArgs.create_engine_config()`.
    The loading steps read it instead of a fan-out of keyword arguments. See `LLM` for each field.

    No field has a default: `LLM`'s signature and `EngineArgs` hold them (vLLM's names), and both
    pass every field, so the defaults live in two places rather than three.

    The checks that need nothing loaded run here, in the order `LLM` always reported them; those
    that need the model (max_model_len against its positions, the TP/DCP rules against its heads)
    run when it is loaded.
    """

    model: str
    tokenizer: str | None
    parallel: ParallelConfig
    dtype: str
    max_model_len: int | None  # None: the model's max_position_embeddings
    kv_cache_memory_bytes: int | None
    kv_cache_dtype: str
    attention_backend: str
    seed: int
    block_size: int
    gpu_memory_utilization: float
    max_num_seqs: int
    max_num_batched_tokens: int
    async_scheduling: bool
    orbax_checkpoint: str | None
    enable_prefix_caching: bool
    speculative: SpeculativeConfig | None
    load_format: str
    generation_config: str
    max_logprobs: int
    compilation_cache_dir: str | None  # "auto": compile_watch.default_compilation_cache_dir(); None or "": off
    enforce_eager: bool | None  # skip the start-up precompile (`dcpjax.runner.precompile`); None: on CPU only
    quantization: str | None = None  # how weights are held (`loader.quantized_source.QUANTIZATIONS`); None: auto
    kv_transfer: KVTransferConfig | None = None  # prefill/decode disaggregation's role (None: off)

    def skips_precompile(self, platform: str) -> bool:
        """enforce_eager, or on CPU when unset: XLA:CPU builds a step shape in seconds and maps ~350
        memory regions for it, and a configuration can dispatch hundreds (`dcpjax.runner.precompile`)."""
        return platform == "cpu" if self.enforce_eager is None else self.enforce_eager

    def __post_init__(self) -> None:
        check_attention_backend(self.attention_backend)
        layout.check_block_size(self.block_size, self.parallel.interleave)
        check_max_num_batched_tokens(self.max_num_batched_tokens)
        check_quantization(self.quantization)
        if self.kv_transfer is not None and self.speculative is not None and self.speculative.method == "draft_model":
            raise ValueError("kv_transfer_config: a transferred prompt brings no draft model KV; use ngram "
                             "speculative decoding, or none, on a server that transfers KV")

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's part, once the model fixed max_model_len."""
        spec = self.speculative
        return SchedulerConfig(max_model_len, self.block_size, self.max_num_seqs, self.max_num_batched_tokens,
                               self.async_scheduling, self.enable_prefix_caching,
                               num_lookahead_tokens=spec.num_speculative_tokens if spec else 0)

    def dtypes(self, platform: str) -> tuple[jnp.dtype, jnp.dtype]:
        """(weights and activations, KV cache) on `platform` ("auto": bfloat16 on GPU/TPU, float32 on
        CPU; the KV cache's "auto": the model's)."""
        model = _resolve_dtype(self.dtype, "dtype", platform)
        if self.kv_cache_dtype == "auto":
            return model, model
        if self.kv_cache_dtype in KV_CACHE_DTYPES:
            return model, KV_CACHE_DTYPES[self.kv_cache_dtype]
        return model, _resolve_dtype(self.kv_cache_dtype, "kv_cache_dtype ('auto', 'fp8' or a dtype name)", platform)


def _resolve_dtype(name: str, what: str, platform: str):
    if name == "auto":
        return jnp.float32 if platform == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise ValueError(f"{what} must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]
