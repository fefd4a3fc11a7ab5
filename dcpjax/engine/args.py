"""Engine arguments: every engine flag defined once (vLLM's `EngineArgs`).

`EngineArgs` holds what `LLM(...)` takes, plus `num_cpu_devices` (fake CPU devices for
the process). Each field carries its CLI flag(s), help, `choices` (taken from the code's
own constants) and check. `EngineArgs.add_cli_args(parser)` generates the engine flags of
`python -m dcpjax.generate`, `serve`, `bench` and `demo`; `EngineArgs.from_cli_args(args)`
reads them back (checked again), `to_cli_args()` writes them out (to start a server) and
`create_engine_config()` makes the `EngineConfig` that `LLM.from_engine_args(args)` builds the engine from.
"""

from __future__ import annotations

import argparse
import dataclasses
import decimal
import json
import logging
import re
from collections.abc import Callable, Collection, Mapping
from typing import Any

from dcpjax.engine.config import DTYPES, KV_CACHE_DTYPES, EngineConfig
from dcpjax.kernels import ATTENTION_BACKENDS
from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.loader.model_source import BUILTIN_NAMES, LOAD_FORMATS
from dcpjax.loader.quantized_source import QUANTIZATIONS
from dcpjax.sampling import MAX_LOGPROBS, MAX_LOGPROBS_LIMIT
from dcpjax.sharding.config import COMM_BACKENDS, ParallelConfig
from dcpjax.spec_decode.config import SpeculativeConfig

logger = logging.getLogger(__name__)

Check = Callable[[Any], "str | None"]  # a problem with the value ("must be >= 1"), or None


def _at_least(low: float) -> Check:
    return lambda value: None if value >= low else f"must be >= {low}"


def _fraction(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be in (0, 1]"


def _config_problem(parse: Callable[[dict], Any], name: str) -> Check:
    """The check of a JSON-config flag: what `parse` refuses of the value, without the flag's own name."""
    def check(value: dict) -> str | None:
        try:
            parse(value)
        except ValueError as error:
            return str(error).removeprefix(f"{name} ")
        return None
    return check


_kv_transfer_problem = _config_problem(KVTransferConfig.from_value, "kv_transfer_config")
_speculative_problem = _config_problem(SpeculativeConfig.from_dict, "speculative_config")


def _arg(default: Any, help: str, *, kind: type = int, aliases: tuple[str, ...] = (),
         choices: Collection[str] | None = None, check: Check | None = None, default_help: str | None = None,
         llm: bool = True, cli_values: Mapping[str, Any] | None = None, readable: bool = False) -> Any:
    """A field with what its CLI flag needs (`default_help`: what a None default means);
    `llm=False`: not an `LLM(...)` argument; `cli_values`: words the flag takes for a value
    (vLLM's, e.g. max_model_len's "auto"); `readable`: an integer flag takes vLLM's "32k" / "4G"."""
    metadata = dict(help=help, kind=kind, aliases=aliases, choices=tuple(choices) if choices else None,
                    check=check, default_help=default_help, llm=llm, cli_values=dict(cli_values or {}),
                    readable=readable)
    return dataclasses.field(default=default, metadata=metadata)


_READABLE = re.compile(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)")


def readable_int(text: str) -> int:
    """vLLM's human-readable integers: "32k" = 32,000, "32K" = 32,768 (k m g t: powers of 1000,
    K M G T: of 1024), "25.6k" = 25,600; ValueError for anything else or a fraction left over."""
    match = _READABLE.fullmatch(text.strip())
    if not match:
        raise ValueError(text)
    number, suffix = match.groups()
    scale = (1000 if suffix.islower() else 1024) ** ("kmgt".index(suffix.lower()) + 1) if suffix else 1
    value = decimal.Decimal(number) * scale  # exact: 25.6 * 1000 is 25,600, not 25,600.000000000004
    if value != int(value):
        raise ValueError(text)
    return int(value)


def _problem(f: dataclasses.Field, value: Any) -> str | None:
    """What is wrong with `value` for field `f` (None: fine)."""
    if value is None:
        return None if f.default is None else "must be set"
    kind, choices, check = f.metadata["kind"], f.metadata["choices"], f.metadata["check"]
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, (int, float) if kind is float else kind):
        return f"must be {'a number' if kind is float else 'an integer' if kind is int else 'a ' + kind.__name__}"
    if choices is not None and value not in choices:
        return f"must be one of {list(choices)}"
    return check(value) if check is not None else None


_METAVARS = {int: "N", float: "X", dict: "JSON"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli_type(f: dataclasses.Field) -> Callable[[str], Any]:
    """argparse `type=`: converts and checks, so a bad value is an argparse error naming the flag."""
    kind = f.metadata["kind"]

    def parse(text: str) -> Any:
        if text in f.metadata["cli_values"]:
            return f.metadata["cli_values"][text]
        if f.default is None and text in ("None", ""):  # vLLM's optional flags take "None": unset
            return None
        try:
            value = json.loads(text) if kind is dict else readable_int(text) if f.metadata["readable"] else kind(text)
            if kind is dict and not isinstance(value, dict):
                raise ValueError
        except ValueError:
            if kind is dict:
                raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}") from None
            expected = "an integer (or 32k, 4G: k / K = 1000 / 1024)" if f.metadata["readable"] else \
                "an integer" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        problem = None if f.metadata["choices"] else _problem(f, value)
        if problem:
            # a check that names the value already (a JSON config's field) says it once
            raise argparse.ArgumentTypeError(problem if ", got " in problem else f"{problem}, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


@dataclasses.dataclass(frozen=True)
class EngineArgs:
    """Every engine argument, with its CLI flag (vLLM's spelling). See `LLM` for the meaning."""

    model: str = _arg("tiny-llama", f"Hugging Face folder, GGUF file, or built-in name ({', '.join(BUILTIN_NAMES)})",
                      kind=str)
    tokenizer: str | None = _arg(None, "Hugging Face folder whose tokenizer replaces the model's own", kind=str,
                                 default_help="the model's")
    tensor_parallel_size: int = _arg(1, "devices of one model replica (TP)", aliases=("-tp",), check=_at_least(1))
    decode_context_parallel_size: int = _arg(
        1, "DCP: splits the KV cache by token over this many of the TP devices", aliases=("-dcp",), check=_at_least(1))
    cp_kv_cache_interleave_size: int = _arg(
        1, "I: token p lives on DCP rank (p // I) %% DCP", check=_at_least(1),
        aliases=("--dcp-kv-cache-interleave-size",))  # vLLM's older name, kept there too
    dcp_comm_backend: str = _arg("ag_rs", "LSE merge over DCP: all_gather + psum_scatter, or one all_to_all",
                                 kind=str, choices=COMM_BACKENDS)
    enable_expert_parallel: bool = _arg(False, "place routed experts whole over the TP devices (EP size = TP) "
                                        "instead of splitting each one; MoE models only", kind=bool)
    dtype: str = _arg("auto", "weights and activations ('auto': bfloat16 on GPU/TPU, float32 on CPU)",
                      kind=str, choices=("auto", *DTYPES))
    max_model_len: int | None = _arg(None, "longest prompt + output (32k = 32,000, 32K = 32,768; 'auto' or -1: the "
                                     "model's)", check=_at_least(2), default_help="the model's max_position_embeddings",
                                     readable=True, cli_values={"auto": None, "-1": None})
    kv_cache_memory_bytes: int | None = _arg(
        None, "KV cache bytes per device (4G = 4 GiB, 4g = 4e9)", check=_at_least(1), readable=True,
        default_help="--gpu-memory-utilization of device memory; on CPU 1 GiB over this process's devices (or one "
        "--max-model-len sequence if more), at most what --max-num-seqs sequences of --max-model-len fill and a "
        "quarter of the host's available memory")
    gpu_memory_utilization: float = _arg(0.9, "share of device memory for the KV cache when "
                                         "--kv-cache-memory-bytes is not given", kind=float, check=_fraction)
    kv_cache_dtype: str = _arg("auto", "'auto' (the model dtype), 'fp8' (e4m3 with a float32 scale per token and "
                               "KV head) or a dtype name", kind=str, choices=("auto", *KV_CACHE_DTYPES, *DTYPES))
    attention_backend: str = _arg("auto", "attention implementation, decode and prefill ('auto': Pallas on GPU/TPU "
                                  "where the shapes fit)", kind=str, choices=ATTENTION_BACKENDS)
    block_size: int = _arg(16, "tokens per KV block on each DCP rank", check=_at_least(1))
    max_num_seqs: int = _arg(64, "sequences running together", check=_at_least(1))
    max_num_batched_tokens: int = _arg(256, "tokens per step, prefill chunks and decode tokens together (any "
                                       "value, 8k too; a step's model call pads to the next power of two)",
                                       check=_at_least(1), readable=True)
    async_scheduling: bool = _arg(True, "keep the host one step ahead of the device", kind=bool)
    enable_prefix_caching: bool = _arg(True, "reuse the KV of prompt prefixes computed before, in blocks of "
                                       "block_size x DCP tokens (automatic prefix caching)", kind=bool)
    speculative_config: dict | None = _arg(  # noqa: RUF009 (a dataclasses.field whose default is None)
        None, "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}' or '{\"method\": \"draft_model\", \"model\": \"tiny-llama\", "
        "\"num_speculative_tokens\": 4}'", kind=dict, check=_speculative_problem, default_help="off",
        aliases=("-sc",))
    kv_transfer_config: dict | None = _arg(  # noqa: RUF009
        None, "prefill/decode disaggregation as JSON (vLLM's KVTransferConfig): '{\"kv_role\": \"kv_producer\", "
        "\"kv_port\": 14579}' on the prefill server, '{\"kv_role\": \"kv_consumer\"}' on the decode server; "
        "python -m dcpjax.serve.router in front of both", kind=dict, check=_kv_transfer_problem, default_help="off")
    seed: int = _arg(0, "seed of random weights and of unseeded sampling")
    orbax_checkpoint: str | None = _arg(None, "restore the weights from this orbax folder (written by "
                                        "LLM.save_checkpoint, on any mesh)", kind=str)
    load_format: str = _arg("auto", "how to read the weights: 'auto' (what --model is), 'safetensors' / 'gguf' (insist "
                            "on it), 'dummy' (random weights of the model's config)", kind=str, choices=LOAD_FORMATS)
    generation_config: str = _arg("auto", "default sampling parameters: 'auto' (the model folder's "
                                  "generation_config.json, if any), 'vllm' (vLLM's defaults) or a folder", kind=str)
    max_logprobs: int = _arg(MAX_LOGPROBS, "the most logprobs / prompt_logprobs a request may ask for (-1: "
                             f"as many as a request can, {MAX_LOGPROBS_LIMIT})", check=_at_least(0),
                             cli_values={"-1": MAX_LOGPROBS_LIMIT})
    compilation_cache_dir: str | None = _arg(
        "auto", "JAX's persistent compilation cache folder, so a second start loads its steps instead of compiling "
        "them: 'auto' ($DCPJAX_COMPILATION_CACHE_DIR, else ~/.cache/dcpjax/jax), a folder, or 'none' (dcpjax sets "
        "none: JAX's own jax_compilation_cache_dir stands)", kind=str)
    enforce_eager: bool | None = _arg(None, "skip the start-up precompile of every step shape the configuration can "
                                      "dispatch (then a shape compiles when first met, while requests wait)",
                                      kind=bool, default_help="on CPU only")
    trust_remote_code: bool = _arg(False, "accepted for vLLM's command lines: dcpjax runs no code from model "
                                   "folders (its own implementations of the supported architectures)", kind=bool)
    quantization: str | None = _arg(None, "how weights are held on the devices: 'fp8' (fp8 block-scaled; an "
                                    "unquantized checkpoint quantized at load), 'gguf' (a GGUF file's own types), "
                                    "'none' (all dequantized into --dtype)", kind=str, aliases=("-q",),
                                    choices=QUANTIZATIONS, cli_values={"None": "auto"},  # vLLM's: detect
                                    default_help="as the checkpoint holds them; on CPU a GGUF is dequantized")
    num_cpu_devices: int = _arg(0, "fake this many CPU devices (0: real devices)", check=_at_least(0), llm=False)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = _problem(f, getattr(self, f.name))
            if problem:
                raise ValueError(f"EngineArgs.{f.name} {problem}, got {getattr(self, f.name)!r}")

    # -- argparse ------------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, include: Collection[str] | None = None,
                     defaults: Mapping[str, Any] | None = None,
                     default_help: Mapping[str, str] | None = None) -> argparse._ArgumentGroup:
        """Add the engine flags (those named in `include`; default: all) to `parser`, as one group.

        `defaults` overrides a field's default for this CLI; `default_help` says what a None default means.
        """
        defaults, default_help = dict(defaults or {}), dict(default_help or {})
        unknown = (set(include or ()) | set(defaults) | set(default_help)) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"not engine arguments: {sorted(unknown)}")
        group = parser.add_argument_group("engine arguments")
        for f in dataclasses.fields(cls):
            if include is not None and f.name not in include:
                continue
            default = defaults.get(f.name, f.default)
            shown = default_help.get(f.name, f.metadata["default_help"] if default is None else "%(default)s")
            help = f.metadata["help"] + (f" (default: {shown})" if shown else "")
            flags = (_flag(f.name), *f.metadata["aliases"])
            kind = f.metadata["kind"]
            if kind is bool:
                action = group.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=help)
                action.help = help  # some Pythons' BooleanOptionalAction append a second "(default: ...)"
            else:
                group.add_argument(*flags, dest=f.name, type=_cli_type(f), choices=f.metadata["choices"],
                                   default=default, help=help, metavar=_METAVARS.get(kind))
        return group

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> EngineArgs:
        """The engine arguments parsed into `args` (fields the CLI lacks keep their defaults)."""
        values = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    def to_cli_args(self) -> list[str]:
        """The flags that give these arguments back, for a parser with EngineArgs' own defaults."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value == f.default:
                continue
            if f.metadata["kind"] is bool:
                argv.append(_flag(f.name) if value else "--no-" + _flag(f.name)[2:])
            else:
                argv += [_flag(f.name), json.dumps(value) if isinstance(value, dict) else str(value)]
        return argv

    # -- the engine ----------------------------------------------------------------------------
    def with_dcp(self, dcp: int) -> EngineArgs:
        """The same engine at DCP `dcp` (at DCP 1: interleave 1 and "ag_rs", the only valid ones)."""
        if dcp == 1:
            return dataclasses.replace(self, decode_context_parallel_size=1, cp_kv_cache_interleave_size=1,
                                       dcp_comm_backend="ag_rs")
        return dataclasses.replace(self, decode_context_parallel_size=dcp)

    def with_kv_bytes(self, bytes_per_device: int) -> EngineArgs:
        """The same engine with `bytes_per_device` of KV cache per device (to compare layouts at equal bytes)."""
        return dataclasses.replace(self, kv_cache_memory_bytes=int(bytes_per_device))

    def parallel_config(self) -> ParallelConfig:
        """The `ParallelConfig` of these arguments (raises ValueError naming a broken rule)."""
        return ParallelConfig(self.tensor_parallel_size, self.decode_context_parallel_size,
                              self.cp_kv_cache_interleave_size, self.dcp_comm_backend, self.enable_expert_parallel)

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `LLM(...)`."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["llm"]}

    def use_cpu_devices(self) -> None:
        """Fake `num_cpu_devices` CPU devices (if > 0); call before JAX creates its backends."""
        if self.num_cpu_devices:
            from dcpjax.sharding.devices import use_cpu_devices

            use_cpu_devices(self.num_cpu_devices)

    def create_engine_config(self) -> EngineConfig:
        """These arguments as one checked `EngineConfig` (raises ValueError naming a broken rule)."""
        values = self.llm_kwargs()
        for name in ("tensor_parallel_size", "decode_context_parallel_size", "cp_kv_cache_interleave_size",
                     "dcp_comm_backend", "enable_expert_parallel", "speculative_config", "trust_remote_code",
                     "kv_transfer_config"):
            del values[name]  # grouped below, or accepted only for vLLM's command lines
        return EngineConfig(parallel=self.parallel_config(),
                            speculative=SpeculativeConfig.from_dict(self.speculative_config),
                            kv_transfer=KVTransferConfig.from_value(self.kv_transfer_config), **values)
