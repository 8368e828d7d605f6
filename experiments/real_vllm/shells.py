"""The real-vLLM experiment's two shells: one policy's run through the gateway on real vLLM
workers, and the simulator's run of the same programs on a calibrated preset.

Live: the gateway in a process of its own (``tests/support/parity_servers.py``, uvloop, real
time) in front of the fleet's vLLM workers (KV events, replay and the Sluice plugin's directive
socket on loopback); a client in this process keeps ``concurrency`` programs in closed loop for
``duration_s`` seconds, the first ones spread over ``ramp_s`` as :class:`sim.feeds.ClosedLoop`
spreads them, and reads the workers' and the gateway's counters from ``/metrics`` at the start
and at the end. Simulated: :class:`sim.simulation.Simulation` with the same programs, pools,
queue order and policy config, and the step-time model fitted to these workers.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from experiments.real_vllm.workload import AgentProgram, AgentWorkload, WorkloadShape
from scheduler.config_reading import make_policy_config
from sim.runs import policy_costs_taken
from sim.step_time import StepTimeModel
from tests.support.parity import (
    ADMIN_TOKEN,
    SIM_RAMP_JITTERS_S,
    CallRecord,
    ClientOutcome,
    ServerProcess,
    ShellRun,
    read_counters,
    reprefill_at_admission,
    simulate_closed_loop,
    wait_ready,
)
from tests.support.parity_servers import LoopLag, VirtualClock
from tests.support.vllm_fleet import MODEL_NAME, Fleet

KEEPALIVE_EXPIRY_S = 2.0
CALL_TIMEOUT_S = 300.0


@dataclass(frozen=True, slots=True)
class RunSetup:
    seed: int
    workers: int
    blocks: int  # per worker, vLLM's num_gpu_blocks (the null block included)
    block_size: int
    concurrency: int
    duration_s: float
    ramp_s: float
    shape: WorkloadShape
    scheduling_policy: str
    growth_reserve_tokens: int
    # The calibrated preset's cost terms (sim/runs.py preset_policy_costs): a policy that
    # prices calls (vllm_router's cost models, autellix, continuum) takes them in both
    # shells, as `sluice sim --preset-file` gives them; the others have no such keys.
    policy_costs: Mapping[str, float] = field(default_factory=dict)

    def policy_section(self, policy: str) -> dict[str, Any]:
        section = {"name": policy, "growth_reserve_tokens": self.growth_reserve_tokens}
        return {**section, **policy_costs_taken(make_policy_config(section), self.policy_costs)}


# -- live --------------------------------------------------------------------------------------


class AgentClient:
    """Plays the programs through the gateway in closed loop, in token ids."""

    def __init__(self, setup: RunSetup, workload: AgentWorkload, gateway_url: str,
                 worker_urls: list[str]) -> None:
        self.setup = setup
        self.workload = workload
        self.gateway_url = gateway_url
        self.worker_urls = worker_urls
        self.outcome = ClientOutcome()
        self.lag = LoopLag()
        self._next_index = 0
        self.clock = VirtualClock(1.0)

    async def run(self) -> ClientOutcome:
        setup = self.setup
        limits = httpx.Limits(max_connections=setup.concurrency + 8,
                              max_keepalive_connections=setup.concurrency + 8,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(base_url=self.gateway_url, limits=limits, trust_env=False,
                                     timeout=httpx.Timeout(CALL_TIMEOUT_S)) as http, \
                httpx.AsyncClient(timeout=10.0, trust_env=False) as metrics:
            base = await self._read_counters(metrics)
            self.clock = VirtualClock(1.0)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self.lag.run)
                for slot in range(setup.concurrency):
                    tasks.start_soon(self._slot, http, slot)
                await anyio.sleep(setup.duration_s)
                end = await self._read_counters(metrics)
                tasks.cancel_scope.cancel()
        self.outcome.counters = {name: value - base.get(name, 0.0) for name, value in end.items()}
        return self.outcome

    async def _slot(self, http: httpx.AsyncClient, slot: int) -> None:
        await anyio.sleep(self.setup.ramp_s * slot / self.setup.concurrency)
        while True:
            index = self._next_index
            self._next_index += 1
            self.outcome.programs_started += 1
            if await self._play(http, self.workload.program(index)):
                self.outcome.programs_completed += 1

    async def _play(self, http: httpx.AsyncClient, program: AgentProgram) -> bool:
        prompts = program.prompt_tokens(self.workload.shape.system_tokens)
        context = [*self.workload.system_ids, *program.opening_ids]
        for k in range(program.calls):
            if k:
                await anyio.sleep(program.tool_s[k - 1])
            answer = await self._call(http, program, k, context, prompts)
            if answer is None:
                return False
            if k + 1 < program.calls:
                context = [*context, *answer, *program.tool_ids[k]]
        return True

    async def _call(self, http: httpx.AsyncClient, program: AgentProgram, k: int, context: list[int],
                    prompts: list[int]) -> list[int] | None:
        headers = {"x-session-id": program.session_id}
        if k == program.calls - 1:
            headers["x-dynamo-session-final"] = "true"
        body = {"model": MODEL_NAME, "prompt": context, "max_tokens": program.output_tokens[k],
                "min_tokens": program.output_tokens[k], "ignore_eos": True, "temperature": 0,
                "return_token_ids": True}
        where = f"{program.session_id}#{k}"
        sent = self.clock()
        try:
            response = await http.post("/v1/completions", json=body, headers=headers)
        except httpx.TransportError as err:
            self.outcome.errors.append(f"{where}: {type(err).__name__}: {err}")
            return None
        answered = self.clock()
        if response.status_code != 200:
            self.outcome.errors.append(f"{where}: HTTP {response.status_code}: {response.text[:200]}")
            return None
        data = response.json()
        usage = data["usage"]
        answer = data["choices"][0].get("token_ids")
        prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if prompt != len(context) or output != program.output_tokens[k] or answer is None \
                or len(answer) != output:
            self.outcome.errors.append(f"{where}: off script: prompt {prompt} (sent {len(context)}), "
                                       f"output {output} (asked {program.output_tokens[k]}), "
                                       f"{'no' if answer is None else len(answer)} token ids")
            return None
        # an answer off the script ended the program above: this one is on it
        self.outcome.calls.append(CallRecord(
            program.session_id, k, sent, answered, prompt, cached, output,
            reprefill_at_admission(prompts, program.output_tokens, k, prompt, cached), matches_script=True))
        return answer

    async def _read_counters(self, http: httpx.AsyncClient) -> dict[str, float]:
        started = self.clock()
        counters = await read_counters(http, [self.gateway_url, *self.worker_urls])
        self.outcome.read_at_s = (started, self.clock())
        return counters


def serve_config(setup: RunSetup, policy: str, fleet: Fleet, request_log: Path) -> dict[str, Any]:
    return {
        "admin_token": ADMIN_TOKEN, "admin_token_env": None, "capacity_retry_s": 0.2,
        "reload_poll_s": 0, "log_level": "warning", "request_log": str(request_log),
        "upstream": {"connect_timeout_s": 5.0, "read_timeout_s": CALL_TIMEOUT_S},
        "workers": [{**worker.gateway_entry(), "scheduling_policy": setup.scheduling_policy}
                    for worker in fleet.workers],
        "policy": setup.policy_section(policy),
    }


def run_live(setup: RunSetup, policy: str, fleet: Fleet, label: str) -> ShellRun:
    """``policy`` through the gateway on ``fleet``; ``label`` names the run's token ids."""
    workload = AgentWorkload(setup.seed, setup.shape, label)
    with tempfile.TemporaryDirectory(prefix="sluice-real-vllm-") as tmp:
        config = serve_config(setup, policy, fleet, Path(tmp) / "requests.jsonl")
        gateway = ServerProcess("gateway", json.dumps(config), "1.0").start()
        try:
            gateway_url = gateway.wait_serving()["url"]
            wait_ready(gateway_url, len(fleet.workers), setup.scheduling_policy, timeout_s=60.0)
            client = AgentClient(setup, workload, gateway_url, [w.url for w in fleet.workers])
            outcome = anyio.run(client.run, backend_options={"use_uvloop": True})
        finally:
            gateway.stop()
        gateway.check_exit()
    return _live_run(setup, policy, outcome, client.lag.summary(), gateway)


def _live_run(setup: RunSetup, policy: str, outcome: ClientOutcome, client_lag: dict[str, float],
              gateway: ServerProcess) -> ShellRun:
    done = [call for call in outcome.calls if call.answered_s <= setup.duration_s]
    # the counters were read just after the run's end: scaled back to its duration
    scale = setup.duration_s / (sum(outcome.read_at_s) / 2.0)
    counters = outcome.counters

    def total(name: str) -> int:
        return round(counters.get(name, 0.0) * scale)

    return ShellRun(
        shell="live", policy=policy, duration_s=setup.duration_s,
        output_tokens=total("vllm:generation_tokens_total"),
        prompt_tokens=total("vllm:prefix_cache_queries_total"),
        cached_tokens=total("vllm:prefix_cache_hits_total"),
        calls_completed=len(done), call_latencies_s=[c.answered_s - c.sent_s for c in done],
        pauses=total("sluice_pauses_total"), resumes=total("sluice_resumes_total"),
        marks=total("sluice_marks_total"), preemptions=total("vllm:num_preemptions_total"),
        reprefill_at_admission=sum(c.reprefill_at_admission for c in done), engine_reprefill=None,
        latency_by_call={f"{c.session_id}#{c.call}": c.answered_s - c.sent_s for c in done},
        diagnostics={
            "errors": len(outcome.errors), "error_samples": outcome.errors[:5],
            "programs_started": outcome.programs_started,
            "programs_completed": outcome.programs_completed,
            "counters_read_at_s": [round(t, 3) for t in outcome.read_at_s],
            "directives_sent": total("sluice_directives_sent_total"),
            # engine iterations and the tokens they computed (vLLM's iteration_tokens histogram)
            "engine_steps": total("vllm:iteration_tokens_total_count"),
            "engine_workers": setup.workers,
            "engine_step_tokens": total("vllm:iteration_tokens_total_sum"),
            "loop_lag_wall_s": {"client": client_lag, "gateway": gateway.loop_lag},
            "cpu_s": {"gateway": gateway.cpu_s},
        })


# -- simulated ---------------------------------------------------------------------------------


def run_simulated(setup: RunSetup, policy: str, model: StepTimeModel, ramp_jitter_s: float = 0.0) -> ShellRun:
    return simulate_closed_loop(
        policy, setup.policy_section(policy), AgentWorkload(setup.seed, setup.shape).spec,
        concurrency=setup.concurrency, ramp_s=setup.ramp_s + ramp_jitter_s, workers=setup.workers,
        model=model, duration_s=setup.duration_s, block_size=setup.block_size, num_blocks=setup.blocks,
        scheduling_policy=setup.scheduling_policy)


def run_simulated_band(setup: RunSetup, policy: str, model: StepTimeModel,
                       jitters_s: Sequence[float] = SIM_RAMP_JITTERS_S) -> list[ShellRun]:
    return [run_simulated(setup, policy, model, jitter) for jitter in jitters_s]
