"""DeepSeek-V3.2's and GLM-5's sparse attention in the engine: what the parity tests (test_hf_parity.py)
do not show.

The fixture's selection matters (the same weights attending densely give other tokens), the indexer
keys take their bytes in the cache, GLM-5's indexer layout is read from its config, and a config the
indexer cannot run is refused by name.
"""

import json
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_parity import check_against_transformers, check_prompt_logprobs

import dcpjax
from dcpjax.models.config import ModelConfig
from dcpjax.runner.kv_layout import kv_block_layout
from dcpjax.sharding.config import ParallelConfig

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "deepseek-v32"
GLM5 = FIXTURE.parent / "glm-5"

# Against transformers (tests/fixtures/make_hf_fixtures.py, make_fp8_fixtures.py: a top-k of 16, prompts of 1, 15,
# 17 and 64 tokens + 20 new ones, every top-k row with a clear gap at the k-th score): greedy identical, top-5
# logprobs within 1e-3, at the layouts the issue names, both merges, interleave 1 and 2, both kernels; a case other
# cases cover runs on one Python (e2e: the newest jax; oldest_jax: the oldest). Here, not in test_hf_parity.py, so
# that CI's workers (one file each) run them beside that file's cases.
newest, oldest = pytest.mark.e2e, pytest.mark.oldest_jax
PARITY = [
    ("deepseek-v32", 1, 1, 1, "ag_rs", "reference"),
    ("deepseek-v32", 8, 8, 1, "ag_rs", "reference"),
    pytest.param("deepseek-v32", 8, 4, 2, "a2a", "reference", marks=oldest),
    pytest.param("deepseek-v32", 4, 2, 1, "ag_rs", "reference", marks=newest),
    pytest.param("deepseek-v32", 8, 8, 2, "a2a", "pallas", marks=oldest),
    pytest.param("deepseek-v32", 4, 2, 1, "a2a", "pallas", marks=newest),
    # GLM-5: the indexer's RoPE interleaved, a "shared" layer attending with the previous layer's top-k
    ("glm-5", 1, 1, 1, "ag_rs", "reference"),
    pytest.param("glm-5", 8, 8, 1, "ag_rs", "pallas", marks=newest),
    pytest.param("glm-5", 8, 4, 2, "a2a", "reference", marks=oldest),
    pytest.param("glm-5", 4, 2, 1, "ag_rs", "reference", marks=oldest),
    # as DeepSeek-V3.2 ships: fp8 in [16, 24] blocks, the indexer's wq_b and wk too
    ("deepseek-v32-fp8", 1, 1, 1, "ag_rs", "reference"),
    pytest.param("deepseek-v32-fp8", 8, 4, 2, "a2a", "reference", marks=newest),
]


@pytest.mark.parametrize("name, tp, dcp, interleave, comm, backend", PARITY)
def test_greedy_tokens_and_logprobs_match_transformers(name, tp, dcp, interleave, comm, backend):
    check_against_transformers(name, tp, dcp, interleave, comm, backend)


def test_prompt_logprobs_match_transformers():
    """Prefill rows select too: each prompt position's logprobs, from the packed prefill chunks."""
    check_prompt_logprobs("deepseek-v32", 8, 4, 1, "a2a")


def test_expert_parallel_matches_transformers():
    """The routed experts whole on their devices, as for DeepSeek-V3."""
    check_against_transformers("glm-5", 8, 2, 2, "ag_rs", "reference", enable_expert_parallel=True)


def _greedy(folder, **engine):
    expected = json.loads((FIXTURE / "expected.json").read_text())["cases"]
    llm = dcpjax.LLM(str(folder), block_size=4, max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20, **engine)
    outputs = llm.generate([{"prompt_token_ids": c["prompt"]} for c in expected],
                           dcpjax.SamplingParams(temperature=0, max_tokens=20))
    return [o.outputs[0].token_ids for o in outputs], [c["greedy"] for c in expected]


def test_the_selection_matters(tmp_path):
    """With a top-k past every prompt the same checkpoint attends densely: its tokens equal transformers'
    sparse ones while a row sees at most 16 positions, and part from them after."""
    folder = tmp_path / "dense"
    shutil.copytree(FIXTURE, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"index_topk": 4096}))
    got, want = _greedy(folder)
    # one token of prompt: token i comes from a row that sees 1 + i positions, all of them while 1 + i <= 16
    assert got[0][:16] == want[0][:16] and got[0] != want[0]
    assert got[-1] != want[-1]  # 64 tokens: the top 16 of 64 is not all of them


def test_a_cached_prefix_brings_its_indexer_keys():
    """Prefix caching: the second run of the 64-token prompt takes its cached blocks (latents and indexer
    keys together) and still gives transformers' tokens."""
    case = json.loads((FIXTURE / "expected.json").read_text())["cases"][-1]
    llm = dcpjax.LLM(str(FIXTURE), tensor_parallel_size=4, decode_context_parallel_size=2, block_size=4,
                     max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20, enable_prefix_caching=True)
    params = dcpjax.SamplingParams(temperature=0, max_tokens=20)
    first, second = (llm.generate([{"prompt_token_ids": case["prompt"]}], params)[0] for _ in range(2))
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == case["greedy"]
    assert second.num_cached_tokens >= 56  # whole virtual blocks of 8 positions


def test_the_indexer_keys_sit_beside_the_latent():
    cfg = ModelConfig.from_pretrained(FIXTURE)
    assert cfg.use_sparse_attention and (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (16, 16, 16)
    assert not cfg.index_rope_interleave  # V3.2's indexer rotates halves
    layout = kv_block_layout(cfg, ParallelConfig(8, 8), block_size=4, dtype="float32")
    assert layout.pool_names == ("k", "index_k") and layout.pool_dims == (cfg.latent_dim, 16)
    # per token and layer: the latent (32 + 8) and the key (16), float32
    assert layout.bytes_per_block_per_device(1, 1) == 4 * (40 + 16) * 4
    fp8 = kv_block_layout(cfg, ParallelConfig(8, 8), block_size=4, dtype="float8_e4m3fn")
    assert fp8.bytes_per_block_per_device(1, 1) == 4 * ((40 + 16) + 2 * 4)  # each with its own float32 scale


@pytest.mark.parametrize("change, message", [
    ({"index_topk": 0}, "needs positive index_topk, index_n_heads and index_head_dim"),
    ({"index_n_heads": None}, "needs positive index_topk, index_n_heads and index_head_dim"),
    ({"q_lora_rank": None}, "needs q_lora_rank"),
    ({"index_head_dim": 4}, r"index_head_dim \(4\) must hold the qk_rope_head_dim \(8\)"),
])
def test_a_config_the_indexer_cannot_run_is_refused(change, message):
    config = json.loads((FIXTURE / "config.json").read_text()) | change
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_hf(config)


@pytest.mark.e2e  # newest jax only (fp8 KV: tests/test_llm.py on both)
def test_fp8_kv_cache_holds_the_indexer_keys_quantized():
    """An fp8 KV cache quantizes the indexer keys too, each token with its own float32 scale: the first
    layer's keys (which depend on the embeddings alone) as the kernels read them equal a float cache's
    to fp8's precision, in the same slots."""
    prompt = json.loads((FIXTURE / "expected.json").read_text())["cases"][-1]["prompt"]
    pools = []
    for dtype in ("auto", "fp8"):
        llm = dcpjax.LLM(str(FIXTURE), tensor_parallel_size=4, decode_context_parallel_size=2, block_size=4,
                         max_num_batched_tokens=64, kv_cache_memory_bytes=8 << 20, kv_cache_dtype=dtype)
        llm.generate([{"prompt_token_ids": prompt}], dcpjax.SamplingParams(temperature=0, max_tokens=2))
        pools.append(llm.runner.kv_caches[0])
    exact, fp8 = pools
    assert fp8.index_k.dtype == jnp.float8_e4m3fn and fp8.index_k_scale.shape == fp8.index_k.shape[:3]
    by_rank = lambda x: x.reshape(x.shape[0], 2, -1, *x.shape[2:])[:, :, :16]  # each DCP rank's first blocks
    want = by_rank(np.asarray(exact.index_k, np.float32))
    got = by_rank(np.asarray(fp8.index_k.astype(jnp.float32)) * np.asarray(fp8.index_k_scale)[..., None])
    assert np.any(want != 0) and np.array_equal(got == 0, want == 0)
    np.testing.assert_allclose(got, want, rtol=0, atol=0.07 * np.abs(want).max())


def test_glm5_reads_its_shared_layers_and_interleaved_indexer():
    cfg = ModelConfig.from_pretrained(GLM5)
    assert cfg.index_shared_layers == (2,) and cfg.index_rope_interleave and cfg.rope_interleave
    config = json.loads((GLM5 / "config.json").read_text())
    del config["indexer_types"]
    assert ModelConfig.from_hf(config | {"index_topk_pattern": "FSF"}).index_shared_layers == (1,)
    # transformers' schedule: every index_topk_freq-th layer from index_skip_topk_offset runs its indexer
    assert ModelConfig.from_hf(config | {"index_topk_freq": 2, "index_skip_topk_offset": 1}).index_shared_layers == (1,)
    assert ModelConfig.from_hf(config).index_shared_layers == ()  # the default: every layer its own indexer
    with pytest.raises(ValueError, match="indexer_types must name each of the 3 layers 'full' or 'shared', the first"):
        ModelConfig.from_hf(config | {"indexer_types": ["shared", "full", "full"]})


def test_the_built_in_tiny_model_runs_sparse_at_dcp_8():
    """`tiny-deepseek-v32` (random weights, top-k 16): a 40-token prompt at TP 8 / DCP 8 selects (more
    positions than the top-k on every rank's share) and decodes to the end."""
    llm = dcpjax.LLM("tiny-deepseek-v32", tensor_parallel_size=8, decode_context_parallel_size=8, block_size=4,
                     kv_cache_memory_bytes=8 << 20)
    assert llm.model_config.use_sparse_attention and llm.model_config.index_topk == 16
    out = llm.generate([{"prompt_token_ids": list(range(3, 43))}], dcpjax.SamplingParams(temperature=0, max_tokens=8))
    assert len(out[0].outputs[0].token_ids) == 8 and out[0].outputs[0].finish_reason == "length"
