"""One resolution of every value a plan depends on: command line > training config > plan profile > default.

Each value keeps where it came from (`--seq-len`, `conf/train.yaml:14`, `profile demo-plan`, `default`, or the
framework's own default such as `HF Trainer default`) and the lower-ranked values it overrode, so that every
printed plan can show them. A memory-relevant value that only the planner's default sets is a warning.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpuopt_tui.core.planner.trainconfig import TrainingConfig, display_path
from gpuopt_tui.core.profiles.plan import PlanSection
from gpuopt_tui.core.profiles.schema import AUTO

COMMAND_LINE = "command line"
CONFIG = "config"
PROFILE = "profile"
FRAMEWORK = "framework default"
DEFAULT = "default"


@dataclass(frozen=True)
class Role:
    name: str  # the TrainSetup field
    label: str  # as printed
    config_role: str  # trainconfig role
    profile_key: str  # PlanSection field
    memory: bool  # a value that changes the peak: warned about when only defaulted


ROLES: tuple[Role, ...] = (
    Role("micro_batch", "micro-batch", "batch_size", "micro_batch", True),
    Role("accumulate", "accumulation", "accumulate", "accumulate", False),
    Role("seq_len", "sequence length", "seq_len", "seq_len", True),
    Role("precision", "precision", "precision", "precision", True),
    Role("trainable", "trains", "trainable", "trainable", True),
    Role("lora_rank", "LoRA rank", "lora_rank", "lora_rank", True),
    Role("lora_targets", "LoRA targets", "lora_targets", "lora_targets", True),
    Role("gradient_checkpointing", "checkpointing", "gradient_checkpointing", "gradient_checkpointing", True),
    Role("n_gpus", "GPUs", "devices", "n_gpus", False),
    Role("zero_stage", "ZeRO stage", "zero_stage", "zero_stage", False),
    Role("n_positives", "positives per anchor", "n_positives", "n_positives", False),
    Role("n_negatives", "negatives per anchor", "n_negatives", "n_negatives", False),
)
LORA_ROLES = ("lora_rank", "lora_targets")
# when gradients are freed decides the peak; read from the framework the config is written for, not from a key
LOOP = Role("loop", "training loop", "", "loop", True)


@dataclass(frozen=True)
class Origins:
    """Which plan values the command line set (PlanSection key -> the flag, e.g. "--seq-len"; "model" for
    --model), and the name of the profile the others come from (None: no profile file, only defaults)."""

    flags: Mapping[str, str] = field(default_factory=dict)
    profile: str | None = None


@dataclass(frozen=True)
class Resolved:
    role: str
    label: str
    value: Any
    source: str  # as printed: "--seq-len", "conf/train.yaml:14", "profile demo-plan", "default"
    origin: str  # COMMAND_LINE, CONFIG, PROFILE, FRAMEWORK or DEFAULT
    overridden: tuple[str, ...] = ()  # lower-ranked values that lost, e.g. "32 (profile demo-plan)"
    note: str = ""

    @property
    def text(self) -> str:
        v = self.value
        if isinstance(v, bool):
            return "on" if v else "off"
        if isinstance(v, (tuple, list)):
            return ",".join(map(str, v))
        return str(v)


def show(value: Any) -> str:
    return Resolved("", "", value, "", "").text


def profile_value(plan: PlanSection, key: str) -> Any:
    """A profile value, or None when the profile leaves it to the config ("auto", an empty list)."""
    value = getattr(plan, key)
    return None if value == AUTO or value == [] else (tuple(value) if isinstance(value, list) else value)


def resolve_role(
    role: Role,
    flag_value: tuple[Any, str] | None,
    config_value: tuple[Any, str, str] | None,
    profile: tuple[Any, str] | None,
    framework: tuple[Any, str] | None,
    default: Any,
) -> Resolved:
    """The winner among the candidates, highest rank first; the others present are recorded as overridden."""
    ranked: list[tuple[Any, str, str, str]] = []  # value, source, origin, note
    if flag_value is not None:
        ranked.append((flag_value[0], flag_value[1], COMMAND_LINE, ""))
    if config_value is not None:  # value, where it is written, note
        ranked.append((*config_value[:2], CONFIG, config_value[2]))
    if profile is not None:
        ranked.append((profile[0], profile[1], PROFILE, ""))
    if framework is not None:
        ranked.append((framework[0], framework[1], FRAMEWORK, ""))
    ranked.append((default, "default", DEFAULT, ""))
    value, source, origin, note = ranked[0]
    lost = tuple(f"{show(v)} ({s})" for v, s, o, _ in ranked[1:] if o in (CONFIG, PROFILE) and v != value)
    return Resolved(role.name, role.label, value, source, origin, lost, note)


def resolve_setup_roles(
    plan: PlanSection,
    config: TrainingConfig | None,
    origins: Origins,
    defaults: Callable[[str], Any],
) -> dict[str, Resolved]:
    """Every TrainSetup role resolved; `defaults(name)` is the planner's default of a role."""
    out = {}
    layout = config.layout if config is not None else None
    for role in ROLES:
        flag = origins.flags.get(role.profile_key)
        in_profile = profile_value(plan, role.profile_key)
        flag_value = (in_profile, flag) if flag and in_profile is not None else None
        profile = (in_profile, origins.profile) if origins.profile and in_profile is not None and not flag else None
        config_value = None
        if config is not None:
            value, setting = config.typed(role.config_role)
            config_value = (value, setting.where, setting.note) if setting is not None else None
        framework = None
        if layout is not None and role.config_role in layout.defaults:
            framework = (layout.defaults[role.config_role], f"{layout.label} default")
        out[role.name] = resolve_role(role, flag_value, config_value, profile, framework, defaults(role.name))
    out[LOOP.name] = _resolve_loop(plan, config, origins, defaults(LOOP.name))
    return out


def _resolve_loop(plan: PlanSection, config: TrainingConfig | None, origins: Origins, default: str) -> Resolved:
    """The training loop: --loop, else the loop of the framework the config was detected as, else the profile's."""
    flag = origins.flags.get(LOOP.profile_key)
    in_profile = profile_value(plan, LOOP.profile_key)
    flag_value = (in_profile, flag) if flag and in_profile is not None else None
    profile = (in_profile, origins.profile) if origins.profile and in_profile is not None and not flag else None
    framework = None
    if config is not None and config.layout.loop is not None:
        framework = (config.layout.loop, display_path(config.path).as_posix(), f"the loop {config.layout.label} runs")
    return resolve_role(LOOP, flag_value, framework, profile, None, default)


def warnings(resolved: Mapping[str, Resolved]) -> list[str]:
    """Memory-relevant values that only the planner's default sets (LoRA's only when LoRA trains)."""
    lora = resolved["trainable"].value == "lora"
    out = []
    for role in ROLES:
        r = resolved[role.name]
        if not role.memory or r.origin != DEFAULT or (role.name in LORA_ROLES and not lora):
            continue
        out.append(f"{role.label} is set nowhere (command line, config or profile): planning for the default {r.text}")
    return out
