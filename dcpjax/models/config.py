"""Model configuration read from a Hugging Face `config.json` (both spellings).

Current transformers writes `rope_parameters` (with `rope_theta` inside) and
`num_local_experts`; published checkpoints carry `rope_theta` + `rope_scaling`
and `num_experts`. Both are read into one `ModelConfig`.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Any

LLAMA_FAMILY = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ARCHITECTURES = LLAMA_FAMILY
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
    def from_hf(cls, config: dict[str, Any]) -> "RopeConfig":
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
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    dtype: str = "float32"  # the checkpoint's torch_dtype

    @property
    def use_mla(self) -> bool:
        return False

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "ModelConfig":
        """From a parsed `config.json`; ValueError names an unsupported architecture or field."""
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else None
        if architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {architecture!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
        heads = config["num_attention_heads"]
        eos = config.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
        window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
        return cls(
            architecture=architecture,
            vocab_size=config["vocab_size"],
            hidden_size=config["hidden_size"],
            intermediate_size=config["intermediate_size"],
            num_hidden_layers=config["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=config.get("num_key_value_heads") or heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            max_position_embeddings=config.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(config.get("attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            rope=RopeConfig.from_hf(config),
            sliding_window=window,
            bos_token_id=config.get("bos_token_id"),
            eos_token_id=eos,
            dtype=str(config.get("torch_dtype") or config.get("dtype") or "float32"),
        )

    @classmethod
    def from_pretrained(cls, folder: str | pathlib.Path) -> "ModelConfig":
        path = pathlib.Path(folder) / "config.json"
        if not path.is_file():
            raise ValueError(f"{folder} has no config.json: not a Hugging Face model folder")
        return cls.from_hf(json.loads(path.read_text()))

    def check_max_model_len(self, max_model_len: int) -> None:
        """Full attention equals sliding-window attention only within the window."""
        if self.sliding_window is not None and max_model_len > self.sliding_window:
            raise ValueError(
                f"this checkpoint uses sliding-window attention (window {self.sliding_window}), which dcpjax "
                f"does not implement; set max_model_len <= {self.sliding_window} (got {max_model_len})"
            )


# Built-in tiny configurations with random weights: the embedded default runs anywhere.
# Byte-level tokenizer: ids 0..255 are bytes, then BOS and EOS; vocab padded to 264.
BYTE_VOCAB, BYTE_BOS, BYTE_EOS = 264, 256, 257
TINY_MODELS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=2048, bos_token_id=BYTE_BOS, eos_token_id=(BYTE_EOS,),
        rope=RopeConfig(theta=10000.0),
    ),
    "tiny-qwen3": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=BYTE_VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=16, qk_norm=True,
        max_position_embeddings=2048, bos_token_id=BYTE_BOS, eos_token_id=(BYTE_EOS,),
        rope=RopeConfig(theta=1000000.0), tie_word_embeddings=True,
    ),
}
