"""Mesh, interleaved KV layout and LSE-merge collectives."""

from dcpjax.sharding.mesh import DCP_AXIS, LOGICAL_AXIS_RULES, TP_AXIS, check_mesh, logical_spec, make_mesh

__all__ = ["DCP_AXIS", "LOGICAL_AXIS_RULES", "TP_AXIS", "check_mesh", "logical_spec", "make_mesh"]
