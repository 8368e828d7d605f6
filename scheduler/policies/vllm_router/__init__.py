"""vllm-router's program scheduling (vllm-router ≥ 0.1.16), as documented: the ``vllm_router``
baseline. :class:`VllmRouterPolicy` (``policy.py``) is the façade; each rule below names its
room and its source.

Sources: vllm-project/router ``docs/program_scheduling.md`` (the doc: its Configuration
reference gives every default of :class:`~scheduler.config.VllmRouterConfig`), and where the doc
is silent its implementation, ``src/program_scheduling/`` (files named per rule). Sluice's
workers are the source's ranks; a program is a session.

- **Binding** (``binding.py``; binding/mod.rs): a new program is bound at its first call to a
  worker by consistent hashing (``hash_virtual_nodes`` 160 per worker) and keeps it: its calls
  go there unless it moves cross-rank (below) or the worker fails (then it is bound afresh).
- **Request pool** (``policy.py``, ``admission.py``; scheduler_admission.rs): the call of an
  ACTIVE program (reasoning, or acting within its TTL) goes straight to its worker. Any other
  call waits in the pool until admission lets its program in: by token capacity (the ledger's
  capacity of the worker, ``low_watermark_ratio`` of it; the doc's
  ``token_capacity_per_target``), by ``max_active_programs_per_target``, and by the growth
  reserve learned over ``stats_window_size`` completions (0 before), for which modelled batch
  gain may stand in (``enable_batch_gain_admission``). A program's tokens are its context plus
  ``decode_buffer_tokens``, or plus its call's expected output (``CallHints``) (the source's
  private tokens; the ledger subtracts what programs share). A call arriving at a worker no
  other program waits for is admitted at once when admission allows (the source schedules on
  arrival); else at the next tick (every ``scheduler_interval_s``, and after each completion
  as the source's ``complete`` does).
- **Progress-TTL** (``progress_ttl.py``; policy.rs, scheduler_lifecycle.rs): a call that ends
  leaves its program ACTIVE for an acting TTL fitted to its worker's window of call intervals
  and the call's cache-miss impact, capped at ``max_acting_ttl_seconds``, 0 before the window
  holds ``stats_window_size`` intervals; the client's ``retention_ttl_s`` replaces it. When
  it runs out the program is paused and its tokens given back; its next call goes through the
  pool. Acting programs are never reclaimed by admission or resume.
- **Capacity repair** (``policy.py``; scheduler_lifecycle.rs ``repair_capacity``): when a
  worker's tokens plus each reasoning program's mean output to come pass
  ``high_watermark_ratio`` of its capacity, reasoning programs are marked, highest score first
  (time in their segment, weighted up for programs smaller than the mean prompt), until the
  projection is down to ``low_watermark_ratio``; a marked program pauses when its call
  completes (nothing in flight is aborted). A failed call pauses its program too.
- **Resume** (``admission.py``, ``cross_rank.py``; scheduler_admission.rs,
  scheduler_fairness.rs, scheduler_global.rs): waiting programs are tried on their previous
  worker first: expired force-resume deadlines first (a forced program passes the count and
  token checks), then larger client priority, then programs that did not just yield, then
  ``resume_order`` (MRU by default). With ``global_queue`` (the doc's default is false; it
  recommends true, which Sluice takes) a program paused before may then move to another
  worker with enough headroom (``cross_rank_headroom_ratio``), FCFS. The force-resume
  deadline is workload-derived, at most ``force_resume_timeout_seconds``.
- **Segment yield** (scheduler_fairness.rs ``yield_completed_segment``): an idle program
  that ran ``max_segment_rounds`` cache-continuous rounds since its admission pauses when
  another program waits for its worker, and ranks behind its tier at its next resume.
- **Timeouts** (scheduler_admission.rs, scheduler_lifecycle.rs): a call waiting
  ``queue_timeout_seconds`` fails; an idle program paused ``paused_retention_ttl_seconds`` is
  released.
- **Cost models** (the doc, "Offline calibration models"): cache-miss impact from the
  cold-prefill coefficients, batch gain from the decode-step coefficients; the simulator
  derives both from its preset (sim/step_time.py ``vllm_router_cost_terms``), as the doc tells
  operators to calibrate them on their deployment.

Sluice's choices, where the source is silent or reads what Sluice's policy cannot see:

- The engine's waiting-request count (``admission_waiting_request_threshold``) is not
  observable to the policy: left out (admission.py says why).
- The source's router-side occupancy, blended with the engine's reported KV usage, is the
  ledger's load here (contexts and buffers of the active programs less their shared prefixes,
  from KV events or continuation chains), and a program's shared prefix is what its first
  completed call found cached (the source refreshes it on a freshness schedule,
  ``shared_prefix_freshness_*``, left out).
- Capacity repair marks reasoning programs only, as the doc says; the implementation read
  also pauses idle acting programs there, which the doc's "acting Programs are not reclaimed"
  and its repair sentence leave out.
- A call past ``queue_timeout_seconds`` releases its program (reason ``queue timeout``): a
  policy cannot refuse one held call, and a release makes the shell refuse the held ones.
- A waiting program's call admitted on arrival resumes it without a ``Resume`` action (a
  decision carries none; its ``Admit`` says ``resumed``). Admitted calls keep their arrival
  as their priority: the source gives resumed calls no boost.
- Each worker tries its waiting programs once per pass, in order, rather than restarting
  the order after each admission (an admission only makes the next one harder).
- Left out with their doc defaults: ``binding_only`` (false), ``binding_strategy`` (only its
  default, ``consistent_hash``), ``program_scheduling_enable_key`` (every Sluice call has a
  program). The shared ``idle_release_s`` and ``growth_reserve_tokens`` are not read:
  ``paused_retention_ttl_seconds`` and the decode buffer take their places.
"""

from scheduler.policies.vllm_router.policy import VllmRouterPolicy

__all__ = ["VllmRouterPolicy"]
