"""Progress-TTL: each worker's rolling windows and the formulas read from them.

Sources: vllm-project/router ``src/program_scheduling/factors.rs`` (the windows) and
``src/program_scheduling/policy.rs`` (the formulas); docs/program_scheduling.md
("Offline calibration models") for the two cost models.

- Windows, one set per worker, each bounded to ``stats_window_size`` samples (oldest out):
  completed calls (prompt and output tokens, the context growth over the program's previous
  call, the rounds since its last TTL pause, when it finished), and the intervals from a
  program's completion to its next call's arrival. Every estimate keeps its cold-start value
  (0) until its window is full.
- Cache-miss impact of ``u`` uncached tokens: ``prefill(u/1000)·(2 − decode_throughput_alpha)``
  with ``prefill(x) = intercept + linear·x + quadratic·x²`` (0 for ``u`` = 0).
- Acting TTL: 0 until the interval window is full; then the candidate ``d`` in {0, min, max}
  and 32 log-spaced points between ``min = min(0.05 s, max)`` and ``max = min(max_acting_ttl,
  impact)`` that maximises ``P(T < d)·impact − E[T; T < d] − d·P(T ≥ d)`` under a log-normal
  fit of the intervals ``T``; 0 when the best utility is negative.
- Target rounds: ``ceil(2·mean rounds since TTL pause)`` clamped to [1, max_segment_rounds]
  (0 until the call window is full); growth reserve ``mean growth·(target + Σ remaining
  rounds of the worker's active programs)``.
- Decode throughput of ``B`` sequences over ``C`` context tokens:
  ``B / (fixed + per_request·B + per_context_token·C)``.
- Batch gain (``enable_batch_gain_admission``, full call window, at least one program
  reasoning): one more sequence's relative throughput gain times the mean decode time
  (``B·mean output / throughput``: Sluice's shells report no decode time, the source's
  fallback) must cover the candidate's recovery cost plus the continuity loss of the
  protected programs (the source's formula, :func:`batch_gain_admits`).

Sluice's choice: the normal CDF is ``math.erf``'s (the source uses a 1.5e-7 approximation).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.config import VllmRouterConfig

# The smallest non-zero acting TTL candidate, and the points between it and the cap
# (policy.rs ``fitted_acting_ttl``).
MIN_TTL_CANDIDATE_S = 0.05
TTL_GRID_POINTS = 32
# f64::EPSILON, the source's "no protected round left"
EPSILON = math.ulp(1.0)


@dataclass(frozen=True, slots=True)
class CallSample:
    """One completed call, as a worker's window keeps it."""

    prompt_tokens: int
    completion_tokens: int
    context_growth_tokens: int | None  # growth over the program's previous prompt, if any
    rounds_since_ttl_pause: int
    finished_at: float


class RankFactors:
    """One worker's bounded windows, with the sums their means read (kept as samples come
    and go, so a mean costs nothing)."""

    def __init__(self) -> None:
        self._calls: deque[CallSample] = deque()
        self._intervals: deque[float] = deque()
        # sums over the call window, for its means
        self._prompt_sum = self._completion_sum = self._rounds_sum = self._growth_sum = 0.0
        self._growth_count = 0
        self._fit: tuple[float, float] | None = None  # log-normal (mean, sigma); None: stale

    def push_call(self, sample: CallSample, limit: int) -> None:
        self._calls.append(sample)
        self._count(sample, +1)
        while len(self._calls) > limit:
            self._count(self._calls.popleft(), -1)

    def push_interval(self, seconds: float, limit: int) -> None:
        self._intervals.append(seconds)
        while len(self._intervals) > limit:
            self._intervals.popleft()
        self._fit = None

    def _count(self, sample: CallSample, sign: int) -> None:
        self._prompt_sum += sign * sample.prompt_tokens
        self._completion_sum += sign * sample.completion_tokens
        self._rounds_sum += sign * sample.rounds_since_ttl_pause
        if sample.context_growth_tokens is not None:
            self._growth_sum += sign * sample.context_growth_tokens
            self._growth_count += sign

    def calls_complete(self, limit: int) -> bool:
        return len(self._calls) >= limit

    def intervals_complete(self, limit: int) -> bool:
        return len(self._intervals) >= limit

    def _mean(self, total: float) -> float:
        return total / len(self._calls) if self._calls else 0.0

    def mean_prompt_tokens(self) -> float:
        return self._mean(self._prompt_sum)

    def mean_completion_tokens(self) -> float:
        return self._mean(self._completion_sum)

    def mean_rounds_since_ttl_pause(self) -> float:
        return self._mean(self._rounds_sum)

    def mean_context_growth_tokens(self) -> float:
        return self._growth_sum / self._growth_count if self._growth_count else 0.0

    def calls_per_second(self) -> float:
        """Completions per second across the window (first to last finish)."""
        if len(self._calls) < 2:
            return 0.0
        elapsed = self._calls[-1].finished_at - self._calls[0].finished_at
        return (len(self._calls) - 1) / elapsed if elapsed > 0 else 0.0

    def interval_fit(self) -> tuple[float, float] | None:
        """The log-normal (mean, sigma) of the positive intervals; None without any."""
        if self._fit is None:
            logs = [math.log(t) for t in self._intervals if math.isfinite(t) and t > 0]
            if not logs:
                return None
            mean = sum(logs) / len(logs)
            sigma = math.sqrt(sum((x - mean) ** 2 for x in logs) / len(logs))
            self._fit = (mean, max(sigma, 1e-6))
        return self._fit


def _normal_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def cache_miss_impact_s(config: VllmRouterConfig, uncached_tokens: int) -> float:
    if uncached_tokens <= 0:
        return 0.0
    x = uncached_tokens / 1000.0
    prefill = (config.prefill_intercept_seconds + config.prefill_linear_seconds_per_1k_tokens * x
               + config.prefill_quadratic_seconds_per_1k_tokens_squared * x * x)
    return prefill * (2.0 - config.decode_throughput_alpha)


def fitted_acting_ttl_s(config: VllmRouterConfig, factors: RankFactors, impact_s: float) -> float:
    if not factors.intervals_complete(config.stats_window_size):
        return 0.0
    fit = factors.interval_fit()
    cap = min(config.max_acting_ttl_seconds, impact_s)
    if fit is None or cap <= 0.0 or impact_s <= 0.0:
        return 0.0
    mean, sigma = fit
    low = min(MIN_TTL_CANDIDATE_S, cap)
    candidates = [0.0, low, cap]
    if cap > low:
        span = math.log(cap) - math.log(low)
        candidates += [math.exp(math.log(low) + span * i / (TTL_GRID_POINTS - 1))
                       for i in range(TTL_GRID_POINTS)]
    lognormal_mean = math.exp(mean + sigma * sigma / 2.0)
    best, best_utility = 0.0, -math.inf
    for ttl in candidates:
        if ttl <= 0.0:
            utility = 0.0
        else:
            hit = _normal_cdf((math.log(ttl) - mean) / sigma)
            truncated = lognormal_mean * _normal_cdf((math.log(ttl) - mean - sigma * sigma) / sigma)
            utility = impact_s * hit - truncated - ttl * (1.0 - hit)
        if utility >= best_utility:  # ties to the later (longer) candidate, as the source
            best, best_utility = ttl, utility
    return best if best_utility >= 0.0 else 0.0


def target_rounds(config: VllmRouterConfig, factors: RankFactors) -> float:
    if not factors.calls_complete(config.stats_window_size):
        return 0.0
    rounds = math.ceil(2.0 * factors.mean_rounds_since_ttl_pause())
    return float(min(max(rounds, 1), config.max_segment_rounds))


def growth_reserve_tokens(config: VllmRouterConfig, factors: RankFactors,
                          active_remaining_rounds: float) -> float:
    target = target_rounds(config, factors)
    growth = factors.mean_context_growth_tokens()
    if target <= 0.0 or growth <= 0.0:
        return 0.0
    return growth * (target + active_remaining_rounds)


def decode_throughput(config: VllmRouterConfig, batch: int, context_tokens: float) -> float:
    step = (config.decode_fixed_step_seconds + config.decode_batch_step_seconds_per_request * batch
            + config.decode_context_step_seconds_per_token * context_tokens)
    return batch / step


@dataclass(frozen=True, slots=True)
class BatchGainCase:
    """What a batch-gain decision reads of one worker and one candidate."""

    capacity_tokens: int
    used_tokens: float
    required_tokens: float
    batch_before: int  # programs reasoning there
    context_before: float  # their contexts, summed
    candidate_context: float
    candidate_recovery_s: float
    protected: Sequence[tuple[float, float]]  # (remaining rounds, cache-miss impact) each


def batch_gain_admits(config: VllmRouterConfig, factors: RankFactors, case: BatchGainCase) -> bool:
    if (not config.enable_batch_gain_admission or case.batch_before == 0
            or not factors.calls_complete(config.stats_window_size)):
        return False
    before = decode_throughput(config, case.batch_before, case.context_before)
    after = decode_throughput(config, case.batch_before + 1, case.context_before + case.candidate_context)
    if before <= 0.0:
        return False
    decode_s = case.batch_before * factors.mean_completion_tokens() / before
    if not math.isfinite(decode_s) or decode_s <= 0.0:
        return False
    gain_s = decode_s * max(0.0, after / before - 1.0)
    return gain_s >= case.candidate_recovery_s + _continuity_loss_s(config, factors, case)


def _continuity_loss_s(config: VllmRouterConfig, factors: RankFactors, case: BatchGainCase) -> float:
    """What admitting the candidate costs the protected programs: the rounds of theirs the
    free tokens can still grow, before and after, priced at their mean cache-miss impact."""
    growth = factors.mean_context_growth_tokens()
    if growth <= 0.0:
        return 0.0
    protected_rounds = sum(rounds for rounds, _ in case.protected)
    free = max(0.0, case.capacity_tokens * config.low_watermark_ratio - case.used_tokens)
    before = min(protected_rounds, free / growth)
    left = free - case.required_tokens - growth * target_rounds(config, factors)
    after = min(protected_rounds, max(0.0, left) / growth)
    if before > 0.0 and after <= EPSILON:
        return math.inf
    if not case.protected or after <= EPSILON:
        return 0.0
    mean_impact = sum(impact for _, impact in case.protected) / len(case.protected)
    return max(0.0, before - after) / after * mean_impact
