"""dcpjax: Decode Context Parallelism for long-context LLM decoding in JAX.

The public names below are imported on first use (PEP 562), so `import dcpjax` (and
`dcpjax.__version__`) costs no JAX: the router and the command lines that need none start in a
fraction of a second. `from dcpjax import LLM` and `dcpjax.LLM` work as before.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "LLM": "dcpjax.llm",
    "CompletionOutput": "dcpjax.outputs",
    "DCPKVCache": "dcpjax.sharding.attention",
    "Logprob": "dcpjax.outputs",
    "ParallelConfig": "dcpjax.sharding.config",
    "RequestOutput": "dcpjax.outputs",
    "SamplingParams": "dcpjax.sampling",
    "append_kv": "dcpjax.sharding.attention",
    "dcp_decode_attention": "dcpjax.sharding.attention",
    "dcp_sparse_decode_attention": "dcpjax.sharding.attention",
    "decode_attention": "dcpjax.kernels",
    "empty_kv_cache": "dcpjax.sharding.attention",
    "make_mesh": "dcpjax.sharding.mesh",
    "shard_kv_cache": "dcpjax.sharding.attention",
    "use_cpu_devices": "dcpjax.sharding.devices",
}

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
    "dcp_sparse_decode_attention",
    "decode_attention",
    "empty_kv_cache",
    "make_mesh",
    "shard_kv_cache",
    "use_cpu_devices",
]

if TYPE_CHECKING:
    from dcpjax.kernels import decode_attention
    from dcpjax.llm import LLM
    from dcpjax.outputs import CompletionOutput, Logprob, RequestOutput
    from dcpjax.sampling import SamplingParams
    from dcpjax.sharding.attention import (
        DCPKVCache,
        append_kv,
        dcp_decode_attention,
        dcp_sparse_decode_attention,
        empty_kv_cache,
        shard_kv_cache,
    )
    from dcpjax.sharding.config import ParallelConfig
    from dcpjax.sharding.devices import use_cpu_devices
    from dcpjax.sharding.mesh import make_mesh


def __getattr__(name: str):
    """A public name, imported from its module on first use (then cached here)."""
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
