import jax
import pytest
from jax.sharding import PartitionSpec as P

from dcpjax import ParallelConfig, make_mesh
from dcpjax.sharding.mesh import check_mesh, logical_spec


@pytest.mark.parametrize("tp, dcp", [(1, 1), (2, 2), (4, 2), (8, 2), (8, 4), (8, 8), (4, 4), (8, 1)])
def test_mesh_shape_axes_and_rank_order(tp, dcp):
    pc = ParallelConfig(tp, dcp)
    mesh = make_mesh(pc)
    assert mesh.axis_names == ("tp", "dcp")
    assert dict(mesh.shape) == {"tp": tp // dcp, "dcp": dcp}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    devices = jax.devices()
    for g in range(tp // dcp):
        for d in range(dcp):
            # DCP is the minor factor: TP rank g * DCP + d.
            assert mesh.devices[g, d] == devices[g * dcp + d]
    check_mesh(mesh, pc)


def test_explicit_devices_and_too_few():
    devices = jax.devices()[::-1]
    mesh = make_mesh(ParallelConfig(4, 2), devices)
    assert mesh.devices[0, 0] == devices[0]
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count=16"):
        make_mesh(ParallelConfig(16, 2))


def test_mesh_mismatch_is_named():
    with pytest.raises(ValueError, match="does not match"):
        check_mesh(make_mesh(ParallelConfig(8, 2)), ParallelConfig(8, 4))


def test_logical_axis_rules():
    assert logical_spec("batch", "q_heads", None) == P(None, ("tp", "dcp"), None)
    assert logical_spec("batch", "kv_tokens", "kv_heads", None) == P(None, "dcp", "tp", None)
    with pytest.raises(KeyError, match="unknown logical axis"):
        logical_spec("heads")


@pytest.mark.parametrize("tp", [1, 4])
def test_row_parallel_reductions_are_collectives_only_when_tp_splits(tp):
    """reduce_model / gather_model are psum / all_gather over the TP devices, and nothing at
    TP 1 (XLA would keep a one-device collective in every step)."""
    import jax.numpy as jnp
    import numpy as np

    from dcpjax.sharding.mesh import gather_model, reduce_model

    mesh = make_mesh(ParallelConfig(tp, 1))
    body = lambda x: (reduce_model(x), gather_model(x, axis=0))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("tp", "dcp")), out_specs=(P(), P()), check_vma=False))
    x = jnp.arange(8.0)
    total, gathered = f(x)
    np.testing.assert_allclose(total, x.reshape(tp, -1).sum(axis=0))
    np.testing.assert_array_equal(gathered, x)
    hlo = f.lower(x).compile().as_text()
    assert ("all-reduce" in hlo, "all-gather" in hlo) == (tp > 1, tp > 1)
