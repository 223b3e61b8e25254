"""The hierarchical reduce-scatter kernel (remote DMAs on a 2-level mesh) against `lax.psum_scatter` and
`qwen35.sharding.hierarchical_psum_scatter`, on 8 fake CPU devices in TPU interpret mode with race detection, and
its TPU lowering over an AbstractMesh."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import AbstractMesh, AxisType, NamedSharding, PartitionSpec as P

from qwen35.kernels.reduce_scatter import hierarchical_reduce_scatter, reduce_scatter_bytes
from qwen35.sharding import hierarchical_psum_scatter, make_mesh

from helpers import BF16_EPS, assert_close, fp32_tol
from pallas_helpers import RACES, clean_interpreter, races_found  # noqa: F401 (autouse fixture)

AXES = ("chip", "core")  # outer, inner


def _shard(f, mesh):
    spec = P(AXES)
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("chips, cores, micro, dtype", [
    pytest.param(2, 4, 2, jnp.float32, id="2chips-x-4cores-2micro"),
    pytest.param(4, 2, 1, jnp.float32, id="4chips-x-2cores-1micro"),
    pytest.param(1, 8, 2, jnp.bfloat16, id="1chip-x-8cores-bf16"),
])
def test_reduce_scatter_matches_psum_scatter(chips, cores, micro, dtype):
    mesh = make_mesh(chip=chips, core=cores)
    n = chips * cores
    M, D = n * micro * 2, 16  # rows per device: 2 rows per micro-batch piece
    x = jnp.asarray(np.random.default_rng(chips).standard_normal((n * M, D)), jnp.float32).astype(dtype)
    y = _shard(lambda x: hierarchical_reduce_scatter(x, "core", "chip", micro_batches=micro, interpret=RACES), mesh)(x)
    assert not races_found(), "the race detector reported a data race"
    flat = _shard(lambda x: jax.lax.psum_scatter(x, AXES, scatter_dimension=0, tiled=True), mesh)(x)
    hier = _shard(lambda x: hierarchical_psum_scatter(x, "core", "chip"), mesh)(x)
    assert y.shape == flat.shape == (M, D)  # global: n blocks of M / n rows
    # an n-term sum in another order: the float32 rule, or in bf16 each partial sum rounded to bf16 (half a bf16
    # ulp of a partial sum, accumulating like the float32 rule's random walk)
    total = np.asarray(x, np.float32).reshape(n, M, D).sum(0)  # device d's block: rows d·M/n .. of the sum
    scale = float(np.max(np.abs(np.asarray(x, np.float32)))) * np.sqrt(n)  # the partial sums' size
    tol = 2 * BF16_EPS * scale * np.sqrt(n) if dtype == jnp.bfloat16 else fp32_tol(scale, n)
    for name, want in (("psum_scatter", flat), ("hierarchical_psum_scatter", hier), ("numpy sum", total)):
        assert_close(np.asarray(y, np.float32), np.asarray(want, np.float32), atol=tol, name=name)


def test_reduce_scatter_rejects_rows_that_do_not_split():
    mesh = make_mesh(chip=2, core=4)
    x = jnp.zeros((8 * 12, 4))  # 12 rows per device: not a multiple of 2·4·2
    with pytest.raises(ValueError, match="multiple of chip×core×micro_batches"):
        _shard(lambda x: hierarchical_reduce_scatter(x, "core", "chip", micro_batches=2, interpret=RACES), mesh)(x)


@pytest.mark.timeout(60)
def test_reduce_scatter_lowers_for_tpu_over_an_abstract_mesh():
    am = AbstractMesh((2, 4), AXES, axis_types=(AxisType.Explicit,) * 2)
    f = jax.shard_map(lambda x: hierarchical_reduce_scatter(x, "core", "chip", micro_batches=4, interpret=False),
                      mesh=am, in_specs=P(AXES), out_specs=P(AXES), check_vma=False)
    x = jax.ShapeDtypeStruct((8 * 1024, 128), jnp.bfloat16, sharding=NamedSharding(am, P(AXES)))
    exp = jax.export.export(jax.jit(f), platforms=["tpu"])(x)
    assert exp.nr_devices == 8 and "tpu_custom_call" in exp.mlir_module()


def test_reduce_scatter_bytes_favour_the_hierarchy():
    b = reduce_scatter_bytes(M=1024, D=128, itemsize=2, inner=4, outer=2)
    X = 1024 * 128 * 2
    assert b["on_chip"] == 3 / 4 * X and b["cross_chip"] == 1 / 8 * X and b["flat_ring"] == 7 / 8 * X
    assert b["on_chip"] + b["cross_chip"] == b["flat_ring"]  # same total, but only 1/8 of X crosses chips


@pytest.mark.timeout(60)
def test_the_race_detector_catches_a_racy_remote_dma():
    """The flag the tests assert on is live: a kernel that reads its receive buffer while the neighbour's DMA into
    it may still be in flight (no wait before the read) is reported."""
    from jax.experimental import pallas as pl

    def racy(x_ref, o_ref, buf, send_sem, recv_sem):
        me = jax.lax.axis_index("core")
        cp = pltpu.make_async_remote_copy(x_ref, buf, send_sem, recv_sem, device_id={"core": (me + 1) % 8},
                                          device_id_type=pl.DeviceIdType.MESH)
        cp.start()
        o_ref[...] = buf[...]  # BUG: read before cp.wait_recv()
        cp.wait()

    mesh = make_mesh(core=8)
    vmem = pltpu.MemorySpace.VMEM

    def f(x):
        return pl.pallas_call(racy, in_specs=[pl.BlockSpec(memory_space=vmem)],
                              out_specs=pl.BlockSpec(memory_space=vmem),
                              out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                              scratch_shapes=[pltpu.VMEM(x.shape, x.dtype), pltpu.SemaphoreType.DMA(()),
                                              pltpu.SemaphoreType.DMA(())],
                              interpret=pltpu.InterpretParams(detect_races=True, dma_execution_mode="eager"))(x)

    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("core"), out_specs=P("core"), check_vma=False))(
        jnp.ones((8 * 8, 128))).block_until_ready()
    assert races_found()
