"""Live against simulated: one scripted workload through both shells.

Every throughput claim of Sluice comes from the simulator; this shows the gateway on workers
does what the simulator measured. The same programs (:class:`sim.scripted.ScriptedWorkload`),
the same engine model, step-time preset, time scale and KV pool, the same policy and config:

- :func:`run_simulated` plays them in :class:`sim.simulation.Simulation` (virtual clock);
- :func:`run_live` plays them through the real gateway (``controller.gateway.create_app``,
  uvicorn on loopback) in front of real simworkers (``simworker.worker.create_app``, served by
  tests/support/parity_servers.py in subprocesses, the gateway in one of its own), driven by a client that plays each
  program: call ``k``, its answer, the tool time, call ``k + 1`` with the messages so far, the
  answer verbatim and a tool message. Sessions come in ``x-session-id``, so identity is not a
  variable.

Time. The simworkers run the engine model in scaled real time (virtual = wall /
``time_scale``). The gateway is given the same scaled clock (``create_app(clock=...)``), so
the policy sees virtual seconds in both shells and takes the very same config; the one key
converted is ``tick_interval_s``, which the gateway's tick loop sleeps on the wall clock
(:func:`live_policy_section`). Both runs last ``duration_s`` virtual seconds from the first
program's start, in closed loop at ``concurrency`` (a program ends, the next starts), the first
programs spread over ``ramp_s`` as :class:`sim.feeds.ClosedLoop` spreads them; the live
counters are read at that moment from the simworkers' and the gateway's ``/metrics``.

The engines' queue order is one parameter of both shells (``scheduling_policy``): the
simulator's engines, the simworkers' (vLLM's ``--scheduling-policy``) and the gateway's worker
entries, which under ``priority`` make it send the policy's engine priority.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx
import numpy as np
import zmq
from prometheus_client.parser import text_string_to_metric_families

from controller.serve_config import parse_serve_config
from scheduler.config_reading import parse_policy_config
from scheduler.kv_events import EventBatchDecoder
from scheduler.policies import make_policy
from sim.engine import SCHEDULING_POLICIES
from sim.feeds import ClosedLoop
from sim.programs import ProgramSpec
from sim.scripted import ScriptedProgram, ScriptedWorkload
from sim.simulation import Simulation
from sim.step_time import DEFAULT_PRESET, StepTimeModel
from sim.step_time import preset as load_preset
from simworker.worker import SimWorkerConfig
from tests.support.parity_servers import LoopLag, VirtualClock, simworker_configs_json

ADMIN_TOKEN = "parity-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
MODEL = "sluice-sim"
REPO = Path(__file__).resolve().parents[2]
# How the simworkers are spread over processes: one process each, or all in one.
LAYOUTS = ("processes", "one_process")
# A simworker whose event loop is held up (a busy host) runs the iterations it missed back to
# back up to this far behind, and skips only what lies beyond (its max_lag_wall_s, 0.25 s by
# default): the engines' model time then stays the simulator's through the stalls another
# process on a shared 2-core host causes, and only the calls' delivery is late.
CATCH_UP_WALL_S = 5.0
KEEPALIVE_EXPIRY_S = 2.0


@dataclass(frozen=True, slots=True)
class ParitySetup:
    """Everything both shells share. The defaults oversubscribe the fleet's KV about 1.4×
    under program_aware (it pauses and resumes ~3.8 programs a second) and run in real time:
    a call's HTTP hops cost the live shell a few milliseconds of wall time each, which a
    time scale below 1 would magnify into that many more virtual ones (design notes, "Live
    against simulated"). Many programs on large pools keep the run short all the same: the
    events to compare come from the programs' number, not from compressed time."""

    seed: int = 7
    workers: int = 3
    blocks: int = 1600            # per worker, the null block included (vLLM's num_gpu_blocks)
    block_size: int = 16
    preset: str = DEFAULT_PRESET
    # The programs' contexts are short (~2.4k tokens at the end); charging prompt tokens 10×
    # keeps a re-prefill's cost against a turn's decode where it is for long contexts on a
    # GPU (as the demo does with its own scale).
    prefill_scale: float = 10.0
    time_scale: float = 1.0       # wall seconds per virtual second in the live run
    concurrency: int = 72
    ramp_s: float = 10.0
    duration_s: float = 120.0     # virtual seconds
    # the programs' replies are 16–128 tokens: the default reserve (512) would hold back a
    # large share of the pools for calls in flight
    growth_reserve_tokens: int = 128
    # vLLM's --scheduling-policy of every engine, simulated and live: under "priority" the
    # policy's Admit priority orders each engine's queue (the simulator's default), under
    # "fcfs" (vLLM's) arrival does
    scheduling_policy: str = "priority"
    layout: str = "one_process"

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if not self.time_scale > 0 or not self.duration_s > 0:
            raise ValueError("time_scale and duration_s must be > 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")

    def workload(self) -> ScriptedWorkload:
        return ScriptedWorkload(self.seed)

    def engine_model(self) -> StepTimeModel:
        """The preset as the simworkers run it (``--prefill-scale``)."""
        model = load_preset(self.preset)
        return model.with_prefill_scale(self.prefill_scale)

    def policy_section(self, policy: str) -> dict[str, Any]:
        """The ``policy:`` section both shells run (virtual seconds)."""
        return {"name": policy, "growth_reserve_tokens": self.growth_reserve_tokens}


def live_policy_section(section: dict[str, Any], time_scale: float) -> dict[str, Any]:
    """The section for a gateway on the scaled clock: the same, but for ``tick_interval_s``,
    which its tick loop sleeps on the wall clock (controller/admission.py ``run_ticks``)."""
    config = parse_policy_config(section)
    if "tick_interval_s" not in type(config).model_fields:
        raise ValueError(f"{config.name} ticks on a key of its own; the harness converts only "
                         "tick_interval_s")
    return {**section, "tick_interval_s": config.tick_interval_s * time_scale}


# -- what one shell measured -----------------------------------------------------------------


@dataclass(slots=True)
class ShellRun:
    """One shell's measurements over ``duration_s`` virtual seconds. Counters are the
    engines' (output, prompt and cached tokens, preemptions) and the policy's (pauses,
    resumes, marks); calls are those completed within the run, latencies from the call's
    arrival to its answer."""

    shell: str
    policy: str
    duration_s: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    calls_completed: int
    call_latencies_s: list[float]
    pauses: int
    resumes: int
    marks: int
    preemptions: int
    # Σ over completed calls of the prompt tokens their program had computed before (the
    # previous call's prompt and output) that missed the prefix cache: re-prefill as usage
    # shows it, the same sum in both shells
    reprefill_at_admission: int
    # the engines' own re-prefill count (preemption recompute included); None where the
    # engines do not count it (the simworker does not know a session's previous context)
    engine_reprefill: int | None
    # "<session>#<call>" → latency of each completed call (the same key in both shells)
    latency_by_call: dict[str, float] = field(default_factory=dict)
    diagnostics: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.duration_s

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def latency_quantile(self, q: float) -> float:
        if not self.call_latencies_s:
            return math.nan
        return float(np.quantile(np.asarray(self.call_latencies_s), q))

    def row(self) -> dict[str, Any]:
        return {
            "shell": self.shell, "policy": self.policy, "duration_s": self.duration_s,
            "output_tokens_per_s": round(self.output_tokens_per_s, 2),
            "hit_rate": round(self.hit_rate, 4), "pauses": self.pauses, "resumes": self.resumes,
            "marks": self.marks, "calls_completed": self.calls_completed,
            "p50_call_s": round(self.latency_quantile(0.5), 3),
            "p99_call_s": round(self.latency_quantile(0.99), 3),
            "reprefill_at_admission": self.reprefill_at_admission,
            "engine_reprefill": self.engine_reprefill, "preemptions": self.preemptions,
            "output_tokens": self.output_tokens, "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens, "diagnostics": self.diagnostics,
        }


def reprefill_at_admission(program_prompts: Sequence[int], program_outputs: Sequence[int], k: int,
                           prompt_tokens: int, cached_tokens: int) -> int:
    """Call ``k``'s prompt tokens its program had computed before that missed the cache."""
    if k == 0:
        return 0
    before = program_prompts[k - 1] + program_outputs[k - 1]
    return max(0, min(before, prompt_tokens) - cached_tokens)


# -- the simulated shell -----------------------------------------------------------------------


# Offsets to the first programs' ramp, in seconds: each gives the simulator's run of the same
# programs with start times a few milliseconds apart, as a live run's are from its own. The
# spread of their results is what timing noise alone does to each metric; the comparison
# reads the simulated value as their mean.
SIM_RAMP_JITTERS_S = (0.0, 0.001, 0.002, 0.004)


def run_simulated_band(setup: ParitySetup, policy: str,
                       jitters_s: Sequence[float] = SIM_RAMP_JITTERS_S) -> list[ShellRun]:
    return [run_simulated(setup, policy, ramp_jitter_s=jitter) for jitter in jitters_s]


def run_simulated(setup: ParitySetup, policy: str, ramp_jitter_s: float = 0.0) -> ShellRun:
    return simulate_closed_loop(
        policy, setup.policy_section(policy), setup.workload().make_program,
        concurrency=setup.concurrency, ramp_s=setup.ramp_s + ramp_jitter_s, workers=setup.workers,
        model=setup.engine_model(), duration_s=setup.duration_s, block_size=setup.block_size,
        num_blocks=setup.blocks, scheduling_policy=setup.scheduling_policy)


def simulate_closed_loop(policy: str, policy_section: dict[str, Any], make_program: Callable[[int], ProgramSpec],
                         *, concurrency: int, ramp_s: float, workers: int, model: StepTimeModel,
                         duration_s: float, block_size: int, num_blocks: int,
                         scheduling_policy: str) -> ShellRun:
    """The simulated shell: ``make_program``'s programs in closed loop, measured as the live
    shell measures them (re-prefill at admission from each program's own call sizes)."""
    programs: dict[str, ProgramSpec] = {}

    def recorded(index: int) -> ProgramSpec:
        spec = make_program(index)
        programs[spec.session_id] = spec
        return spec

    simulation = Simulation(
        make_policy(parse_policy_config(policy_section)), ClosedLoop(recorded, concurrency, ramp_s=ramp_s),
        workers=workers, model=model, duration_s=duration_s, block_size=block_size,
        num_blocks=num_blocks, scheduling_policy=scheduling_policy)
    result = simulation.run()
    at_admission = 0
    latency_by_call: dict[str, float] = {}
    for engine in simulation.engines:
        for request in engine.finished:
            # the simulator names a call "<session>#<call index>"
            session, _, k = request.request_id.rpartition("#")
            calls = programs[session].calls
            at_admission += reprefill_at_admission([c.prompt_tokens for c in calls],
                                                   [c.output_tokens for c in calls], int(k),
                                                   request.prompt_tokens, request.cached_tokens)
            assert request.finished_at is not None
            latency_by_call[request.request_id] = request.finished_at - request.arrival
    return ShellRun(
        shell="sim", policy=policy, duration_s=result.duration_s,
        output_tokens=result.output_tokens, prompt_tokens=result.prompt_tokens,
        cached_tokens=result.cached_tokens, calls_completed=result.calls_completed,
        call_latencies_s=list(result.call_latencies_s), pauses=result.pauses,
        resumes=result.resumes, marks=result.marks, preemptions=result.preemptions,
        reprefill_at_admission=at_admission, engine_reprefill=result.reprefill_tokens,
        latency_by_call=latency_by_call,
        diagnostics={"programs_completed": result.programs_completed,
                     "programs_started": len(programs),
                     "engine_steps": sum(engine.stats.steps for engine in simulation.engines),
                     "engine_busy_s": round(sum(engine.stats.busy_s for engine in simulation.engines), 3)})


# -- the live shell ----------------------------------------------------------------------------


def worker_configs(setup: ParitySetup) -> list[SimWorkerConfig]:
    """The fleet as the simworkers run it: ZMQ sockets on loopback ports the kernel picks,
    the engines' queue order ``setup.scheduling_policy`` (vLLM's ``--scheduling-policy``)."""
    return [SimWorkerConfig(name=f"w{i}", model=MODEL, preset=setup.preset, num_blocks=setup.blocks,
                            block_size=setup.block_size, kv_events="tcp://127.0.0.1:*",
                            replay="tcp://127.0.0.1:*", directives="tcp://127.0.0.1:*",
                            time_scale=setup.time_scale, prefill_scale=setup.prefill_scale,
                            max_lag_wall_s=CATCH_UP_WALL_S, scheduling_policy=setup.scheduling_policy)
            for i in range(setup.workers)]


class ServerProcess:
    """One ``python -m tests.support.parity_servers`` process: what it serves (its first line
    on stdout), and on stop its event loop's lag."""

    def __init__(self, *args: str) -> None:
        self._args = args
        self._log = tempfile.TemporaryFile(mode="w+")
        self._process: subprocess.Popen[str] | None = None
        self.served: Any = None
        self.loop_lag: dict[str, float] | None = None
        self.cpu_s: float | None = None
        self.exit_code: int | None = None
        self.stderr_tail = ""

    def start(self) -> ServerProcess:
        self._process = subprocess.Popen([sys.executable, "-m", "tests.support.parity_servers", *self._args],
                                         cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=self._log, text=True)
        return self

    def wait_serving(self) -> Any:
        assert self._process is not None and self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self._args[0]} exited before serving:\n{self.log_tail()}")
        self.served = json.loads(line)
        return self.served

    def log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-3000:]

    def stop(self) -> None:
        process = self._process
        if process is None:
            return
        try:
            out, _ = process.communicate(timeout=15)  # closes its stdin: the signal to stop
        except subprocess.TimeoutExpired:
            process.kill()
            out, _ = process.communicate()
        for line in out.splitlines():
            if line.startswith('{"loop_lag"'):
                last = json.loads(line)
                self.loop_lag, self.cpu_s = last["loop_lag"], last["cpu_s"]
        self.exit_code = process.returncode
        self.stderr_tail = self.log_tail()
        self._log.close()
        self._process = None

    def check_exit(self) -> None:
        """Raise if the process ended badly (its stderr's tail in the message)."""
        if self.exit_code not in (0, None):
            raise RuntimeError(f"{self._args[0]} exited with {self.exit_code}:\n{self.stderr_tail}")


class KvEventProbe:
    """A second subscriber to every worker's KV events, in a thread of this process: how long
    a batch takes from the simworker's publish (its ``ts``) to a SUB socket on the same host,
    the transport the gateway's subscriber reads from (its own queue and the admission lock
    come on top)."""

    def __init__(self, endpoints: list[str]) -> None:
        self._endpoints = endpoints
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.delays_s: list[float] = []
        self.events = 0
        self._failure: BaseException | None = None

    def start(self) -> KvEventProbe:
        self._thread.start()
        return self

    def _run(self) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.SUBSCRIBE, b"")
        decoder = EventBatchDecoder()
        try:
            for endpoint in self._endpoints:
                socket.connect(endpoint)
            while not self._stop.is_set():
                if not socket.poll(100):
                    continue
                frames = socket.recv_multipart()
                received = time.time()
                batch = decoder.decode(frames[2])
                self.delays_s.append(received - batch.ts)
                self.events += len(batch.events)
        except Exception as err:  # handed to stop(), which raises it in the caller
            self._failure = err
        finally:
            socket.close()
            context.term()

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(5)
        if self._failure is not None:
            raise RuntimeError("the KV-event probe failed") from self._failure
        return {"batches": len(self.delays_s), "events": self.events, **_quantiles(self.delays_s)}


def serve_config(setup: ParitySetup, policy: str, endpoints: list[dict[str, Any]],
                 request_log: Path) -> dict[str, Any]:
    """The gateway's ``sluice serve`` config (as a mapping)."""
    config = {
        "admin_token": ADMIN_TOKEN,
        "admin_token_env": None,
        "capacity_retry_s": 0.1,
        "reload_poll_s": 0,
        "log_level": "warning",
        "request_log": str(request_log),
        # the gateway sends the policy's priority to workers declared to order by it
        "workers": [{**endpoint, "scheduling_policy": setup.scheduling_policy} for endpoint in endpoints],
        "policy": live_policy_section(setup.policy_section(policy), setup.time_scale),
    }
    parse_serve_config(config)  # fail here, naming the key, rather than in the process
    return config


def wait_ready(gateway_url: str, workers: int, scheduling_policy: str, timeout_s: float = 30.0) -> None:
    """Until the gateway knows every worker's capacity (read from its /metrics); each must
    be declared with the run's queue order (what decides whether it is sent priorities)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(base_url=gateway_url, headers=ADMIN, timeout=5.0, trust_env=False) as http:
        while True:
            states = http.get("/sluice/workers").json()["workers"]
            if len(states) == workers and all(state["capacity_tokens"] for state in states):
                declared = {state["name"]: state["scheduling_policy"] for state in states}
                if set(declared.values()) != {scheduling_policy}:
                    raise RuntimeError(f"workers declared {declared}, not {scheduling_policy}")
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not learn the workers' capacities: {states}")
            time.sleep(0.05)


@dataclass(slots=True)
class CallRecord:
    session_id: str
    call: int
    sent_s: float        # virtual seconds since the run started
    answered_s: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reprefill_at_admission: int
    matches_script: bool  # usage equals the script's counts


@dataclass(slots=True)
class ClientOutcome:
    calls: list[CallRecord] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    programs_started: int = 0
    programs_completed: int = 0
    counters: dict[str, float] = field(default_factory=dict)
    read_at_s: tuple[float, float] = (0.0, 0.0)  # virtual seconds the counters were read between


class ScriptedClient:
    """Plays the workload's programs through the gateway in closed loop (module docstring)
    and reads the fleet's counters when the run's time is up."""

    def __init__(self, setup: ParitySetup, gateway_url: str, worker_urls: list[str]) -> None:
        self.setup = setup
        self.workload = setup.workload()
        self.gateway_url = gateway_url
        self.worker_urls = worker_urls
        self.outcome = ClientOutcome()
        self.lag = LoopLag()
        self._next_index = 0

    async def run(self) -> ClientOutcome:
        setup = self.setup
        concurrency = setup.concurrency
        # Idle connections are dropped well before the gateway's (uvicorn's) 5 s keep-alive
        # runs out, so a call is never written into a connection the server is closing.
        limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8,
                              keepalive_expiry=KEEPALIVE_EXPIRY_S)
        async with httpx.AsyncClient(base_url=self.gateway_url, limits=limits, trust_env=False,
                                     timeout=httpx.Timeout(300.0)) as http, \
                httpx.AsyncClient(timeout=10.0, trust_env=False) as metrics:
            # Read once before the start: the counters' base, and connections kept alive so
            # that the reading at the end takes as little of the run as it can.
            self.clock = VirtualClock(setup.time_scale)
            base = await self._read_counters(metrics)
            self.clock = VirtualClock(setup.time_scale)
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self.lag.run)
                for slot in range(concurrency):
                    tasks.start_soon(self._slot, http, slot)
                await anyio.sleep(self.clock.wall_s(setup.duration_s))
                end = await self._read_counters(metrics)
                tasks.cancel_scope.cancel()
        self.outcome.counters = {name: value - base.get(name, 0.0) for name, value in end.items()}
        return self.outcome

    async def _slot(self, http: httpx.AsyncClient, slot: int) -> None:
        # ClosedLoop's ramp: slot i's first program starts at ramp_s · i / concurrency
        await anyio.sleep(self.clock.wall_s(self.setup.ramp_s * slot / self.setup.concurrency))
        while True:
            index = self._next_index
            self._next_index += 1
            self.outcome.programs_started += 1
            if await self._play(http, self.workload.program(index)):
                self.outcome.programs_completed += 1

    async def _play(self, http: httpx.AsyncClient, program: ScriptedProgram) -> bool:
        messages = self.workload.opening(program)
        for k in range(program.calls):
            if k:
                await anyio.sleep(self.clock.wall_s(program.tool_s[k - 1]))
            reply = await self._call(http, program, k, messages)
            if reply is None:
                return False
            if k + 1 < program.calls:
                messages = [*messages, {"role": "assistant", "content": reply},
                            program.tool_message(k)]
        return True

    async def _call(self, http: httpx.AsyncClient, program: ScriptedProgram, k: int,
                    messages: list[dict[str, str]]) -> str | None:
        headers = {"x-session-id": program.session_id}
        if k == program.calls - 1:
            headers["x-dynamo-session-final"] = "true"  # the simulator's CallRequest.final
        body = {"model": MODEL, "messages": messages, "max_tokens": program.output_tokens[k]}
        sent = self.clock()
        try:
            response = await http.post("/v1/chat/completions", json=body, headers=headers)
        except httpx.TransportError as err:
            self.outcome.errors.append(f"{program.session_id}#{k}: {type(err).__name__}: {err}")
            return None
        answered = self.clock()
        if response.status_code != 200:
            self.outcome.errors.append(f"{program.session_id}#{k}: HTTP {response.status_code}: "
                                       f"{response.text[:200]}")
            return None
        data = response.json()
        usage = data["usage"]
        prompt, output = usage["prompt_tokens"], usage["completion_tokens"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        self.outcome.calls.append(CallRecord(
            program.session_id, k, sent, answered, prompt, cached, output,
            reprefill_at_admission(program.prompt_tokens, program.output_tokens, k, prompt, cached),
            prompt == program.prompt_tokens[k] and output == program.output_tokens[k]))
        return data["choices"][0]["message"]["content"]

    async def _read_counters(self, http: httpx.AsyncClient) -> dict[str, float]:
        """The gateway's and the workers' counters, summed over the workers, all read at
        once (``read_at_s`` says when)."""
        started = self.clock()
        counters = await read_counters(http, [self.gateway_url, *self.worker_urls])
        self.outcome.read_at_s = (started, self.clock())
        return counters


async def read_counters(http: httpx.AsyncClient, base_urls: Sequence[str]) -> dict[str, float]:
    """Every sample of every server's ``/metrics`` (read concurrently), summed by name over
    the servers."""
    texts: list[str] = [""] * len(base_urls)

    async def read(i: int) -> None:
        response = await http.get(f"{base_urls[i]}/metrics")
        response.raise_for_status()
        texts[i] = response.text

    async with anyio.create_task_group() as reads:
        for i in range(len(base_urls)):
            reads.start_soon(read, i)
    counters: dict[str, float] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if not sample.name.endswith("_created"):
                    counters[sample.name] = counters.get(sample.name, 0.0) + sample.value
    return counters


def run_live(setup: ParitySetup, policy: str, kv_probe: bool = False) -> ShellRun:
    """``kv_probe``: also measure the KV events' transport delay (:class:`KvEventProbe`), at
    the cost of decoding every batch once more in this process."""
    configs = worker_configs(setup)
    groups = [configs] if setup.layout == "one_process" else [[config] for config in configs]
    fleet = [ServerProcess("simworkers", simworker_configs_json(group)) for group in groups]
    gateway: ServerProcess | None = None
    with tempfile.TemporaryDirectory(prefix="sluice-parity-") as tmp:
        request_log = Path(tmp) / "requests.jsonl"
        try:
            for process in fleet:
                process.start()
            endpoints = [endpoint for process in fleet for endpoint in process.wait_serving()]
            gateway = ServerProcess("gateway", json.dumps(serve_config(setup, policy, endpoints, request_log)),
                                    str(setup.time_scale)).start()
            gateway_url = gateway.wait_serving()["url"]
            wait_ready(gateway_url, setup.workers, setup.scheduling_policy)
            client = ScriptedClient(setup, gateway_url, [endpoint["url"] for endpoint in endpoints])
            probe = KvEventProbe([endpoint["kv_events"] for endpoint in endpoints]).start() if kv_probe else None
            cpu_before = _cpu_s()
            load_before = os.getloadavg()[0]
            outcome = anyio.run(client.run, backend_options={"use_uvloop": True})
            client_cpu_s = _cpu_s() - cpu_before
            load = (round(load_before, 2), round(os.getloadavg()[0], 2))
            kv_delays = probe.stop() if probe is not None else None
        finally:
            if gateway is not None:
                gateway.stop()
            for process in fleet:
                process.stop()
        assert gateway is not None  # it started, or the run would have raised
        for process in [*fleet, gateway]:
            process.check_exit()
        gateway_records = read_request_log(request_log)
    loop_lags = {"client": client.lag.summary(), "gateway": gateway.loop_lag,
                 "workers": [process.loop_lag for process in fleet]}
    cpu_s = {"client": round(client_cpu_s, 3), "gateway": gateway.cpu_s,
             "workers": [process.cpu_s for process in fleet]}
    run = _live_run(setup, policy, outcome, gateway_records, loop_lags, cpu_s, load)
    if kv_delays is not None:
        run.diagnostics["kv_event_delay_s"] = kv_delays
    return run


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def read_request_log(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The gateway's ``request_end`` records per session, in the order the calls ended (a
    program's calls run one after the other, so the k-th is its call k)."""
    by_session: dict[str, list[dict[str, Any]]] = {}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            by_session.setdefault(record["agent_context"]["session_id"], []).append(record["request"])
    return by_session


def _live_run(setup: ParitySetup, policy: str, outcome: ClientOutcome,
              gateway_records: dict[str, list[dict[str, Any]]], loop_lags: dict[str, Any],
              cpu_s: dict[str, Any], load: tuple[float, float]) -> ShellRun:
    counters = outcome.counters
    done = [call for call in outcome.calls if call.answered_s <= setup.duration_s]
    # The client's latency less the gateway's (from the request read to the answer sent,
    # on the same virtual clock): what the client↔gateway hop and the client itself add.
    outside_gateway, held = [], []
    for call in done:
        records = gateway_records.get(call.session_id, [])
        if call.call < len(records):
            record = records[call.call]
            outside_gateway.append(call.answered_s - call.sent_s - record["total_time_ms"] / 1000.0)
            held.append(record["queue_time_ms"] / 1000.0)
    # The counters were read a little after the run's end (the reading takes a few
    # milliseconds, more when the host holds the client up): counted over the time to the
    # middle of the reading, scaled back to the run's duration.
    scale = setup.duration_s / (sum(outcome.read_at_s) / 2.0)

    def total(name: str) -> int:
        return int(round(counters.get(name, 0.0) * scale))

    return ShellRun(
        shell="live", policy=policy, duration_s=setup.duration_s,
        output_tokens=total("vllm:generation_tokens_total"),
        prompt_tokens=total("vllm:prefix_cache_queries_total"),
        cached_tokens=total("vllm:prefix_cache_hits_total"),
        calls_completed=len(done),
        call_latencies_s=[call.answered_s - call.sent_s for call in done],
        pauses=total("sluice_pauses_total"), resumes=total("sluice_resumes_total"),
        marks=total("sluice_marks_total"), preemptions=total("vllm:num_preemptions_total"),
        reprefill_at_admission=sum(call.reprefill_at_admission for call in done),
        engine_reprefill=None,
        latency_by_call={f"{call.session_id}#{call.call}": call.answered_s - call.sent_s for call in done},
        diagnostics={
            "errors": len(outcome.errors), "error_samples": outcome.errors[:5],
            "calls_off_script": sum(not call.matches_script for call in outcome.calls),
            "programs_started": outcome.programs_started,
            "programs_completed": outcome.programs_completed,
            "counters_read_at_s": [round(t, 3) for t in outcome.read_at_s],
            "skipped_lag_s": counters.get("sluice_simworker:skipped_lag_seconds_total", 0.0),
            "kv_batches_dropped": total("sluice_kv_batches_dropped_total"),
            "kv_gaps_repaired": total("sluice_kv_gaps_repaired_total"),
            "kv_index_resets": total("sluice_kv_index_resets_total"),
            "directives_applied": total("sluice_simworker:directives_applied_total"),
            "client_outside_gateway_s": _quantiles(outside_gateway),
            "held_s": _quantiles(held),
            "loop_lag_wall_s": loop_lags,
            "cpu_s": cpu_s,
            # the host's 1-minute load average at the start and at the end of the run
            "load_average": load,
        })


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    array = np.asarray(values)
    return {"p1": round(float(np.quantile(array, 0.01)), 4), "p50": round(float(np.quantile(array, 0.5)), 4),
            "p99": round(float(np.quantile(array, 0.99)), 4), "mean": round(float(array.mean()), 4)}


# -- the comparison ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Metric:
    key: str
    label: str
    read: Callable[[ShellRun], float | None]
    fmt: str
    # how the difference is stated: "points" (absolute, in percentage points) or "relative"
    difference: str = "relative"


METRICS = (
    Metric("hit_rate", "prefix-cache hit rate", lambda r: r.hit_rate, "{:.2%}", "points"),
    Metric("pauses", "pauses", lambda r: r.pauses, "{:.0f}"),
    Metric("resumes", "resumes", lambda r: r.resumes, "{:.0f}"),
    Metric("marks", "marks", lambda r: r.marks, "{:.0f}"),
    Metric("output_tokens_per_s", "output tokens/s", lambda r: r.output_tokens_per_s, "{:.1f}"),
    Metric("calls_completed", "calls completed", lambda r: r.calls_completed, "{:.0f}"),
    Metric("reprefill_at_admission", "re-prefill tokens at admission",
           lambda r: r.reprefill_at_admission, "{:,.0f}"),
    Metric("engine_reprefill", "re-prefill tokens (engine)", lambda r: r.engine_reprefill, "{:,.0f}"),
    Metric("preemptions", "preemptions", lambda r: r.preemptions, "{:.0f}"),
    Metric("p50_call_s", "call latency p50 (s)", lambda r: r.latency_quantile(0.5), "{:.3f}"),
    Metric("p99_call_s", "call latency p99 (s)", lambda r: r.latency_quantile(0.99), "{:.3f}"),
)
METRIC_BY_KEY = {metric.key: metric for metric in METRICS}


@dataclass(frozen=True, slots=True)
class Comparison:
    """One policy's live run against its simulated runs (the band of ramp jitters)."""

    live: ShellRun
    simulated: tuple[ShellRun, ...]

    @property
    def policy(self) -> str:
        return self.live.policy

    def simulated_values(self, metric: Metric) -> list[float]:
        return [v for v in map(metric.read, self.simulated) if v is not None]

    def simulated_mean(self, metric: Metric) -> float | None:
        values = self.simulated_values(metric)
        return float(np.mean(values)) if values else None

    def difference(self, key: str) -> float | None:
        """Live less simulated (the band's mean): in points for a rate, else relative."""
        metric = METRIC_BY_KEY[key]
        live, sim = metric.read(self.live), self.simulated_mean(metric)
        if live is None or sim is None:
            return None
        if metric.difference == "points":
            return (live - sim) * 100.0
        if sim == 0:
            return 0.0 if live == 0 else math.inf
        return (live - sim) / sim

    def rows(self) -> list[list[str]]:
        rows = []
        for metric in METRICS:
            live = metric.read(self.live)
            band = self.simulated_values(metric)
            mean = self.simulated_mean(metric)
            difference = self.difference(metric.key)
            rows.append([
                self.policy, metric.label,
                "n/a" if live is None else metric.fmt.format(live),
                "n/a" if mean is None else metric.fmt.format(mean),
                "n/a" if not band else f"{metric.fmt.format(min(band))} – {metric.fmt.format(max(band))}",
                "n/a" if difference is None else (f"{difference:+.2f} pt" if metric.difference == "points"
                                                  else f"{difference:+.1%}"),
            ])
        return rows

    def paired_latency_difference_s(self) -> dict[str, float]:
        """Live less simulated latency of the calls both shells completed (the first
        simulated run's): how much later the same call's answer came live."""
        simulated = self.simulated[0].latency_by_call
        pairs = [live - simulated[key] for key, live in self.live.latency_by_call.items() if key in simulated]
        return {"calls": len(pairs), **_quantiles(pairs)} if pairs else {"calls": 0}

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "live": self.live.row(),
                "simulated": [run.row() for run in self.simulated],
                "difference": {metric.key: self.difference(metric.key) for metric in METRICS},
                "paired_latency_difference_s": self.paired_latency_difference_s()}


def comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """A markdown table: per policy and metric, live, simulated (the band's mean and range)
    and live less simulated."""
    lines = ["| policy | metric | live | sim (mean) | sim (range) | live − sim |",
             "|---|---|---:|---:|---:|---:|"]
    for comparison in comparisons:
        lines += ["| " + " | ".join(row) + " |" for row in comparison.rows()]
    return lines


def compare(setup: ParitySetup, policy: str, kv_probe: bool = False) -> Comparison:
    """The live run, then the simulated band, of ``policy`` on ``setup``."""
    live = run_live(setup, policy, kv_probe=kv_probe)
    return Comparison(live, tuple(run_simulated_band(setup, policy)))
