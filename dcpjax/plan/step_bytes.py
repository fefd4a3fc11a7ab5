"""What one decode step reads of the KV cache and moves over the link, per device: the planner's
roofline terms. The KV capacity behind them is `plan.kv_capacity`; the collective formulas are
`sharding.traffic` (held to compiled HLO by the tests).

Sparse attention (DSA) reads, per layer, every indexer key of the context (to score it) and only the
`index_topk` latents its queries select; its exact global top-k adds one all_gather of the candidates.
"""

from __future__ import annotations

from dcpjax.models.config import ModelConfig
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.plan.kv_capacity import KVCapacity
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.traffic import COLLECTIVES_PER_LAYER, dcp_collective_bytes, top_k_merge_bytes


def indexed_layers(cfg: ModelConfig) -> int:
    """Layers that run their own indexer (GLM-5's shared layers reuse the previous layer's top-k)."""
    return cfg.num_kv_layers - len(cfg.index_shared_layers) if cfg.use_sparse_attention else 0


def top_k_merges(cfg: ModelConfig, context: float) -> int:
    """The top-k all_gathers of a decode step at `context` tokens: one per indexed layer, once the context
    exceeds the top-k (before that a step attends densely)."""
    return indexed_layers(cfg) if cfg.use_sparse_attention and context > cfg.index_topk else 0


def kv_read_bytes(cfg: ModelConfig, capacity: KVCapacity, batch: int, context: float, index_share: float
                  ) -> float:
    """KV bytes one device reads in a decode step of `batch` sequences at `context` tokens: each layer
    its window of the context (all of it without one). index_share: the part of a token's bytes that
    are indexer keys (`KVCacheLayout.share_of("index_k")`): with sparse attention those are read over
    the context, the rest (the latent) over the top-k positions only."""
    groups = KVCacheGroups.of(cfg)
    per_token = capacity.bytes_per_layer_token
    if cfg.use_sparse_attention:  # keys where an indexer scores them, the top-k's latents in every layer
        keys = indexed_layers(cfg) * context * index_share
        latents = cfg.num_kv_layers * min(context, cfg.index_topk) * (1 - index_share)
        return batch * per_token * (keys + latents)
    layer_tokens = sum(min(context, w or context) * len(g) for g, w in zip(groups.layers, groups.windows))
    return batch * per_token * layer_tokens


def dense_read_bytes(cfg: ModelConfig, capacity: KVCapacity, batch: int, context: float, index_share: float
                     ) -> float:
    """What the same step would read attending densely (every latent of the context, no indexer keys):
    the sparse model's step against dense MLA's."""
    return batch * capacity.bytes_per_layer_token * (1 - index_share) * context * cfg.num_kv_layers


def collective_bytes(cfg: ModelConfig, pc: ParallelConfig, batch: int, q_bytes: int, context: float
                     ) -> dict[str, float]:
    """DCP collective bytes per decode step per device, all layers, for each merge backend (and, when a
    sparse model's context exceeds its top-k, the top-k merge)."""
    if cfg.use_mla:
        dk, dv = cfg.latent_dim, cfg.kv_lora_rank
    else:
        dk = dv = cfg.head_dim
    top_k = top_k_merges(cfg, context) * top_k_merge_bytes(dcp=pc.dcp, batch=batch, top_k=cfg.index_topk)
    return {comm: top_k + cfg.num_kv_layers * dcp_collective_bytes(
        tp=pc.tp, dcp=pc.dcp, q_heads=cfg.num_attention_heads, dk=dk, dv=dv, batch=batch, q_bytes=q_bytes, comm=comm)
        for comm in COLLECTIVES_PER_LAYER}
