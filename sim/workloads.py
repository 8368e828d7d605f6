"""Synthetic agent workloads (architecture.md §5.6): programs to play.

Three generators, all deterministic given ``seed`` and a program's ``index`` and independent
of the order programs are asked for (each program draws from its own
``numpy.random.default_rng([seed, ...])`` stream), plus Poisson arrival times for open-loop
use. All produce :class:`sim.programs.ProgramSpec` objects whose calls use the program's
*token stream* (``hashes=None``): every prompt extends the previous call's prompt and
output, ``prompt_k = prompt_{k-1} + output_{k-1} + observation_{k-1}``.

Where the numbers come from
---------------------------
Nobody publishes fitted distributions (lognormal or otherwise) for agent trajectories. The
works below describe trajectories *descriptively* (examples, histograms, summary figures).
Every distribution parameter here is **Sluice's assumption**, chosen so that generated
programs land in these descriptive ranges:

- turns per SWE-bench episode peak around 20–50, with a long tail;
- the context at the end of an episode is around 20k–50k tokens;
- tool calls are shell/editor commands that mostly return in ~1–3 s, with a long tail to
  tens of seconds; test runs take minutes;
- the system prompt and tool documentation are several thousand tokens and identical for
  every session.

These are not fits and must not be quoted as measurements. Descriptive sources:

- [SWE-bench] Jimenez et al., "SWE-bench: Can Language Models Resolve Real-World GitHub
  Issues?", arXiv 2310.06770 — the task set; issue texts are a few hundred tokens on
  average with a long tail to thousands.
- [SWE-agent] Yang et al., "SWE-agent: Agent-Computer Interfaces Enable Automated Software
  Engineering", arXiv 2405.15793 — the episode shape: a system prompt with the tool (ACI)
  documentation, the issue, then (thought + action, observation) turns whose actions are
  shell commands, under a turn/cost budget.
- [OpenHands] Wang et al., "OpenHands: An Open Platform for AI Software Developers as
  Generalist Agents", arXiv 2407.16741 — the same shape for CodeAct agents, with sandboxed
  command execution (commands, edits, test runs).
- [kv-cache-tester] callanjfox/kv-cache-tester, docs/trace_replay_tester.md — real coding
  agent (Claude Code) traces: tool definitions ~8–12k tokens plus a ~2–3k system prompt,
  shared across conversations.
- [GRPO] Shao et al., "DeepSeekMath", arXiv 2402.03300 — GRPO samples a group of G outputs
  per prompt and normalises rewards within the group; a batch is P prompts × G samples and
  the trainer waits for the whole batch (the barrier).

:class:`SwebenchWorkload` parameters (all keyword arguments of the constructor)

===========================  =====================================  ===========================
parameter                    default                                source
===========================  =====================================  ===========================
shared_prefix_tokens         6144 (system prompt + tool docs,       assumption; [SWE-agent],
                             same for every session: one family)    [OpenHands], [kv-cache-tester]
family                       0                                      —
task_tokens                  LogNormal(median 400, σ 0.8),          assumption; [SWE-bench]
(issue + per-task template)  clipped to [64, 8192]                  issue-text lengths
turns                        20 + LogNormal(median 12, σ 0.8),      assumption; [SWE-agent],
                             capped at 80 → range [20, 80], mode    [OpenHands] turn counts
                             ≈ 26, median 32, mean ≈ 36, ~2 % at 80
output_tokens (per turn)     LogNormal(median 160, σ 0.7),          assumption; thought +
                             clipped to [16, 4096]                  command per turn [SWE-agent]
observation_tokens           LogNormal(median 300, σ 1.1),          assumption; file views and
(tool output per turn)       clipped to [8, 8192]                   test logs have a long tail;
                                                                    total context lands in
                                                                    ~20k–50k [SWE-agent]
tool_latency_s (think_s)     LogNormal(median 1.5 s, σ 1.0),        assumption; [OpenHands]
                             clipped to [0.05, 120] s               shell commands: ~1–3 s,
                                                                    tail to tens of seconds
test_run_probability         0.1 per tool call                      assumption; [OpenHands]
test_run_latency_s           LogNormal(median 60 s, σ 0.8),         assumption; "test runs take
                             clipped to [5, 1800] s                 minutes"
max_context_tokens           131072 − 4096                          a 128k-context model minus
                                                                    a safety margin
===========================  =====================================  ===========================

A program's first call has ``think_s = 0`` (it is sent when the program starts); call ``k``
waits ``think_s`` = the tool latency of the observation it carries. A program ends after its
drawn number of turns, or earlier, *before* a call whose prompt + output would exceed
``max_context_tokens`` (so turn counts in ``[20, 80]`` hold whenever the context allows).

:class:`RlRolloutWorkload` parameters

===========================  =====================================  ===========================
parameter                    default                                source
===========================  =====================================  ===========================
prompts_per_batch (P)        required                               [GRPO]
samples_per_prompt (G)       required                               [GRPO]
prompt_tokens (per prompt,   LogNormal(median 1024, σ 0.6),         assumption
shared by its G samples)     clipped to [128, 8192]
turns                        1 + LogNormal(median 3, σ 0.8),        assumption: multi-turn tool
                             capped at max_turns = 16               environments, long tail
output_tokens (per turn)     LogNormal(median 512, σ 1.0),          assumption: reasoning
                             clipped to [16, 16384]                 rollouts, long-tailed lengths
observation_tokens           LogNormal(median 200, σ 1.0),          assumption
                             clipped to [8, 4096]
env_latency_s (think_s)      LogNormal(median 0.5 s, σ 1.0),        assumption: sandboxed tool
                             clipped to [0.01, 60] s                calls
max_context_tokens           131072 − 4096                          as above
===========================  =====================================  ===========================

Every sample of a prompt has ``family`` = that prompt's id (``family_base + b·P + p``) and
``shared_prefix_tokens`` = the prompt's length, so the G samples share the prompt's blocks;
``group`` = the batch id ``b`` (the driver starts batch ``b+1`` only when all of batch ``b``
has ended). Program ``index`` ``i`` is batch ``i // (P·G)``, prompt ``(i // G) % P``,
sample ``i % G``.

:class:`RlSweWorkload` parameters (agentic RL: GRPO over SWE-style episodes)

===========================  =====================================  ===========================
parameter                    default                                source
===========================  =====================================  ===========================
prompts_per_batch (P)        required (``sluice sim``: CC // 8)     [GRPO]
samples_per_prompt (G)       required (``sluice sim``: 8)           [GRPO]
task prompt (shared by its   system prompt 6144 + task              :class:`SwebenchWorkload`'s
G samples)                   LogNormal(median 400, σ 0.8),
                             clipped to [64, 8192]
turns                        7 + LogNormal(median 4, σ 0.8),        assumption: a bounded
                             capped at 14 → range [7, 14], median   horizon (see "Sizing")
                             11, ~27 % at 14
output_tokens (per turn)     LogNormal(median 160, σ 0.7),          :class:`SwebenchWorkload`
                             clipped to [16, 4096]
observation_tokens           LogNormal(median 600, σ 1.1),          assumption: twice
                             clipped to [8, 8192]                   SwebenchWorkload's, so the
                                                                    shorter episodes still end
                                                                    at ~20k tokens (median)
tool_latency_s (think_s)     LogNormal(median 1.5 s, σ 1.0),        :class:`SwebenchWorkload`'s,
                             clipped to [0.05, 30] s                tail cut at 30 s
test_run_probability         0.1 per tool call                      :class:`SwebenchWorkload`
test_run_latency_s           LogNormal(median 20 s, σ 0.8),         assumption: an RL
                             clipped to [5, 60] s                   environment runs the task's
                                                                    own tests under a timeout
max_context_tokens           131072 − 4096                          as above
===========================  =====================================  ===========================

Every sample draws its own episode (turns, outputs, observations, latencies) from
``SwebenchWorkload.draw_turns`` / ``draw_calls`` with these parameters (any
:class:`SwebenchWorkload` keyword overrides them); the G samples of a task share its prompt:
``family`` = the task's id (``family_base + b·P + p``) and ``shared_prefix_tokens`` = system
prompt + task. The stream hashes the prefix per family, so tasks do not share the system
prompt with each other; only a task's own samples do. ``group`` = the batch, as above.

Sizing (seed 7, 8 × ``llama3.1-8b-h100``, 426,483 tokens of KV each, 3.41 M in all):
with every sample at its middle turn a batch holds ≈ 13.9k tokens per sample, so **CC 512
≈ 2.1×** the fleet's KV (2.0× at CC ≈ 490; 1.2× if each task's shared prompt were stored
once fleet-wide). Measured under least_loaded at CC 512, the live context peaks at 2.3×
(ledger utilization averaged over workers). The horizon is short on purpose: at 2×
oversubscription a thrashing fleet re-prefills every context on every turn, ≈ 30 s per
turn, so SWE-bench's 20–80 turns would make one batch outlast a 30-minute run. With
[7, 14] turns least_loaded finishes a batch in ≈ 560 s and the admission-controlled
policies in ≈ 350–380 s, so every policy completes ≥ 3 batches in 1800 s (makespan p50/p99
and output tokens per second in ``sluice sim``'s table). Within a batch the samples end at
different times: the barrier leaves the fleet underused while the last ones run.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sim.programs import CallSpec, ProgramSpec

DEFAULT_MAX_CONTEXT_TOKENS = 131072 - 4096


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A lognormal given by its median and σ (of the log), clipped to ``[low, high]``."""

    median: float
    sigma: float
    low: float
    high: float

    def __post_init__(self) -> None:
        if self.median <= 0 or self.sigma < 0 or not 0 <= self.low <= self.high:
            raise ValueError(f"invalid lognormal {self}")

    def draw(self, rng: np.random.Generator, size: int) -> np.ndarray:
        values = rng.lognormal(np.log(self.median), self.sigma, size)
        return np.clip(values, self.low, self.high)

    def draw_tokens(self, rng: np.random.Generator, size: int) -> list[int]:
        return np.maximum(np.rint(self.draw(rng, size)), 1).astype(np.int64).tolist()


def _shifted_count(rng: np.random.Generator, base: int, tail: LogNormal, cap: int) -> int:
    """``base + round(tail)``, capped at ``cap``: a count with a floor and a long tail."""
    return int(min(cap, base + int(round(float(tail.draw(rng, 1)[0])))))


def _grow(prefix_tokens: int, turns: int, outputs: list[int], observations: list[int],
          latencies: list[float], max_context_tokens: int) -> list[CallSpec]:
    """Calls of a program whose context only grows; stop before a call that would not fit."""
    if prefix_tokens >= max_context_tokens:
        raise ValueError(f"the first prompt ({prefix_tokens} tokens) does not fit in "
                         f"max_context_tokens={max_context_tokens}")
    calls: list[CallSpec] = []
    prompt = prefix_tokens
    for k in range(turns):
        if k:
            prompt += outputs[k - 1] + observations[k - 1]
        output = outputs[k]
        if prompt + output > max_context_tokens:
            if k:
                break
            output = max_context_tokens - prompt  # the first call always exists: shorten it
        calls.append(CallSpec(prompt_tokens=prompt, output_tokens=output,
                              think_s=latencies[k - 1] if k else 0.0))
    return calls


class SwebenchWorkload:
    """SWE-bench-style agent programs (parameters and sources: the module docstring)."""

    def __init__(
        self,
        seed: int,
        *,
        shared_prefix_tokens: int = 6144,
        family: int = 0,
        task_tokens: LogNormal = LogNormal(400, 0.8, 64, 8192),
        min_turns: int = 20,
        max_turns: int = 80,
        extra_turns: LogNormal = LogNormal(12, 0.8, 0, 10_000),
        output_tokens: LogNormal = LogNormal(160, 0.7, 16, 4096),
        observation_tokens: LogNormal = LogNormal(300, 1.1, 8, 8192),
        tool_latency_s: LogNormal = LogNormal(1.5, 1.0, 0.05, 120.0),
        test_run_probability: float = 0.1,
        test_run_latency_s: LogNormal = LogNormal(60.0, 0.8, 5.0, 1800.0),
        max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
    ) -> None:
        if seed < 0:
            raise ValueError(f"seed must be ≥ 0, got {seed}")
        if shared_prefix_tokens < 0 or family < 0:
            raise ValueError("shared_prefix_tokens and family must be ≥ 0")
        if not 1 <= min_turns <= max_turns:
            raise ValueError(f"need 1 ≤ min_turns ≤ max_turns, got {min_turns}, {max_turns}")
        if not 0.0 <= test_run_probability <= 1.0:
            raise ValueError(f"test_run_probability must be in [0, 1], got {test_run_probability}")
        if max_context_tokens <= shared_prefix_tokens + task_tokens.high:
            raise ValueError("max_context_tokens must exceed the largest first prompt "
                             f"({shared_prefix_tokens} + {task_tokens.high})")
        self.seed = seed
        self.shared_prefix_tokens = shared_prefix_tokens
        self.family = family
        self.task_tokens = task_tokens
        self.min_turns = min_turns
        self.max_turns = max_turns
        self.extra_turns = extra_turns
        self.output_tokens = output_tokens
        self.observation_tokens = observation_tokens
        self.tool_latency_s = tool_latency_s
        self.test_run_probability = test_run_probability
        self.test_run_latency_s = test_run_latency_s
        self.max_context_tokens = max_context_tokens

    def draw_turns(self, rng: np.random.Generator) -> int:
        """An episode's turn budget (it may end earlier on the context limit)."""
        return _shifted_count(rng, self.min_turns, self.extra_turns, self.max_turns)

    def draw_calls(self, rng: np.random.Generator, turns: int, first_prompt_tokens: int) -> list[CallSpec]:
        """An episode's calls after its first prompt: per turn an output, an observation and
        the tool latency before the next call (a test run with ``test_run_probability``)."""
        outputs = self.output_tokens.draw_tokens(rng, turns)
        observations = self.observation_tokens.draw_tokens(rng, turns)
        tool = self.tool_latency_s.draw(rng, turns)
        tests = self.test_run_latency_s.draw(rng, turns)
        is_test = rng.random(turns) < self.test_run_probability
        latencies = np.where(is_test, tests, tool).tolist()
        return _grow(first_prompt_tokens, turns, outputs, observations, latencies,
                     self.max_context_tokens)

    def make_program(self, index: int) -> ProgramSpec:
        if index < 0:
            raise ValueError(f"index must be ≥ 0, got {index}")
        rng = np.random.default_rng([self.seed, index])
        # Draw in a fixed order so a program depends on (seed, index) only.
        turns = self.draw_turns(rng)
        task = self.task_tokens.draw_tokens(rng, 1)[0]
        calls = self.draw_calls(rng, turns, self.shared_prefix_tokens + task)
        return ProgramSpec(
            session_id=f"swe-{self.seed}-{index}",
            calls=calls,
            index=index,
            family=self.family,
            shared_prefix_tokens=self.shared_prefix_tokens,
        )

    def programs(self, n: int, start_index: int = 0) -> list[ProgramSpec]:
        if n < 0:
            raise ValueError(f"n must be ≥ 0, got {n}")
        return [self.make_program(i) for i in range(start_index, start_index + n)]


class _GrpoBatches:
    """The batch shape both RL workloads share: batch ``b`` is P prompts × G samples, and
    program ``index`` ``i`` is batch ``i // (P·G)``, prompt ``(i // G) % P``, sample ``i % G``."""

    def __init__(self, seed: int, prompts_per_batch: int, samples_per_prompt: int,
                 family_base: int) -> None:
        if seed < 0:
            raise ValueError(f"seed must be ≥ 0, got {seed}")
        if prompts_per_batch <= 0 or samples_per_prompt <= 0:
            raise ValueError("prompts_per_batch and samples_per_prompt must be > 0, got "
                             f"{prompts_per_batch}, {samples_per_prompt}")
        if family_base < 0:
            raise ValueError(f"family_base must be ≥ 0, got {family_base}")
        self.seed = seed
        self.prompts_per_batch = prompts_per_batch
        self.samples_per_prompt = samples_per_prompt
        self.family_base = family_base

    @property
    def batch_size(self) -> int:
        return self.prompts_per_batch * self.samples_per_prompt

    def locate(self, index: int) -> tuple[int, int, int]:
        """``(batch, prompt within the batch, sample within the prompt)`` of a program."""
        g = self.samples_per_prompt
        return index // self.batch_size, (index // g) % self.prompts_per_batch, index % g

    def prompt_id(self, batch: int, prompt: int) -> int:
        return batch * self.prompts_per_batch + prompt

    def make_program(self, index: int) -> ProgramSpec:
        raise NotImplementedError

    def programs(self, n: int, start_index: int = 0) -> list[ProgramSpec]:
        if n < 0:
            raise ValueError(f"n must be ≥ 0, got {n}")
        return [self.make_program(i) for i in range(start_index, start_index + n)]

    def batch(self, b: int) -> list[ProgramSpec]:
        """The P·G programs of batch ``b`` (all with ``group == b``)."""
        if b < 0:
            raise ValueError(f"batch must be ≥ 0, got {b}")
        return self.programs(self.batch_size, b * self.batch_size)


class RlRolloutWorkload(_GrpoBatches):
    """GRPO-style rollout batches: P prompts × G samples (parameters: the module docstring)."""

    def __init__(
        self,
        seed: int,
        prompts_per_batch: int,
        samples_per_prompt: int,
        *,
        family_base: int = 0,
        prompt_tokens: LogNormal = LogNormal(1024, 0.6, 128, 8192),
        max_turns: int = 16,
        extra_turns: LogNormal = LogNormal(3, 0.8, 0, 10_000),
        output_tokens: LogNormal = LogNormal(512, 1.0, 16, 16384),
        observation_tokens: LogNormal = LogNormal(200, 1.0, 8, 4096),
        env_latency_s: LogNormal = LogNormal(0.5, 1.0, 0.01, 60.0),
        max_context_tokens: int = DEFAULT_MAX_CONTEXT_TOKENS,
    ) -> None:
        super().__init__(seed, prompts_per_batch, samples_per_prompt, family_base)
        if max_turns < 1:
            raise ValueError(f"max_turns must be ≥ 1, got {max_turns}")
        if max_context_tokens <= prompt_tokens.high:
            raise ValueError("max_context_tokens must exceed the largest prompt "
                             f"({prompt_tokens.high})")
        self.prompt_tokens = prompt_tokens
        self.max_turns = max_turns
        self.extra_turns = extra_turns
        self.output_tokens = output_tokens
        self.observation_tokens = observation_tokens
        self.env_latency_s = env_latency_s
        self.max_context_tokens = max_context_tokens

    def make_program(self, index: int) -> ProgramSpec:
        if index < 0:
            raise ValueError(f"index must be ≥ 0, got {index}")
        b, p, g = self.locate(index)
        pid = self.prompt_id(b, p)
        # The prompt's own stream: the same for its G samples.
        prompt = self.prompt_tokens.draw_tokens(np.random.default_rng([self.seed, 1, pid]), 1)[0]
        rng = np.random.default_rng([self.seed, 0, index])
        turns = _shifted_count(rng, 1, self.extra_turns, self.max_turns)
        outputs = self.output_tokens.draw_tokens(rng, turns)
        observations = self.observation_tokens.draw_tokens(rng, turns)
        latencies = self.env_latency_s.draw(rng, turns).tolist()
        calls = _grow(prompt, turns, outputs, observations, latencies, self.max_context_tokens)
        return ProgramSpec(
            session_id=f"rl-{self.seed}-b{b}-p{p}-g{g}",
            calls=calls,
            index=index,
            family=self.family_base + pid,
            shared_prefix_tokens=prompt,
            group=b,
            task_id=f"task-{self.family_base + pid}",
        )


# The episode shape of an rl_swe sample: SwebenchWorkload's distributions with a bounded
# horizon (module docstring, "RlSweWorkload parameters").
RL_SWE_EPISODE: dict[str, object] = {
    "min_turns": 7,
    "max_turns": 14,
    "extra_turns": LogNormal(4, 0.8, 0, 10_000),
    "observation_tokens": LogNormal(600, 1.1, 8, 8192),
    "tool_latency_s": LogNormal(1.5, 1.0, 0.05, 30.0),
    "test_run_latency_s": LogNormal(20.0, 0.8, 5.0, 60.0),
}


class RlSweWorkload(_GrpoBatches):
    """GRPO batches of long-horizon SWE-style rollouts: P tasks × G samples per batch
    (parameters: the module docstring). Each sample is its own episode drawn like a
    :class:`SwebenchWorkload` program; the G samples of a task share its prompt."""

    def __init__(self, seed: int, prompts_per_batch: int, samples_per_prompt: int, *,
                 family_base: int = 0, **episode: object) -> None:
        super().__init__(seed, prompts_per_batch, samples_per_prompt, family_base)
        # The episode generator supplies the distributions and the draws; its own seed is
        # unused (each sample draws from this workload's streams).
        self.episode = SwebenchWorkload(seed, **{**RL_SWE_EPISODE, **episode})  # type: ignore[arg-type]

    def make_program(self, index: int) -> ProgramSpec:
        if index < 0:
            raise ValueError(f"index must be ≥ 0, got {index}")
        b, p, g = self.locate(index)
        pid = self.prompt_id(b, p)
        episode = self.episode
        # The task's own stream, the same for its G samples; then the sample's own.
        task = episode.task_tokens.draw_tokens(np.random.default_rng([self.seed, 3, pid]), 1)[0]
        prompt = episode.shared_prefix_tokens + task
        rng = np.random.default_rng([self.seed, 4, index])
        calls = episode.draw_calls(rng, episode.draw_turns(rng), prompt)
        return ProgramSpec(
            session_id=f"rlswe-{self.seed}-b{b}-p{p}-g{g}",
            calls=calls,
            index=index,
            family=self.family_base + pid,
            shared_prefix_tokens=prompt,
            group=b,
            task_id=f"task-{self.family_base + pid}",
        )


class BurstWorkload:
    """A burst: every program arrives at once, their first contexts spread evenly (in log
    space) over ``span`` times the smallest, each then an ordinary SWE-bench episode.

    The scenario of ThunderAgent-org/ThunderAgent issue #46 (a burst where the largest programs
    waited ~404 s to start while the smallest waited ~0.5 s): what an admission policy does with
    size when it cannot start everyone. Sizes, span and the shared prefix are Sluice's
    assumption: a 2,048-token system prompt shared by all (a smaller family prefix than
    :class:`SwebenchWorkload`'s, so the contexts' spread is the programs' own), first contexts
    from 4,096 to 40,960 tokens, the rest of each episode drawn as SwebenchWorkload draws it.
    A program's size rank is its index's place in a seeded permutation, so sizes do not follow
    arrival order.
    """

    def __init__(self, seed: int, *, smallest_context_tokens: int = 4096, span: float = 10.0,
                 shared_prefix_tokens: int = 2048) -> None:
        if seed < 0:
            raise ValueError(f"seed must be ≥ 0, got {seed}")
        if span < 1.0:
            raise ValueError(f"span must be ≥ 1, got {span}")
        if not 0 <= shared_prefix_tokens < smallest_context_tokens:
            raise ValueError("need 0 ≤ shared_prefix_tokens < smallest_context_tokens, got "
                             f"{shared_prefix_tokens}, {smallest_context_tokens}")
        self.seed = seed
        self.smallest_context_tokens = smallest_context_tokens
        self.span = span
        self.episodes = SwebenchWorkload(seed, shared_prefix_tokens=shared_prefix_tokens,
                                         family=1)

    def programs(self, n: int) -> list[ProgramSpec]:
        """``n`` programs, all starting at time 0."""
        if n <= 0:
            raise ValueError(f"n must be > 0, got {n}")
        ranks = np.random.default_rng([self.seed, 3]).permutation(n)
        return [self._program(index, int(rank), n) for index, rank in enumerate(ranks)]

    def _program(self, index: int, rank: int, n: int) -> ProgramSpec:
        rng = np.random.default_rng([self.seed, 4, index])
        place = rank / (n - 1) if n > 1 else 0.0
        first_context = round(self.smallest_context_tokens * self.span ** place)
        turns = self.episodes.draw_turns(rng)
        calls = self.episodes.draw_calls(rng, turns, first_context)
        return ProgramSpec(session_id=f"burst-{self.seed}-{index}", calls=calls, index=index,
                           family=self.episodes.family,
                           shared_prefix_tokens=self.episodes.shared_prefix_tokens)


def open_loop_arrivals(rate_per_s: float, duration_s: float, seed: int) -> list[float]:
    """Arrival times of a Poisson process of rate ``rate_per_s`` in ``[0, duration_s)``."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s must be > 0, got {rate_per_s}")
    if duration_s < 0:
        raise ValueError(f"duration_s must be ≥ 0, got {duration_s}")
    rng = np.random.default_rng([seed, 2])
    arrivals: list[float] = []
    t = 0.0
    # Draw gaps in chunks sized to the expected count; stop at the horizon.
    chunk = max(16, int(rate_per_s * duration_s * 1.1) + 16)
    while True:
        for gap in rng.exponential(1.0 / rate_per_s, chunk):
            t += float(gap)
            if t >= duration_s:
                return arrivals
            arrivals.append(t)
