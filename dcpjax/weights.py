"""Hugging Face weights -> sharded parameters, each device reading only its slice.

Every dcpjax parameter has a rule that maps the part a device holds (an index of
slices into the dcpjax layout) to the slice of the Hugging Face tensor it comes
from, so `jax.make_array_from_callback` reads exactly those bytes from the
safetensors files (or from an in-memory state dict for random tiny models).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from typing import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from dcpjax.config import ParallelConfig
from dcpjax.models.base import kv_head_slots
from dcpjax.models.config import ModelConfig
from dcpjax.sharding.mesh import logical_spec

IGNORED_CHECKPOINT_TENSORS = re.compile(r".*rotary_emb\.inv_freq$")


# -- where tensors come from -------------------------------------------------------------
class TensorSource:
    """Read a named tensor, or a slice of it, as numpy."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index: tuple[slice, ...]) -> np.ndarray:
        raise NotImplementedError


class DictSource(TensorSource):
    def __init__(self, tensors: Mapping[str, np.ndarray]):
        self.tensors = dict(tensors)

    def names(self):
        return set(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, index):
        return np.asarray(self.tensors[name][index])


class SafetensorsSource(TensorSource):
    """`*.safetensors` files of a folder, with or without `model.safetensors.index.json`."""

    def __init__(self, folder: str | pathlib.Path):
        from safetensors import safe_open

        folder = pathlib.Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in folder.glob("*.safetensors"))
            weight_map = None
        if not files:
            raise ValueError(f"{folder} has no *.safetensors files")
        self.handles = {f: safe_open(str(folder / f), framework="flax") for f in files}
        if weight_map is None:
            weight_map = {name: f for f, h in self.handles.items() for name in h.keys()}
        self.weight_map = weight_map

    def names(self):
        return set(self.weight_map)

    def shape(self, name):
        return tuple(self.handles[self.weight_map[name]].get_slice(name).get_shape())

    def read(self, name, index):
        return np.asarray(self.handles[self.weight_map[name]].get_slice(name)[index])


# -- rules: dcpjax layout <- checkpoint layout ------------------------------------------------
def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[tuple[int, int]]:
    return [s.indices(n)[:2] for s, n in zip(index, shape)]


@dataclasses.dataclass(frozen=True)
class Rule:
    """How one dcpjax parameter is read: the checkpoint tensors it comes from (name ->
    shape) and `read(source, index, shape)`, the slice mapping."""

    tensors: dict[str, tuple[int, ...]]
    read: Callable[[TensorSource, tuple[slice, ...], tuple[int, ...]], np.ndarray]


def same(hf_name, hf_shape) -> Rule:
    return Rule({hf_name: hf_shape}, lambda src, idx, shape: src.read(hf_name, idx))


def transposed(hf_name, hf_shape) -> Rule:
    """dcpjax [in, out] <- torch Linear [out, in]."""
    return Rule({hf_name: hf_shape}, lambda src, idx, shape: src.read(hf_name, idx[::-1]).T)


def stacked_experts(hf_names: list[str], hf_shape: tuple[int, int]) -> Rule:
    """dcpjax [experts, in, out] <- one torch Linear [out, in] per expert."""

    def read(src, idx, shape):
        (x0, x1), (i0, i1), (o0, o1) = _bounds(idx, shape)
        return np.stack([src.read(hf_names[e], (slice(o0, o1), slice(i0, i1))).T for e in range(x0, x1)])

    return Rule({name: hf_shape for name in hf_names}, read)


def head_rows(hf_name, heads: int, head_dim: int, repeats: int, hidden: int | None) -> Rule:
    """q/k/v projection ([heads*d, hidden] -> [hidden, slots, d]) or bias ([heads*d] -> [slots, d]).

    Slot s holds head s // repeats (KV heads repeated over the "tp" groups).
    """

    def read(src, idx, shape):
        bounds = _bounds(idx, shape)
        (s0, s1), (d0, d1) = bounds[-2], bounds[-1]
        h0, h1 = s0 // repeats, (s1 - 1) // repeats + 1
        rows = slice(h0 * head_dim, h1 * head_dim)
        if hidden is None:  # bias
            block = src.read(hf_name, (rows,)).reshape(h1 - h0, head_dim)
        else:
            e0, e1 = bounds[0]
            block = src.read(hf_name, (rows, slice(e0, e1))).reshape(h1 - h0, head_dim, e1 - e0)
        block = np.repeat(block, repeats, axis=0)[s0 - h0 * repeats : s1 - h0 * repeats, d0:d1]
        return block if hidden is None else np.moveaxis(block, 2, 0)

    hf_shape = (heads * head_dim,) if hidden is None else (heads * head_dim, hidden)
    return Rule({hf_name: hf_shape}, read)


def output_heads(hf_name, heads: int, head_dim: int, hidden: int) -> Rule:
    """O projection: [hidden, heads*d] -> [heads, d, hidden]."""

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (e0, e1) = _bounds(idx, shape)
        block = src.read(hf_name, (slice(e0, e1), slice(h0 * head_dim, h1 * head_dim)))
        return np.moveaxis(block.reshape(e1 - e0, h1 - h0, head_dim), 0, 2)[:, d0:d1]

    return Rule({hf_name: (hidden, heads * head_dim)}, read)


def vocab_rows(hf_name, vocab: int, hidden: int, transpose: bool) -> Rule:
    """Embedding [vocab, hidden] -> [vocab_padded, hidden] (or its transpose, the LM head); zero padding."""

    def read(src, idx, shape):
        bounds = _bounds(idx, shape)
        (v0, v1), (e0, e1) = bounds[::-1] if transpose else bounds
        real = src.read(hf_name, (slice(min(v0, vocab), min(v1, vocab)), slice(e0, e1)))
        block = np.zeros((v1 - v0, e1 - e0), real.dtype)
        block[: real.shape[0]] = real
        return block.T if transpose else block

    return Rule({hf_name: (vocab, hidden)}, read)


def llama_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """dcpjax parameter path -> Rule, for the Llama family."""
    e, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    repeats = kv_head_slots(kv, pc) // kv
    rules = {
        "embed.weight": vocab_rows("model.embed_tokens.weight", cfg.vocab_size, e, transpose=False),
        "norm.weight": same("model.norm.weight", (e,)),
    }
    if not cfg.tie_word_embeddings:
        rules["lm_head.weight"] = vocab_rows("lm_head.weight", cfg.vocab_size, e, transpose=True)
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        rules |= {
            f"{ours}.input_norm.weight": same(f"{hf}.input_layernorm.weight", (e,)),
            f"{ours}.post_attention_norm.weight": same(f"{hf}.post_attention_layernorm.weight", (e,)),
            f"{ours}.attention.q_proj": head_rows(f"{hf}.self_attn.q_proj.weight", heads, d, 1, e),
            f"{ours}.attention.k_proj": head_rows(f"{hf}.self_attn.k_proj.weight", kv, d, repeats, e),
            f"{ours}.attention.v_proj": head_rows(f"{hf}.self_attn.v_proj.weight", kv, d, repeats, e),
            f"{ours}.attention.o_proj": output_heads(f"{hf}.self_attn.o_proj.weight", heads, d, e),
        }
        if i in cfg.sparse_layers:
            experts, moe = range(cfg.num_experts), cfg.moe_intermediate_size
            rules |= {
                f"{ours}.mlp.router": transposed(f"{hf}.mlp.gate.weight", (cfg.num_experts, e)),
                f"{ours}.mlp.gate": stacked_experts([f"{hf}.mlp.experts.{x}.gate_proj.weight" for x in experts], (moe, e)),
                f"{ours}.mlp.up": stacked_experts([f"{hf}.mlp.experts.{x}.up_proj.weight" for x in experts], (moe, e)),
                f"{ours}.mlp.down": stacked_experts([f"{hf}.mlp.experts.{x}.down_proj.weight" for x in experts], (e, moe)),
            }
        else:
            rules |= {
                f"{ours}.mlp.gate": transposed(f"{hf}.mlp.gate_proj.weight", (f, e)),
                f"{ours}.mlp.up": transposed(f"{hf}.mlp.up_proj.weight", (f, e)),
                f"{ours}.mlp.down": transposed(f"{hf}.mlp.down_proj.weight", (e, f)),
            }
        if cfg.attention_bias:
            rules |= {
                f"{ours}.attention.q_bias": head_rows(f"{hf}.self_attn.q_proj.bias", heads, d, 1, None),
                f"{ours}.attention.k_bias": head_rows(f"{hf}.self_attn.k_proj.bias", kv, d, repeats, None),
                f"{ours}.attention.v_bias": head_rows(f"{hf}.self_attn.v_proj.bias", kv, d, repeats, None),
            }
        if cfg.qk_norm:
            rules |= {
                f"{ours}.attention.q_norm.weight": same(f"{hf}.self_attn.q_norm.weight", (d,)),
                f"{ours}.attention.k_norm.weight": same(f"{hf}.self_attn.k_norm.weight", (d,)),
            }
    return rules


# -- loading -------------------------------------------------------------------------------
def check_checkpoint(rules: dict[str, Rule], source: TensorSource) -> None:
    """Every expected tensor present with its shape, nothing unexplained left over."""
    expected = {name: shape for r in rules.values() for name, shape in r.tensors.items()}
    available = source.names()
    missing = sorted(set(expected) - available)
    extra = sorted(n for n in available - set(expected) if not IGNORED_CHECKPOINT_TENSORS.match(n))
    wrong = [f"{n}: checkpoint {source.shape(n)}, model expects {s}" for n, s in expected.items()
             if n in available and source.shape(n) != s]
    problems = []
    if missing:
        problems.append(f"missing tensors: {', '.join(missing[:10])}{' ...' if len(missing) > 10 else ''}")
    if extra:
        problems.append(f"unexpected tensors: {', '.join(extra[:10])}{' ...' if len(extra) > 10 else ''}")
    if wrong:
        problems.append("mis-shaped tensors: " + "; ".join(wrong[:10]))
    if problems:
        raise ValueError("checkpoint does not match the model config: " + " | ".join(problems))


def _path_name(path) -> str:
    return ".".join(str(getattr(p, "key", p)) for p in path)


def load_state(abstract_state: nnx.State, rules: dict[str, Rule], source: TensorSource, mesh: Mesh, dtype,
               progress: bool = True) -> nnx.State:
    """Fill an abstract model state with sharded arrays read from `source`."""
    check_checkpoint(rules, source)
    flat = list(nnx.to_flat_state(abstract_state))
    unknown = [_path_name(p) for p, _ in flat if _path_name(p) not in rules]
    if unknown:
        raise ValueError(f"no checkpoint rule for parameters: {unknown}")
    for path, var in tqdm(flat, desc="Loading weights", disable=not progress, unit="tensor"):
        rule, shape = rules[_path_name(path)], tuple(var.get_value().shape)
        sharding = NamedSharding(mesh, logical_spec(*var.logical_axes))
        read = lambda index, rule=rule, shape=shape: rule.read(source, index, shape).astype(dtype)
        var.set_value(jax.make_array_from_callback(shape, sharding, read))
    return abstract_state


def random_checkpoint(cfg: ModelConfig, pc: ParallelConfig, seed: int, std: float = 0.3) -> DictSource:
    """A random Hugging Face-layout state dict for a built-in tiny model (norms at 1)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    expected = {name: shape for r in llama_rules(cfg, pc).values() for name, shape in r.tensors.items()}
    for name in sorted(expected):
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = np.ones(expected[name], np.float32)
        else:
            tensors[name] = (rng.standard_normal(expected[name]) * std).astype(np.float32)
    return DictSource(tensors)
