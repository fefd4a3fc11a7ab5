"""The oracles for tests and the demo, in float64 numpy: single-device decode attention, and
Gated DeltaNet's causal convolution and gated delta rule token by token.

Independent of every jax code path (no jnp, no sharding), so agreement with it
is evidence, not self-consistency.
"""

from __future__ import annotations

import numpy as np


def attention_f64(q, k, v, lengths, sm_scale: float | None = None, window: int | None = None,
                  softcap: float | None = None, visible=None):
    """q [B, Hq, dk], k [B, S, Hkv, dk], v [B, S, Hkv, dv], lengths [B]
    -> out [B, Hq, dv], lse [B, Hq] in float64; an empty sequence gives 0 and -inf.
    window: the query (at position length - 1) sees only the last `window` positions;
    softcap: scaled scores become softcap * tanh(score / softcap) (Gemma 2);
    visible: optional [B, S] bool, the positions the query may see at all (sparse attention)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    _, q_heads, dk = q.shape
    seq, kv_heads = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(dk) if sm_scale is None else sm_scale
    head_of = np.arange(q_heads) // (q_heads // kv_heads)  # the KV head each q head reads
    scores = np.einsum("bhd,bshd->bhs", q, k[:, :, head_of]) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    index, lengths = np.arange(seq)[None, None, :], np.asarray(lengths)[:, None, None]
    valid = index < lengths
    if window is not None:
        valid &= index >= lengths - window
    if visible is not None:
        valid &= np.asarray(visible, bool)[:, None, :]
    scores = np.where(valid, scores, -np.inf)
    peak = scores.max(axis=-1, keepdims=True)
    peak = np.where(np.isfinite(peak), peak, 0.0)
    weights = np.exp(scores - peak)
    total = weights.sum(axis=-1)
    out = np.einsum("bhs,bshd->bhd", weights, v[:, :, head_of]) / np.where(total > 0, total, 1.0)[..., None]
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, peak[..., 0] + np.log(total), -np.inf)
    return out, lse


def index_scores_f64(q, weights, keys, lengths, scale: float):
    """The lightning indexer in float64: q [B, Hi, d], weights [B, Hi], keys [B, S, d], lengths [B]
    -> [B, S] scores sum_h w_h relu(q_h . k_s * scale), -inf at positions >= length."""
    q, weights, keys = (np.asarray(x, np.float64) for x in (q, weights, keys))
    scores = np.einsum("bh,bhs->bs", weights, np.maximum(np.einsum("bhd,bsd->bhs", q, keys) * scale, 0.0))
    return np.where(np.arange(keys.shape[1])[None] < np.asarray(lengths)[:, None], scores, -np.inf)


def top_k_f64(scores, k: int):
    """[B, S] scores -> [B, k] positions of the k best, best first; ties to the lowest position; -1
    where fewer than k positions have a finite score (those are all selected)."""
    scores = np.asarray(scores, np.float64)
    out = np.full((scores.shape[0], k), -1, np.int64)
    for b, row in enumerate(scores):
        order = np.lexsort((np.arange(len(row)), -row))  # by score descending, then position
        best = [p for p in order[:k] if np.isfinite(row[p])]
        out[b, : len(best)] = best
    return out


def causal_conv_f64(x, weight):
    """One sequence from its start: x [T, C], weight [C, K] -> silu(sum_i w[:, i] x[t - K + 1 + i])."""
    x, weight = np.asarray(x, np.float64), np.asarray(weight, np.float64)
    taps = weight.shape[1]
    padded = np.concatenate([np.zeros((taps - 1, x.shape[1])), x])
    y = sum(padded[i : i + len(x)] * weight[:, i] for i in range(taps))
    return y / (1 + np.exp(-y))


def gated_delta_f64(q, k, v, g, beta):
    """One sequence from a zero state, token by token: q, k [T, H, dk], v [T, H, dv], g, beta [T, H]
    -> out [T, H, dv] (q and k L2-normalised, q scaled by dk^-0.5), as the recurrent reference."""
    q, k, v, g, beta = (np.asarray(a, np.float64) for a in (q, k, v, g, beta))
    norm = lambda a: a / np.sqrt((a * a).sum(-1, keepdims=True) + 1e-6)
    q, k = norm(q) * q.shape[-1] ** -0.5, norm(k)
    state = np.zeros((q.shape[1], q.shape[2], v.shape[2]))
    out = np.zeros(v.shape)
    for t in range(len(q)):
        state = state * np.exp(g[t])[:, None, None]
        delta = (v[t] - np.einsum("hde,hd->he", state, k[t])) * beta[t][:, None]
        state = state + k[t][:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hde,hd->he", state, q[t])
    return out


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
