"""The flat call input on its own: what the host packs by name, the device unpacks by name; what the
runner keeps of each request from the scheduler's messages."""

import numpy as np
import pytest

from dcpjax.runner import step_input
from dcpjax.runner.messages import NewRequestData, ScheduledCall
from dcpjax.runner.request_states import RequestStates
from dcpjax.runner.step_input import CallShape
from dcpjax.sampling import SamplingParams


def test_pack_then_unpack_gives_every_field_back():
    shape, n, slots = CallShape("decode", 4, 1, 5, 4), 3, 16
    call = step_input.PackedCall(shape, n, slots)
    call.tokens("tokens")[:n, 0] = [7, 8, 9]
    call.tokens("positions")[:n, 0] = [0, 7, 30]
    call.tokens("from_slot")[1, 0] = 0
    call.set("sample_at", [0, 1, 2])
    call.set("count", [1, 1, 1])
    call.set("slot", [2, 0, 9])
    call.set("samples", [0, 1, 1])
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                             frequency_penalty=-0.25, repetition_penalty=1.2, min_tokens=3, logprobs=2),
              SamplingParams(temperature=0), SamplingParams(top_k=2**40)]
    call.set_request_values(np.stack([step_input.request_values(p, seed, i == 0)
                                      for i, (p, seed) in enumerate(zip(params, [1, 2**32 + 5, 2**31]))]))
    call.set("counter", [0, 4, 9])
    call.block_tables[0, :n] = np.arange(n * 5).reshape(n, 5)

    x = step_input.unpack(call.array, shape)
    f = x.fields
    assert x.tokens[:, 0].tolist() == [7, 8, 9, 0] and x.positions[:, 0].tolist() == [0, 7, 30, -1]  # -1: padding
    assert x.from_slot[:, 0].tolist() == [-1, 0, -1, -1] and x.page_offsets is None and x.targets is None
    np.testing.assert_array_equal(x.block_tables[0, :n], np.arange(n * 5).reshape(n, 5))
    assert f.count.tolist() == [1, 1, 1, 0] and f.sample_at.tolist() == [0, 1, 2, 0]
    assert f.slot.tolist() == [2, 0, 9, slots]  # the padding row has no slot: its writes are dropped
    assert f.counter.tolist() == [0, 4, 9, 0] and f.wants_logprobs[:n].tolist() == [1, 0, 0]
    np.testing.assert_allclose(f.temperature[:n], [0.7, 0, 1], rtol=1e-7)
    np.testing.assert_allclose([f.top_p[0], f.min_p[0], f.presence[0], f.frequency[0], f.repetition[0]],
                               [0.9, 0.05, 0.5, -0.25, 1.2], rtol=1e-7)
    assert f.top_k[:n].tolist() == [50, 0, 2**31 - 1]  # past the vocabulary: everything kept, same draw
    assert np.asarray(f.seed[:n]).view(np.uint32).tolist() == [1, 5, 2**31]
    assert f.min_tokens[:n].tolist() == [3, 0, 0] and f.uses_state[:n].tolist() == [1, 0, 0]


def test_a_packed_call_carries_page_offsets_and_prompt_targets():
    shape = CallShape("prompt", 1, 8, 6, 4)
    assert shape.packed and shape.token_arrays == ("tokens", "positions", "from_slot", "seq_slots", "page_offsets",
                                                   "targets")
    call = step_input.PackedCall(shape, 2, 16)
    call.tokens("tokens")[0, :5] = [1, 2, 3, 4, 5]
    call.tokens("page_offsets")[0, 3:5] = 2
    call.tokens("targets")[0, :2] = [2, 3]
    call.block_tables[0, 0, :3] = [11, 12, 13]
    call.set("sample_at", [2, 4])
    x = step_input.unpack(call.array, shape)
    assert x.tokens.shape == (1, 8) and x.page_offsets[0].tolist() == [0, 0, 0, 2, 2, 0, 0, 0]
    assert x.targets[0].tolist() == [2, 3, -1, -1, -1, -1, -1, -1]
    assert x.block_tables[0, 0].tolist() == [11, 12, 13, 0, 0, 0] and x.fields.sample_at.tolist() == [2, 4, 0, 0]
    assert x.seq_slots[0].tolist() == [16] * 8  # no token set: every one padding
    assert call.array.size == shape.size == 6 * 8 + 6 + 4 * len(step_input.FIELDS)


def test_the_runner_keeps_requests_by_id_from_the_schedulers_messages():
    """New requests are learnt, finished ones forgotten first (an id may come back as a new request),
    and a chunk of a request the runner was never told of is a clear error."""
    states = RequestStates()
    new = lambda rid, temperature: NewRequestData(rid, SamplingParams(temperature=temperature), 3)
    states.update(ScheduledCall((), np.zeros((0, 0), np.int32), (new("a", 0.5), new("b", 0.0))))
    assert len(states) == 2
    np.testing.assert_array_equal(states["a"].values, step_input.request_values(SamplingParams(temperature=0.5), 3,
                                                                                False))
    states.update(ScheduledCall((), np.zeros((0, 0), np.int32), (new("a", 1.0),),
                                finished_request_ids=frozenset({"a", "b"})))
    assert len(states) == 1 and states["a"].data.params.temperature == 1.0
    with pytest.raises(KeyError, match="never told of request 'b'"):
        states["b"]
