"""Bytes DCP moves per decode step: the algorithm's formula, and the count read from compiled HLO.

Per layer and decode step, DCP's attention adds (`sharding.local_ops.dcp_attention`): an
all_gather of the KV-head group's queries over "dcp", then the LSE merge: all_gather of
the LSEs + psum_scatter of the outputs ("ag_rs"), or one all_to_all of outputs and LSEs
("a2a"). Bytes are those one device receives by ring algorithms. The planner uses the
formula; the tests and `benchmarks/attention.py` hold it to the HLO of a compiled step.
"""

from __future__ import annotations

import re

import numpy as np

_SHAPE = re.compile(r"(f32|bf16|f16|s32|u32|pred)\[([\d,]*)\]")
_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "pred": 1}
COLLECTIVES_PER_LAYER = {"ag_rs": 3, "a2a": 2}  # query all_gather, then the merge's one or two


def dcp_collective_bytes(*, tp: int, dcp: int, q_heads: int, dk: int, dv: int, batch: int, q_bytes: int,
                         comm: str) -> float:
    """Bytes one device receives per decode step and layer for DCP attention (0 at DCP 1).

    q_heads: the model's query heads (MLA: its heads; dk the absorbed query width, latent
    + rope; dv the latent width); q_bytes: the query dtype's size; LSEs and outputs are float32.
    """
    if dcp == 1:
        return 0.0
    group_heads = q_heads // (tp // dcp)  # the query heads of one KV-head group
    gather_q = batch * (q_heads // tp) * dk * q_bytes * (dcp - 1)
    if comm == "a2a":
        merge = batch * group_heads * (dv + 1) * 4 * (dcp - 1) / dcp
    else:
        merge = batch * group_heads * 4 * (dcp - 1) + batch * group_heads * dv * 4 * (dcp - 1) / dcp
    return gather_q + merge


def top_k_merge_bytes(*, dcp: int, batch: int, top_k: int) -> float:
    """Bytes one device receives per decode step and sparse layer for the exact global top-k
    (`sharding.sparse.merge_top_k`): an all_gather of every rank's top_k candidates, a float32
    score and an int32 position each (0 at DCP 1). Added to `dcp_collective_bytes`' query gather
    and merge, which a sparse layer keeps."""
    return 0.0 if dcp == 1 else batch * top_k * 8 * (dcp - 1)


def _shape_bytes(text: str) -> int:
    match = _SHAPE.search(text)
    dims = [int(d) for d in match.group(2).split(",") if d]
    return _BYTES[match.group(1)] * int(np.prod(dims, dtype=np.int64))


def hlo_collective_bytes(hlo_text: str, group: int) -> list[tuple[str, float]]:
    """(kind, bytes each device receives by ring algorithms) of every collective in compiled HLO
    text, for collectives over `group` devices. Results may be tuples (the CPU backend splits an
    all-to-all into one operand per peer)."""
    shapes = {}  # instruction name -> bytes of its (non-tuple) result
    for m in re.finditer(r"%(\S+) = (\w+\[[\d,]*\])", hlo_text):
        shapes[m.group(1)] = _shape_bytes(m.group(2))
    kinds = "all-gather|reduce-scatter|all-to-all|all-reduce|collective-permute"
    found = []
    for m in re.finditer(rf"%\S+ = (\(.*?\)|\S+) ({kinds})(?:-start)?\(([^)]*)\)", hlo_text):
        result = sum(_shape_bytes(t.group(0)) for t in _SHAPE.finditer(m.group(1)))
        operands = sum(shapes[name] for name in re.findall(r"%([^,\s]+)", m.group(3)))
        kind = m.group(2)
        if kind == "all-gather":
            moved = result * (group - 1) / group
        elif kind in ("reduce-scatter", "all-to-all"):
            moved = operands * (group - 1) / group
        elif kind == "all-reduce":
            moved = operands * 2 * (group - 1) / group
        else:
            moved = operands
        found.append((kind, moved))
    return found


def moe_collective_bytes(*, tokens: int, hidden: int, tp: int, act_bytes: int) -> float:
    """Bytes one device receives per routed-expert layer and step: the all-reduce (ring) of the
    [tokens, hidden] partial sums over all TP devices (0 at TP 1).

    The same with expert parallelism: attention leaves the activations replicated on every TP
    device, so each device runs its own whole experts on the tokens routed to them and this one
    reduction combines them, as it combines tensor-parallel experts' slices (no dispatch; see
    `ep_all_to_all_bytes` for what a dispatch would move instead).
    """
    return 0.0 if tp == 1 else 2 * (tp - 1) / tp * tokens * hidden * act_bytes


def ep_all_to_all_bytes(*, tokens: int, hidden: int, top_k: int, ep: int, act_bytes: int) -> float:
    """What an all_to_all dispatch would move per layer and step instead (for comparison; dcpjax
    does not build it): the tokens split over the EP devices, each token copy sent to its expert's
    device and its output sent back (two all_to_alls of tokens x top_k / EP rows each), then the
    outputs all-gathered so every device has every token again for the next attention."""
    if ep == 1:
        return 0.0
    copies = tokens * top_k / ep  # one device's token copies
    return 2 * copies * hidden * act_bytes * (ep - 1) / ep + tokens * hidden * act_bytes * (ep - 1) / ep
