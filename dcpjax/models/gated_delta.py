"""Gated DeltaNet's two sequence ops, on one device's heads: the short causal convolution and the
gated delta rule, each carrying a fixed-size state per sequence (Qwen3-Next's linear attention).

Tokens arrive flat, [N] = the call's B rows x T tokens, each with the slot of its sequence
(`seq_slots`, the engine's slot; `num_slots` for padding) and its position in that sequence. A
sequence's tokens are contiguous. A token at position 0 starts from a zero state; any other
starts from its slot's state, left there by the sequence's previous call.

The delta rule, per value head, with state S [dk, dv], for each token (decay g <= 0, beta in (0, 1)):
    S <- S * exp(g);   S <- S + k (beta (v - S^T k))^T;   out = S^T q
(q and k L2-normalised, q scaled by dk^-0.5). It runs in chunks of C tokens: within a chunk
every token's update is solved at once (a unit lower-triangular system, the UT transform of the
DeltaNet papers), and the state passes from chunk to chunk. A chunk belongs to one sequence:
decode and verify rows are a chunk each (C = T, independent of each other); a packed prefill
call pads each sequence's tokens to a multiple of `CHUNK` (the call builder does), so its
chunks run in order, each continuing its sequence's state or starting the next sequence's.
Padding tokens have beta = 0 and g = 0: they change no state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 16  # tokens a packed prefill call's delta-rule chunk holds (sequences padded to a multiple)


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """x / sqrt(sum(x^2) + eps) over the last axis, in float32 (as the reference kernels)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _same_sequence(seq_slots: jax.Array, lag: int) -> jax.Array:
    """[N] bool: the token `lag` places earlier exists and belongs to the same sequence."""
    earlier = jnp.pad(seq_slots, (lag, 0), constant_values=-1)[: seq_slots.shape[0]]
    return earlier == seq_slots


def causal_conv(x: jax.Array, weight: jax.Array, seq_slots: jax.Array, positions: jax.Array,
                conv_state: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Depthwise causal convolution of kernel K, then SiLU, over each sequence's inputs.

    x [N, C] this call's inputs (C channels); weight [C, K] (tap K - 1 is the current token);
    seq_slots, positions [N]; conv_state [S, C, K - 1]: each slot's last K - 1 inputs, oldest
    first. Returns (y [N, C], conv_state with each sequence of the call's last K - 1 inputs).
    """
    n, taps = x.shape[0], weight.shape[1]
    slots = jnp.clip(seq_slots, 0, conv_state.shape[0] - 1)
    same = [_same_sequence(seq_slots, lag) for lag in range(1, taps)]
    before = sum(s.astype(jnp.int32) for s in same)  # this sequence's earlier tokens in the call (<= K - 1)
    fresh = (positions - before) == 0  # the sequence starts in this call: nothing before it
    values = [x]  # values[lag]: the input `lag` tokens back, from this call or the slot's state
    for lag in range(1, taps):
        shifted = jnp.pad(x, ((lag, 0), (0, 0)))[:n]
        # lag - before tokens before this call's first: the state's entry K - 1 - (lag - before)
        column = jnp.clip(taps - 1 - (lag - before), 0, taps - 2)
        stored = jnp.take_along_axis(conv_state[slots], column[:, None, None], axis=2)[..., 0]
        values.append(jnp.where(same[lag - 1][:, None], shifted, jnp.where(fresh[:, None], 0.0, stored)))
    # products summed in float32 (bfloat16 inputs), as the reference kernels accumulate
    y = sum(values[lag].astype(jnp.float32) * weight[:, taps - 1 - lag].astype(jnp.float32) for lag in range(taps))
    # a sequence's last token (valid, and the next token is another sequence's) leaves the state
    last = (seq_slots < conv_state.shape[0]) & ~jnp.concatenate([_same_sequence(seq_slots, 1)[1:], jnp.zeros(1, bool)])
    new = jnp.stack([values[taps - 2 - j] for j in range(taps - 1)], axis=-1)  # [N, C, K - 1], oldest first
    conv_state = conv_state.at[jnp.where(last, seq_slots, conv_state.shape[0])].set(
        new.astype(conv_state.dtype), mode="drop")
    return jax.nn.silu(y).astype(x.dtype), conv_state


def _chunk(state, q, k, v, g, beta):
    """One chunk of one sequence: q, k [C, H, dk], v [C, H, dv], g, beta [C, H] float32 and the
    state [H, dk, dv] before it -> (out [C, H, dv], the state after it)."""
    c = q.shape[0]
    q, k, v, g, beta = (jnp.moveaxis(x, 0, 1) for x in (q, k, v, g, beta))  # heads first
    cum = jnp.cumsum(g, axis=-1)  # [H, C]: log decay from the chunk's start
    lower = jnp.tril(jnp.ones((c, c), bool))
    decay = jnp.where(lower, jnp.exp(jnp.where(lower, cum[:, :, None] - cum[:, None, :], 0.0)), 0.0)  # [H, C, C]
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # the UT transform: (I + strictly_lower(beta k k^T decay)) [u, w] = [v beta, k beta exp(cum)]
    system = jnp.einsum("hid,hjd->hij", k_beta, k) * decay
    solve = lambda rhs: jax.lax.linalg.triangular_solve(system, rhs, left_side=True, lower=True, unit_diagonal=True)
    u, w = solve(v_beta), solve(k_beta * jnp.exp(cum)[..., None])
    v_new = u - jnp.einsum("hcd,hde->hce", w, state)  # each token's correction to what the state predicts
    attend = jnp.einsum("hid,hjd->hij", q, k) * decay
    out = jnp.einsum("hcd,hde->hce", q * jnp.exp(cum)[..., None], state) + jnp.einsum("hij,hje->hie", attend, v_new)
    k_to_end = k * jnp.exp(cum[:, -1:] - cum)[..., None]
    state = state * jnp.exp(cum[:, -1])[:, None, None] + jnp.einsum("hcd,hce->hde", k_to_end, v_new)
    return jnp.moveaxis(out, 0, 1), state


def gated_delta_rule(q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array,
                     seq_slots: jax.Array, positions: jax.Array, state: jax.Array, *,
                     chunk: int, independent: bool) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over a call's tokens in chunks of `chunk` (see the module docstring).

    q, k [N, H, dk] (L2-normalised here; q also scaled), v [N, H, dv], g, beta [N, H], with H the
    device's value heads (q and k already repeated to them); seq_slots, positions [N]; state
    [S, H, dk, dv] float32 per slot. independent: every chunk is a whole sequence's tokens (decode,
    verify rows); else chunks run in order, a sequence's state passing from one to the next.
    Returns (out [N, H, dv] float32, state).
    """
    n, heads, dk = q.shape
    valid = (seq_slots < state.shape[0])[:, None]
    q = l2_normalize(q) * dk**-0.5
    k = jnp.where(valid[..., None], l2_normalize(k), 0.0)
    g = jnp.where(valid, g.astype(jnp.float32), 0.0)  # padding: no decay, no update
    beta = jnp.where(valid, beta.astype(jnp.float32), 0.0)
    m = n // chunk
    split = lambda x: x.reshape(m, chunk, *x.shape[1:])
    q, k, v, g, beta = split(q), split(k), split(v.astype(jnp.float32)), split(g), split(beta)
    slot = seq_slots[::chunk]  # each chunk's sequence (its first token; padding chunks: S)
    first_of_sequence = jnp.concatenate([jnp.ones(1, bool), slot[1:] != slot[:-1]])
    last_of_sequence = jnp.concatenate([slot[1:] != slot[:-1], jnp.ones(1, bool)])
    fresh = positions[::chunk] == 0
    stored = state[jnp.clip(slot, 0, state.shape[0] - 1)]
    initial = jnp.where(fresh[:, None, None, None], 0.0, stored)  # [M, H, dk, dv]
    if independent:
        out, final = jax.vmap(_chunk)(initial, q, k, v, g, beta)
    else:
        def step(carried, xs):
            start, first, qc, kc, vc, gc, bc = xs
            out, after = _chunk(jnp.where(first, start, carried), qc, kc, vc, gc, bc)
            return after, (out, after)

        _, (out, final) = jax.lax.scan(step, jnp.zeros_like(initial[0]), (initial, first_of_sequence, q, k, v, g,
                                                                            beta))
    state = state.at[jnp.where(last_of_sequence, slot, state.shape[0])].set(final, mode="drop")
    return out.reshape(n, heads, -1), state
