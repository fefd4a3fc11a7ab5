"""What a configuration cannot do with its model and its devices, found once the model's config is
read and before anything is placed, and reported all at once: a command line with two mistakes
(a TP the model's heads do not allow, too few devices for it) fails once, naming both.

The rules are the library's own (`ParallelConfig.model_rule_violations`, the model's positions),
so every list of valid sizes in a message is computed by the rules that accept.
"""

from __future__ import annotations

from dcpjax.models.config import ModelConfig
from dcpjax.sharding.config import ParallelConfig


class ConfigurationError(ValueError):
    """Every problem of one configuration, one sentence each (`problems`), and, when too few
    devices is among them, `devices` = (needed, visible, platform): a CLI names its own
    --num-cpu-devices flag as the fix (`entrypoints.cli`)."""

    def __init__(self, problems: list[str], devices: tuple[int, int, str] | None = None):
        self.problems, self.devices = list(problems), devices
        super().__init__(self.message(device_fix=None))

    def message(self, device_fix: str | None) -> str:
        """All problems in one line; `device_fix`: how to get more devices (None: the Python API's way)."""
        parts = list(self.problems)
        if self.devices is not None:
            needed, visible, platform = self.devices
            fix = device_fix or (f"on CPU, call dcpjax.use_cpu_devices({needed}) first thing in the program (or set "
                                 f"XLA_FLAGS=--xla_force_host_platform_device_count={needed} before JAX starts)")
            parts.append(f"tensor_parallel_size={needed} needs {needed} devices but {visible} {platform} device(s) "
                         f"are visible — {fix}")
        if len(parts) == 1:
            return parts[0]
        return f"{len(parts)} problems: " + " ".join(f"({i}) {p.rstrip('.')};" for i, p in enumerate(parts, 1))[:-1]


def max_model_len_problem(max_model_len: int | None, cfg: ModelConfig) -> str | None:
    """Why the engine cannot run `max_model_len` (None: the model's max_position_embeddings) on this
    model, or None: within its positions, and within a sliding window dcpjax does not implement."""
    value = max_model_len or cfg.max_position_embeddings
    if not 1 < value <= cfg.max_position_embeddings:
        return (f"max_model_len must be in [2, {cfg.max_position_embeddings}] for this model, got {value} — pass "
                f"--max-model-len {cfg.max_position_embeddings} or less (max_model_len= in Python), or leave it out "
                "for the model's own")
    try:
        cfg.check_max_model_len(value)
    except ValueError as err:
        return str(err)
    return None


def layout_problem(pc: ParallelConfig, cfg: ModelConfig) -> str | None:
    """Why `pc` cannot run this model's attention (its rules, with the sizes that would work), or None."""
    try:
        pc.validate(cfg.num_attention_heads, cfg.num_key_value_heads, use_mla=cfg.use_mla)
    except ValueError as err:
        return str(err)
    return None


def expert_parallel_problem(pc: ParallelConfig, cfg: ModelConfig) -> str | None:
    """Expert parallelism asked of a model without routed experts, or None."""
    if pc.enable_expert_parallel and not (cfg.num_experts and cfg.sparse_layers):
        return (f"enable_expert_parallel needs routed experts, and {cfg.architecture} has none (a dense model) "
                "— leave --enable-expert-parallel off")
    return None


def check_configuration(pc: ParallelConfig, cfg: ModelConfig, max_model_len: int | None, num_devices: int,
                        platform: str) -> int:
    """Every problem of running `cfg` on `pc` over `num_devices` devices of `platform`, raised at
    once as a `ConfigurationError`; else the max_model_len to run (the model's when None)."""
    problems = [p for p in (layout_problem(pc, cfg), expert_parallel_problem(pc, cfg),
                            max_model_len_problem(max_model_len, cfg)) if p]
    devices = (pc.tp, num_devices, platform) if num_devices < pc.tp else None
    if problems or devices:
        raise ConfigurationError(problems, devices)
    return max_model_len or cfg.max_position_embeddings
