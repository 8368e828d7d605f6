"""Sluice's program-aware policy: architecture.md §3 (v1) with the v2 rules of
docs/design-notes.md "Policy v2". :class:`ProgramAwarePolicy` (``policy.py``) is the façade;
each mechanism has its own room, named below with its rule.

A tick runs, in order: release idle programs → dormancy → predicted prefetches → overdue
calls → resume (forced, reserved, in order) → pause → soft band → retention.

- **Capacity** (``capacity.py``): a worker pauses at ``pause_threshold``; with a host tier
  (``retention.host_tier``) a worker none of whose programs is paused runs them all while
  their contexts add up to at most ``host_tier_overcommit`` GPU pools (its threshold is
  that), and a paused program whose home still holds its KV (GPU or tier) resumes only
  there: elsewhere it would recompute what the home loads back; ``max_wait_s`` still bounds
  its wait.
- **Admission of a new program** (``placement.py``): score = prefix credit − U (credit =
  resident prompt tokens / capacity, so both are shares of the worker; for a program of a
  group, the prompt it shares with an active sibling homed there counts as resident), minus
  ``soft_band_delay_s`` in a soft-band worker, among workers where it fits below their
  threshold; a worker that runs all its programs takes new ones by fewest calls in flight;
  sub-agents go to their parent's worker when it fits. While other programs wait for room,
  a new one queues behind them (as ThunderAgent does), and the resume pass orders them.
- **Resume** (``resume.py``): paused programs with a waiting call, then new programs, then
  idle paused ones; inside each, the client's higher priority first
  (``CallHints.priority``), then smallest first, sizes halved every
  ``resume_aging_halflife_s`` of waiting so a large program is not bypassed forever. Each
  goes to its home worker if it fits there (its KV may still be resident), else to the
  parent's worker for a sub-agent, else best fit (the fitting worker with the least headroom
  left). "Fits" means ``U ≤ threshold − resume_hysteresis`` afterwards. A program parked for
  ``force_resume_after_s`` is resumed regardless (its home, else the emptiest worker).
- **Bounded waiting (v2)** (``resume.py``): a call held ``max_wait_s`` (stretched in
  proportion when the programs that want to run ask for more than ``wait_stretch_from``
  pools, at most ``max_wait_stretch`` times; shortened by the client's ``deadline_s``) goes ahead: its program is resumed on its home, else the emptiest
  worker, room or not (counted in ``wait_limit_resumes``); the pause pass then makes room. A
  program larger than any worker's resume limit gets a reserved worker instead of waiting
  for that: nothing else is placed there, and it resumes when it fits or, forced, once
  nothing there is reasoning.
- **Pause** (``pausing.py``): on each worker with ``U ≥`` its threshold, pause ACTING
  programs smallest first until ``U ≤ pause_target``; if that is not enough, mark REASONING
  programs smallest first, counting marked tokens as already gone. Nothing in flight is
  aborted: a marked program pauses when its last call completes.
- **Soft band** (``pausing.py``): calls admitted to a worker with ``pause_target ≤ U <
  pause_threshold`` (one that does not run all its programs) go ``soft_band_delay_s``
  seconds later in the engine's queue (the Dynamo port's soft demote).
- **Dormancy (v2)** (``dormancy.py``): an ACTING program still in its tool call after the
  ``dormant_quantile`` of recent tool-call durations (at least ``dormant_min_s``; the
  client's retention TTL for that call instead when it gave one) is likely in a long one (a
  test run, a user away): it stops counting in ``U`` (weight ``dormant_token_weight``), so
  its room goes to work that is ready; its KV stays retained until the engine needs the room
  (LRU takes it before KV in use). Its next call goes home as usual and counts again.
- **Retention** (``keep.py``): a placed or resumed program gets ``Retain`` (refreshed
  before its TTL runs out while it stays active, dormant or not); a paused one ``Demote``; a
  released one ``Release``. With a host tier a paused program gets ``Offload`` instead (its
  KV waits in host memory, most recent, rather than being lost), a resumed one whose KV the
  tier holds gets ``Prefetch`` (kept there until its call loads it back), so does a paused
  one whose call is held (at ``held_priority``, below a resumed one's), and with
  ``offload_dormant`` a program turning dormant is offloaded too (no Retain refresh until
  its next call) and, with ``prefetch_predicted``, prefetched when its tool call is predicted
  to end (the median of recent tool calls longer than it has lasted so far).
- **Engine priority**: every :class:`Admit` carries the call's arrival (a held call keeps its
  place), minus ``resume_priority_boost_s`` for a resumed program's calls, plus
  ``soft_band_delay_s`` in a soft band; the shells hand the engine
  :func:`scheduler.actions.engine_priority` of it (ms relative to dispatch). It orders the
  queue of the simulator's engines and of a vLLM started with ``--scheduling-policy
  priority`` and declared so (``scheduling_policy: priority``); under vLLM's default
  ``fcfs`` the soft band and the boost do not act (architecture.md §3).
- **Client hints** (``CallHints``): a deadline shortens ``max_wait_s`` for its call, an
  expected output length replaces ``growth_reserve_tokens`` in its demand, a retention TTL is
  the program's dormancy cutoff for the tool call that follows.
"""

from scheduler.policies.program_aware.policy import ProgramAwarePolicy

__all__ = ["ProgramAwarePolicy"]
