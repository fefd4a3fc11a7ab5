"""The packed step input on its own: what the host packs by name, the device unpacks by name."""

import numpy as np

from dcpjax.runner import step_input
from dcpjax.sampling import SamplingParams


def test_pack_then_unpack_gives_every_field_back():
    batch, n, chunk, width, slots = 4, 3, 8, 5, 16
    step = step_input.PackedStep(batch, n, chunk, width, slots)
    step.set("start", [0, 7, 30])
    step.set("count", [8, 1, 3])
    step.set("slot", [2, 0, 9])
    step.set("samples", [0, 1, 1])
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.9, min_p=0.05, presence_penalty=0.5,
                             frequency_penalty=-0.25, repetition_penalty=1.2, min_tokens=3),
              SamplingParams(temperature=0), SamplingParams(top_k=2**40)]
    step.set_request_values(np.stack([step_input.request_values(p, seed, i == 0)
                                      for i, (p, seed) in enumerate(zip(params, [1, 2**32 + 5, 2**31]))]))
    step.set("counter", [0, 4, 9])
    step.set("next", 42, row=0)
    step.tokens[0] = np.arange(8)
    step.block_tables[:n] = np.arange(n * width).reshape(n, width)

    x = step_input.unpack(step.array, chunk)
    f = x.fields
    np.testing.assert_array_equal(x.tokens[0], np.arange(8))
    np.testing.assert_array_equal(x.block_tables[:n], np.arange(n * width).reshape(n, width))
    assert f.start.tolist() == [0, 7, 30, 0] and f.count.tolist() == [8, 1, 3, 0]
    assert f.slot.tolist() == [2, 0, 9, slots]  # the padding row has no slot: its writes are dropped
    assert f.next.tolist() == [42, -1, -1, -1] and f.counter.tolist() == [0, 4, 9, 0]
    np.testing.assert_allclose(f.temperature[:n], [0.7, 0, 1], rtol=1e-7)
    np.testing.assert_allclose([f.top_p[0], f.min_p[0], f.presence[0], f.frequency[0], f.repetition[0]],
                               [0.9, 0.05, 0.5, -0.25, 1.2], rtol=1e-7)
    assert f.top_k[:n].tolist() == [50, 0, 2**31 - 1]  # past the vocabulary: everything kept, same draw
    assert np.asarray(f.seed[:n]).view(np.uint32).tolist() == [1, 5, 2**31]
    assert f.min_tokens[:n].tolist() == [3, 0, 0] and f.uses_state[:n].tolist() == [1, 0, 0]


def test_a_request_is_packed_once_and_dropped_with_it():
    class Seq:
        params, seed, logits_spec = SamplingParams(), 3, None

    cache, seq = step_input.RequestCache(), Seq()
    first = cache.values(seq)
    assert cache.values(seq) is first and len(cache._values) == 1
    del seq
    assert len(cache._values) == 0
