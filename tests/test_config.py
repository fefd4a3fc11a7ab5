import pytest

from dcpjax import ParallelConfig


def test_defaults_and_frozen():
    pc = ParallelConfig()
    assert (pc.tp, pc.dcp, pc.interleave, pc.dcp_comm_backend) == (1, 1, 1, "ag_rs")
    with pytest.raises(AttributeError):  # dataclasses.FrozenInstanceError
        pc.tensor_parallel_size = 2


@pytest.mark.parametrize(
    "kwargs, rule",
    [
        (dict(tensor_parallel_size=8, decode_context_parallel_size=3),
         "tensor_parallel_size % decode_context_parallel_size"),
        (dict(tensor_parallel_size=6, decode_context_parallel_size=4),
         "valid decode_context_parallel_size for tensor_parallel_size=6 (before a model's own rules): [1, 2, 3, 6]"),
        (dict(cp_kv_cache_interleave_size=0), "cp_kv_cache_interleave_size must be an integer >= 1"),
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1"),
        (dict(dcp_comm_backend="nccl"), "dcp_comm_backend must be one of"),
        (dict(tensor_parallel_size=4, dcp_comm_backend="a2a"), 'a2a" needs decode_context_parallel_size > 1'),
    ],
)
def test_construction_and_size_rules(kwargs, rule):
    """Types at construction; the sizes' own rules at `check` (a mesh calls it), where the valid
    sizes listed are those of the same rules (a model's narrow them further: `validate`)."""
    with pytest.raises(ValueError) as err:
        ParallelConfig(**kwargs).check()
    assert rule in str(err.value)


def test_sizes_listed_are_those_the_model_allows():
    """TP 9 / DCP 2 on 9 query heads and 3 KV heads (SmolLM2): DCP must divide TP, and of the
    divisors 1, 3, 9 only 1 and 3 keep the model's rules."""
    pc = ParallelConfig(9, 2)
    with pytest.raises(ValueError, match=r"9 % 2 = 1 .* valid decode_context_parallel_size for "
                                         r"tensor_parallel_size=9: \[1, 3\]\."):
        pc.validate(9, 3)
    assert ParallelConfig(9).valid_dcp_sizes(9, 3) == [1, 3] and ParallelConfig.valid_tp_sizes(9, 3) == [1, 3, 9]
    with pytest.raises(ValueError, match=r"the model allows tensor_parallel_size \[1, 3, 9\]"):
        ParallelConfig(4).validate(9, 3)


@pytest.mark.parametrize(
    "tp, dcp, q, kv, mla",
    [
        (8, 2, 64, 4, False),  # Qwen3-235B-A22B
        (8, 8, 128, 1, True),  # DeepSeek-V3
        (8, 8, 64, 1, False),  # MQA
        (8, 1, 32, 8, False),  # MHA-like, no DCP
        (16, 2, 64, 8, False),  # Llama-3.1-70B on two hosts
        (4, 4, 12, 1, False),  # non power-of-two heads
        (8, 4, 24, 2, False),
    ],
)
def test_valid_models(tp, dcp, q, kv, mla):
    ParallelConfig(tp, dcp).validate(q, kv, use_mla=mla)


@pytest.mark.parametrize(
    "tp, dcp, q, kv, mla, rule, valid",
    [
        (8, 4, 64, 4, False, "decode_context_parallel_size <= tensor_parallel_size // num_kv_heads", "[1, 2]"),
        (4, 2, 8, 8, False, "tensor_parallel_size > num_kv_heads", "[1]"),
        (8, 2, 24, 8, False, "tensor_parallel_size > num_kv_heads", "[1]"),
        (8, 4, 20, 1, False, "num_attention_heads % tensor_parallel_size", "no decode_context_parallel_size works"),
        (8, 4, 36, 4, False, "num_attention_heads % tensor_parallel_size", "no decode_context_parallel_size"),
        (6, 2, 6, 2, False, "(num_attention_heads // num_kv_heads) % decode_context_parallel_size", "[1, 3]"),
        (6, 2, 12, 2, False, "KV heads split evenly over the TP // DCP = 3", "[1, 3]"),
        (4, 1, 12, 3, False, "KV heads split evenly over the TP // DCP = 4", "[]"),
        (8, 8, 12, 1, True, "num_attention_heads % tensor_parallel_size", "no decode"),
        (8, 2, 64, 6, False, "num_attention_heads % num_kv_heads", "no decode"),
    ],
)
def test_invalid_models_name_rule_and_valid_sizes(tp, dcp, q, kv, mla, rule, valid):
    with pytest.raises(ValueError) as err:
        ParallelConfig(tp, dcp).validate(q, kv, use_mla=mla)
    message = str(err.value)
    assert rule in message
    assert f"tensor_parallel_size={tp}" in message
    if valid.startswith("["):
        if valid != "[]":
            assert f"for tensor_parallel_size={tp}: {valid}" in message
    else:
        assert valid in message


def test_mla_counts_as_one_kv_head():
    # MLA's num_kv_heads is ignored: DCP 8 at TP 8 is valid whatever it says.
    ParallelConfig(8, 8).validate(128, 128, use_mla=True)
    assert ParallelConfig(8, 1).valid_dcp_sizes(128, 128, use_mla=True) == [1, 2, 4, 8]
    assert ParallelConfig(8, 1).valid_dcp_sizes(64, 4) == [1, 2]
