"""Typed configuration (pydantic). Shells read the YAML; parsing and validation live here.

Defaults of the program-aware policy are those published for the Dynamo port of
ThunderAgent (DESIGN.md §3). Every validation error names the key it is about, with its
full dotted path, so an operator can find the line to fix.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

PolicyName = Literal[
    "program_aware",
    "round_robin",
    "least_loaded",
    "kv_aware",
    "sticky_least_loaded",
    "thunderagent",
    "continuum",
    "autellix",
]
POLICY_NAMES: tuple[str, ...] = PolicyName.__args__  # type: ignore[attr-defined]

Fraction = Annotated[float, Field(ge=0.0, le=4.0)]
NonNegative = Annotated[float, Field(ge=0.0)]
Positive = Annotated[float, Field(gt=0.0)]


# How far below pause_threshold a pause pass stops when pause_target is not given.
PAUSE_TARGET_GAP = 0.02


class _Strict(BaseModel):
    # strict: a YAML `true` or "100" is not silently taken for a number
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RetentionConfig(_Strict):
    """Retention-bias directives sent to engines (DESIGN.md §3 "Retention")."""

    enabled: bool = True
    active_priority: Annotated[int, Field(ge=0, le=100)] = 90
    ttl_s: Positive = 300.0
    # Re-send a Retain when less than this share of its TTL is left.
    refresh_fraction: Annotated[float, Field(gt=0.0, lt=1.0)] = 0.5


class ProgramAwareConfig(_Strict):
    """Thresholds of the program-aware policy; see DESIGN.md §3 for each key's meaning."""

    # v2 defaults (docs/design-notes.md "Policy v2"): pause only past the whole pool; the
    # v1 values (0.95 / 0.80 / 0.10, the Dynamo port's) held ~15% of the pool back. Left
    # out, pause_target is PAUSE_TARGET_GAP below pause_threshold (so a v1 file that sets
    # only the threshold stays valid).
    pause_threshold: Fraction = 1.0
    pause_target: Fraction = 1.0 - PAUSE_TARGET_GAP
    soft_band_penalty: float = -2.0
    resume_hysteresis: Annotated[float, Field(ge=0.0, le=1.0)] = 0.03
    buffer_per_program: Annotated[int, Field(ge=0)] = 100
    resume_priority_boost_s: NonNegative = 1.0
    force_resume_after_s: Positive = 1800.0
    acting_token_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    idle_release_s: Positive = 600.0
    tick_interval_s: Positive = 1.0
    # Tokens a REASONING call may still add (its output); Sluice's own default, sized to
    # a typical agent turn (see sim/workloads.py for the output-length distribution).
    growth_reserve_tokens: Annotated[int, Field(ge=0)] = 512
    # Aging for resume order: a waiting program's size counts half after this long, so a
    # large program is not bypassed forever by a stream of small ones.
    resume_aging_halflife_s: Positive = 60.0
    # Bounded waiting: a call held this long goes ahead (its program is resumed on its home,
    # else the emptiest worker, room or not). None: only force_resume_after_s bounds it.
    max_wait_s: Positive | None = 60.0
    # Dormancy: an ACTING program still in its tool call after the ``dormant_quantile`` of
    # recent tool-call durations (and at least ``dormant_min_s``) is likely in a long one:
    # its KV counts in U at ``dormant_token_weight`` until its next call. None: off.
    dormant_quantile: Annotated[float, Field(gt=0.0, lt=1.0)] | None = 0.5
    dormant_min_s: NonNegative = 90.0
    dormant_token_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    tool_time_window: Annotated[int, Field(ge=1)] = 1000
    retention: RetentionConfig = RetentionConfig()

    @model_validator(mode="before")
    @classmethod
    def _pause_target_follows_the_threshold(cls, data: Any) -> Any:
        if isinstance(data, dict) and "pause_target" not in data and "pause_threshold" in data:
            threshold = data["pause_threshold"]
            if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
                data = {**data, "pause_target": max(0.0, round(threshold - PAUSE_TARGET_GAP, 6))}
        return data

    @model_validator(mode="after")
    def _thresholds_are_ordered(self) -> ProgramAwareConfig:
        if self.pause_target > self.pause_threshold:
            raise ValueError(
                f"pause_target ({self.pause_target}) must be ≤ pause_threshold "
                f"({self.pause_threshold}): a pause pass stops at pause_target"
            )
        if self.resume_hysteresis > self.pause_threshold:
            raise ValueError(
                f"resume_hysteresis ({self.resume_hysteresis}) must be ≤ pause_threshold "
                f"({self.pause_threshold})"
            )
        return self


class BaselineConfig(_Strict):
    """Parameters of the baselines (DESIGN.md §4); each policy's docstring gives its source."""

    # least_loaded (VERL): sessions remembered for stickiness.
    sticky_lru_size: Annotated[int, Field(ge=1)] = 10_000
    # kv_aware (Dynamo KV router): weight of prefix overlap against load.
    kv_overlap_score_weight: NonNegative = 1.0
    # thunderagent: the original tick.
    thunderagent_tick_s: Positive = 5.0
    # continuum: TTL a program's KV is pinned for after each response — the cold-start
    # value, then this quantile of observed tool times, capped.
    continuum_ttl_s: Positive = 2.0
    continuum_ttl_quantile: Annotated[float, Field(gt=0.0, le=1.0)] = 0.8
    continuum_max_ttl_s: Positive = 60.0
    continuum_pin_priority: Annotated[int, Field(ge=0, le=100)] = 100
    # autellix (arXiv 2502.13965): a call of at most this many prompt tokens goes to the
    # least-used engine, a longer one to its program's engine (Algorithm 2: 2048).
    autellix_short_call_tokens: Annotated[int, Field(ge=0)] = 2048
    # autellix PLAS queues: K queues, Q_1 = [0, first_queue_s), each later bound `growth`
    # times the one before. The paper publishes no values; Sluice's, sized to agent turns.
    autellix_queues: Annotated[int, Field(ge=1, le=64)] = 8
    autellix_first_queue_s: Positive = 1.0
    autellix_queue_growth: Annotated[float, Field(gt=1.0)] = 2.0
    # autellix anti-starvation β: a call enters Q_1 when its program's waiting time is at
    # least β times its attained service (§4.2.2; no value published: Sluice's choice).
    autellix_starvation_ratio: Positive = 8.0
    # autellix attained service from usage: seconds per output token (one decode step) and
    # per computed prompt token (sim/step_time.py's llama3.1-8b-h100 preset).
    autellix_decode_token_s: Positive = 0.02
    autellix_prefill_token_s: Positive = 3.6e-5


class PolicyConfig(ProgramAwareConfig):
    """The ``policy:`` section: which policy runs, its thresholds and baseline knobs."""

    name: PolicyName = "program_aware"
    baselines: BaselineConfig = BaselineConfig()


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names every offending key."""


def _format_errors(err: ValidationError, prefix: str) -> str:
    lines = []
    for item in err.errors():
        loc = ".".join(str(part) for part in item["loc"])
        msg = item["msg"].removeprefix("Value error, ")
        if not loc:
            lines.append(f"{prefix}: {msg}" if prefix else msg)
        else:
            lines.append(f"{prefix + '.' if prefix else ''}{loc}: {msg}")
    return "\n".join(lines)


def parse_policy_config(data: Any, prefix: str = "policy") -> PolicyConfig:
    """Validate a mapping as a :class:`PolicyConfig`; errors name ``prefix.key``."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix}: expected a mapping, got {type(data).__name__}")
    try:
        return PolicyConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, prefix)) from None


def load_yaml_text(text: str, source: str) -> Any:
    """Parse YAML, turning syntax errors into a :class:`ConfigError` naming ``source``."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML: {err}") from None
    except RecursionError:
        # PyYAML composes and constructs nodes recursively, so a document nested deeper than
        # the interpreter's stack (e.g. ``[[[[...]]]]`` ~1,000 levels) would escape as a crash
        # of check-config or a 500 from a reload instead of a config problem.
        raise ConfigError(f"{source}: not valid YAML: nested too deeply to parse") from None


def parse_policy_yaml(text: str, source: str = "<config>") -> PolicyConfig:
    """Read the ``policy:`` section of a Sluice YAML document (other sections are the shells')."""
    data = load_yaml_text(text, source)
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    try:
        return parse_policy_config(data.get("policy"), "policy")
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
