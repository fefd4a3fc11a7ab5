"""dcpjax: Decode Context Parallelism for long-context LLM decoding in JAX."""

from dcpjax.kernels import decode_attention
from dcpjax.llm import LLM
from dcpjax.outputs import CompletionOutput, Logprob, RequestOutput
from dcpjax.sampling import SamplingParams
from dcpjax.sharding.attention import DCPKVCache, append_kv, dcp_decode_attention, empty_kv_cache, shard_kv_cache
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.devices import use_cpu_devices
from dcpjax.sharding.mesh import make_mesh

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "DCPKVCache",
    "Logprob",
    "ParallelConfig",
    "RequestOutput",
    "SamplingParams",
    "append_kv",
    "dcp_decode_attention",
    "decode_attention",
    "empty_kv_cache",
    "make_mesh",
    "shard_kv_cache",
    "use_cpu_devices",
]
