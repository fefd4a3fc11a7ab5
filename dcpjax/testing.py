"""The oracle for tests and the demo: single-device decode attention in float64 numpy.

Independent of every jax code path (no jnp, no sharding), so agreement with it
is evidence, not self-consistency.
"""

from __future__ import annotations

import numpy as np


def attention_f64(q, k, v, lengths, sm_scale: float | None = None):
    """q [B, Hq, dk], k [B, S, Hkv, dk], v [B, S, Hkv, dv], lengths [B]
    -> out [B, Hq, dv], lse [B, Hq] in float64; an empty sequence gives 0 and -inf."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, q_heads, dk = q.shape
    seq, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(dk) if sm_scale is None else sm_scale
    head_of = np.arange(q_heads) // (q_heads // kv_heads)  # the KV head each q head reads
    scores = np.einsum("bhd,bshd->bhs", q, k[:, :, head_of]) * scale
    valid = np.arange(seq)[None, None, :] < np.asarray(lengths)[:, None, None]
    scores = np.where(valid, scores, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(scores - peak)
    total = weights.sum(axis=-1)
    out = np.einsum("bhs,bshd->bhd", weights, v[:, :, head_of]) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, peak[..., 0] + np.log(total), -np.inf)
    return out, lse


def assert_close_to_oracle(out, lse, want_out, want_lse, atol: float, rtol: float = 0.0) -> None:
    """out and lse within tolerance of the oracle, no NaN, -inf exactly where the oracle has it."""
    out, lse = np.asarray(out, np.float64), np.asarray(lse, np.float64)
    assert not np.isnan(out).any() and not np.isnan(lse).any(), "NaN in out or lse"
    np.testing.assert_allclose(out, want_out, atol=atol, rtol=rtol)
    empty = np.isneginf(want_lse)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    np.testing.assert_allclose(lse[~empty], want_lse[~empty], atol=atol, rtol=rtol)


def assert_same_generations(got, want, logprob_tol: float = 1e-4) -> None:
    """Two runs' `RequestOutput`s: identical tokens, and each token's logprobs (the returned top
    ones included) within `logprob_tol` (runs that split the work differently sum in another order)."""
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (a.request_id, b.request_id)
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert x.keys() == y.keys()
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) <= logprob_tol
