"""EngineArgs: the engine flags of every CLI come from one dataclass, with LLM's defaults."""

import argparse
import dataclasses
import inspect

import pytest

from dcpjax import LLM, SamplingParams
from dcpjax.bench import __main__ as bench
from dcpjax.bench.throughput import engine_args
from dcpjax.demo import __main__ as demo
from dcpjax.engine.args import EngineArgs
from dcpjax.engine.config import DTYPES, KV_CACHE_DTYPES
from dcpjax.entrypoints import generate
from dcpjax.kernels import ATTENTION_BACKENDS
from dcpjax.serve import __main__ as serve
from dcpjax.sharding.config import COMM_BACKENDS

# every engine flag as the CLIs spelled them by hand before EngineArgs (tests and README use them)
HAND_WRITTEN = ["--model", "--tensor-parallel-size", "-tp", "--decode-context-parallel-size", "-dcp",
                "--cp-kv-cache-interleave-size", "--dcp-comm-backend", "--dtype", "--max-model-len",
                "--kv-cache-memory-bytes", "--gpu-memory-utilization", "--kv-cache-dtype", "--attention-backend",
                "--block-size", "--max-num-seqs", "--max-num-batched-tokens", "--seed", "--num-cpu-devices",
                "--no-async-scheduling"]
# a value other than the default for every field
NON_DEFAULT = EngineArgs(model="tiny-qwen3", tensor_parallel_size=8, decode_context_parallel_size=4,
                         cp_kv_cache_interleave_size=2, dcp_comm_backend="a2a", dtype="bfloat16", max_model_len=300,
                         kv_cache_memory_bytes=1 << 20, gpu_memory_utilization=0.5, kv_cache_dtype="fp8",
                         attention_backend="reference", block_size=8, max_num_seqs=3, max_num_batched_tokens=64,
                         async_scheduling=False, seed=7, orbax_checkpoint="/tmp/ckpt", num_cpu_devices=8)


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


PARSERS = {
    "generate": generate.build_parser,
    "serve": serve.build_parser,
    "bench throughput": lambda: _subparser(bench.build_parser(), "throughput"),
    "bench compare": lambda: _subparser(bench.build_parser(), "compare"),
}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False)
    EngineArgs.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("cli", PARSERS)
def test_every_cli_takes_every_engine_flag(cli):
    parser = PARSERS[cli]()
    assert set(HAND_WRITTEN) <= _options(parser)
    assert _options(_engine_parser()) <= _options(parser)
    parsed = EngineArgs.from_cli_args(parser.parse_args(NON_DEFAULT.to_cli_args()))
    assert parsed == NON_DEFAULT


def test_defaults_are_llms_defaults():
    llm = {name: p.default for name, p in inspect.signature(LLM.__init__).parameters.items()
           if name not in ("self", "devices")}
    assert EngineArgs().llm_kwargs() == llm
    assert EngineArgs.from_cli_args(_engine_parser().parse_args([])) == EngineArgs()
    for cli in ("generate", "serve"):  # no CLI defaults of their own
        assert EngineArgs.from_cli_args(PARSERS[cli]().parse_args([])) == EngineArgs()


def test_cli_specific_defaults_are_kept():
    compare = EngineArgs.from_cli_args(PARSERS["bench compare"]().parse_args([]))
    assert (compare.tensor_parallel_size, compare.decode_context_parallel_size,
            compare.max_num_batched_tokens) == (8, 2, 512)
    args = PARSERS["bench throughput"]().parse_args(["--num-prompts", "5", "--input-len", "10", "--output-len", "6"])
    throughput = engine_args(args)
    assert (throughput.max_num_seqs, throughput.max_model_len, throughput.max_num_batched_tokens) == (5, 17, 4096)
    assert throughput.async_scheduling and not engine_args(
        PARSERS["bench throughput"]().parse_args(["--no-async-scheduling"])).async_scheduling
    args = demo.parse_args([])
    assert (args.num_cpu_devices, args.tensor_parallel_size) == (8, 8)
    assert not hasattr(args, "max_model_len")  # the attention demo takes only the flags it uses


def test_round_trip():
    parser = _engine_parser()
    assert EngineArgs.from_cli_args(parser.parse_args(NON_DEFAULT.to_cli_args())) == NON_DEFAULT
    assert EngineArgs().to_cli_args() == []
    assert EngineArgs.from_cli_args(parser.parse_args(["-tp", "4"]), seed=3) == EngineArgs(tensor_parallel_size=4,
                                                                                          seed=3)


def test_choices_come_from_the_codes_constants():
    fields = {f.name: f.metadata["choices"] for f in dataclasses.fields(EngineArgs)}
    assert fields["attention_backend"] == ATTENTION_BACKENDS
    assert fields["dcp_comm_backend"] == COMM_BACKENDS
    assert set(fields["dtype"]) == {"auto", *DTYPES}
    assert set(fields["kv_cache_dtype"]) == {"auto", *KV_CACHE_DTYPES, *DTYPES}


@pytest.mark.parametrize("argv, message", [
    (["--dtype", "int4"], "argument --dtype: invalid choice: 'int4'"),
    (["--kv-cache-dtype", "int4"], "argument --kv-cache-dtype: invalid choice: 'int4'"),
    (["--attention-backend", "triton"], "argument --attention-backend: invalid choice: 'triton'"),
    (["--dcp-comm-backend", "nccl"], "argument --dcp-comm-backend: invalid choice: 'nccl'"),
    (["-tp", "0"], "argument --tensor-parallel-size/-tp: must be >= 1, got 0"),
    (["--block-size", "x"], "argument --block-size: expected an integer, got 'x'"),
    (["--max-num-batched-tokens", "0"], "argument --max-num-batched-tokens: must be >= 1, got 0"),
    (["--gpu-memory-utilization", "1.5"], "argument --gpu-memory-utilization: must be in (0, 1], got 1.5"),
    (["--max-model-len", "1"], "argument --max-model-len: must be >= 2, got 1"),
])
@pytest.mark.parametrize("cli", ["generate", "serve", "bench compare"])
def test_bad_values_are_rejected_with_the_flag_named(cli, argv, message, capsys):
    with pytest.raises(SystemExit):
        PARSERS[cli]().parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("field, value, message", [
    ("block_size", 0, "EngineArgs.block_size must be >= 1, got 0"),
    ("block_size", "16", "EngineArgs.block_size must be an integer"),
    ("dtype", "int4", "EngineArgs.dtype must be one of"),
    ("max_num_seqs", None, "EngineArgs.max_num_seqs must be set"),
    ("async_scheduling", 1, "EngineArgs.async_scheduling must be a bool"),
])
def test_bad_values_in_code_name_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(**{field: value})


def test_with_dcp_and_parallel_config():
    args = EngineArgs(tensor_parallel_size=8, decode_context_parallel_size=2, cp_kv_cache_interleave_size=4,
                      dcp_comm_backend="a2a")
    one = args.with_dcp(1)
    assert (one.decode_context_parallel_size, one.cp_kv_cache_interleave_size, one.dcp_comm_backend) == (1, 1, "ag_rs")
    assert args.with_dcp(4).parallel_config().dcp == 4 and args.with_dcp(4).dcp_comm_backend == "a2a"
    with pytest.raises(ValueError, match="tensor_parallel_size % decode_context_parallel_size"):
        args.with_dcp(3).parallel_config().check()


def test_llm_from_engine_args():
    llm = LLM.from_engine_args(EngineArgs(tensor_parallel_size=8, decode_context_parallel_size=2,
                                          kv_cache_memory_bytes=1 << 20, max_model_len=64))
    assert llm.parallel_config.dcp == 2 and llm.max_model_len == 64 and llm.kv_cache_size_tokens > 0


def test_any_token_budget_as_vllm_takes_it():
    """vLLM takes any max_num_batched_tokens; dcpjax took only powers of two (40 and 72 were a
    ValueError). A step schedules at most that many tokens; its model call is padded onto the
    shape grid (40 -> calls of up to 64 tokens, 72 -> 128), and the tokens are those of any budget."""
    prompts = [list(range(3, 3 + n)) for n in (100, 7, 61)]  # several chunks at either budget
    params = SamplingParams(max_tokens=12, temperature=0.0)
    outputs = {}
    for tokens, top in ((40, 64), (72, 128), (256, 256)):
        args = EngineArgs.from_cli_args(generate.parse_args(["--max-num-batched-tokens", str(tokens)]),
                                        max_model_len=128, kv_cache_memory_bytes=1 << 18, tensor_parallel_size=2)
        llm = LLM.from_engine_args(args)
        assert llm.scheduler_config.max_num_batched_tokens == tokens and llm.shape_grid.tokens[-1] == top
        outputs[tokens] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                                         params)]
    assert outputs[40] == outputs[72] == outputs[256]


@pytest.mark.parametrize("argv, field, value", [
    (["--max-model-len", "32k"], "max_model_len", 32_000),
    (["--max-model-len", "32K"], "max_model_len", 32_768),
    (["--max-model-len", "25.6k"], "max_model_len", 25_600),
    (["--max-model-len", "auto"], "max_model_len", None),
    (["--max-model-len", "-1"], "max_model_len", None),
    (["--kv-cache-memory-bytes", "4G"], "kv_cache_memory_bytes", 4 << 30),
    (["--kv-cache-memory-bytes", "4g"], "kv_cache_memory_bytes", 4_000_000_000),
    (["--max-num-batched-tokens", "8k"], "max_num_batched_tokens", 8_000),
    (["--max-num-batched-tokens", "72"], "max_num_batched_tokens", 72),
    (["-sc", '{"method": "ngram", "num_speculative_tokens": 2}'], "speculative_config",
     {"method": "ngram", "num_speculative_tokens": 2}),
    (["--dcp-kv-cache-interleave-size", "4"], "cp_kv_cache_interleave_size", 4),
    (["--tokenizer", "None"], "tokenizer", None),
    (["-q", "None"], "quantization", "auto"),
    (["--max-logprobs", "-1"], "max_logprobs", 1024),
])
@pytest.mark.parametrize("cli", ["generate", "serve"])
def test_vllms_spellings_of_values(cli, argv, field, value):
    """What vLLM's EngineArgs takes, taken the same (docs/serving.md lists what still differs)."""
    assert getattr(EngineArgs.from_cli_args(PARSERS[cli]().parse_args(argv)), field) == value


@pytest.mark.parametrize("text", ["1.0001k", "1e3", "32 k", "k", "0.5"])
def test_readable_integers_refuse_what_is_not_one(text, capsys):
    with pytest.raises(SystemExit):
        PARSERS["generate"]().parse_args(["--max-model-len", text])
    assert "argument --max-model-len: expected an integer (or 32k, 4G" in capsys.readouterr().err
