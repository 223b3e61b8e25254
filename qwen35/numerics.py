"""How close two float32 results must be, stated once (the tests and the notebooks use it).

Two correct float32 evaluations of the same value differ by their rounding: another CPU (vector width, fused
multiply-adds, AMX or AVX-512 micro-kernels), another thread count or another library sums in another order. Each
rounding errs by at most eps/2 relative (eps = 2^-23 for float32), and a sum of n rounded terms gathers an error
that grows like sqrt(n) times the size of its partial sums: rounding errors of either sign add like a random walk
(Higham & Mary, "A New Approach to Probabilistic Rounding Error Analysis", SIAM J. Sci. Comput. 41(5), 2019). So a
float32 comparison is bounded by

    fp32_tol(scale, terms) = ULPS · eps · scale · sqrt(terms)

with `scale` the size of the values being summed (by default the largest |expected|) and `terms` the reduction
length (for a chain of operations, the sum of the chain's reduction lengths: `attention_terms`, `gdn_terms`,
`moe_terms` and `model_terms` count them for the model's blocks). ULPS = 16 covers both evaluations' errors and the
tail of their distribution. Greedy tokens follow from it: two tokens whose logits lie within twice the bound
are a near tie that another CPU may order either way (`assert_same_greedy`, `assert_no_near_tie`). A real bug (a wrong transpose, a missing renormalisation, a dropped token) changes a
value by a sizeable fraction of `scale`, hundreds of times this bound at the sizes used here (the tests check that
such mutations fail).

numpy only: importing this module does not start jax.
"""

from __future__ import annotations

import math

import numpy as np

F32_EPS = float(np.finfo(np.float32).eps)  # 2^-23
BF16_EPS = 2.0 ** -7  # bfloat16 keeps 8 significant bits (7 stored)
ULPS = 16


def fp32_tol(scale, terms=1, ulps=ULPS):
    """The bound two correct float32 evaluations of a `terms`-long reduction of size `scale` stay within."""
    return ulps * F32_EPS * float(scale) * math.sqrt(max(int(terms), 1))


def assert_close(actual, expected, *, atol=None, rtol=0.0, terms=None, scale=None, ulps=ULPS, name="value"):
    """np.testing.assert_allclose with the max abs error (and the bound's rule) in the message.

    Either `atol` (for exact comparisons, atol=0, or a bound derived in the test) or `terms`: the bound is then
    fp32_tol(scale, terms, ulps), `scale` defaulting to the largest |expected| (at least 1e-30)."""
    a, e = np.asarray(actual, dtype=np.float64), np.asarray(expected, dtype=np.float64)
    assert a.shape == e.shape, f"{name}: shape {a.shape} != expected {e.shape}"
    if (atol is None) == (terms is None):
        raise TypeError("assert_close takes exactly one of atol= and terms=")
    rule = ""
    if terms is not None:
        if scale is None:
            scale = float(np.max(np.abs(e))) if e.size else 0.0
        atol = fp32_tol(max(scale, 1e-30), terms, ulps)
        rule = f" (bound {atol:.3g} = {ulps} ulps x scale {scale:.3g} x sqrt({terms}))"
    err = float(np.max(np.abs(a - e))) if a.size else 0.0
    np.testing.assert_allclose(a, e, atol=atol, rtol=rtol, err_msg=f"{name}: max abs err {err:.3g}{rule}")


def topk_margin(logits, k):
    """The smallest gap, over rows, between the k-th and (k+1)-th largest of logits [N, E]: routing is well
    defined under rounding error only where this is far above the logits' error (inf when k = E)."""
    logits = np.asarray(logits, np.float64)
    if k >= logits.shape[-1]:
        return math.inf
    s = -np.sort(-logits, axis=-1)
    return float(np.min(s[:, k - 1] - s[:, k]))


def attention_terms(cfg, S):
    """A gated attention layer's reduction chain: q/k/v projections over the hidden size, q/k RMSNorm and scores
    over head_dim, the softmax-weighted values over S keys, the output projection over Hq·Dh."""
    return cfg.hidden_size + 2 * cfg.head_dim + S + cfg.num_attention_heads * cfg.head_dim


def rule_terms(T, Dk, chunk=64):
    """The delta rule's chain: k·S and q·S over Dk each, a chunk's triangular solve over up to `chunk` rows, and
    the state carried through T updates (each adds its rounding)."""
    return 2 * Dk + chunk + T


def gdn_terms(cfg, T, chunk=64):
    """A Gated DeltaNet layer's chain: in_proj over the hidden size, the conv's taps, the q/k l2norm, the delta
    rule (k·S and q·S over Dk, a chunk's triangular solve, T carried updates), the gated norm over Dv and out_proj
    over Hv·Dv."""
    Dk, Dv, Hv = cfg.linear_key_head_dim, cfg.linear_value_head_dim, cfg.linear_num_value_heads
    return cfg.hidden_size + cfg.linear_conv_kernel_dim + Dk + rule_terms(T, Dk, chunk) + Dv + Hv * Dv


def moe_terms(cfg):
    """An MoE block's chain: the router over the hidden size, an expert's gate/up over H and down over I, the
    weighted sum of k experts and the shared expert."""
    return cfg.hidden_size + max(cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) \
        + cfg.num_experts_per_tok + 1


def model_terms(cfg, S):
    """The whole decoder's chain for an S-token context: the residual stream carries every layer's error, so the
    layers' chains add (two RMSNorms, the mixer, the MoE each), then the final norm and the lm_head over H."""
    H, total = cfg.hidden_size, 2 * cfg.hidden_size
    for kind in cfg.layer_types:
        mixer = attention_terms(cfg, S) if kind == "full_attention" else gdn_terms(cfg, S)
        total += 2 * H + mixer + moe_terms(cfg)
    return total


def greedy_step_logits(model, prompt, tokens, bucket=64):
    """The logits each greedy token was chosen from, by one forward pass over prompt + tokens (teacher forcing):
    row j is the model's distribution after prompt + tokens[:j]. float64 [len(tokens), V]. The ids are padded to a
    multiple of `bucket` (the model is causal, so padding after them changes none of these rows) to share compiles."""
    prompt, tokens = np.asarray(prompt).reshape(-1), np.asarray(tokens).reshape(-1)
    ids = np.concatenate([prompt, tokens])
    ids = np.pad(ids, (0, -len(ids) % bucket))
    logits, _ = model(ids[None].astype(np.int32))
    T = len(prompt)
    return np.asarray(logits[0, T - 1:T - 1 + len(tokens)], np.float64)


def near_tie_tol(step_logits, terms):
    """Two correct float32 evaluations of one step's logits may each err by fp32_tol(scale, terms), so they may
    order two tokens whose logits lie within twice that either way."""
    return 2 * fp32_tol(float(np.max(np.abs(step_logits))), terms)


def assert_same_greedy(actual, expected, logits, terms, *, name="greedy tokens"):
    """Greedy tokens `actual` are the reference's `expected` (chosen from `logits` [>= len(actual), V], see
    greedy_step_logits), up to one near tie: at the first step where they differ, the reference must rate the
    actual token within near_tie_tol of its own choice (a tie that another CPU's rounding may order the other
    way); after it the two continue from different prefixes and are not compared. Any other difference fails.
    Returns the number of leading steps that matched."""
    actual, expected = [int(t) for t in np.asarray(actual).reshape(-1)], np.asarray(expected).reshape(-1)
    assert len(actual) <= len(expected), f"{name}: {len(actual)} tokens, the reference has {len(expected)}"
    for j, tok in enumerate(actual):
        if tok == expected[j]:
            continue
        gap = float(logits[j, expected[j]] - logits[j, tok])
        tol = near_tie_tol(logits[j], terms)
        assert gap <= tol, (f"{name}: step {j} chose {tok}, the reference {int(expected[j])}, whose logit is higher "
                            f"by {gap:.3g} > the near-tie bound {tol:.3g}; tokens {actual} vs {expected.tolist()}")
        return j
    return len(actual)


def assert_no_near_tie(logits, terms, *, name="reference"):
    """The test data has no near tie at these greedy steps (logits [n, V]): the top-2 gap of every step exceeds
    near_tie_tol, so an exact token comparison over them holds on any CPU. A guard on fixed test data (it fails
    the same way everywhere if a seed change lands on a tie), not on the code under test."""
    logits = np.asarray(logits, np.float64)
    top2 = -np.sort(-logits, axis=-1)[:, :2]
    for j, (row, (a, b)) in enumerate(zip(logits, top2)):
        tol = near_tie_tol(row, terms)
        assert a - b > tol, f"{name}: step {j}'s top-2 logits are a near tie ({a - b:.3g} <= {tol:.3g}); reseed"
