"""Gated DeltaNet's ops against the float64 token-by-token oracle, across calls that carry each
sequence's state: a packed prefill call (sequences padded to whole chunks), then verify-style and
decode rows, as the engine runs them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dcpjax.kernels.oracle import causal_conv_f64, gated_delta_f64
from dcpjax.models.gated_delta import CHUNK, causal_conv, gated_delta_rule

SLOTS, HEADS, DK, DV, CHANNELS, TAPS = 4, 3, 8, 5, 6, 4
# sequence -> (slot, tokens computed by each call); calls: packed prefill, rows of 2, rows of 1
PLAN = {"a": (0, [18, 2, 1]), "b": (2, [5, 1, 0]), "c": (3, [1, 0, 0]), "d": (1, [2, 0, 1])}


def sequence_inputs(rng, length):
    return dict(x=rng.standard_normal((length, CHANNELS)), q=rng.standard_normal((length, HEADS, DK)),
                k=rng.standard_normal((length, HEADS, DK)), v=rng.standard_normal((length, HEADS, DV)),
                g=-np.log1p(np.exp(rng.standard_normal((length, HEADS)))),  # -softplus: <= 0
                beta=1 / (1 + np.exp(-rng.standard_normal((length, HEADS)))))


def layout_call(inputs, call: int, packed: bool, width: int):
    """The flat tokens of one call: per sequence its part, padded to whole chunks (packed) or to a
    row of `width` (rows); returns arrays, seq_slots, positions and where each part landed."""
    parts, at = [], 0
    for name, (slot, counts) in PLAN.items():
        start, count = sum(counts[:call]), counts[call]
        if count:
            room = -(-count // CHUNK) * CHUNK if packed else width
            parts.append((name, slot, start, count, at))
            at += room
        elif not packed:
            at += width  # a padding row
    total = -(-at // CHUNK) * CHUNK + (CHUNK if packed else 0)  # a padding chunk at the tail too
    seq_slots = np.full(total, SLOTS, np.int32)
    positions = np.zeros(total, np.int32)
    arrays = {key: np.zeros((total, *inputs["a"][key].shape[1:])) for key in inputs["a"]}
    for name, slot, start, count, offset in parts:
        seq_slots[offset : offset + count] = slot
        positions[offset : offset + count] = np.arange(start, start + count)
        for key, values in arrays.items():
            values[offset : offset + count] = inputs[name][key][start : start + count]
    return arrays, seq_slots, positions, parts


def test_packed_then_rows_calls_match_the_oracle():
    rng = np.random.default_rng(0)
    lengths = {name: sum(counts) for name, (_, counts) in PLAN.items()}
    inputs = {name: sequence_inputs(rng, n) for name, n in lengths.items()}
    weight = rng.standard_normal((CHANNELS, TAPS))
    conv_state = jnp.full((SLOTS, CHANNELS, TAPS - 1), 7.0)  # stale values from an earlier owner: never read
    state = jnp.full((SLOTS, HEADS, DK, DV), 3.0)
    got = {name: {"conv": [], "delta": []} for name in PLAN}
    for call, (packed, width) in enumerate([(True, 0), (False, 2), (False, 1)]):
        arrays, seq_slots, positions, parts = layout_call(inputs, call, packed, width)
        f32 = lambda a: jnp.asarray(a, jnp.float32)
        y, conv_state = causal_conv(f32(arrays["x"]), f32(weight), jnp.asarray(seq_slots), jnp.asarray(positions),
                                    conv_state)
        out, state = gated_delta_rule(*(f32(arrays[key]) for key in ("q", "k", "v", "g", "beta")),
                                      jnp.asarray(seq_slots), jnp.asarray(positions), state,
                                      chunk=CHUNK if packed else width, independent=not packed)
        for name, _, _, count, offset in parts:
            got[name]["conv"].append(np.asarray(y)[offset : offset + count])
            got[name]["delta"].append(np.asarray(out)[offset : offset + count])
    for name, seq in inputs.items():
        np.testing.assert_allclose(np.concatenate(got[name]["conv"]), causal_conv_f64(seq["x"], weight),
                                   rtol=1e-5, atol=1e-5, err_msg=name)
        want = gated_delta_f64(seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"])
        np.testing.assert_allclose(np.concatenate(got[name]["delta"]), want, rtol=1e-4, atol=1e-4, err_msg=name)


@pytest.mark.parametrize("chunk", [1, 4, 16])
def test_chunk_size_does_not_change_the_result(chunk):
    """One 32-token sequence in chunks of 1, 4 or 16: the UT transform equals the recurrence."""
    rng = np.random.default_rng(1)
    seq = sequence_inputs(rng, 32)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    out, state = gated_delta_rule(*(f32(seq[key]) for key in ("q", "k", "v", "g", "beta")),
                                  jnp.zeros(32, jnp.int32), jnp.arange(32, dtype=jnp.int32),
                                  jnp.zeros((1, HEADS, DK, DV)), chunk=chunk, independent=False)
    want = gated_delta_f64(seq["q"], seq["k"], seq["v"], seq["g"], seq["beta"])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)
    assert np.isfinite(np.asarray(state)).all()


def test_jit_and_padding_change_nothing():
    """A padding token (slot S) writes no state; the ops trace under jit."""
    rng = np.random.default_rng(2)
    seq = sequence_inputs(rng, 4)
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    args = [f32(seq[key]) for key in ("q", "k", "v", "g", "beta")]
    state = jnp.ones((SLOTS, HEADS, DK, DV))
    run = jax.jit(gated_delta_rule, static_argnames=("chunk", "independent"))
    _, after = run(*args, jnp.full(4, SLOTS, jnp.int32), jnp.zeros(4, jnp.int32), state, chunk=4, independent=True)
    np.testing.assert_array_equal(np.asarray(after), np.asarray(state))
