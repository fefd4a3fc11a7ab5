"""Model configuration read from a Hugging Face `config.json` (both spellings).

Current transformers writes `rope_parameters` (with `rope_theta` inside) and
`num_local_experts`; published checkpoints carry `rope_theta` + `rope_scaling`
and `num_experts`. Both are read into one `ModelConfig`: the fields every family shares here,
a family's own (`ModelFamily.config_fields`: MLA, linear attention, q/k norms, ...) by its
module. This module knows no architecture: the registry registers each family's
(`register_architectures`) when `dcpjax.models` is imported, before any config is read.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dcpjax.quantization.formats import CheckpointQuantization

FULL_ATTENTION, LINEAR_ATTENTION, SLIDING_ATTENTION = "full_attention", "linear_attention", "sliding_attention"
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# config.json's hidden_act -> what the gated MLP applies to its gate (`layers.ACTIVATIONS`)
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: base theta and the scaling a checkpoint uses."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> RopeConfig:
        params = config.get("rope_parameters")
        if isinstance(params, dict) and "rope_theta" in params:
            params = dict(params)  # current transformers: theta inside
        else:
            params = dict(config.get("rope_scaling") or {})
            params["rope_theta"] = config.get("rope_theta", 10000.0)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"RoPE type {rope_type!r} is not supported; supported: {ROPE_TYPES}")
        fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in params.items() if k in fields and v is not None}
        original = params.get("original_max_position_embeddings") or config.get("max_position_embeddings")
        if rope_type == "yarn" and "factor" not in known:
            known["factor"] = config["max_position_embeddings"] / original
        return cls(
            theta=float(params["rope_theta"]), rope_type=rope_type,
            **{k: v for k, v in known.items() if k not in ("theta", "rope_type", "original_max_position_embeddings")},
            original_max_position_embeddings=original,
        )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """What the dcpjax models need from a checkpoint's config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2: always)
    qk_norm: bool = False  # RMSNorm on each q and k head before RoPE (Qwen3)
    rope: RopeConfig = RopeConfig()
    sliding_window: int | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: SwiGLU (silu) or GeGLU (gelu_pytorch_tanh, Gemma)
    # Gemma: softmax scale query_pre_attn_scalar ** -0.5 (None: head_dim ** -0.5); the sliding layers'
    # own RoPE (None: `rope`, every layer alike); embeddings times sqrt(hidden); norms after attention
    # and the MLP too ("sandwich"); logits soft-capped, cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None
    local_rope: RopeConfig | None = None
    embed_scale: float = 1.0
    sandwich_norms: bool = False
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: the attention scores soft-capped the same way
    # routed experts (Qwen3-MoE); sparse_layers lists the layers whose MLP is routed
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    sparse_layers: tuple[int, ...] = ()
    # DeepSeek-V3: multi-head latent attention and grouped sigmoid routing with shared experts
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False
    n_shared_experts: int = 0
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # DeepSeek-V3.2 / GLM-5 sparse attention (DSA): the lightning indexer's heads, their width, the
    # positions each query attends to (0: dense MLA) and its RoPE's pair layout (V3.2 half-split)
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_rope_interleave: bool = False
    index_shared_layers: tuple[int, ...] = ()  # GLM-5's "shared" indexer layers: the previous layer's top-k
    # Qwen3-Next: which layers are Gated DeltaNet (linear attention, a fixed-size state per
    # sequence) and which full attention (a KV cache, under DCP); Gemma: which attend through a
    # sliding window of `sliding_window` positions (a KV cache too); Qwen3-Next's full layers' sigmoid output
    # gate and partial RoPE; (1 + w) RMSNorms; a gated shared expert beside the routed ones
    layer_types: tuple[str, ...] = ()
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0
    attention_output_gate: bool = False
    partial_rotary_factor: float = 1.0
    norm_offset: float = 0.0
    shared_expert_intermediate_size: int = 0
    eos_token_id: tuple[int, ...] = ()
    # config.json's quantization_config (an fp8 checkpoint), None for an unquantized one
    quantization: CheckpointQuantization | None = None

    @property
    def use_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def use_sparse_attention(self) -> bool:
        """MLA over each query's top-k positions by the lightning indexer (DSA)."""
        return self.index_topk > 0

    @property
    def is_hybrid(self) -> bool:
        """Some layers keep a recurrent state instead of a KV cache."""
        return LINEAR_ATTENTION in self.layer_types

    def is_linear(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == LINEAR_ATTENTION

    def window_of(self, layer: int) -> int | None:
        """The sliding window of an attention layer (positions a query sees, itself included), None
        for full attention."""
        if self.layer_types and self.layer_types[layer] == SLIDING_ATTENTION:
            return self.sliding_window
        return None

    @property
    def has_sliding_layers(self) -> bool:
        return SLIDING_ATTENTION in self.layer_types

    def rope_of(self, layer: int) -> RopeConfig:
        """The RoPE of an attention layer: Gemma's sliding layers have their own base (and no scaling)."""
        return self.local_rope if self.local_rope is not None and self.window_of(layer) is not None else self.rope

    @property
    def attention_scale(self) -> float:
        """The softmax scale of the attention layers (MLA sets its own)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_kv_layers(self) -> int:
        """Layers with a KV cache (the full-attention ones): what KV bytes per token count."""
        return sum(not self.is_linear(i) for i in range(self.num_hidden_layers))

    @property
    def rotary_dim(self) -> int:
        """The leading dims of a head that RoPE rotates (partial rotary: a fraction of head_dim)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def linear_state_bytes(self, linear_heads_ways: int = 1) -> int:
        """Bytes of one sequence's state in all linear-attention layers (float32), on a device that
        holds 1 / `linear_heads_ways` of the heads: the causal convolution's last kernel - 1 inputs
        and the [value heads, key dim, value dim] delta-rule state."""
        layers = self.num_hidden_layers - self.num_kv_layers
        conv = (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim) * (self.linear_conv_kernel_dim - 1)
        recurrent = self.linear_num_value_heads * self.linear_key_head_dim * self.linear_value_head_dim
        return layers * 4 * (conv + recurrent) // linear_heads_ways

    @property
    def latent_dim(self) -> int:
        """Width of one cached MLA token: the compressed KV plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> ModelConfig:
        """From a parsed `config.json`; ValueError names an unsupported architecture or field."""
        if (part := text_part(config)) is not None:  # a multimodal checkpoint: its text model
            config = part.config(config)
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in _FAMILY_FIELDS:
            raise ValueError(
                f"architecture {architecture!r} is not supported; supported: {', '.join(_FAMILY_FIELDS)}"
            )
        own = _FAMILY_FIELDS[architecture](architecture, config)  # the family's checks come first
        fields = _shared_fields(config) | own
        if fields["hidden_act"] != "silu" and (fields.get("num_experts") or fields.get("kv_lora_rank")
                                               or LINEAR_ATTENTION in fields.get("layer_types", ())):
            # routed and shared experts, MLA's and the hybrid's MLPs apply silu whatever the config says
            raise ValueError(f"hidden_act {fields['hidden_act']!r} is supported for dense models only (routed "
                             "experts, MLA and hybrid models run silu)")
        if fields["hidden_act"] not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {fields['hidden_act']!r} is not supported "
                             f"(supported: {', '.join(HIDDEN_ACTS)})")
        return cls(architecture=architecture, **fields)

    @classmethod
    def from_pretrained(cls, folder: str | pathlib.Path) -> ModelConfig:
        path = pathlib.Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
        return cls.from_hf(json.loads(path.read_text()))

    def check_max_model_len(self, max_model_len: int) -> None:
        """A family that reads `sliding_window` but names no sliding layer (Mistral, Qwen2 with
        use_sliding_window) would run full attention: equal to the window only within it."""
        if self.sliding_window is not None and not self.has_sliding_layers and max_model_len > self.sliding_window:
            raise ValueError(
                f"this {self.architecture} checkpoint uses sliding-window attention (window {self.sliding_window}), "
                f"which dcpjax implements for Gemma's sliding layers but not yet for this family; set "
                f"max_model_len <= {self.sliding_window} (got {max_model_len})"
            )


def _shared_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The fields every family reads the same way (a family's `config_fields` may override any)."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    eos = config.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    experts = config.get("num_local_experts") or config.get("num_experts") or config.get("n_routed_experts") or 0
    step, dense_only = config.get("decoder_sparse_step", 1) or 1, set(config.get("mlp_only_layers") or [])
    first_sparse = config.get("first_k_dense_replace", 0)
    sparse = tuple(i for i in range(layers)
                   if experts and i not in dense_only and (i + 1) % step == 0 and i >= first_sparse)
    return dict(
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        intermediate_size=config["intermediate_size"],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        rope=RopeConfig.from_hf(config),
        sliding_window=window,
        hidden_act=config.get("hidden_act") or "silu",
        num_experts=experts,
        num_experts_per_tok=config.get("num_experts_per_tok", 0) if experts else 0,
        moe_intermediate_size=config.get("moe_intermediate_size", 0) if experts else 0,
        norm_topk_prob=bool(config.get("norm_topk_prob", False)),
        sparse_layers=sparse,
        eos_token_id=eos,
        quantization=CheckpointQuantization.from_hf(config.get("quantization_config")),
    )


# A family's reading of its own fields: (architecture, config.json) -> ModelConfig fields
ConfigFields = Callable[[str, dict[str, Any]], dict[str, Any]]
_FAMILY_FIELDS: dict[str, ConfigFields] = {}  # every supported architecture, in the registry's order


@dataclasses.dataclass(frozen=True)
class TextPart:
    """The text model inside a multimodal checkpoint (Gemma 3's 4B to 27B: `Gemma3ForConditionalGeneration`),
    read as its text-only architecture when its tensors are that model's under a prefix.

    architecture: the text model's; defaults: its config class's defaults, for the fields a nested
    `text_config` leaves out; prefixes: (checkpoint prefix, the text model's prefix) of its tensors,
    the first that matches renames a tensor, tensors no prefix matches (the vision tower) are not read.
    """

    architecture: str
    defaults: Mapping[str, Any]
    prefixes: tuple[tuple[str, str], ...]

    def config(self, config: dict[str, Any]) -> dict[str, Any]:
        """The text model's config.json: the defaults, its `text_config`, the outer eos ids if set."""
        text = {**self.defaults, **(config.get("text_config") or {}), "architectures": [self.architecture]}
        if config.get("eos_token_id") is not None:
            text["eos_token_id"] = config["eos_token_id"]
        return text

    def tensor_name(self, name: str) -> str | None:
        """The text model's name of checkpoint tensor `name`, None if it is not the text model's."""
        for prefix, ours in self.prefixes:
            if name.startswith(prefix):
                return ours + name[len(prefix):]
        return None


_TEXT_PARTS: dict[str, TextPart] = {}  # multimodal architectures whose text model dcpjax reads


def text_part(config: dict[str, Any]) -> TextPart | None:
    """The `TextPart` of a parsed config.json whose architecture is a multimodal wrapper, else None."""
    architectures = config.get("architectures") or []
    return _TEXT_PARTS.get(architectures[0]) if architectures else None

# Byte-level tokenizer of the built-in tiny models: ids 0..255 are bytes, then BOS and EOS; vocab padded to 264.
BYTE_VOCAB, BYTE_BOS, BYTE_EOS = 264, 256, 257
# Built-in tiny configurations with random weights (the embedded default runs anywhere), each
# declared by its family (`ModelFamily.tiny_models`) and gathered here by `register_architectures`.
TINY_MODELS: dict[str, ModelConfig] = {}


def register_architectures(architectures: Iterable[str], config_fields: ConfigFields,
                           tiny_models: Mapping[str, ModelConfig] | None = None,
                           text_parts: Mapping[str, TextPart] | None = None) -> None:
    """Make `from_hf` read a family's architectures (and the multimodal ones whose text model it
    reads) and list its tiny models (the registry calls this once per family: this module knows
    none itself, so the families can import it)."""
    for architecture in architectures:
        _FAMILY_FIELDS[architecture] = config_fields
    TINY_MODELS.update(tiny_models or {})
    _TEXT_PARTS.update(text_parts or {})
