"""Parallel configuration of one model replica: TP, DCP and how KV is split.

Names and rules follow vLLM (`tensor_parallel_size`, `decode_context_parallel_size`,
`cp_kv_cache_interleave_size`, `dcp_comm_backend`), so a vLLM launch line carries
over. Every rule that fails raises `ValueError` naming the rule, the numbers and
the sizes that would be valid.
"""

from __future__ import annotations

import dataclasses

COMM_BACKENDS = ("ag_rs", "a2a")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """How one model replica is spread over `tensor_parallel_size` devices.

    Attributes:
      tensor_parallel_size: devices of one replica (TP).
      decode_context_parallel_size: DCP; divides TP and re-uses TP ranks. KV
        tokens are split over DCP ranks, KV heads over the TP // DCP groups.
      cp_kv_cache_interleave_size: I; token p lives on DCP rank (p // I) % DCP.
      dcp_comm_backend: "ag_rs" (all_gather LSE + psum_scatter outputs) or
        "a2a" (one all_to_all of outputs and LSE).
      enable_expert_parallel: routed experts placed whole over the replica's TP devices
        (EP size = TP; vLLM's flag) instead of each split over all of them; attention, dense
        layers and shared experts keep their layout (`dcpjax.models.layers.expert_axes`).
    """

    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    dcp_comm_backend: str = "ag_rs"
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        # Types and names only: whether the sizes fit each other and a model is
        # `size_rule_violations` / `model_rule_violations`
        # (one list of rules, so every list of valid sizes comes from the rules that accept).
        for name in ("tensor_parallel_size", "decode_context_parallel_size", "cp_kv_cache_interleave_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
        if self.dcp_comm_backend not in COMM_BACKENDS:
            raise ValueError(
                f"dcp_comm_backend must be one of {COMM_BACKENDS}, got {self.dcp_comm_backend!r}."
            )
        if type(self.enable_expert_parallel) is not bool:  # a user's value: ValueError, as every check here
            raise ValueError(f"enable_expert_parallel must be a bool, got {self.enable_expert_parallel!r}.")

    # -- derived sizes -----------------------------------------------------
    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def interleave(self) -> int:
        return self.cp_kv_cache_interleave_size

    @property
    def kv_head_groups(self) -> int:
        """Size of the mesh's "tp" axis: the TP // DCP groups that split KV heads."""
        return self.tensor_parallel_size // self.decode_context_parallel_size

    # -- model rules --------------------------------------------------------
    def size_rule_violations(self) -> list[str]:
        """The rules between the sizes themselves, whatever the model, one sentence each."""
        tp, dcp = self.tp, self.dcp
        broken = []
        if tp % dcp != 0:
            broken.append(f"'tensor_parallel_size % decode_context_parallel_size == 0' failed: {tp} % {dcp} = "
                          f"{tp % dcp} (DCP re-uses TP ranks, so it must divide TP).")
        if self.dcp_comm_backend == "a2a" and dcp == 1:
            broken.append("'dcp_comm_backend=\"a2a\" needs decode_context_parallel_size > 1' failed: with DCP 1 "
                          "there is nothing to exchange (use dcp_comm_backend=\"ag_rs\", or DCP > 1).")
        return broken

    def model_rule_violations(self, num_attention_heads: int, num_kv_heads: int, use_mla: bool = False) -> list[str]:
        """Every rule this configuration breaks for this model, the size rules first, one sentence
        each (empty if valid)."""
        if broken := self.size_rule_violations():
            return broken
        tp, dcp, groups = self.tp, self.dcp, self.kv_head_groups
        q, kv = num_attention_heads, (1 if use_mla else num_kv_heads)
        if q < 1 or kv < 1 or q % kv != 0:
            return [f"'num_attention_heads % num_kv_heads == 0' failed: {q} query heads, {kv} KV heads."]
        broken = []
        if q % tp != 0:
            broken.append(f"'num_attention_heads % tensor_parallel_size == 0' failed: {q} % {tp} = {q % tp}.")
        if dcp > 1 and not use_mla:
            if not tp > kv:
                broken.append(
                    f"'tensor_parallel_size > num_kv_heads' failed: {tp} <= {kv}. TP already gives every "
                    "KV head its own devices, so there are no duplicate copies for DCP to remove."
                )
            elif not dcp <= tp // kv:
                broken.append(
                    f"'decode_context_parallel_size <= tensor_parallel_size // num_kv_heads' failed: "
                    f"{dcp} > {tp} // {kv} = {tp // kv}."
                )
            if (q // kv) % dcp != 0:
                broken.append(
                    f"'(num_attention_heads // num_kv_heads) % decode_context_parallel_size == 0' failed: "
                    f"({q} // {kv}) % {dcp} = {(q // kv) % dcp}."
                )
        # The q heads a DCP group gathers must all read KV heads that group holds
        # (vLLM asserts the same divisibility when it replicates KV heads).
        if not broken and not (kv % groups == 0 or groups % kv == 0):
            broken.append(
                f"'KV heads split evenly over the TP // DCP = {groups} KV head groups "
                f"(num_kv_heads % groups == 0 or groups % num_kv_heads == 0)' failed: {kv} KV heads."
            )
        return broken

    def valid_dcp_sizes(self, num_attention_heads: int, num_kv_heads: int, use_mla: bool = False) -> list[int]:
        """DCP sizes that would be valid for this model at this TP."""
        valid = []
        for d in _divisors(self.tp):
            backend = self.dcp_comm_backend if d > 1 else "ag_rs"
            candidate = dataclasses.replace(self, decode_context_parallel_size=d, dcp_comm_backend=backend)
            if not candidate.model_rule_violations(num_attention_heads, num_kv_heads, use_mla):
                valid.append(d)
        return valid

    def check(self) -> None:
        """Raise `ValueError` if the sizes break a rule whatever the model (a mesh needs this much;
        `validate` checks a model's rules too, and lists the sizes valid for it)."""
        if broken := self.size_rule_violations():
            valid = [d for d in _divisors(self.tp)
                     if not dataclasses.replace(self, decode_context_parallel_size=d,
                                                dcp_comm_backend=self.dcp_comm_backend if d > 1 else "ag_rs")
                     .size_rule_violations()]
            raise ValueError(f"Rule {' Rule '.join(broken).removesuffix('.')} — valid decode_context_parallel_size "
                             f"for tensor_parallel_size={self.tp} (before a model's own rules): {valid}.")

    @staticmethod
    def valid_tp_sizes(num_attention_heads: int, num_kv_heads: int, use_mla: bool = False) -> list[int]:
        """TP sizes that run this model (at DCP 1; `valid_dcp_sizes` then says which DCP sizes)."""
        return [t for t in _divisors(num_attention_heads)
                if not ParallelConfig(t).model_rule_violations(num_attention_heads, num_kv_heads, use_mla)]

    def validate(self, num_attention_heads: int, num_kv_heads: int, use_mla: bool = False) -> None:
        """Raise `ValueError` if this configuration cannot run the model.

        Args:
          num_attention_heads: query heads of the model.
          num_kv_heads: KV heads (ignored for MLA, which caches one latent "head").
          use_mla: the model uses multi-head latent attention (DeepSeek-V3, Kimi K2).
        """
        broken = self.model_rule_violations(num_attention_heads, num_kv_heads, use_mla)
        if not broken:
            return
        kind = "MLA (counts as 1 KV head)" if use_mla else f"{num_kv_heads} KV heads"
        valid = self.valid_dcp_sizes(num_attention_heads, num_kv_heads, use_mla)
        hint = (
            f"valid decode_context_parallel_size for tensor_parallel_size={self.tp}: {valid}"
            if valid
            else f"no decode_context_parallel_size works at tensor_parallel_size={self.tp}; the model allows "
            f"tensor_parallel_size {self.valid_tp_sizes(num_attention_heads, num_kv_heads, use_mla)}"
        )
        raise ValueError(
            f"tensor_parallel_size={self.tp}, decode_context_parallel_size={self.dcp} cannot run a model "
            f"with {num_attention_heads} query heads and {kind}: rule "
            + " Rule ".join(broken).removesuffix(".")  # each rule is a sentence: no ". (" before the hint
            + f" — {hint}."
        )


class TooFewDevicesError(ValueError):
    """A mesh needs more devices than are visible (`needed`, `visible`): a CLI names its own
    --num-cpu-devices flag as the fix."""

    def __init__(self, needed: int, visible: int, message: str):
        super().__init__(message)
        self.needed, self.visible = needed, visible
