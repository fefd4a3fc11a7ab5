"""The offline API on the built-in tiny models: DCP invariance, sampling, stops, errors."""

import dataclasses

import numpy as np
import pytest

import dcpjax
from dcpjax import LLM, SamplingParams
from dcpjax.engine.output_processor import OutputProcessor
from dcpjax.loader.rules import model_rules
from dcpjax.loader.weights import DictSource, load_state, random_checkpoint
from dcpjax.models.config import BYTE_EOS, TINY_MODELS
from dcpjax.models.registry import build_model
from dcpjax.runner.step_input import CallShape
from dcpjax.sequence import Sequence
from dcpjax.text.tokenizer import ByteTokenizer

PROMPTS = ["Hello", "Decode context parallelism splits the KV cache by token. " * 5, "x"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=3)


def make(model="tiny-llama", tp=8, dcp=1, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    kw.setdefault("kv_cache_memory_bytes", 4 << 20)
    kw.setdefault("max_model_len", 512)
    return LLM(model, tensor_parallel_size=tp, decode_context_parallel_size=dcp, **kw)


# each model: both merge backends, interleave 1 and > 1, and the largest DCP its KV heads allow
# (test_hf_parity proves more layouts against transformers, on every Python; GQA's cases here run on the newest
# jax, MLA's on the oldest)
@pytest.mark.parametrize("model, layouts", [
    pytest.param("tiny-llama", ((2, "ag_rs", 1), (4, "a2a", 4)), marks=pytest.mark.e2e),
    pytest.param("tiny-qwen3", ((8, "ag_rs", 1), (8, "a2a", 4)), marks=pytest.mark.e2e),
    pytest.param("tiny-deepseek", ((2, "a2a", 4), (8, "ag_rs", 1)), marks=pytest.mark.oldest_jax),
])
def test_dcp_k_equals_dcp_1(model, layouts):
    base = make(model, dcp=1).generate(PROMPTS, GREEDY)
    for dcp, comm, interleave in layouts:
        llm = make(model, dcp=dcp, dcp_comm_backend=comm, cp_kv_cache_interleave_size=interleave, block_size=8)
        for want, got in zip(base, llm.generate(PROMPTS, GREEDY)):
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs):
                assert {t: lp.logprob for t, lp in a.items()} == pytest.approx(
                    {t: lp.logprob for t, lp in b.items()}, abs=1e-4)


def test_outputs_look_like_vllm():
    out = make().generate(PROMPTS[:2], GREEDY)
    assert [o.request_id for o in out] != [] and out[0].prompt == "Hello"
    assert out[0].prompt_token_ids == ByteTokenizer().encode("Hello")
    completion = out[0].outputs[0]
    assert len(completion.token_ids) == 12 and completion.finish_reason == "length"
    assert completion.text == ByteTokenizer().decode(completion.token_ids)
    for step, token in zip(completion.logprobs, completion.token_ids):
        assert token in step and 3 <= len(step) <= 4
        assert step[token].rank == 1  # greedy picks the best token
        assert isinstance(step[token].decoded_token, str)
    assert completion.cumulative_logprob == pytest.approx(
        sum(s[t].logprob for s, t in zip(completion.logprobs, completion.token_ids)))


def test_calls_stay_on_the_shape_grid_as_sequences_grow():
    """A call's compile key is its point on the shape grid (rows or tokens, block-table width):
    sequences grow inside a width without recompiling, and each width they reach adds one shape."""
    llm = make(enable_prefix_caching=False)  # blocks of 16 tokens, DCP 1; repeated prompts compute in full
    grid, runner = llm.shape_grid, llm.runner
    assert grid.widths == (8, 16, 32) and grid.rows == (1, 2, 4, 8, 16, 32, 64)
    llm.generate(["a" * 10, "b" * 40], SamplingParams(temperature=0, max_tokens=5))
    shapes = set(runner.seen)
    # one packed prefill of both prompts, one decode of 2 rows; greedy: the model's argmax, no sampler call
    assert shapes == {CallShape("prefill", 1, 64, 8, 64), CallShape("decode", 2, 1, 8, 2)}
    # longer outputs inside the same buckets: positions and lengths are data, not compile keys
    llm.generate(["c" * 12, "d" * 45], SamplingParams(temperature=0, max_tokens=15, ignore_eos=True))
    assert runner.seen == shapes
    # 46 + 100 tokens need 10 blocks: decode width 16 joins, once
    for _ in range(2):
        llm.generate(["c" * 12, "d" * 45], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        assert runner.seen - shapes == {CallShape("decode", 2, 1, 16, 2)}
    # any mix stays on the grid, each shape compiled once
    llm.generate(["e" * n for n in (3, 30, 61, 7, 19)], SamplingParams(temperature=0.5, max_tokens=9))
    assert runner.seen <= set(grid.call_shapes()) | set(grid.sampler_shapes())
    assert runner.compiled_step_count == len(runner.seen)


def test_sampling_controls():
    llm = make()
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8))
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]
    for params in (SamplingParams(temperature=1.5, top_k=1, max_tokens=8),
                   SamplingParams(temperature=1.5, min_p=1.0, max_tokens=8),
                   SamplingParams(temperature=1.5, top_p=1e-6, max_tokens=8)):
        assert ids(llm.generate(PROMPTS, params)) == ids(greedy)
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=16)
    first = ids(llm.generate(PROMPTS, seeded))
    assert ids(llm.generate(PROMPTS[::-1], seeded))[::-1] == first  # reproducible whatever the batch
    other = ids(llm.generate(PROMPTS, SamplingParams(temperature=1.0, seed=124, max_tokens=16)))
    assert other != first
    assert first != ids(greedy)
    sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, top_k=5, max_tokens=16, logprobs=0))
    for out in sampled:
        for step, token in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
            assert step[token].rank <= 5


def test_stop_token_ids_and_stop_strings():
    llm = make()
    base = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    stop_id = base.token_ids[4]
    cut = base.token_ids.index(stop_id)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: cut + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    text = base.text
    stop = text[5:7]
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, stop=[stop]))[0].outputs[0]
    assert out.text == text[: text.index(stop)] and (out.finish_reason, out.stop_reason) == ("stop", stop)
    kept = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=12, stop=stop,
                                                include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == text[: text.index(stop) + len(stop)]


@pytest.mark.parametrize("ignore_eos, reason", [(False, "stop"), (True, None)])
def test_eos_ends_a_sequence_unless_ignored(ignore_eos, reason):
    processor = OutputProcessor(ByteTokenizer(), {BYTE_EOS})
    seq = Sequence("0", "p", [1, 2], SamplingParams(ignore_eos=ignore_eos, max_tokens=10), max_total=12, seed=0)
    for token in (ord("h"), ord("i"), BYTE_EOS):
        processor.append(seq, token)
    assert seq.finish_reason == reason
    assert seq.text == "hi" if reason else seq.text.startswith("hi")


def test_max_model_len_caps_generation():
    llm = make(max_model_len=32)
    out = llm.generate("y" * 25, SamplingParams(temperature=0, max_tokens=None))[0].outputs[0]
    assert len(out.token_ids) == 32 - 26 and out.finish_reason == "length"  # BOS + 25 bytes


def test_max_tokens_past_the_context_warns_and_stops_at_it(caplog):
    """Offline generation keeps vLLM's cap (finish 'length' at max_model_len) and says so up front."""
    llm = make(max_model_len=32)
    with caplog.at_level("WARNING", logger="dcpjax.engine.requests"):
        out = llm.generate(["y" * 25, "x"], SamplingParams(temperature=0, max_tokens=9000, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in out] == [32 - 26, 32 - 2]
    message, = (r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage())
    assert ("prompt 0: 26 tokens + max_tokens 9000 = 9026 passes max_model_len 32 (and 1 more prompt(s)): its output "
            "stops at 6 tokens" in message and "--max-tokens" in message and "--max-model-len" in message)
    caplog.clear()
    llm.generate("y" * 25, SamplingParams(temperature=0, max_tokens=6))  # fits exactly: no word
    assert not [r for r in caplog.records if "max_model_len" in r.getMessage()]


def test_the_progress_bar_counts_prompts_and_tokens_on_a_terminal_only():
    import io

    from dcpjax.engine.progress import GenerationProgress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    llm = make()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = [llm.make_sequences(p, dataclasses.replace(params, n=n)) for p, n in (("a", 2), ("b", 1))]
    assert GenerationProgress(requests, enabled=True).bar.disable  # pytest's stderr is no terminal
    assert GenerationProgress(requests, enabled=False, file=Terminal()).bar.disable
    screen = Terminal()
    with GenerationProgress(requests, enabled=True, file=screen) as progress:
        llm.engine.run([seq for seqs in requests for seq in seqs], on_finish=progress.finished,
                       on_step=progress.stepped)
        assert progress.bar.n == 2
    assert "2/2" in screen.getvalue() and "output 12 tokens" in screen.getvalue()


def test_the_load_log_names_the_mesh_the_kv_default_and_the_expected_peak(caplog):
    from dcpjax.runner.memory import CPU_RUNTIME_BYTES, expected_peak_bytes

    with caplog.at_level("INFO"):
        llm = make(dcp=2, kv_cache_memory_bytes=None, max_num_seqs=2, max_model_len=128)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "TP 8, DCP 2 over 8 cpu device(s): mesh {'tp': 4, 'dcp': 2}, its axes (TP // DCP, DCP)" in text
    assert "KV cache on CPU by default:" in text and "--kv-cache-memory-bytes sets it" in text
    peak = expected_peak_bytes(llm.weight_bytes_by_device(), llm.kv_cache_memory_bytes)
    assert peak == sum(llm.weight_bytes_by_device().values()) + 8 * llm.kv_cache_memory_bytes + CPU_RUNTIME_BYTES
    assert f"expected peak memory: about {peak / 2**30:.1f} GiB of host memory" in text


def test_kv_cache_capacity_grows_with_dcp():
    sizes = {dcp: make("tiny-qwen3", dcp=dcp).kv_cache_size_tokens for dcp in (1, 2, 8)}
    assert sizes[2] == 2 * sizes[1] and sizes[8] == 8 * sizes[1]
    mla = {dcp: make("tiny-deepseek", dcp=dcp).kv_cache_size_tokens for dcp in (1, 8)}
    assert mla[8] == 8 * mla[1]
    llama = {dcp: make(dcp=dcp).kv_cache_size_tokens for dcp in (1, 2, 4)}
    assert llama[2] == 2 * llama[1] and llama[4] == 4 * llama[1]


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0), ("max_tokens", 0),
     ("logprobs", 1025), ("seed", 1.5), ("stop", [""]), ("stop_token_ids", [-1])],
)
def test_invalid_sampling_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})


def test_bad_requests_and_configurations():
    llm = make(max_model_len=64)
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate("z" * 80)
    with pytest.raises(ValueError, match="is empty"):
        llm.generate({"prompt_token_ids": []})
    with pytest.raises(ValueError, match="outside"):
        llm.generate({"prompt_token_ids": [5, 100000]})
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate("a", [GREEDY, GREEDY])
    with pytest.raises(ValueError, match="neither a built-in model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="decode_context_parallel_size <= tensor_parallel_size // num_kv_heads"):
        make(dcp=8)  # tiny-llama has 2 KV heads
    with pytest.raises(ValueError, match="raise kv_cache_memory_bytes"):
        make(kv_cache_memory_bytes=64 << 10, max_model_len=2048)
    with pytest.raises(ValueError, match="block_size % cp_kv_cache_interleave_size"):
        make(dcp=2, cp_kv_cache_interleave_size=3, block_size=16)


def test_cpu_kv_default_is_1_gib_at_most_a_share_of_host_memory_and_no_more_than_can_be_filled(monkeypatch):
    from dcpjax.runner import kv_budget as llm_module

    kw = dict(tp=2, kv_cache_memory_bytes=None, max_model_len=256)
    # plenty of memory: no more than 4 sequences of 256 tokens fill (16 blocks each)
    monkeypatch.setattr(llm_module, "host_available_bytes", lambda: 8 << 30)
    assert make(max_num_seqs=4, **kw).kv_cache_size_tokens == 4 * 256
    # little memory: a quarter of it, split over the 2 devices (64 sequences of 4096 would fill 64 MiB)
    monkeypatch.setattr(llm_module, "host_available_bytes", lambda: 64 << 20)
    assert make(**(kw | dict(max_model_len=4096))).kv_cache_memory_bytes == (64 << 20) // 4 // 2
    # too little for one sequence: the numbers and both flags
    monkeypatch.setattr(llm_module, "host_available_bytes", lambda: 256 << 10)
    with pytest.raises(ValueError,
                       match=r"max_model_len=256 needs 16 KV blocks.*--kv-cache-memory-bytes.*--max-model-len"):
        make(**kw)
    # the host's memory cannot be read: the fixed fallback
    monkeypatch.setattr(llm_module, "host_available_bytes", lambda: None)
    assert make(**(kw | dict(max_model_len=8192))).kv_cache_memory_bytes == llm_module.CPU_DEFAULT_KV_BYTES
    # a big host: still 1 GiB for the process's devices together (a 135M model's server is not gigabytes)
    monkeypatch.setattr(llm_module, "host_available_bytes", lambda: 256 << 30)
    assert make(max_num_seqs=1024, **(kw | dict(max_model_len=32768))).kv_cache_memory_bytes == (1 << 30) // 2
    # ... unless one max_model_len sequence needs more: then that sequence fits
    monkeypatch.setattr(llm_module, "CPU_KV_BUDGET_BYTES", 1 << 20)
    assert make(**(kw | dict(max_model_len=4096))).kv_cache_size_tokens == 4096


def test_checkpoint_problems_are_named():
    cfg, pc = TINY_MODELS["tiny-llama"], dcpjax.ParallelConfig(2)
    mesh = dcpjax.make_mesh(pc)
    rules = model_rules(cfg, pc)
    good = random_checkpoint(cfg, pc, seed=0).tensors

    def load(tensors):
        load_state(build_model(cfg, pc, np.float32)[1], rules, DictSource(tensors), mesh, progress=False)

    load(good)
    missing = dict(good)
    del missing["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="missing tensors: model.layers.1.mlp.up_proj.weight"):
        load(missing)
    with pytest.raises(ValueError, match="unexpected tensors: model.layers.2.mlp.up_proj.weight"):
        load(good | {"model.layers.2.mlp.up_proj.weight": np.zeros(3)})
    with pytest.raises(ValueError, match=r"mis-shaped tensors: model.norm.weight: checkpoint \(3,\)"):
        load(good | {"model.norm.weight": np.zeros(3)})
    # known leftovers are fine: rotary caches, a multi-token-prediction head (Qwen3-Next's mtp.*)
    load(good | {"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8), "mtp.fc.weight": np.zeros(3)})


@pytest.mark.parametrize("model, dcp", [pytest.param("tiny-llama", 4, marks=pytest.mark.e2e),
                                        pytest.param("tiny-deepseek", 8, marks=pytest.mark.oldest_jax)])
def test_fp8_kv_cache(model, dcp):
    """fp8 quantises each token on its own, so DCP k gives exactly DCP 1's tokens; the cache
    holds more tokens than a float32 one in the same bytes."""
    fp8 = {d: make(model, dcp=d, kv_cache_dtype="fp8") for d in (1, dcp)}
    base = fp8[1].generate(PROMPTS, GREEDY)
    for want, got in zip(base, fp8[dcp].generate(PROMPTS, GREEDY)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert fp8[1].kv_cache_size_tokens > 3 * make(model, dcp=1).kv_cache_size_tokens
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make(model, kv_cache_dtype="int4")
