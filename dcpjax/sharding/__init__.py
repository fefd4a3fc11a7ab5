"""Mesh, interleaved KV layout and LSE-merge collectives."""

from dcpjax.sharding.mesh import DCP_AXIS, RULES, TP_AXIS, ShardingRules, check_mesh, logical_spec, make_mesh

__all__ = ["DCP_AXIS", "RULES", "TP_AXIS", "ShardingRules", "check_mesh", "logical_spec", "make_mesh"]
