"""Save loaded parameters as an orbax checkpoint and restore them onto any mesh.

Sharded layouts depend on the mesh (KV heads repeated over the "tp" groups,
vocabulary and MLP widths padded to a multiple of TP), so the checkpoint stores the
canonical layout, the one of TP 1: every KV head once, the true sizes. Saving drops
the repeats and the padding; restoring reads each parameter with the sharding
the new mesh wants (replicating only an axis the canonical size cannot split),
then repeats and pads for that mesh. The logical axis names on each parameter
say where to do what, so no model needs its own code here.
"""

from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from dcpjax.loader.holding import path_name
from dcpjax.models.config import ModelConfig
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import RULES, kv_head_slots, logical_spec


def _kv_heads(cfg: ModelConfig) -> int:
    return 1 if cfg.use_mla else cfg.num_key_value_heads


def _canonical_shape(var: nnx.Variable, cfg: ModelConfig) -> tuple[int, ...]:
    """The parameter's shape at TP 1: true sizes (no padding), every KV head once."""
    shape = getattr(var, "unpadded_shape", var.get_value().shape)
    return tuple(_kv_heads(cfg) if a == "kv_heads" else n for n, a in zip(shape, var.logical_axes))


def _to_canonical(value, axes, canonical, cfg: ModelConfig, pc: ParallelConfig):
    for i, axis in enumerate(axes):
        if axis == "kv_heads":
            value = jax.lax.slice_in_dim(value, 0, None, kv_head_slots(_kv_heads(cfg), pc) // _kv_heads(cfg), axis=i)
        else:  # padding dropped
            value = jax.lax.slice_in_dim(value, 0, canonical[i], axis=i)
    return value


def _from_canonical(value, axes, shape, cfg: ModelConfig, pc: ParallelConfig):
    for i, axis in enumerate(axes):
        if axis == "kv_heads":
            value = jnp.repeat(value, kv_head_slots(_kv_heads(cfg), pc) // _kv_heads(cfg), axis=i)
    return jnp.pad(value, [(0, n - m) for n, m in zip(shape, value.shape)])  # zeros where the mesh pads


def _restore_spec(shape, axes, mesh: Mesh) -> PartitionSpec:
    """The param's spec, with any axis the canonical size cannot split replicated."""
    spec = []
    for n, axis in zip(shape, axes):
        mesh_axes = RULES.mesh_axes(axis) if axis else None
        ways = 1
        for name in mesh_axes or ():
            ways *= mesh.shape[name]
        spec.append(logical_spec(axis)[0] if mesh_axes and n % ways == 0 else None)
    return PartitionSpec(*spec)


def _variables(state: nnx.State):
    return list(nnx.to_flat_state(state))


def save_state(state: nnx.State, cfg: ModelConfig, pc: ParallelConfig, path: str | pathlib.Path) -> None:
    """Write the parameters of a loaded model to an orbax checkpoint at `path` (a new folder)."""
    import orbax.checkpoint as ocp

    canonical = {}
    for var_path, var in _variables(state):
        axes, shape = var.logical_axes, _canonical_shape(var, cfg)
        to_canonical = lambda v, axes=axes, shape=shape: _to_canonical(v, axes, shape, cfg, pc)
        canonical[path_name(var_path)] = jax.jit(to_canonical)(var.get_value())
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(pathlib.Path(path).absolute(), canonical)
    checkpointer.wait_until_finished()


def restore_state(abstract_state: nnx.State, cfg: ModelConfig, pc: ParallelConfig, mesh: Mesh,
                  path: str | pathlib.Path) -> nnx.State:
    """Fill an abstract state for `mesh` from an orbax checkpoint written by `save_state`."""
    import orbax.checkpoint as ocp

    variables = _variables(abstract_state)
    target = {}
    for var_path, var in variables:
        shape = _canonical_shape(var, cfg)
        sharding = NamedSharding(mesh, _restore_spec(shape, var.logical_axes, mesh))
        target[path_name(var_path)] = jax.ShapeDtypeStruct(shape, var.get_value().dtype, sharding=sharding)
    path = pathlib.Path(path).absolute()
    if not path.is_dir():
        raise ValueError(f"no orbax checkpoint at {path}")
    try:
        restored = ocp.StandardCheckpointer().restore(path, target)
    except (ValueError, KeyError) as err:
        raise ValueError(f"the checkpoint at {path} does not fit this model config: {err}") from err
    for var_path, var in variables:
        axes, shape = var.logical_axes, var.get_value().shape
        out = NamedSharding(mesh, logical_spec(*axes))
        expand = jax.jit(lambda v, axes=axes, shape=shape: _from_canonical(v, axes, shape, cfg, pc), out_shardings=out)
        var.set_value(expand(restored[path_name(var_path)]))
    return abstract_state
