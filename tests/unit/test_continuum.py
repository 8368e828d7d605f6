"""``continuum`` as CacheTTL (arXiv 2511.02230v4; scheduler/policies/continuum.py): the pin's
TTL is τ* = argmax P(τ)·(T·η + Prefill-Reload) − τ over the observed tool times (§4.2), the
configured TTL until enough are seen, never above the cap; calls FCFS by program, pinned first."""

from __future__ import annotations

import random

import pytest

from scheduler.actions import Admit, Retain
from scheduler.calls import Usage
from scheduler.config import ConfigError, ContinuumConfig
from scheduler.config_reading import parse_policy_yaml
from scheduler.policies.continuum import PINNED_TIER_S, Memoryfulness, cache_ttl
from tests.unit.test_baselines import Driver, make, of

# Ten tool times: half of them 1 s, then a tail. τ* by the benefit B (§4.2):
# u(1) = .5B − 1, u(2) = .6B − 2, u(3) = .7B − 3, u(4) = .8B − 4, u(5) = .9B − 5, u(20) = B − 20
TOOL_TIMES = [1.0] * 5 + [2.0, 3.0, 4.0, 5.0, 20.0]


def pins(gaps: list[float], context: int, **keys) -> list[float]:
    """One program's pins (their TTLs; 0 for none) after each response, its tool calls
    lasting ``gaps``; each call ends as it arrives, so no queueing delay is observed."""
    d = Driver(make("continuum", **keys))
    now = 0.0
    call = d.arrive("a", context, now=now)
    ttls = []
    for gap in [*gaps, 0.0]:
        retains = of(d.finish(call.request_id, context, now=now), Retain)
        ttls.append(retains[0].ttl_s if retains else 0.0)
        now += gap
        call = d.arrive("a", context, now=now)
    return ttls


def test_tau_star_is_zero_when_the_reload_is_cheap_against_the_memory_it_holds() -> None:
    assert cache_ttl(sorted(TOOL_TIMES), 1.0) == 0.0  # every τ > 0 costs more than it saves
    # in the policy: 1,000 tokens at 1 ms each is a 1 s reload; τ* = 0 pins nothing
    assert pins(TOOL_TIMES, 1_000, cold_start_samples=9, prefill_token_s=1e-3)[-1] == 0.0


def test_tau_star_grows_with_the_reload_cost() -> None:
    durations = sorted(TOOL_TIMES)
    assert [cache_ttl(durations, b) for b in (1.0, 4.0, 20.0, 200.0)] == [0.0, 1.0, 5.0, 20.0]
    # in the policy, through the context it would have to recompute (1 ms a token)
    by_context = [pins(TOOL_TIMES, tokens, cold_start_samples=9, prefill_token_s=1e-3)[-1]
                  for tokens in (4_000, 20_000, 200_000)]
    assert by_context == [1.0, 5.0, 20.0]


def test_tau_star_never_exceeds_the_cap() -> None:
    assert pins(TOOL_TIMES, 200_000, cold_start_samples=9, prefill_token_s=1e-3,
                max_ttl_s=12.0)[-1] == 12.0
    assert pins([], 10, ttl_s=30.0, max_ttl_s=12.0) == [12.0]  # the cold-start TTL too


def test_cold_start_uses_the_configured_ttl_until_more_than_k_tool_times_are_seen() -> None:
    assert ContinuumConfig().cold_start_samples == 100  # the paper's K
    ttls = pins(TOOL_TIMES, 20_000, cold_start_samples=9, prefill_token_s=1e-3, ttl_s=3.0)
    assert ttls[:10] == [3.0] * 10  # 0 … 9 tool times seen: at most K
    assert ttls[10] == 5.0          # 10 seen: τ* of the empirical CDF


def test_the_pin_is_a_retain_carrying_tau_star() -> None:
    d = Driver(make("continuum", cold_start_samples=1, prefill_token_s=1e-3, pin_priority=77))
    now = 0.0
    call = d.arrive("a", 10, now=now)
    for gap in (1.0, 1.0, 3.0):
        d.finish(call.request_id, 10, now=now)
        now += gap
        call = d.arrive("a", 10, now=now)
    actions = d.finish(call.request_id, 4_000, now=now)  # a 4 s reload: B = 4
    # tool times 1, 1, 3: u(1) = 2/3 · 4 − 1 = 1.67 > u(3) = 4 − 3 = 1 > u(0) = 0
    assert actions == [Retain("a", "w0", 77, 1.0, None)]
    assert cache_ttl([1.0, 1.0, 3.0], 4.0) == 1.0


def test_with_a_host_tier_the_pin_weighs_a_reload_not_a_recompute() -> None:
    recompute = pins(TOOL_TIMES, 20_000, cold_start_samples=9, prefill_token_s=1e-3,
                     reload_token_s=1e-5)[-1]
    reload = pins(TOOL_TIMES, 20_000, cold_start_samples=9, prefill_token_s=1e-3,
                  reload_token_s=1e-5, host_tier=True)[-1]
    assert (recompute, reload) == (5.0, 0.0)  # B = 20 s against B = 0.2 s
    assert ContinuumConfig().for_host_tier().host_tier
    assert not ContinuumConfig(host_tier=False).for_host_tier().host_tier  # the file said


def test_an_evicted_calls_queueing_delay_adds_to_the_benefit() -> None:
    d = Driver(make("continuum", cold_start_samples=9, prefill_token_s=1e-3, decode_token_s=0.01))
    now = 0.0
    call = d.arrive("a", 1_000, now=now)
    for gap in TOOL_TIMES:
        d.p.on_complete(call.request_id, Usage(1_000, 0, cached_tokens=1_000), now)
        now += gap
        call = d.arrive("a", 1_000, now=now)
    assert d.p.adaptive_settings()["queue_delay_s"] == 0.0  # every call found its KV
    # evicted (none of its 1,000 held tokens cached): 12 s latency − (100 · 0.01 + 1,000 · 1e-3)
    actions = d.p.on_complete(call.request_id, Usage(1_000, 100, cached_tokens=0), now + 12.0)
    assert d.p.adaptive_settings()["queue_delay_s"] == pytest.approx(10.0)
    # B = T·η + reload = 10 · 1 + 1.1 s (1,100 tokens): u(1) = 4.55 < … < u(5) = 4.99
    assert of(actions, Retain)[0].ttl_s == cache_ttl(sorted(TOOL_TIMES), 11.1) == 5.0


def test_memoryfulness_is_one_for_fixed_lengths_and_about_zero_for_memoryless_ones() -> None:
    fixed, varied, geometric = Memoryfulness(), Memoryfulness(), Memoryfulness()
    assert fixed.eta == 1.0  # undefined yet: the paper's cold start assumes memoryful
    for _ in range(5):
        fixed.observe_program(8)
    for calls in (1, 2, 4, 8, 16, 32, 64):
        varied.observe_program(calls)
    rng = random.Random(1)
    for _ in range(2_000):  # geometric lengths: as much left after k calls as at the start
        calls = 1
        while rng.random() < 0.9:
            calls += 1
        geometric.observe_program(calls)
    assert fixed.eta == pytest.approx(1.0)
    assert 0.0 < varied.eta < 0.9
    assert abs(geometric.eta) < 0.1


def test_a_finished_programs_length_feeds_memoryfulness() -> None:
    d = Driver(make("continuum", {"w0": 1_000_000}))
    for i, calls in enumerate((1, 2, 4, 8, 16, 32, 64)):
        for n in range(calls):
            call = d.arrive(f"p{i}", 10, now=float(n), final=n == calls - 1)
            d.finish(call.request_id, now=float(n))
    assert d.p.adaptive_settings()["memoryfulness"] < 0.9


def test_calls_go_fcfs_by_program_arrival_and_a_pinned_programs_first() -> None:
    d = Driver(make("continuum", ttl_s=5.0))
    old = d.arrive("old", now=5.0)
    d.finish(old.request_id, now=6.0)  # pinned until 11 s
    newcomer = d.arrive("new", now=8.0)
    pinned_turn = d.arrive("old", now=10.0)
    assert newcomer.priority == 8.0
    assert pinned_turn.priority == 5.0 - PINNED_TIER_S  # its pin is live: ahead of the tier
    d.finish(pinned_turn.request_id, now=10.5)  # pinned until 15.5 s
    late_turn = d.arrive("old", now=30.0)
    assert isinstance(late_turn, Admit) and late_turn.priority == 5.0  # pin over: FCFS by program


def test_the_quantile_key_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"policy: ttl_quantile: continuum no longer takes it"):
        parse_policy_yaml("policy: {name: continuum, ttl_quantile: 0.8}")
