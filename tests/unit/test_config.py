"""Typed configuration (architecture.md §2 "Config", §3 defaults): clear errors naming the key."""

from __future__ import annotations

import re
from typing import Literal, get_origin
from pathlib import Path

import pytest

from scheduler.config import (

    BASELINE_KEYS_MOVED,

    POLICY_NAMES,

    AutellixConfig,

    BaselineConfig,

    ConfigError,

    ContinuumConfig,

    KvAwareConfig,

    LeastLoadedConfig,
    MoriConfig,
    PolicyConfig,
    PolicyName,

    ProgramAwareConfig,

    RetentionConfig,

    RouterConfig,

    StickyKvConfig,

    ThunderAgentConfig,
    VllmRouterConfig,
    load_yaml_text,

    section_class,

)

from scheduler.config_reading import make_policy_config, parse_policy_config, parse_policy_yaml

# The v1 defaults: those published for the Dynamo port of ThunderAgent.
DESIGN_DEFAULTS = {
    "pause_threshold": 0.95,
    "pause_target": 0.80,
    "soft_band_penalty": -2.0,
    "resume_hysteresis": 0.10,
    "buffer_per_program": 100,
    "resume_priority_boost_s": 1.0,
    "force_resume_after_s": 1800,
    "acting_token_weight": 1.0,
    "idle_release_s": 600,
    "tick_interval_s": 1.0,
}
# Policy v2 departs from v1 on these (docs/design-notes.md "Policy v2": the v1
# values held ~15% of the pool back and lost to plain balancing below real thrash).
V2_DEPARTURES = {
    "pause_threshold": 1.0,
    "pause_target": 0.98,
    "resume_hysteresis": 0.03,
}
# v1's signed soft_band_penalty is now soft_band_delay_s, its magnitude.
RENAMED = {"soft_band_penalty": ("soft_band_delay_s", abs)}


def default_of(config, key: str):
    """``config``'s value of a v1 key, through its rename if it has one."""
    name, convert = RENAMED.get(key, (key, None))
    return getattr(config, name), convert


# -- defaults ------------------------------------------------------------------------------


@pytest.mark.parametrize("key, value", sorted({**DESIGN_DEFAULTS, **V2_DEPARTURES}.items()))
def test_program_aware_defaults_are_v1s_except_the_v2_departures(key, value):
    for config in (ProgramAwareConfig(), make_policy_config()):
        actual, convert = default_of(config, key)
        assert actual == (convert(value) if convert else value)


def test_the_architecture_docs_defaults_table_matches_the_config():
    """docs/architecture.md §3 lists each program_aware key with its default: the reader's
    reference cannot drift from the code."""
    path = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
    section = path.read_text(encoding="utf-8").split("## 3.", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*([a-z_, ]+?)\s*\|\s*([-0-9., ]+?)\s*(?:\([^)]*\))?\s*\|", section,
                      flags=re.M)
    assert len(rows) >= 12
    defaults = ProgramAwareConfig()
    for keys, values in rows:
        for key, value in zip(keys.split(", "), values.split(", "), strict=True):
            assert float(getattr(defaults, key)) == float(value), key


def _is_text(annotation) -> bool:
    """Whether a key takes words (a name, a choice), which the docs table does not check."""
    return annotation is str or get_origin(annotation) is Literal


def _own_keys(section) -> set[str]:
    """The keys a router section adds to what every router takes."""
    return set(section.model_fields) - set(RouterConfig.model_fields)


def test_the_architecture_docs_baseline_table_matches_the_config():
    """docs/architecture.md §4 lists each baseline key in its policy's section with its default:
    every key the deprecated bag carried, and every key of continuum and sticky_kv."""
    path = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
    section = path.read_text(encoding="utf-8").split("## 4.", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\|\s*([a-z_]+)\s*\|\s*([a-z0-9_, ]+?)\s*\|\s*((?:[-0-9.e, ]|true|false)+?)\s*\|",
                      section, flags=re.M)
    documented = set()
    for policy, keys, values in rows:
        defaults = make_policy_config({"name": policy})
        for key, value in zip(keys.split(", "), values.split(", "), strict=True):
            number = {"true": 1.0, "false": 0.0}.get(value) if value.isalpha() else float(value)
            assert float(getattr(defaults, key)) == number, f"{policy}.{key}"
            documented.add((policy, key))
    # every key the deprecated bag had, every key but a text one of a baseline added since
    # (none of whose keys was ever in the bag) but the tick every router shares, and
    # continuum's own
    moved = set(BASELINE_KEYS_MOVED.values())
    since = {(name, key) for name in POLICY_NAMES if name != "program_aware"
             and not any(policy == name for policy, _ in moved)
             for key, field in section_class(name).model_fields.items()
             if key not in PolicyConfig.model_fields and key != "tick_interval_s"
             and not _is_text(field.annotation)}
    continuum = {("continuum", key) for key in _own_keys(ContinuumConfig)}
    assert documented == moved | since | continuum


def test_empty_or_absent_policy_section_gives_the_defaults():
    assert parse_policy_yaml("") == ProgramAwareConfig()
    assert parse_policy_yaml("policy:\n") == ProgramAwareConfig()
    assert parse_policy_yaml("gateway: {port: 8000}\n") == ProgramAwareConfig()
    assert parse_policy_config(None) == ProgramAwareConfig()
    assert make_policy_config().name == "program_aware"


def test_yaml_values_override_defaults_and_other_sections_are_ignored():
    text = """
    workers:
      - url: http://w0:8000
    policy:
      name: program_aware
      pause_threshold: 0.9
      pause_target: 0.7
      buffer_per_program: 64
      retention:
        ttl_s: 120
      thunderagent:
        scheduler_interval_s: 2.5
    """
    cfg = parse_policy_yaml(text, "sluice.yaml")
    assert cfg.name == "program_aware"
    assert (cfg.pause_threshold, cfg.pause_target, cfg.buffer_per_program) == (0.9, 0.7, 64)
    assert cfg.retention.ttl_s == 120.0
    assert cfg.retention.enabled is True  # untouched nested defaults stay
    assert cfg.thunderagent.scheduler_interval_s == 2.5
    assert cfg.idle_release_s == 600


def test_config_is_frozen():
    cfg = ProgramAwareConfig()
    with pytest.raises(Exception):
        cfg.pause_target = 0.5  # type: ignore[misc]
    assert isinstance(cfg.retention, RetentionConfig)


# -- errors --------------------------------------------------------------------------------


def test_pause_target_above_pause_threshold_is_rejected_naming_both_keys():
    with pytest.raises(ConfigError) as info:
        parse_policy_yaml("policy: {pause_target: 0.99, pause_threshold: 0.95}", "sluice.yaml")
    msg = str(info.value)
    assert "pause_target" in msg and "pause_threshold" in msg
    assert "0.99" in msg and "0.95" in msg
    assert msg.startswith("sluice.yaml: ")


def test_pause_target_equal_to_pause_threshold_is_allowed():
    cfg = parse_policy_yaml("policy: {pause_target: 0.9, pause_threshold: 0.9}")
    assert cfg.pause_target == cfg.pause_threshold == 0.9


def test_default_pause_threshold_still_checks_a_lone_pause_target():
    with pytest.raises(ConfigError, match="pause_target.*pause_threshold"):
        parse_policy_yaml("policy: {pause_target: 1.05}")


def test_resume_hysteresis_above_pause_threshold_is_rejected_naming_both():
    with pytest.raises(ConfigError, match="resume_hysteresis.*pause_threshold"):
        parse_policy_yaml(
            "policy: {pause_threshold: 0.05, pause_target: 0.0, resume_hysteresis: 0.1}")


def test_unknown_key_is_rejected_with_its_dotted_path():
    with pytest.raises(ConfigError) as info:
        parse_policy_yaml("policy:\n  pause_treshold: 0.9\n", "sluice.yaml")
    assert "policy.pause_treshold" in str(info.value)


def test_unknown_nested_key_is_rejected_with_its_dotted_path():
    with pytest.raises(ConfigError, match=r"policy\.retention\.ttl\b"):
        parse_policy_yaml("policy: {retention: {ttl: 5}}")
    with pytest.raises(ConfigError, match=r"policy\.least_loaded\.sticky_lru\b"):
        parse_policy_yaml("policy: {least_loaded: {sticky_lru: 5}}")
    with pytest.raises(ConfigError, match=r"policy\.baselines\.sticky_lru\b"):
        parse_policy_yaml("policy: {baselines: {sticky_lru: 5}}")


@pytest.mark.parametrize(
    "yaml_text, path",
    [
        ("policy: {retention: {ttl_s: soon}}", "policy.retention.ttl_s"),
        ("policy: {retention: {ttl_s: [1, 2]}}", "policy.retention.ttl_s"),
        ("policy: {buffer_per_program: 1.5}", "policy.buffer_per_program"),
        ("policy: {tick_interval_s: fast}", "policy.tick_interval_s"),
        ("policy: {retention: {enabled: maybe}}", "policy.retention.enabled"),
        ("policy: {baselines: {sticky_lru_size: {a: 1}}}", "policy.baselines.sticky_lru_size"),
        ("policy: {autellix: {queues: many}}", "policy.autellix.queues"),
        ("policy: {name: autellix, queues: many}", "policy.queues"),
    ],
)
def test_wrong_type_names_the_key_with_its_dotted_path(yaml_text, path):
    with pytest.raises(ConfigError) as info:
        parse_policy_yaml(yaml_text, "sluice.yaml")
    assert f"{path}:" in str(info.value)


@pytest.mark.parametrize(
    "yaml_text, path",
    [
        ("policy: {tick_interval_s: 0}", "policy.tick_interval_s"),
        ("policy: {buffer_per_program: -1}", "policy.buffer_per_program"),
        ("policy: {acting_token_weight: 1.5}", "policy.acting_token_weight"),
        ("policy: {retention: {refresh_fraction: 1.0}}", "policy.retention.refresh_fraction"),
        ("policy: {retention: {active_priority: 101}}", "policy.retention.active_priority"),
    ],
)
def test_out_of_range_values_name_the_key(yaml_text, path):
    with pytest.raises(ConfigError, match=re.escape(path)):
        parse_policy_yaml(yaml_text)


def test_every_offending_key_is_named_at_once():
    with pytest.raises(ConfigError) as info:
        parse_policy_yaml("policy: {pause_treshold: 1, retention: {ttl_s: soon}}")
    msg = str(info.value)
    assert "policy.pause_treshold" in msg and "policy.retention.ttl_s" in msg


def test_invalid_yaml_syntax_is_a_config_error_naming_the_source():
    with pytest.raises(ConfigError) as info:
        parse_policy_yaml("policy: [\n", "configs/sluice.yaml")
    assert str(info.value).startswith("configs/sluice.yaml: ")
    assert "YAML" in str(info.value)
    with pytest.raises(ConfigError, match=r"^x\.yaml: "):
        load_yaml_text("a: {b: 1\n", "x.yaml")


@pytest.mark.parametrize("document", [
    "policy: " + "[" * 1000 + "]" * 1000,                   # sequences in sequences
    "policy: " + "{a: " * 1000 + "1" + "}" * 1000,          # flow mappings in mappings
    "".join(" " * depth + f"k{depth}:\n" for depth in range(1000)),  # block mappings
])
def test_deeply_nested_yaml_is_a_config_error_naming_the_source(document):
    # PyYAML recurses once per level: past the interpreter's stack this was a RecursionError.
    with pytest.raises(ConfigError, match=r"^deep\.yaml: not valid YAML: nested too deeply"):
        load_yaml_text(document, "deep.yaml")
    with pytest.raises(ConfigError, match=r"^deep\.yaml: not valid YAML"):
        parse_policy_yaml(document, "deep.yaml")


def test_top_level_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"^sluice\.yaml: .*mapping"):
        parse_policy_yaml("- just\n- a list\n", "sluice.yaml")


def test_policy_section_must_be_a_mapping():
    with pytest.raises(ConfigError, match=r"policy: expected a mapping, got list"):
        parse_policy_yaml("policy: [1, 2]")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# -- policy names --------------------------------------------------------------------------


def test_policy_names_are_exactly_the_registered_policies():
    from scheduler.policies import POLICIES

    assert set(POLICY_NAMES) == set(POLICIES)
    assert {"program_aware", "round_robin", "least_loaded", "kv_aware", "sticky_least_loaded",
            "thunderagent", "continuum", "autellix", "sticky_kv", "mori", "vllm_router"} == set(POLICY_NAMES)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_every_registered_policy_name_parses(name):
    assert parse_policy_yaml(f"policy: {{name: {name}}}").name == name


@pytest.mark.parametrize("name", ["fifo", "ProgramAware", "program-aware", ""])
def test_unregistered_policy_name_is_rejected_naming_the_key(name):
    with pytest.raises(ConfigError) as info:
        parse_policy_yaml(f"policy: {{name: '{name}'}}", "sluice.yaml")
    msg = str(info.value)
    assert "policy.name" in msg
    assert "program_aware" in msg  # the message lists what is allowed


def test_a_lone_pause_threshold_brings_pause_target_just_below_it():
    # a v1 file that set only the threshold stays valid under the v2 defaults
    assert parse_policy_yaml("policy: {pause_threshold: 0.95}").pause_target == pytest.approx(0.93)
    assert parse_policy_yaml("policy: {pause_threshold: 0.01, resume_hysteresis: 0}").pause_target == 0.0
    assert parse_policy_yaml("policy: {pause_threshold: 0.9, pause_target: 0.5}").pause_target == 0.5


# -- one section per policy ----------------------------------------------------------------


@pytest.mark.parametrize("name", [n for n in POLICY_NAMES if n != "program_aware"])
@pytest.mark.parametrize("key", ["pause_threshold", "soft_band_delay_s", "soft_band_penalty",
                                 "retention", "max_wait_s", "dormant_quantile"])
def test_a_program_aware_key_on_another_policy_is_an_error_naming_it(name, key):
    value = {"retention": {"enabled": False}}.get(key, 0.5)
    with pytest.raises(ConfigError) as err:
        parse_policy_yaml(f"policy: {{name: {name}, {key}: {value}}}", "sluice.yaml")
    assert f"sluice.yaml: policy: {key}: a key of program_aware; {name} does not take it" in str(err.value)


def test_each_policy_gets_its_own_section_type():
    sections = {name: type(parse_policy_config({"name": name})) for name in POLICY_NAMES}
    assert sections == {"program_aware": ProgramAwareConfig, "thunderagent": ThunderAgentConfig,
                        "round_robin": RouterConfig, "least_loaded": LeastLoadedConfig,
                        "kv_aware": KvAwareConfig, "sticky_least_loaded": RouterConfig,
                        "continuum": ContinuumConfig, "autellix": AutellixConfig,
                        "sticky_kv": StickyKvConfig,
                        "mori": MoriConfig,
                        "vllm_router": VllmRouterConfig}
    assert not hasattr(parse_policy_config({"name": "least_loaded"}), "pause_threshold")
    assert PolicyName.__args__ == POLICY_NAMES  # derived, not a second list


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_the_section_a_config_carries_for_a_policy_is_that_policys(name):
    # the table of sections (the fields of PolicyConfig) and the sections' names agree
    carried = make_policy_config({"name": "round_robin" if name == "program_aware" else "program_aware",
                                  name: {}})
    assert type(getattr(carried, name)) is section_class(name)
    assert getattr(carried, name).name == name


def test_for_policy_reads_the_section_carried_over_the_keys_both_sections_take():
    config = parse_policy_config({"pause_threshold": 0.9, "idle_release_s": 30.0,
                                  "tick_interval_s": 2.0,
                                  "least_loaded": {"sticky_lru_size": 7, "idle_release_s": 40.0},
                                  "thunderagent": {"scheduler_interval_s": 3.0}})
    router = config.for_policy("least_loaded")
    assert isinstance(router, LeastLoadedConfig) and router.name == "least_loaded"
    assert (router.idle_release_s, router.tick_interval_s, router.sticky_lru_size) == (40.0, 2.0, 7)
    kv_aware = config.for_policy("kv_aware")
    assert (kv_aware.idle_release_s, kv_aware.tick_interval_s) == (30.0, 2.0)
    # thunderagent's tick is its own key: program_aware's tick_interval_s does not reach it
    assert config.for_policy("thunderagent").tick_interval_s == 3.0
    assert config.for_policy("program_aware") is config
    assert "least_loaded" not in config.model_dump()  # the running section's dump is its own


@pytest.mark.parametrize("document, problem", [
    ("policy: {program_aware: {pause_threshold: 0.9}}", "policy: program_aware: the keys of program_aware itself"),
    ("policy: {autellix: {kv_aware: {}}}", "policy: autellix.kv_aware: sections do not nest"),
    ("policy: {autellix: {name: kv_aware}}", "policy: autellix.name: the section under autellix is autellix's"),
    ("policy: {autellix: {pause_threshold: 0.9}}", "policy.autellix: pause_threshold: a key of program_aware"),
])
def test_a_carried_section_out_of_place_is_refused_naming_it(document, problem):
    with pytest.raises(ConfigError) as err:
        parse_policy_yaml(document)
    assert problem in str(err.value)


@pytest.mark.parametrize("old, moved", sorted(BASELINE_KEYS_MOVED.items()))
def test_a_key_of_the_deprecated_baselines_bag_moves_to_its_policys_section(old, moved):
    policy, key = moved
    value = section_class(policy).model_fields[key].default
    value = value - 1 if isinstance(value, int) else value * 0.75  # not the default, in bounds
    with pytest.warns(FutureWarning, match=f"policy.baselines.{old} is deprecated"):
        carried = parse_policy_config({"baselines": {old: value}})
    assert getattr(carried.for_policy(policy), key) == value
    assert carried.deprecation_notes == (
        f"policy.baselines.{old} is deprecated: read as policy.{policy}.{key}; move the key",)
    with pytest.warns(FutureWarning):
        own = parse_policy_config({"name": policy, "baselines": {old: value}})
    assert getattr(own, key) == value and own.baselines is None
    assert f"read as policy.{key};" in own.deprecation_notes[0]
    with pytest.raises(ConfigError, match=f"baselines.{old} and {key} both set"):
        parse_policy_config({"name": policy, key: value, "baselines": {old: value}})


def test_every_key_of_the_deprecated_bag_has_a_new_place():
    assert set(BaselineConfig.model_fields) == set(BASELINE_KEYS_MOVED)


def test_soft_band_penalty_is_read_as_its_magnitude_with_a_deprecation_warning():
    with pytest.warns(FutureWarning, match="soft_band_penalty is deprecated"):
        cfg = parse_policy_yaml("policy: {soft_band_penalty: -3.5}")
    assert cfg.soft_band_delay_s == 3.5
    assert any("soft_band_delay_s" in note for note in cfg.deprecation_notes)
    assert parse_policy_yaml("policy: {soft_band_delay_s: 1.5}").deprecation_notes == ()
    with pytest.raises(ConfigError, match="soft_band_delay_s"):
        parse_policy_yaml("policy: {soft_band_delay_s: -1}")
    with pytest.raises(ConfigError, match="keep only"):
        parse_policy_yaml("policy: {soft_band_penalty: 1, soft_band_delay_s: 1}")


def test_fractions_are_bounded_at_twice_the_pool():
    assert parse_policy_yaml("policy: {pause_threshold: 2.0, pause_target: 1.5}").pause_threshold == 2.0
    with pytest.raises(ConfigError, match="policy.pause_threshold: Input should be less than or equal to 2"):
        parse_policy_yaml("policy: {pause_threshold: 2.5, pause_target: 1.5}")


@pytest.mark.parametrize("section", [RetentionConfig, BaselineConfig, ProgramAwareConfig,
                                     ThunderAgentConfig, RouterConfig, LeastLoadedConfig,
                                     KvAwareConfig, ContinuumConfig, AutellixConfig, MoriConfig])
def test_every_model_is_strict(section):
    assert section.model_config["extra"] == "forbid" and section.model_config["strict"] is True


def test_turning_the_host_tier_on_gives_the_tier_defaults_to_the_keys_left_out():
    tiered = parse_policy_yaml("policy:\n  retention:\n    host_tier: true\n")
    assert (tiered.pause_threshold, tiered.host_tier_overcommit) == (1.0, 2.5)
    assert (tiered.dormant_quantile, tiered.dormant_min_s) == (0.25, 30.0)
    assert tiered.retention.offload_dormant is True
    assert ProgramAwareConfig(retention=RetentionConfig(host_tier=True)) == tiered


def test_keys_a_file_sets_win_over_the_host_tier_defaults():
    tiered = parse_policy_yaml("policy:\n  pause_threshold: 1.0\n  dormant_quantile: 0.5\n"
                               "  retention:\n    host_tier: true\n    offload_dormant: false\n")
    assert (tiered.pause_threshold, tiered.pause_target) == (1.0, 0.98)
    assert (tiered.dormant_quantile, tiered.dormant_min_s) == (0.5, 30.0)
    assert tiered.retention.offload_dormant is False


def test_a_fleet_with_a_host_tier_turns_it_on_unless_the_file_said_otherwise():
    assert ProgramAwareConfig().for_host_tier() == parse_policy_yaml(
        "policy:\n  retention:\n    host_tier: true\n")
    kept = parse_policy_yaml("policy:\n  pause_threshold: 0.9\n").for_host_tier()
    assert kept.retention.host_tier and (kept.pause_threshold, kept.dormant_min_s) == (0.9, 30.0)
    refused = parse_policy_yaml("policy:\n  retention:\n    host_tier: false\n")
    assert refused.for_host_tier() is refused
    router = LeastLoadedConfig()
    assert router.for_host_tier() is router
    carrying = parse_policy_yaml("policy:\n  autellix: {queues: 3}\n").for_host_tier()
    assert carrying.retention.host_tier and carrying.for_policy("autellix").queues == 3


def test_host_tier_overcommit_below_the_pause_threshold_is_refused():
    with pytest.raises(ConfigError, match="host_tier_overcommit"):
        parse_policy_yaml("policy:\n  pause_threshold: 1.2\n  host_tier_overcommit: 1.1\n")
