"""Typed configuration (pydantic). Shells read the YAML; parsing and validation live here.

The ``policy:`` section is one section per policy, a union discriminated by ``name``
(:data:`AnyPolicyConfig`): each section holds the keys its policy reads, and may carry other
policies' sections under their names for a file that configures a comparison
(:meth:`PolicyConfig.for_policy`). Defaults of the program-aware policy are those published
for the Dynamo port of ThunderAgent, moved where policy v2 says (architecture.md §3). Every
validation error names the key it is about, with its full dotted path, so an operator can
find the line to fix.
"""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal, get_args

from pydantic import Field, PrivateAttr, create_model, model_validator

from scheduler.config_types import (
    HOST_TIER_DEFAULTS,
    HOST_TIER_RETENTION_DEFAULTS,
    ConfigError,
    Fraction,
    NonNegative,
    Positive,
    RetentionConfig,
    Strict,
    host_tier_in,
    load_yaml_text,  # re-exported, as ConfigError: the shells read both from here
)

# How far below pause_threshold a pause pass stops when pause_target is not given.
PAUSE_TARGET_GAP = 0.02


def _carried() -> Any:
    """A field holding a section of another policy: read only when that policy runs from the
    same file (:meth:`PolicyConfig.for_policy`), so it is left out of the running config's
    dump."""
    return Field(default=None, exclude=True, repr=False)


class PolicyConfig(Strict):
    """The ``policy:`` section: one section per policy, chosen by ``name``
    (:data:`AnyPolicyConfig`, the union pydantic validates).

    The keys every policy reads live here; each section adds its own, and a key that
    belongs to another policy is an error naming it (a baseline carries no program-aware
    keys). A section may also carry the sections of other policies, each under its
    policy's name (``autellix: {queues: 4}``): one file then configures a comparison of
    several policies (``sluice sim --policy a,b --config``, a sweep), each reading its own
    (:meth:`for_policy`). The fields below the shared keys are that table of sections, in
    the order :data:`POLICY_NAMES` lists them.
    """

    name: str
    idle_release_s: Positive = 600.0
    # Tokens a REASONING call may still add (its output): what every policy's ledger counts
    # for a call in flight. Sluice's own default, sized to a typical agent turn (see
    # sim/workloads.py for the output-length distribution).
    growth_reserve_tokens: Annotated[int, Field(ge=0)] = 512
    # Deprecated: every baseline's keys in one bag; read once, to move each key to its
    # policy's section (:data:`BASELINE_KEYS_MOVED`), so a built section never holds it.
    baselines: BaselineConfig | None = _carried()

    program_aware: ProgramAwareConfig | None = _carried()
    thunderagent: ThunderAgentConfig | None = _carried()
    round_robin: RouterConfig | None = _carried()
    least_loaded: LeastLoadedConfig | None = _carried()
    kv_aware: KvAwareConfig | None = _carried()
    sticky_least_loaded: RouterConfig | None = _carried()
    continuum: ContinuumConfig | None = _carried()
    autellix: AutellixConfig | None = _carried()
    sticky_kv: StickyKvConfig | None = _carried()
    mori: MoriConfig | None = _carried()
    vllm_router: VllmRouterConfig | None = _carried()

    _deprecation_notes: tuple[str, ...] = PrivateAttr(default=())

    @property
    def deprecation_notes(self) -> tuple[str, ...]:
        """Deprecated keys this section (and the sections it carries) was read with, each
        with what to write instead."""
        carried = tuple(note for section in self.other_sections().values()
                        for note in section.deprecation_notes)
        return (*self._deprecation_notes, *carried)

    def other_sections(self) -> dict[str, PolicyConfig]:
        """The sections of other policies this one carries, by policy name."""
        return {name: section for name in POLICY_NAMES
                if (section := getattr(self, name)) is not None}

    @model_validator(mode="wrap")
    @classmethod
    def _one_section(cls, data: Any, handler: Any) -> PolicyConfig:
        """Refuse the keys of other policies, name the sections carried, and move the keys
        of the deprecated ``baselines:`` bag to their sections (with a note that is both
        emitted and kept on the config, ``deprecation_notes``)."""
        if not isinstance(data, dict):
            return handler(data)
        name = data.get("name", cls.model_fields["name"].default)
        _refuse_keys_of_other_policies(cls, data, name)
        data = _name_the_sections_carried(data, name)
        config = handler(data)
        if config.baselines is None:
            return config
        data, notes = _move_baseline_keys(data, config.baselines, config.name)
        config = handler(data)
        config._deprecation_notes = (*config._deprecation_notes, *notes)
        for note in notes:
            warnings.warn(note, FutureWarning, stacklevel=2)
        return config

    def for_host_tier(self) -> PolicyConfig:
        """This section for workers that have a host KV tier (a policy that knows the tier
        overrides it; the others run as they are, with vLLM's native offloading)."""
        return self

    def for_policy(self, name: str) -> PolicyConfig:
        """The section policy ``name`` runs with from this file: its own section carried
        here (if any), over the keys both sections take, carried over from this one."""
        if name == self.name:
            return self
        target = section_class(name)
        carried = {key: getattr(self, key) for key in target.model_fields
                   if key in type(self).model_fields and key not in _NOT_CARRIED}
        own = getattr(self, name)
        keys = own.model_dump(exclude_unset=True) if own is not None else {}
        return target.model_validate({**carried, **keys, "name": name})


class ProgramAwareConfig(PolicyConfig):
    """The ``policy:`` section of Sluice's program-aware policy (``name: program_aware``, the
    default); scheduler/policies/program_aware/ says what each rule does."""

    name: Literal["program_aware"] = "program_aware"

    # v2 defaults (docs/design-notes.md "Policy v2"): pause only past the whole pool; the
    # v1 values (0.95 / 0.80 / 0.10, the Dynamo port's) held ~15% of the pool back. Left
    # out, pause_target is PAUSE_TARGET_GAP below pause_threshold (so a v1 file that sets
    # only the threshold stays valid).
    pause_threshold: Fraction = 1.0
    pause_target: Fraction = 1.0 - PAUSE_TARGET_GAP
    # Calls admitted to a worker with pause_target ≤ U < pause_threshold go this much later
    # in its queue, and new programs' routing counts it against that worker. It replaces the
    # signed soft_band_penalty, whose sign was never used (still read, as its magnitude).
    soft_band_delay_s: NonNegative = 2.0
    resume_hysteresis: Annotated[float, Field(ge=0.0, le=1.0)] = 0.03
    buffer_per_program: Annotated[int, Field(ge=0)] = 100
    resume_priority_boost_s: NonNegative = 1.0
    # A held call counts in the engine's queue as arrived at most this long before it is let
    # go (then the boost): with its whole hold it went ahead of minutes of queue under compute
    # overload and the engines preempted running calls for it (design notes "The engine
    # priority"). None: its whole hold.
    held_call_lead_s: NonNegative | None = 0.0
    force_resume_after_s: Positive = 1800.0
    acting_token_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    tick_interval_s: Positive = 1.0
    # Aging for resume order: a waiting program's size counts half after this long, so a
    # large program is not bypassed forever by a stream of small ones.
    resume_aging_halflife_s: Positive = 60.0
    # Bounded waiting: a call held this long goes ahead (its program is resumed on its home,
    # else the emptiest worker, room or not). None: only force_resume_after_s bounds it.
    max_wait_s: Positive | None = 60.0
    # ... stretched when the fleet is oversubscribed past this many pools (what the programs
    # that want to run ask of the KV: the active load plus the held programs' demand), in
    # proportion, at most ``max_wait_stretch`` times: a program must wait longer when more
    # want the room, and waits bounded below that only swap programs in and out by force
    # (design notes "Waiting under deep overload"). None: max_wait_s as it is.
    wait_stretch_from: Positive | None = 1.5
    max_wait_stretch: Annotated[float, Field(ge=1.0)] = 2.25
    # Bounded work per tick: at most this many programs resume by force in one tick (overdue
    # calls, then force_resume_after_s), earliest deadline first; the rest stay due and go
    # in the following ticks (design notes "Bounded waiting"). None: no cap.
    max_forced_per_tick: Annotated[int, Field(ge=1)] | None = 8
    # Dormancy: an ACTING program still in its tool call after the ``dormant_quantile`` of
    # recent tool-call durations (and at least ``dormant_min_s``) is likely in a long one:
    # its KV counts in U at ``dormant_token_weight`` until its next call. None: off.
    dormant_quantile: Annotated[float, Field(gt=0.0, lt=1.0)] | None = 0.5
    dormant_min_s: NonNegative = 90.0
    dormant_token_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    tool_time_window: Annotated[int, Field(ge=1)] = 1000
    # With ``retention.host_tier``: a worker whose programs' contexts (all of them, dormant
    # and paused ones included) add up to at most this many GPU pools pauses none of them
    # (what overflows the GPU waits in the tier); past it, and until every program it then
    # paused is back, ``pause_threshold`` rules as without a tier. A multiple of the GPU
    # pool, not a share: the tier is several times the pool (llama3.1-8b-h100: 3.8×).
    host_tier_overcommit: Annotated[float, Field(gt=0.0, le=10.0)] = 2.5
    retention: RetentionConfig = RetentionConfig()

    @model_validator(mode="wrap")
    @classmethod
    def _renamed_keys(cls, data: Any, handler: Any) -> ProgramAwareConfig:
        """Accept ``soft_band_penalty`` (deprecated) as ``soft_band_delay_s`` = its magnitude,
        with a warning that is both emitted and kept on the config (``deprecation_notes``)."""
        notes: list[str] = []
        if isinstance(data, dict) and "soft_band_penalty" in data:
            data = dict(data)
            penalty = data.pop("soft_band_penalty")
            if "soft_band_delay_s" in data:
                raise ValueError("soft_band_penalty and soft_band_delay_s both set: keep only "
                                 "soft_band_delay_s (soft_band_penalty is its deprecated name)")
            if isinstance(penalty, (int, float)) and not isinstance(penalty, bool):
                penalty = abs(float(penalty))
            data["soft_band_delay_s"] = penalty
            notes.append(f"soft_band_penalty is deprecated: read as soft_band_delay_s: {penalty} "
                         "(its magnitude); rename the key")
        config = handler(data)
        if notes:
            config._deprecation_notes = (*config._deprecation_notes, *notes)
            for note in notes:
                warnings.warn(note, FutureWarning, stacklevel=2)
        return config

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        """The defaults that depend on other keys: with ``retention.host_tier`` the keys of
        :data:`HOST_TIER_DEFAULTS` the file leaves out take those values; then a left-out
        ``pause_target`` follows ``pause_threshold``."""
        if isinstance(data, dict) and host_tier_in(data.get("retention")):
            data = {**HOST_TIER_DEFAULTS, **data}
            retention = data["retention"]
            if isinstance(retention, dict):
                data["retention"] = {**HOST_TIER_RETENTION_DEFAULTS, **retention}
            elif isinstance(retention, RetentionConfig):
                unset = {key: value for key, value in HOST_TIER_RETENTION_DEFAULTS.items()
                         if key not in retention.model_fields_set}
                data["retention"] = RetentionConfig(**retention.model_dump(exclude_unset=True), **unset)
        if isinstance(data, dict) and "pause_target" not in data and "pause_threshold" in data:
            threshold = data["pause_threshold"]
            if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
                data = {**data, "pause_target": max(0.0, round(threshold - PAUSE_TARGET_GAP, 6))}
        return data

    def for_host_tier(self) -> ProgramAwareConfig:
        """This section for workers that have a host KV tier: ``retention.host_tier`` on
        (with the tier defaults of the keys left unset), unless the section set it itself."""
        if "host_tier" in self.retention.model_fields_set:
            return self
        keys = {**self.model_dump(exclude_unset=True), **self.other_sections()}
        keys["retention"] = {**keys.get("retention", {}), "host_tier": True}
        return type(self).model_validate(keys)

    @model_validator(mode="after")
    def _thresholds_are_ordered(self) -> ProgramAwareConfig:
        if self.pause_target > self.pause_threshold:
            raise ValueError(
                f"pause_target ({self.pause_target}) must be ≤ pause_threshold "
                f"({self.pause_threshold}): a pause pass stops at pause_target"
            )
        if self.host_tier_overcommit < self.pause_threshold:
            raise ValueError(
                f"host_tier_overcommit ({self.host_tier_overcommit}) must be ≥ pause_threshold "
                f"({self.pause_threshold}): with a host tier a worker runs unpaused up to it"
            )
        if self.resume_hysteresis > self.pause_threshold:
            raise ValueError(
                f"resume_hysteresis ({self.resume_hysteresis}) must be ≤ pause_threshold "
                f"({self.pause_threshold})"
            )
        return self


class ThunderAgentConfig(PolicyConfig):
    """ThunderAgent as published: only what the published code lets an operator set. Its
    thresholds are pinned (scheduler/policies/thunderagent.py)."""

    name: Literal["thunderagent"] = "thunderagent"
    force_resume_after_s: Positive = 1800.0
    acting_token_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    # The published scheduler interval (its --scheduler-interval): its tick, and its only one.
    # Not named tick_interval_s so that a comparison's file does not hand it program_aware's.
    scheduler_interval_s: Positive = 5.0

    @property
    def tick_interval_s(self) -> float:
        return self.scheduler_interval_s


class MoriConfig(ThunderAgentConfig):
    """MORI, arXiv 2606.00866: ThunderAgent's keys (MORI is built on ThunderAgent, §5) and its
    own; scheduler/policies/mori.py says where each value comes from."""

    name: Literal["mori"] = "mori"  # type: ignore[assignment]
    # Cycles (a call, then the tool call after it) the idleness is read over (§4.2: k = 5).
    idleness_window: Annotated[int, Field(ge=1)] = 5
    # The idleness of a program none of whose cycles was seen, where Eq. 1 is undefined
    # (Sluice's choice: the midpoint, neither busy nor idle).
    unobserved_idleness: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    # Each worker's host KV tier in tokens (0: none, a program is on GPU or waits); the
    # simulator sets it from the tier it runs with (`--kv-offload-gb`).
    host_tier_tokens: Annotated[int, Field(ge=0)] = 0


class _Router(PolicyConfig):
    """The keys of a router without admission control (every call admitted on arrival)."""

    tick_interval_s: Positive = 1.0


class RouterConfig(_Router):
    """The section of the routers without keys of their own: round_robin and
    sticky_least_loaded (scheduler/policies/routing.py)."""

    name: Literal["round_robin", "sticky_least_loaded"]


class LeastLoadedConfig(_Router):
    """VERL's least-loaded balancer (scheduler/policies/routing.py)."""

    name: Literal["least_loaded"] = "least_loaded"
    # Sessions remembered for stickiness (VERL's routing cache size).
    sticky_lru_size: Annotated[int, Field(ge=1)] = 10_000


class KvAwareConfig(_Router):
    """Dynamo's KV router (scheduler/policies/routing.py)."""

    name: Literal["kv_aware"] = "kv_aware"
    # Weight of prefix overlap against load (Dynamo's --router-kv-overlap-score-weight).
    kv_overlap_score_weight: NonNegative = 1.0


class StickyKvConfig(_Router):
    """Session-sticky KV routing with a load valve (scheduler/policies/sticky_kv.py)."""

    name: Literal["sticky_kv"] = "sticky_kv"
    # A new session's worker: Dynamo's KV cost (its --router-kv-overlap-score-weight, 1.0).
    kv_overlap_score_weight: NonNegative = 1.0
    # The valve: a session leaves its worker when that worker has more than this many calls
    # in flight over the least-loaded one and more than this many times as many (SGLang
    # router's cache-aware --balance-abs-threshold 64 and --balance-rel-threshold 1.5).
    balance_abs_threshold: Annotated[int, Field(ge=0)] = 64
    balance_rel_threshold: Annotated[float, Field(ge=1.0)] = 1.5


# Continuum's keys that CacheTTL's τ* replaced: refused, naming the key and why.
CONTINUUM_REMOVED_KEYS = {
    "ttl_quantile": "the TTL is now CacheTTL's cost–benefit τ* (arXiv 2511.02230v4 §4.2), not a "
                    "quantile of tool times; remove the key",
}


class ContinuumConfig(_Router):
    """Continuum / CacheTTL's TTL pinning (scheduler/policies/continuum.py says where each
    value comes from): a program's KV is pinned after each response for τ*, the TTL of the
    best expected benefit over the observed tool times, or ``ttl_s`` until enough are seen."""

    name: Literal["continuum"] = "continuum"
    # The cold-start TTL (the preview code's fixed 2 s threshold) until more than
    # cold_start_samples tool times are observed (the paper's K = 100, §4.2).
    ttl_s: Positive = 2.0
    cold_start_samples: Annotated[int, Field(ge=1)] = 100
    # Sluice's cap on τ* (the paper has none: a TTL always ends).
    max_ttl_s: Positive = 60.0
    pin_priority: Annotated[int, Field(ge=0, le=100)] = 100
    # Prefill-Reload per context token: recompute (prefill_token_s) or, with a host KV tier
    # (host_tier, set by the runs whose workers have one), reload over the host link
    # (reload_token_s); decode_token_s prices an output token to tell a call's queueing
    # delay from its service. sim/step_time.py's llama3.1-8b-h100 preset: 36 µs, 131,072
    # KV bytes at 50 GB/s, 20 ms (a preset file's own values where it is given).
    prefill_token_s: Positive = 3.6e-5
    reload_token_s: Positive = 2.62144e-6
    decode_token_s: Positive = 0.02
    host_tier: bool = False

    @model_validator(mode="before")
    @classmethod
    def _refuse_removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in CONTINUUM_REMOVED_KEYS.items():
                if key in data:
                    raise ValueError(f"{key}: continuum no longer takes it: {why}")
        return data

    def for_host_tier(self) -> ContinuumConfig:
        """With a host tier a pin saves a reload, not a recompute (unless the file said)."""
        if "host_tier" in self.model_fields_set:
            return self
        return self.model_copy(update={"host_tier": True})


class AutellixConfig(_Router):
    """Autellix, arXiv 2502.13965 (scheduler/policies/autellix.py says where each value
    comes from)."""

    name: Literal["autellix"] = "autellix"
    # A call of at most this many prompt tokens goes to the least-used engine, a longer one
    # to its program's engine (Algorithm 2: 2048).
    short_call_tokens: Annotated[int, Field(ge=0)] = 2048
    # PLAS queues: K queues, Q_1 = [0, first_queue_s), each later bound `queue_growth` times
    # the one before. The paper publishes no values; Sluice's, sized to agent turns.
    queues: Annotated[int, Field(ge=1, le=64)] = 8
    first_queue_s: Positive = 1.0
    queue_growth: Annotated[float, Field(gt=1.0)] = 2.0
    # Anti-starvation β: a call enters Q_1 when its program's waiting time is at least β
    # times its attained service (§4.2.2; no value published: Sluice's choice).
    starvation_ratio: Positive = 8.0
    # Attained service from usage: seconds per output token (one decode step) and per
    # computed prompt token (sim/step_time.py's llama3.1-8b-h100 preset).
    decode_token_s: Positive = 0.02
    prefill_token_s: Positive = 3.6e-5


class VllmRouterConfig(PolicyConfig):
    """vllm-router's program scheduling (scheduler/policies/vllm_router/). Defaults are those of
    the Configuration reference of vllm-project/router docs/program_scheduling.md (the doc),
    under their names there, unless a comment says otherwise."""

    name: Literal["vllm_router"] = "vllm_router"
    # The doc's metrics_interval_seconds, its periodic scheduling interval: the tick. Not named
    # tick_interval_s so that a comparison's file does not hand it program_aware's.
    scheduler_interval_s: Positive = 1.0
    # The doc's default is false; its text recommends true, and Sluice takes the recommendation.
    global_queue: bool = True
    # Rank-local resume order (cross-rank resume is always FCFS).
    resume_order: Literal["mru", "fcfs"] = "mru"
    # A destination needs the source's free tokens plus this many times the program's context.
    cross_rank_headroom_ratio: NonNegative = 1.2
    # Virtual nodes per worker on the consistent-hash ring of initial binding.
    hash_virtual_nodes: Annotated[int, Field(ge=1)] = 160
    # Active programs a worker takes at most (forced resumes excepted).
    max_active_programs_per_target: Annotated[int, Field(ge=1)] = 64
    # The longest a call waits in the pool; past it its program is released.
    queue_timeout_seconds: Positive = 600.0
    # The upper bound (and cold-start value) of the workload-derived force-resume deadline.
    force_resume_timeout_seconds: Positive = 300.0
    # An idle paused program is released after this long.
    paused_retention_ttl_seconds: Positive = 1800.0
    # Tokens every active program holds for its output beyond its context.
    decode_buffer_tokens: Annotated[int, Field(ge=0)] = 100
    # The cap of the acting TTL fitted to the interval window.
    max_acting_ttl_seconds: NonNegative = 10.0
    # Capacity repair starts above high x capacity and stops at low x capacity, the
    # admission and resume limit.
    high_watermark_ratio: Fraction = 1.0
    low_watermark_ratio: Fraction = 1.0
    # Continuous rounds after which an idle program yields to a waiter on its worker.
    max_segment_rounds: Annotated[int, Field(ge=1)] = 14
    # Samples each worker's windows need before their estimates replace the cold-start zeros.
    stats_window_size: Annotated[int, Field(ge=1)] = 100
    # Modelled decode batch gain may stand in for the growth reserve.
    enable_batch_gain_admission: bool = True
    # The cold-prefill model, seconds = intercept + linear x + quadratic x^2 (x: uncached
    # tokens / 1000), and the decode throughput kept while prefill mixes in. The simulator
    # takes the first three from its preset unless set here (sim/step_time.py).
    prefill_intercept_seconds: NonNegative = 0.06600061907132926
    prefill_linear_seconds_per_1k_tokens: NonNegative = 0.05702024012166613
    prefill_quadratic_seconds_per_1k_tokens_squared: NonNegative = 0.0044057347937978475
    decode_throughput_alpha: Annotated[float, Field(ge=0.0, le=1.0)] = 0.15
    # The decode step, seconds = fixed + per_request B + per_context_token C; the simulator
    # takes all three from its preset unless set here.
    decode_fixed_step_seconds: Positive = 0.010635218423115973
    decode_batch_step_seconds_per_request: NonNegative = 0.0004192803698834784
    decode_context_step_seconds_per_token: NonNegative = 1.420458414996201e-7

    @property
    def tick_interval_s(self) -> float:
        return self.scheduler_interval_s

    @model_validator(mode="after")
    def _watermarks_are_ordered(self) -> VllmRouterConfig:
        if self.low_watermark_ratio > self.high_watermark_ratio:
            raise ValueError(f"low_watermark_ratio ({self.low_watermark_ratio}) must be ≤ "
                             f"high_watermark_ratio ({self.high_watermark_ratio})")
        return self


DEFAULT_POLICY = "program_aware"


def _carried_section_type(annotation: Any) -> type[PolicyConfig] | None:
    """The section type of a field ``X | None`` whose X is a policy section, else None."""
    for arg in get_args(annotation):
        if isinstance(arg, type) and issubclass(arg, PolicyConfig):
            return arg
    return None


# Where each key of the deprecated ``baselines:`` bag now lives: its section and its key there.
_BASELINE_KEYS: dict[str, tuple[type[PolicyConfig], str]] = {
    "sticky_lru_size": (LeastLoadedConfig, "sticky_lru_size"),
    "kv_overlap_score_weight": (KvAwareConfig, "kv_overlap_score_weight"),
    "thunderagent_tick_s": (ThunderAgentConfig, "scheduler_interval_s"),
    "continuum_ttl_s": (ContinuumConfig, "ttl_s"),
    "continuum_max_ttl_s": (ContinuumConfig, "max_ttl_s"),
    "continuum_pin_priority": (ContinuumConfig, "pin_priority"),
    "autellix_short_call_tokens": (AutellixConfig, "short_call_tokens"),
    "autellix_queues": (AutellixConfig, "queues"),
    "autellix_first_queue_s": (AutellixConfig, "first_queue_s"),
    "autellix_queue_growth": (AutellixConfig, "queue_growth"),
    "autellix_starvation_ratio": (AutellixConfig, "starvation_ratio"),
    "autellix_decode_token_s": (AutellixConfig, "decode_token_s"),
    "autellix_prefill_token_s": (AutellixConfig, "prefill_token_s"),
}
# The same, by policy name: what a deprecation note names.
BASELINE_KEYS_MOVED: dict[str, tuple[str, str]] = {
    old: (section.model_fields["name"].default, key) for old, (section, key) in _BASELINE_KEYS.items()
}

# The deprecated bag's fields are its keys' fields in their new sections (the same types and
# bounds), so a wrong value is refused naming the key where the file wrote it
# (policy.baselines.…). Read only to move each key (:func:`_move_baseline_keys`).
BaselineConfig = create_model(  # type: ignore[call-overload]
    "BaselineConfig", __base__=Strict,
    __doc__="The deprecated ``baselines:`` bag: every baseline's keys in one section.",
    **{old: (section.model_fields[key].annotation, section.model_fields[key])
       for old, (section, key) in _BASELINE_KEYS.items()},
)

for _section in (PolicyConfig, ProgramAwareConfig, ThunderAgentConfig, MoriConfig, _Router,
                 RouterConfig, LeastLoadedConfig, KvAwareConfig, ContinuumConfig, AutellixConfig,
                 StickyKvConfig, VllmRouterConfig):
    _section.model_rebuild()

# Every policy a config can name, with its section: the sections PolicyConfig can carry
# (the registry in scheduler.policies maps each name to its class, and a test keeps the two
# equal).
_SECTION_OF: dict[str, type[PolicyConfig]] = {
    key: section for key, field in PolicyConfig.model_fields.items()
    if key != "baselines" and (section := _carried_section_type(field.annotation)) is not None
}
POLICY_NAMES: tuple[str, ...] = tuple(_SECTION_OF)
PolicyName = Literal[POLICY_NAMES]  # type: ignore[valid-type]
# Keys for_policy never carries from one section to another: the name, and the sections.
_NOT_CARRIED = frozenset({"name", "baselines", *POLICY_NAMES})


def section_class(name: str) -> type[PolicyConfig]:
    """The config section of policy ``name``."""
    try:
        return _SECTION_OF[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}") from None


def _refuse_keys_of_other_policies(section: type[PolicyConfig], data: dict[str, Any],
                                   name: Any) -> None:
    for key in data:
        owners = [policy for policy, other in _SECTION_OF.items() if key in other.model_fields
                  or key == "soft_band_penalty" and other is ProgramAwareConfig]
        if owners and section not in map(_SECTION_OF.get, owners):
            where = (f" (for {owners[0]} when it runs from this file: {owners[0]}.{key})"
                     if len(owners) == 1 else "")
            raise ValueError(f"{key}: a key of {' / '.join(owners)}; {name} does not take it{where}")


def _name_the_sections_carried(data: dict[str, Any], name: Any) -> dict[str, Any]:
    """``data`` with each section it carries named after its key; a section of the policy
    itself, or one inside another carried section, is refused naming its place."""
    named = dict(data)
    for key in POLICY_NAMES:
        carried = data.get(key)
        if carried is None:
            continue
        if key == name:
            raise ValueError(f"{key}: the keys of {name} itself go in this section, not under {key}")
        if not isinstance(carried, dict):
            continue  # a built section, or a wrong type that validation names
        nested = [inner for inner in carried if inner in POLICY_NAMES or inner == "baselines"]
        if nested:
            raise ValueError(f"{key}.{nested[0]}: sections do not nest; write it at the policy "
                             f"section's top level, as {nested[0]}")
        if carried.get("name", key) != key:
            raise ValueError(f"{key}.name: the section under {key} is {key}'s, "
                             f"not {carried['name']!r}")
        named[key] = {**carried, "name": key}
    return named


def _move_baseline_keys(data: dict[str, Any], baselines: Any, name: str
                        ) -> tuple[dict[str, Any], list[str]]:
    """``data`` with the keys its ``baselines:`` bag set moved to their policies' sections
    (the policy's own keys into this section), and a note for each."""
    moved = {key: value for key, value in data.items() if key != "baselines"}
    notes = []
    for old in sorted(baselines.model_fields_set, key=list(BASELINE_KEYS_MOVED).index):
        policy, key = BASELINE_KEYS_MOVED[old]
        if policy == name:
            section, where = moved, key
        else:
            carried = moved.get(policy)
            section = (dict(carried) if isinstance(carried, dict)
                       else carried.model_dump(exclude_unset=True) if carried is not None
                       else {"name": policy})
            moved[policy], where = section, f"{policy}.{key}"
        if key in section:
            raise ValueError(f"baselines.{old} and {where} both set: keep only {where} "
                             f"(baselines.{old} is its deprecated place)")
        section[key] = getattr(baselines, old)
        notes.append(f"policy.baselines.{old} is deprecated: read as policy.{where}; move the key")
    return moved, notes
