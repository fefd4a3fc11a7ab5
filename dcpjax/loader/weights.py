"""Hugging Face weights -> sharded parameters, each device reading only its slice.

Every dcpjax parameter has a rule that maps the part a device holds (an index of
slices into the dcpjax layout) to the slice of the Hugging Face tensor it comes
from, so `jax.make_array_from_callback` reads exactly those bytes from a
`TensorSource`: safetensors files, a GGUF file (`dcpjax.loader.gguf_loader.GGUFSource`, the same
Hugging Face names and shapes) or an in-memory state dict for random tiny models.
Parameters padded for the mesh (`models.layers.PADDABLE_AXES`) read their true part
and zeros after it (`read_padded`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from dcpjax.config import ParallelConfig
from dcpjax.models.config import ModelConfig
from dcpjax.sharding.mesh import kv_head_slots, logical_spec

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
            # safe_open handles have keys() but are not iterable
            weight_map = {name: f for f, h in self.handles.items() for name in h.keys()}  # noqa: SIM118
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


def kv_b_part(hf_name, heads: int, nope: int, v: int, lora: int, part: str) -> Rule:
    """MLA's kv_b_proj [heads*(nope+v), lora] -> W_UK [heads, nope, lora] or W_UV [heads, v, lora]."""
    offset = 0 if part == "k" else nope

    def read(src, idx, shape):
        (h0, h1), (d0, d1), (c0, c1) = _bounds(idx, shape)
        block = src.read(hf_name, (slice(h0 * (nope + v), h1 * (nope + v)), slice(c0, c1)))
        return block.reshape(h1 - h0, nope + v, c1 - c0)[:, offset + d0 : offset + d1]

    return Rule({hf_name: (heads * (nope + v), lora)}, read)


def mlp_rules(ours: str, hf: str, hidden: int, intermediate: int) -> dict[str, Rule]:
    return {
        f"{ours}.gate": transposed(f"{hf}.gate_proj.weight", (intermediate, hidden)),
        f"{ours}.up": transposed(f"{hf}.up_proj.weight", (intermediate, hidden)),
        f"{ours}.down": transposed(f"{hf}.down_proj.weight", (hidden, intermediate)),
    }


def expert_rules(ours: str, hf: str, cfg: ModelConfig) -> dict[str, Rule]:
    e, moe, experts = cfg.hidden_size, cfg.moe_intermediate_size, range(cfg.num_experts)
    names = lambda proj: [f"{hf}.experts.{x}.{proj}.weight" for x in experts]
    return {
        f"{ours}.router": transposed(f"{hf}.gate.weight", (cfg.num_experts, e)),
        f"{ours}.gate": stacked_experts(names("gate_proj"), (moe, e)),
        f"{ours}.up": stacked_experts(names("up_proj"), (moe, e)),
        f"{ours}.down": stacked_experts(names("down_proj"), (e, moe)),
    }


def gqa_attention_rules(ours: str, hf: str, cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    e, d, heads, kv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    repeats = kv_head_slots(kv, pc) // kv
    rules = {
        f"{ours}.q_proj": head_rows(f"{hf}.q_proj.weight", heads, d, 1, e),
        f"{ours}.k_proj": head_rows(f"{hf}.k_proj.weight", kv, d, repeats, e),
        f"{ours}.v_proj": head_rows(f"{hf}.v_proj.weight", kv, d, repeats, e),
        f"{ours}.o_proj": output_heads(f"{hf}.o_proj.weight", heads, d, e),
    }
    if cfg.attention_bias:
        rules |= {
            f"{ours}.q_bias": head_rows(f"{hf}.q_proj.bias", heads, d, 1, None),
            f"{ours}.k_bias": head_rows(f"{hf}.k_proj.bias", kv, d, repeats, None),
            f"{ours}.v_bias": head_rows(f"{hf}.v_proj.bias", kv, d, repeats, None),
        }
    if cfg.qk_norm:
        rules |= {
            f"{ours}.q_norm.weight": same(f"{hf}.q_norm.weight", (d,)),
            f"{ours}.k_norm.weight": same(f"{hf}.k_norm.weight", (d,)),
        }
    return rules


def mla_attention_rules(ours: str, hf: str, cfg: ModelConfig) -> dict[str, Rule]:
    e, heads, lora = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    rules = {
        f"{ours}.kv_a": transposed(f"{hf}.kv_a_proj_with_mqa.weight", (lora + rope, e)),
        f"{ours}.kv_a_norm.weight": same(f"{hf}.kv_a_layernorm.weight", (lora,)),
        f"{ours}.w_uk": kv_b_part(f"{hf}.kv_b_proj.weight", heads, nope, v, lora, "k"),
        f"{ours}.w_uv": kv_b_part(f"{hf}.kv_b_proj.weight", heads, nope, v, lora, "v"),
        f"{ours}.o_proj": output_heads(f"{hf}.o_proj.weight", heads, v, e),
    }
    if cfg.q_lora_rank:
        rules |= {
            f"{ours}.q_a": transposed(f"{hf}.q_a_proj.weight", (cfg.q_lora_rank, e)),
            f"{ours}.q_a_norm.weight": same(f"{hf}.q_a_layernorm.weight", (cfg.q_lora_rank,)),
            f"{ours}.q_b": head_rows(f"{hf}.q_b_proj.weight", heads, nope + rope, 1, cfg.q_lora_rank),
        }
    else:
        rules[f"{ours}.q_proj"] = head_rows(f"{hf}.q_proj.weight", heads, nope + rope, 1, e)
    return rules


def model_rules(cfg: ModelConfig, pc: ParallelConfig) -> dict[str, Rule]:
    """dcpjax parameter path -> Rule, for every supported architecture."""
    e = cfg.hidden_size
    rules = {
        "embed.weight": same("model.embed_tokens.weight", (cfg.vocab_size, e)),
        "norm.weight": same("model.norm.weight", (e,)),
    }
    if not cfg.tie_word_embeddings:
        rules["lm_head.weight"] = transposed("lm_head.weight", (cfg.vocab_size, e))
    for i in range(cfg.num_hidden_layers):
        ours, hf = f"layers.{i}", f"model.layers.{i}"
        rules |= {
            f"{ours}.input_norm.weight": same(f"{hf}.input_layernorm.weight", (e,)),
            f"{ours}.post_attention_norm.weight": same(f"{hf}.post_attention_layernorm.weight", (e,)),
        }
        if cfg.use_mla:
            rules |= mla_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg)
        else:
            rules |= gqa_attention_rules(f"{ours}.attention", f"{hf}.self_attn", cfg, pc)
        if i not in cfg.sparse_layers:
            rules |= mlp_rules(f"{ours}.mlp", f"{hf}.mlp", e, cfg.intermediate_size)
            continue
        rules |= expert_rules(f"{ours}.mlp", f"{hf}.mlp", cfg)
        if cfg.use_mla:  # DeepSeek-V3: routing bias and shared experts
            rules[f"{ours}.mlp.correction_bias"] = same(f"{hf}.mlp.gate.e_score_correction_bias", (cfg.num_experts,))
            if cfg.n_shared_experts:
                rules |= mlp_rules(f"{ours}.mlp.shared", f"{hf}.mlp.shared_experts", e,
                                   cfg.moe_intermediate_size * cfg.n_shared_experts)
    return rules


def ignored_checkpoint_tensor(cfg: ModelConfig, name: str) -> bool:
    """Tensors a checkpoint may carry that dcpjax does not use (rotary caches, MTP layers)."""
    if IGNORED_CHECKPOINT_TENSORS.match(name):
        return True
    layer = re.match(r"model\.layers\.(\d+)\.", name)
    return layer is not None and int(layer.group(1)) >= cfg.num_hidden_layers  # DeepSeek's next-token layers


# -- loading -------------------------------------------------------------------------------
def check_checkpoint(rules: dict[str, Rule], source: TensorSource, ignored=lambda name: False) -> None:
    """Every expected tensor present with its shape, nothing unexplained left over."""
    expected = {name: shape for r in rules.values() for name, shape in r.tensors.items()}
    available = source.names()
    missing = sorted(set(expected) - available)
    extra = sorted(n for n in available - set(expected) if not IGNORED_CHECKPOINT_TENSORS.match(n) and not ignored(n))
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


def read_padded(rule: Rule, source: TensorSource, index: tuple[slice, ...], shape: tuple[int, ...],
                unpadded: tuple[int, ...]) -> np.ndarray:
    """A device's block of a parameter whose axes are padded past the checkpoint's `unpadded`
    sizes (see `models.layers.PADDABLE_AXES`): the true part read by `rule`, zeros after it."""
    bounds = _bounds(index, shape)
    if tuple(shape) == tuple(unpadded):
        return rule.read(source, index, shape)
    true_part = tuple(slice(min(a, n), min(b, n)) for (a, b), n in zip(bounds, unpadded))
    block = np.zeros([b - a for a, b in bounds], np.float32)
    if all(s.stop > s.start for s in true_part):
        values = rule.read(source, true_part, tuple(unpadded))
        block = block.astype(values.dtype)
        block[tuple(slice(0, n) for n in values.shape)] = values
    return block


def load_state(abstract_state: nnx.State, rules: dict[str, Rule], source: TensorSource, mesh: Mesh,
               progress: bool = True, ignored=lambda name: False) -> nnx.State:
    """Fill an abstract model state with sharded arrays read from `source`, each converted
    to the dtype its parameter was declared with (the model dtype; float32 for routers)."""
    check_checkpoint(rules, source, ignored)
    flat = list(nnx.to_flat_state(abstract_state))
    unknown = [_path_name(p) for p, _ in flat if _path_name(p) not in rules]
    if unknown:
        raise ValueError(f"no checkpoint rule for parameters: {unknown}")
    for path, var in tqdm(flat, desc="Loading weights", disable=not progress, unit="tensor"):
        rule, shape = rules[_path_name(path)], tuple(var.get_value().shape)
        unpadded = getattr(var, "unpadded_shape", shape)
        sharding = NamedSharding(mesh, logical_spec(*var.logical_axes))
        target = var.get_value().dtype
        read = lambda index, rule=rule, shape=shape, unpadded=unpadded, target=target: read_padded(
            rule, source, index, shape, unpadded).astype(target)
        var.set_value(jax.make_array_from_callback(shape, sharding, read))
    return abstract_state


def random_checkpoint(cfg: ModelConfig, pc: ParallelConfig, seed: int, std: float = 0.3) -> DictSource:
    """A random Hugging Face-layout state dict for a built-in tiny model (norms at 1)."""
    rng = np.random.default_rng(seed)
    tensors = {}
    expected = {name: shape for r in model_rules(cfg, pc).values() for name, shape in r.tensors.items()}
    for name in sorted(expected):
        if name.endswith("norm.weight") or "layernorm" in name:
            tensors[name] = np.ones(expected[name], np.float32)
        else:
            tensors[name] = (rng.standard_normal(expected[name]) * std).astype(np.float32)
    return DictSource(tensors)
