"""Expert parallelism (`enable_expert_parallel`): routed experts whole on their devices.

The routed-expert product under EP against a float64 numpy oracle (random routing, all tokens to
one expert, an expert count the devices do not divide), the layout each device holds, whole
models equal with EP off and on (tests/test_hf_parity.py holds EP to transformers), and a dense
model refused.
"""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import dcpjax
from dcpjax.engine.args import EngineArgs
from dcpjax.entrypoints import cli, generate
from dcpjax.models.layers import padded_size, routed_experts
from dcpjax.serve import __main__ as serve
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import MODEL_AXES, make_mesh, reduce_model
from dcpjax.sharding.traffic import hlo_collective_bytes, moe_collective_bytes

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def _silu(x):
    return x / (1 + np.exp(-x))


def oracle(x, experts, weights, gate, up, down):
    """float64: each token's k experts, weighted, summed."""
    out = np.zeros_like(x, dtype=np.float64)
    for n in range(x.shape[0]):
        for e, w in zip(experts[n], weights[n]):
            out[n] += w * ((_silu(x[n] @ gate[e]) * (x[n] @ up[e])) @ down[e])
    return out


def run_ep(pc: ParallelConfig, x, experts, weights, gate, up, down):
    """routed_experts inside shard_map over pc's mesh, experts split whole (padded with zero experts
    to a multiple of the devices, as the model pads them), the partial sums reduced."""
    mesh = make_mesh(pc)
    total = padded_size(gate.shape[0], "ep_experts", pc)
    pad = lambda w: np.concatenate([w, np.zeros((total - w.shape[0], *w.shape[1:]), w.dtype)])
    split = NamedSharding(mesh, P(MODEL_AXES, None, None))
    put = lambda w: jax.device_put(jnp.asarray(pad(w)), split)

    def body(x, experts, weights, gate, up, down):
        return reduce_model(routed_experts(x, experts, weights, gate, up, down, expert_parallel=True))

    spec = P(MODEL_AXES, None, None)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), spec, spec, spec), out_specs=P()))
    return np.asarray(f(jnp.asarray(x), jnp.asarray(experts), jnp.asarray(weights), put(gate), put(up), put(down)))


def _inputs(tokens=24, hidden=16, inter=8, num_experts=8, k=2, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    scores = rng.standard_normal((tokens, num_experts))
    experts = np.argsort(-scores, axis=1)[:, :k].astype(np.int32)
    weights = rng.uniform(0.1, 1, (tokens, k)).astype(np.float32)
    w = lambda *shape: (rng.standard_normal(shape) / np.sqrt(shape[-2])).astype(np.float32)
    return x, experts, weights, w(num_experts, hidden, inter), w(num_experts, hidden, inter), w(num_experts, inter,
                                                                                                    hidden)


@pytest.mark.parametrize("tp, dcp, num_experts", [(8, 1, 8), (8, 4, 16), (4, 2, 8), (8, 2, 6), (4, 1, 5)])
def test_routed_experts_under_ep_equal_the_oracle(tp, dcp, num_experts):
    """Random top-2 routing; 6 and 5 experts pad to 8 over 8 and 4 devices (padded experts never routed)."""
    x, experts, weights, gate, up, down = _inputs(num_experts=num_experts)
    got = run_ep(ParallelConfig(tp, dcp, enable_expert_parallel=True), x, experts, weights, gate, up, down)
    np.testing.assert_allclose(got, oracle(x, experts, weights, gate, up, down), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("expert", [0, 5, 7])
def test_every_token_to_one_expert_drops_nothing(expert):
    """Routing skew: all 64 tokens' copies to one expert (one device gets every one, the others none):
    the exact answer, no token dropped (there is no capacity to overflow)."""
    x, _, _, gate, up, down = _inputs(tokens=64, k=1, seed=1)
    experts = np.full((64, 1), expert, np.int32)
    weights = np.ones((64, 1), np.float32)
    got = run_ep(ParallelConfig(8, 2, enable_expert_parallel=True), x, experts, weights, gate, up, down)
    want = oracle(x, experts, weights, gate, up, down)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=2e-5)
    assert np.all(np.abs(want).sum(axis=1) > 0)  # every token has its output


def _moe_config(folder: pathlib.Path, num_experts: int) -> str:
    """The Qwen3-MoE fixture's config with another expert count, as a JSON config (random weights)."""
    config = json.loads((FIXTURES / "qwen3-moe" / "config.json").read_text())
    config["num_local_experts"] = num_experts
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def _generate(model: str, **kwargs) -> list:
    llm = dcpjax.LLM(model, load_format="dummy", max_model_len=128, kv_cache_memory_bytes=1 << 20,
                     max_num_batched_tokens=32, **kwargs)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 40)]
    outputs = llm.generate(prompts, dcpjax.SamplingParams(temperature=0, max_tokens=8, logprobs=3))
    return llm, [o.outputs[0] for o in outputs]


# slow: float experts on the newest jax, fp8 experts on the oldest
@pytest.mark.parametrize("quantization", [pytest.param("auto", marks=pytest.mark.e2e),
                                          pytest.param("fp8", marks=pytest.mark.oldest_jax)])
def test_ep_holds_whole_experts_and_generates_what_tp_experts_do(tmp_path, quantization):
    """6 experts over 4 devices: padded to 8 (appended: devices 0-2 hold two real experts each, the
    last one only zeros), their FFW unsplit, fp8 experts padded by whole experts too (not to a
    block multiple); the tokens and logprobs equal those of tensor-parallel experts."""
    model = _moe_config(tmp_path, 6)
    kwargs = dict(tensor_parallel_size=4, decode_context_parallel_size=2, quantization=quantization)
    ep, ep_out = _generate(model, enable_expert_parallel=True, **kwargs)
    _, tp_out = _generate(model, **kwargs)
    held = ep.model_weights.state["layers"][1]["mlp"]["gate"]
    gate = held["values"][...] if quantization == "fp8" else held[...]  # fp8: the codes as held
    assert gate.dtype == (jnp.float8_e4m3fn if quantization == "fp8" else jnp.float32)
    assert gate.shape == (8, 64, 32) and gate.addressable_shards[0].data.shape == (2, 64, 32)
    per_expert = np.abs(np.asarray(gate, np.float32)).sum(axis=(1, 2))
    assert np.all(per_expert[:6] > 0) and np.all(per_expert[6:] == 0)
    for a, b in zip(ep_out, tp_out):
        assert a.token_ids == b.token_ids
        for step_a, step_b in zip(a.logprobs, b.logprobs):
            for token in step_b:
                assert step_a[token].logprob == pytest.approx(step_b[token].logprob, abs=1e-4)


def test_a_dense_model_refuses_ep(capsys):
    with pytest.raises(ValueError, match="enable_expert_parallel needs routed experts, and LlamaForCausalLM has none"):
        dcpjax.LLM("tiny-llama", enable_expert_parallel=True)
    for main, more in ((generate.main, []), (serve.main, ["--port", "0"])):
        assert cli.run(main, ["tiny-llama", "--enable-expert-parallel", *more]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: enable_expert_parallel needs routed experts") and len(err.splitlines()) == 1, err


def test_the_flag_reaches_the_parallel_config():
    args = EngineArgs.from_cli_args(generate.parse_args(["--enable-expert-parallel", "-tp", "8"]))
    assert args.parallel_config() == ParallelConfig(8, enable_expert_parallel=True)
    assert "--enable-expert-parallel" in args.to_cli_args()


@pytest.mark.parametrize("expert_parallel", [False, True])
@pytest.mark.parametrize("tp, dcp", [(8, 2), (4, 1)])
def test_moe_bytes_are_the_compiled_steps(tp, dcp, expert_parallel):
    """One routed-expert layer compiled, EP on and off: its HLO collectives move what
    `moe_collective_bytes` says (the one reduction; EP adds no collective)."""
    pc = ParallelConfig(tp, dcp, enable_expert_parallel=expert_parallel)
    x, experts, weights, gate, up, down = _inputs(tokens=24, hidden=16, inter=8, num_experts=8)
    mesh = make_mesh(pc)
    spec = P(MODEL_AXES, None, None) if expert_parallel else P(None, None, MODEL_AXES)
    down_spec = P(MODEL_AXES, None, None) if expert_parallel else P(None, MODEL_AXES, None)

    def body(x, experts, weights, gate, up, down):
        return reduce_model(routed_experts(x, experts, weights, gate, up, down, expert_parallel))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), spec, spec, down_spec), out_specs=P()))
    hlo = f.lower(x, experts, weights, gate, up, down).compile().as_text()
    moved = sum(b for _, b in hlo_collective_bytes(hlo, tp))
    assert moved == pytest.approx(moe_collective_bytes(tokens=24, hidden=16, tp=tp, act_bytes=4), rel=0.05)


def test_the_start_up_precompile_covers_ep(tmp_path):
    """EP changes no call shape: the precompiled grid is every shape a decode / packed-prefill mix
    dispatches, and nothing compiles after it."""
    llm = dcpjax.LLM(_moe_config(tmp_path, 6), load_format="dummy", enforce_eager=False, tensor_parallel_size=4,
                     decode_context_parallel_size=2, enable_expert_parallel=True, max_model_len=48, max_num_seqs=2,
                     max_num_batched_tokens=8, block_size=8, kv_cache_memory_bytes=1 << 20)
    seen = set(llm.runner.seen)
    assert seen == set(llm.shape_grid.call_shapes()) | set(llm.shape_grid.sampler_shapes())
    llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(3, 33))}],
                 dcpjax.SamplingParams(temperature=0, max_tokens=10))
    assert llm.runner.seen == seen and llm.runner.steps_compiled_after_ready == 0
