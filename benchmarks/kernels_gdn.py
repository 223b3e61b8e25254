"""GDN kernels (chunked prefill, fused decode, paged decode) and the hierarchical reduce-scatter against their XLA
references.

    python benchmarks/kernels_gdn.py [--json PATH]

`CASES` lists every case; `benchmarks/kernels_vs_xla.py` imports it. Each `Case` has `applies(backend, n_devices)` (with
the reason when it does not) and `run()`, which builds its inputs, times the Pallas kernel and the XLA reference
in the same process (jitted, after a warm-up, median of a few repeats), checks that they agree (`tol`, on
max |Δ| / max |ref| of every output) and returns a row: seconds of both, the ratio, the error, FLOPs and bytes
from napkin math (for chunked GDN the algorithm's useful work, `gdn_flops(...)["chunked"]`), achieved FLOP/s and
bytes/s, and the fraction of the device's roofline (bf16 peak and HBM bandwidth from `qwen35.roofline.HARDWARE`
for known TPUs and GPUs, measured with `qwen35.bench` elsewhere).

Where it runs what:
  TPU   the realistic sizes: chunked GDN at T = 8K (one prompt, and 8K tokens of ragged prompts packed, against
        the reference on the zero-padded batch), a 64-sequence decode batch with the 397B model's GDN heads (fp32
        and bf16 state), the paged decode reading 64 rows' states from the engine's bf16 pool against the gather +
        rule + scatter it replaces, and the reduce-scatter when there are ≥ 2 devices (a 2-level mesh).
  GPU   the kernels are Mosaic-TPU kernels and do not compile for a GPU: the realistic-size XLA references are
        timed (so their roofline fraction is known) and the kernel column says why it is empty.
  CPU   correctness sizes only, the kernels in TPU interpret mode (a simulator: its timings are not kernel speed,
        and the table says so); the reduce-scatter needs 8 devices (this script fakes them when run directly).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

if __name__ == "__main__":  # fake 8 CPU devices for the collective when run directly (before jax starts)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the shared `Case` beside this file
from kernel_case import Case, log_backend  # noqa: E402

from qwen35.bench import log, machine_info, save_json
from qwen35.roofline import device_roofline
from qwen35.gdn import chunk_gated_delta_rule, gdn_flops

__all__ = ["Case", "CASES", "run_cases", "main"]


# ------------------------------------------------------------------------------------------------------------
# Chunked GDN
def _gdn_args(lens, Hk, Hv, D, dtype, seed=0):
    T = int(sum(lens))
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (T, Hk, D), dtype)
    k = jax.random.normal(ks[1], (T, Hk, D), dtype)
    v = jax.random.normal(ks[2], (T, Hv, D), dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[3], (T, Hv), jnp.float32))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (T, Hv), jnp.float32))
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    return q, k, v, g, beta, cu


def _chunked_case(lens, Hk, Hv, D, dtype=jnp.bfloat16, C=64):
    def build():
        from qwen35.kernels.chunked_gdn import chunked_gdn_packed

        args = _gdn_args(lens, Hk, Hv, D, dtype)
        N, L, rep = len(lens), max(lens), Hv // Hk
        kernel = None
        if jax.default_backend() in ("tpu", "cpu"):
            kernel = jax.jit(lambda q, k, v, g, b, cu: chunked_gdn_packed(q, k, v, g, b, cu, use_qk_l2norm=True,
                                                                          chunk_size=C))
        starts = np.concatenate([[0], np.cumsum(lens)[:-1]])
        real = np.arange(L)[None] < np.asarray(lens)[:, None]  # [N, L]
        n_idx, l_idx = (jnp.asarray(i) for i in np.nonzero(real))

        @jax.jit
        def reference(q, k, v, g, b, cu):  # the XLA path: pad the prompts to one [N, L] batch, repeat the heads
            idx = jnp.asarray(np.minimum(starts[:, None] + np.arange(L)[None], sum(lens) - 1))  # [N, L]
            mask = jnp.asarray(real)[..., None]
            pad = lambda x: jnp.where(mask[..., None] if x.ndim == 3 else mask, x[idx], 0)  # noqa: E731
            qp, kp = (jnp.repeat(pad(x), rep, axis=2) for x in (q, k))
            o, S = chunk_gated_delta_rule(qp, kp, pad(v), pad(g), pad(b), chunk_size=C, use_qk_l2norm=True)
            return o[n_idx, l_idx], S  # back to the packed order

        T = sum(lens)
        flops = sum(gdn_flops(n, Hv, D, D, C)["chunked"] for n in lens)
        isz = jnp.dtype(dtype).itemsize
        nbytes = T * (2 * Hk * D + 2 * Hv * D) * isz + T * Hv * 2 * 4 + N * Hv * D * D * 4
        return kernel, reference, args, flops, nbytes

    return build


# ------------------------------------------------------------------------------------------------------------
# Fused decode
def _decode_case(B, Hk, Hv, D, state_dtype, Kc=4, dtype=jnp.bfloat16):
    def build():
        from qwen35.kernels.fused_gdn_decode import fused_gdn_decode, fused_gdn_decode_reference

        cd = 2 * Hk * D + Hv * D
        ks = jax.random.split(jax.random.key(1), 7)
        args = (jax.random.normal(ks[0], (B, cd), dtype), jax.random.normal(ks[1], (B, Hv), dtype),
                jax.random.normal(ks[2], (B, Hv), dtype), jax.random.normal(ks[3], (B, cd, Kc), dtype),
                (0.1 * jax.random.normal(ks[4], (B, Hv, D, D), jnp.float32)).astype(state_dtype),
                jax.random.normal(ks[5], (cd, Kc), dtype), jnp.log(jnp.linspace(0.1, 4.0, Hv)),
                jax.random.normal(ks[6], (Hv,), jnp.float32))
        kw = dict(num_k_heads=Hk, head_k_dim=D, head_v_dim=D)
        kernel = None
        if jax.default_backend() in ("tpu", "cpu"):
            kernel = jax.jit(lambda *a: fused_gdn_decode(*a, **kw))
        reference = jax.jit(lambda *a: fused_gdn_decode_reference(*a, **kw))
        s_bytes = B * Hv * D * D * jnp.dtype(state_dtype).itemsize
        isz = jnp.dtype(dtype).itemsize
        nbytes = 2 * s_bytes + 2 * B * cd * Kc * isz + B * (cd + Hv * D) * isz  # state r+w, conv r+w, x in, o out
        flops = 6.0 * B * Hv * D * D  # Sᵀk, Sᵀq, the rank-1 update, the decay (2 FLOP per multiply-add)
        return kernel, reference, args, flops, nbytes

    return build


# ------------------------------------------------------------------------------------------------------------
# Paged decode: the states read and written in the serving pool by index
def _paged_case(B, page_size, pool_dtype, cfg_fn, conv=False):
    """The kernel against the XLA path it replaces (gather the rows' states out of the pool, the rule, scatter them
    back), both updating the pool in place (donated). g = 0 and beta = 0 make the step leave every state exactly as
    it was (decay 1, no write) while moving every byte, so repeated calls agree on o however many each side runs.
    With `conv`, the whole decode step (`paged_conv_gdn_decode`: conv window, conv, gates, rule) against gather +
    `fused_gdn_decode_reference` + scatter; zero conv weights make q = k = v = 0 (o = 0) and A_log = b = -30 make
    the decay 1 and the write 0, so the states stay put while every byte moves."""
    def build():
        from qwen35.kernels.paged_gdn_decode import (paged_conv_gdn_decode, paged_conv_gdn_decode_reference,
                                                     paged_gdn_decode, paged_gdn_decode_reference)
        from qwen35.serving.cache import init_paged_cache
        from qwen35.pool import pool_layout, write_rec

        cfg = cfg_fn()
        Hv, Dk, Dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        lay = pool_layout(cfg, page_size, pool_dtype)
        NB = B * lay.state_blocks + 1
        ks = jax.random.split(jax.random.key(3), 4)
        blocks = (1 + jax.random.permutation(ks[0], NB - 1)).reshape(B, -1).astype(jnp.int32)  # scattered
        pool = init_paged_cache(cfg, NB, page_size, pool_dtype).pool
        pool = write_rec(cfg, pool, 0, blocks, 0.1 * jax.random.normal(ks[1], (B, Hv, Dk, Dv), jnp.float32))
        unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)  # noqa: E731
        args = (unit(jax.random.normal(ks[2], (B, Hv, Dk))), unit(jax.random.normal(ks[3], (B, Hv, Dk))),
                jnp.ones((B, Hv, Dv)), jnp.zeros((B, Hv)), jnp.zeros((B, Hv)))
        fresh = jnp.zeros((B,), bool)
        heads = {}
        if conv:
            C, Kc = cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
            args = (jax.random.normal(ks[2], (B, C)), jnp.zeros((B, Hv)), jnp.full((B, Hv), -30.0),
                    jnp.zeros((C, Kc)), jnp.full((Hv,), -30.0), jnp.zeros((Hv,)))
            heads = dict(num_k_heads=cfg.linear_num_key_heads, head_k_dim=Dk, head_v_dim=Dv)

        def in_place(step):  # the pool lives in the closure, donated to every call (as the engine's step does)
            jitted = jax.jit(lambda pool, *a: step(*a, pool, blocks, fresh, jnp.int32(0), lay, **heads),
                             donate_argnums=0)
            box = {"pool": jnp.array(pool, copy=True)}

            def run(*a):
                o, box["pool"] = jitted(box["pool"], *a)
                return o
            return run

        kernel = None
        if jax.default_backend() in ("tpu", "cpu"):
            kernel = in_place(paged_conv_gdn_decode if conv else paged_gdn_decode)
        reference = in_place(paged_conv_gdn_decode_reference if conv else paged_gdn_decode_reference)
        s_bytes = B * Hv * Dk * Dv * 4  # float32 states (two bf16 planes in a bf16 pool: the same bytes)
        nbytes = 2 * s_bytes + B * Hv * (2 * Dk + 2 * Dv + 2) * 4  # states read + written, q k v o g beta
        if conv:  # + the conv windows read and written, the token's columns in
            nbytes += 2 * B * lay.conv_elems * jnp.dtype(pool.dtype).itemsize + B * cfg.linear_conv_dim * 4
        flops = 6.0 * B * Hv * Dk * Dv
        return kernel, reference, args, flops, nbytes

    return build


# ------------------------------------------------------------------------------------------------------------
# Hierarchical reduce-scatter
def _rs_case(rows_per_device, D, dtype=jnp.bfloat16, micro=4):
    def build():
        from jax.sharding import NamedSharding, PartitionSpec as P

        from qwen35.kernels.reduce_scatter import hierarchical_reduce_scatter
        from qwen35.sharding import make_mesh

        n = jax.device_count()
        inner = 2 if n % 2 == 0 and n > 2 else 1
        mesh = make_mesh(chip=n // inner, core=inner)
        spec = P(("chip", "core"))
        sm = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec, check_vma=False))  # noqa
        x = jax.device_put(jax.random.normal(jax.random.key(2), (n * rows_per_device, D), dtype),
                           NamedSharding(mesh, spec))
        kernel = None
        if jax.default_backend() in ("tpu", "cpu"):
            kernel = sm(lambda x: hierarchical_reduce_scatter(x, "core", "chip", micro_batches=micro))
        reference = sm(lambda x: jax.lax.psum_scatter(x, ("chip", "core"), scatter_dimension=0, tiled=True))
        X = rows_per_device * D * jnp.dtype(dtype).itemsize
        nbytes = (n - 1) / n * X  # bytes each device sends (ring): the link-bound quantity
        flops = (n - 1) / n * rows_per_device * D  # the adds
        return kernel, reference, (x,), flops, nbytes

    return build


Q35 = dict(Hk=16, Hv=64, D=128)  # Qwen3.5-397B-A17B's GDN heads


def _q35_gdn_config():
    """The 397B model's GDN and attention heads on 4 layers (3 GDN, 1 attention): a pool of 64 rows' states is
    then 0.8 GiB in bf16, not the 45-layer model's 12 GiB (the kernel touches one layer's states either way)."""
    from qwen35.config import FULL, LINEAR, get_preset

    return get_preset("qwen35-397b-a17b").replace(num_hidden_layers=4, layer_types=(LINEAR,) * 3 + (FULL,))


def _tiny_config():
    from qwen35.config import tiny

    return tiny()
CASES: list[Case] = [
    Case("chunked_gdn T=8192 (1 prompt)", "chunked_gdn", "realistic", _chunked_case([8192], **Q35)),
    Case("chunked_gdn 8192 tokens, 8 ragged prompts", "chunked_gdn", "realistic",
         _chunked_case([3000, 1800, 1200, 900, 600, 400, 200, 92], **Q35)),
    Case("fused_gdn_decode B=64 fp32 state", "fused_gdn_decode", "realistic",
         _decode_case(64, state_dtype=jnp.float32, **Q35)),
    Case("fused_gdn_decode B=64 bf16 state", "fused_gdn_decode", "realistic",
         _decode_case(64, state_dtype=jnp.bfloat16, **Q35)),
    Case("paged_gdn_decode B=64 from a bf16 pool (256-token pages)", "paged_gdn_decode", "realistic",
         _paged_case(64, 256, jnp.bfloat16, _q35_gdn_config)),
    Case("paged_conv_gdn_decode B=64, bf16 pool (conv + rule)", "paged_conv_gdn_decode", "realistic",
         _paged_case(64, 256, jnp.bfloat16, _q35_gdn_config, conv=True)),
    # The kernel keeps its input, output and receive slots in VMEM: 2 MiB per device fits every TPU's scoped VMEM.
    Case("reduce_scatter 1024x1024 bf16 per device", "reduce_scatter", "realistic", _rs_case(1024, 1024),
         min_devices=2),
    # correctness sizes (CPU): tiny, interpreted
    Case("chunked_gdn tiny ragged [5, 17, 8]", "chunked_gdn", "correctness",
         _chunked_case([5, 17, 8], Hk=1, Hv=2, D=16, dtype=jnp.float32, C=8)),
    Case("fused_gdn_decode tiny B=4", "fused_gdn_decode", "correctness",
         _decode_case(4, Hk=2, Hv=4, D=16, state_dtype=jnp.float32, dtype=jnp.float32)),
    Case("paged_gdn_decode tiny B=4 from a bf16 pool", "paged_gdn_decode", "correctness",
         _paged_case(4, 4, jnp.bfloat16, _tiny_config)),
    Case("paged_conv_gdn_decode tiny B=4, bf16 pool", "paged_conv_gdn_decode", "correctness",
         _paged_case(4, 4, jnp.bfloat16, _tiny_config, conv=True)),
    Case("reduce_scatter tiny 2x4 mesh", "reduce_scatter", "correctness", _rs_case(32, 16, jnp.float32, micro=2),
         min_devices=8),
]


def run_cases(cases=None, repeats: int = 5) -> list[dict[str, Any]]:
    rows = []
    for c in cases or CASES:
        ok, why = c.applies()
        if not ok:
            rows.append({"name": c.name, "kernel": c.kernel, "size": c.size, "skipped": why})
            continue
        log(f"  {c.name} ...")
        rows.append(c.run(repeats=repeats))
    return rows


def _fmt(row) -> str:
    if "skipped" in row:
        return f"{row['name']:<46} skipped: {row['skipped']}"
    ks = "-" if row["kernel_s"] is None else f"{row['kernel_s'] * 1e3:9.3f}"
    sp = "-" if row["speedup_vs_reference"] is None else f"{row['speedup_vs_reference']:.2f}x"
    return (f"{row['name']:<46} {ks:>9} {row['reference_s'] * 1e3:9.3f} {sp:>7} "
            f"{row['achieved_flops'] / 1e9:10.2f} {row['achieved_bytes_per_s'] / 1e9:9.2f} "
            f"{100 * row['roofline_fraction']:6.1f}% {row['bound']:<7} {row.get('max_rel_err', float('nan')):8.1e} "
            f"{row['note']}")


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None, help="output path (default results/kernels_gdn.json)")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    log_backend()
    rows = run_cases(repeats=a.repeats)
    peak_f, peak_b, source = device_roofline()
    log(f"\nroofline: {peak_f / 1e9:,.0f} GFLOP/s, {peak_b / 1e9:,.1f} GB/s ({source})")
    log(f"{'case':<46} {'kernel ms':>9} {'ref ms':>9} {'ratio':>7} {'GFLOP/s':>10} {'GB/s':>9} {'roof':>7} "
        f"{'bound':<7} {'rel err':>8}")
    for r in rows:
        log(_fmt(r))
    result = {"machine": machine_info(), "roofline": {"flops": peak_f, "bytes_per_s": peak_b, "source": source},
              "rows": rows}
    p = save_json(result, a.json, "kernels_gdn.json")
    log(f"saved {p}")
    return result


if __name__ == "__main__":
    sys.exit(main() and 0)
