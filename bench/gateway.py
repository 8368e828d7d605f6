"""The gateway's cost: CPU per request and per stream chunk, requests per second on one core,
and the latency it adds to streams.

Three processes on loopback (127.0.0.1, free ports picked at start):

- a **fast upstream** (bench/fast_upstream.py, started as ``python -m bench.fast_upstream
  PORT``): OpenAI-shaped chat completions with no model, pre-encoded, streamed chunk by chunk
  as vLLM streams them, each event ``x-bench-gap-ms`` apart when the request asks.
- the **gateway**, exactly as users run it: ``sluice serve --config FILE`` (run as
  ``python -m entry.cli serve``) with one worker pointing at that upstream,
  ``capacity_tokens`` 10^12 and the default ``program_aware`` policy, so it never holds a call
  — every admission decision, identity resolution, metric, request-log line (the default
  ``info`` level; its stderr goes to a file) and tick still happens.
- the **load generator**: this process (bench/load_generator.py) — raw keep-alive HTTP/1.1
  connections, one per closed-loop client, each client its own ``x-session-id`` (so its own
  program).

This module starts and stops the processes, pins them to their CPUs and runs the measured
phases.

With two or more CPUs the gateway runs alone on CPU 0 and the upstream and the load
generator share the others (``sched_setaffinity``, set before the gateway's ``exec`` so
every thread inherits it). All three run at nice -10 where that is allowed, so other work on
the machine does not take turns on the gateway's core (the figures from /proc do not depend
on that; requests per second and latencies do).

``gateway_cpu_us_per_request`` and ``gateway_req_per_s`` — non-streaming chat completions from
64 closed-loop clients, counted over a fixed window after a warm-up. The CPU figure is the
gateway process's user + system time from ``/proc/PID/stat`` over the window divided by the
requests completed in it: it does not depend on how fast the load generator is. The same load
straight to the upstream is shown on stderr: the ceiling the upstream and the load generator
set on their core.

``gateway_cpu_us_per_chunk`` — the gateway's CPU per relayed SSE event, net of the
per-request cost: streams of ``SHORT_EVENTS`` and of ``LONG_EVENTS`` content chunks
(``CHUNK_STREAMS`` concurrent clients, events ``CHUNK_GAP_MS`` apart so each reaches the
gateway in its own read, as tokens do), gateway CPU per stream from /proc for each; the
difference divided by the difference in events. The clients do not ask for usage, so the
gateway asks on their behalf and drops that chunk again: the path every stock OpenAI SDK
stream takes, and the dearer of the two (each event is framed, not just scanned).

``gateway_overhead_p50_ms`` / ``_p99_ms`` — 100 concurrent streams (closed loop, 100
programs), each ``OVERHEAD_EVENTS`` content events ``OVERHEAD_GAP_MS`` apart (an agent's
stream at ~50 tokens/s), timed in the load generator from just before the request is sent to
the last byte (``data: [DONE]`` seen). These requests ask for ``stream_options.include_usage``
themselves, so both paths return the same bytes (checked once). After a discarded warm-up,
rounds *direct* (load generator → upstream) and *via* (load generator → gateway → upstream)
alternate, the order swapped every other round; the overhead at percentile q is
``q(via) − q(direct)`` over all rounds (the requests are not paired one to one). The gateway
has its own core and is far from saturated, so this is the latency it adds to a call, not a
queue. (Up to commit 017c6e4 the streams were back to back, unpaced: then the figure is
100 × the gateway's CPU per stream — a queue — and read ~106–320 ms.) A request that fails
(an error status, a stream cut short) is counted and reported, not timed; more than a few
abort the benchmark.

``gateway_relays1_req_per_s``, ``gateway_relays2_req_per_s``, ``gateway_relays2_speedup``,
``gateway_relays1_cpu_us_per_request``, ``gateway_relays2_cpu_us_per_request`` —
``sluice serve --relays 2`` (a supervisor, the policy process and two relay processes on one
port) against ``--relays 1`` (the one process), measured after the figures above by
bench/gateway_relays.py: the same upstream, config and non-streaming load as
``gateway_req_per_s``, but with **no process pinned** — the gateway's, the upstream's and the
load generator's all on every CPU, the same for both configurations: a relay group pinned to
one core has nothing to gain, and the CPUs left are the load's (on a 2-CPU machine all three
share both). A fresh gateway per round, rounds in the order A B B A (twice over in the full
run); requests per second and CPU per request are the medians over each configuration's rounds,
the speedup the ratio of the two medians. CPU per request counts every process of the gateway
(for ``--relays 2`` supervisor + policy + relays) over the window; stderr has each round's
split by process. Each gateway must exit 0 on SIGTERM.

``--profile`` adds one more gateway process run under cProfile (``python -m cProfile -o``)
with the non-streaming and streaming loads, and prints its top functions to stderr after the
measurements; the reported numbers never come from the profiled run.

Numbers on the 2-CPU development VM (``python -m bench --only gateway``; other sessions kept
the machine's load average at 4–9 throughout, which moves requests per second and the
latencies, not the /proc figures):

============================  ==============================  ===============================
figure                        before (017c6e4: httpx relay,   after (relay_client, raw ASGI
                              Starlette route, uvicorn h11)   relay path, uvicorn httptools)
============================  ==============================  ===============================
gateway_cpu_us_per_request    2,233                           297–370
gateway_req_per_s             443                             2,500–2,900 with the core to
                                                              itself; 1,250 when other work
                                                              took turns on it
gateway_cpu_us_per_chunk      68                              20–26
gateway_overhead_p50_ms       285 (the gateway saturated)     1.9–3.0
gateway_overhead_p99_ms       664                             13–39
============================  ==============================  ===============================
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from bench.common import percentile, progress, result, run_loop
from bench.load_generator import Load, request_bytes, rounds, window
from entry.ports import free_port

REPO = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 4_000
GATEWAY_CPU = 0
BENCH_NICE = -10

THROUGHPUT_CLIENTS = 64
CHUNK_STREAMS = 32
CHUNK_GAP_MS = 2.0
SHORT_EVENTS = 2
LONG_EVENTS = 502
STREAMS = 100
OVERHEAD_EVENTS = 16
OVERHEAD_GAP_MS = 20.0
# Each stream's client "thinks" (a tool call, say) for a random time, uniform over
# [0, 2 x this], before each request: a hundred agents do not call in lockstep.
OVERHEAD_THINK_MS = 100.0

# -- the fast upstream -------------------------------------------------------------------------

# -- child processes ---------------------------------------------------------------------------


def _cpu_split() -> tuple[set[int], set[int]] | None:
    """(the gateway's CPUs, everyone else's), or None with fewer than two CPUs to split."""
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if len(allowed) < 2:
        return None
    return {allowed[GATEWAY_CPU]}, set(allowed) - {allowed[GATEWAY_CPU]}


def _child_setup(cpus: set[int] | None) -> Callable[[], None]:
    def setup() -> None:  # pragma: no cover - runs in the forked child
        # Linux: the child gets SIGTERM if the bench process dies without cleaning up.
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass  # not Linux/glibc: the parent's try/finally still stops the child
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        _raise_priority()
    return setup


def _raise_priority() -> None:
    """Ahead of other work on the machine (where allowed: root, or CAP_SYS_NICE), so the
    gateway's core is its own while it is measured and the load does not wait for a turn."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, BENCH_NICE)
    except (OSError, AttributeError):
        pass  # not allowed: measured at the usual priority (stderr shows the load average)


class _Child:
    """A server process of the benchmark: started, waited on until it answers, stopped."""

    def __init__(self, name: str, argv: list[str], log_path: Path, cpus: set[int] | None,
                 stop_signal: int = signal.SIGTERM, process_group: int | None = None) -> None:
        self.name = name
        self.stop_signal = stop_signal
        self.log_path = log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_child_setup(cpus) if sys.platform.startswith("linux") else None,
            process_group=process_group,
        )

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-LOG_TAIL_BYTES:]
        except OSError:
            return ""
        return data.decode("utf-8", "replace")

    def wait_ready(self, url: str) -> None:
        import httpx

        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(trust_env=False, timeout=1.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}:\n"
                                       f"{self.log_tail()}")
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.name} did not answer {url} within "
                                       f"{READY_TIMEOUT_S:.0f} s:\n{self.log_tail()}")
                time.sleep(0.05)

    def cpu_seconds(self) -> float:
        return _cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        """``stop_signal`` (uvicorn shuts down cleanly), SIGKILL if stuck."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(self.stop_signal)
                try:
                    self.proc.wait(timeout=STOP_TIMEOUT_S)
                except subprocess.TimeoutExpired:
                    progress(f"gateway: {self.name} did not stop; killing it")
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self._log.close()


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _start_upstream(workdir: Path, cpus: set[int] | None) -> tuple[_Child, str]:
    port = free_port()
    child = _Child("fast upstream", [sys.executable, "-m", "bench.fast_upstream", str(port)],
                   workdir / "upstream.log", cpus)
    return child, f"http://127.0.0.1:{port}"


def _gateway_config(upstream_url: str, port: int) -> str:
    # Everything else at its default (configs/example.yaml): log level info, health checks
    # every 5 s, config file polled every 2 s, program_aware with its usual thresholds —
    # only the worker's capacity is so large that no call is ever held, and the upstream's
    # x-bench-gap-ms header goes through (the gateway forwards only the headers it is told).
    return (
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "forward_client_headers: [x-bench-gap-ms]\n"
        "workers:\n"
        f"  - {{name: fast, url: \"{upstream_url}\", capacity_tokens: 1000000000000}}\n"
        "policy:\n"
        "  name: program_aware\n"
    )


def _start_gateway(workdir: Path, upstream_url: str, label: str, cpus: set[int] | None,
                   profile_path: Path | None = None) -> tuple[_Child, str]:
    port = free_port()
    config = workdir / f"{label}.yaml"
    config.write_text(_gateway_config(upstream_url, port), encoding="utf-8")
    argv = [sys.executable]
    if profile_path is not None:
        argv += ["-m", "cProfile", "-o", str(profile_path)]
    argv += ["-m", "entry.cli", "serve", "--config", str(config)]
    # uvicorn re-raises the signal it stopped on once it is done: SIGTERM would then kill
    # the process before cProfile writes its file, SIGINT ends it in a KeyboardInterrupt
    # that cProfile's ``finally`` outlives.
    child = _Child(f"gateway ({label})", argv, workdir / f"{label}.log", cpus,
                   signal.SIGTERM if profile_path is None else signal.SIGINT)
    return child, f"http://127.0.0.1:{port}"


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


# -- the phases --------------------------------------------------------------------------------


async def _throughput(upstream_port: int, gateway_port: int, gateway: _Child, warmup_s: float,
                      window_s: float) -> tuple[float, float]:
    def requests(port: int) -> list[bytes]:
        return [request_bytes(port, f"bench-whole-{i:03d}", stream=False)
                for i in range(THROUGHPUT_CLIENTS)]

    via = Load(gateway_port)
    try:
        rate, cpu = await window(via, requests(gateway_port), False, warmup_s, window_s,
                                  gateway.cpu_seconds)
    finally:
        via.close()
    direct = Load(upstream_port)
    try:
        ceiling, _ = await window(direct, requests(upstream_port), False, warmup_s / 2,
                                   window_s / 2, None)
    finally:
        direct.close()
    assert cpu is not None
    progress(f"gateway: non-streaming at c={THROUGHPUT_CLIENTS}: {rate:,.0f} req/s via the gateway "
             f"({cpu * 1e6:,.0f} us gateway CPU per request; {via.failures()}), {ceiling:,.0f} req/s "
             f"direct (the upstream + load generator ceiling on their core)")
    return rate, cpu


async def _per_chunk(gateway_port: int, gateway: _Child, warmup_s: float, window_s: float) -> float:
    per_stream = {}
    for words in (SHORT_EVENTS, LONG_EVENTS):
        load = Load(gateway_port)
        try:
            requests = [request_bytes(gateway_port, f"bench-chunks-{words}-{i:03d}", stream=True,
                                 usage=False, words=words, gap_ms=CHUNK_GAP_MS)
                        for i in range(CHUNK_STREAMS)]
            rate, cpu = await window(load, requests, True, warmup_s, window_s, gateway.cpu_seconds)
        finally:
            load.close()
        assert cpu is not None
        per_stream[words] = cpu
        progress(f"gateway: streams of {words} content chunks {CHUNK_GAP_MS:g} ms apart at "
                 f"c={CHUNK_STREAMS}: {rate:,.0f} streams/s, {cpu * 1e6:,.0f} us gateway CPU per "
                 f"stream ({load.failures()})")
    per_chunk = (per_stream[LONG_EVENTS] - per_stream[SHORT_EVENTS]) / (LONG_EVENTS - SHORT_EVENTS)
    progress(f"gateway: {per_chunk * 1e6:.1f} us gateway CPU per relayed chunk (the difference over "
             f"{LONG_EVENTS - SHORT_EVENTS} chunks)")
    return per_chunk


async def _overhead(upstream_port: int, gateway_port: int, gateway: _Child, round_count: int,
                    per_round: int, deadline: float) -> tuple[float, float]:
    def requests(port: int) -> list[bytes]:
        return [request_bytes(port, f"bench-stream-{i:03d}", stream=True, words=OVERHEAD_EVENTS,
                         gap_ms=OVERHEAD_GAP_MS) for i in range(STREAMS)]

    loads = {"direct": Load(upstream_port), "via": Load(gateway_port)}
    reqs = {"direct": requests(upstream_port), "via": requests(gateway_port)}
    samples: dict[str, list[tuple[float, float]]] = {"direct": [], "via": []}
    try:
        same = []
        for name, load in loads.items():
            await load.connect(1)
            same.append(await load.conns[0].request(reqs[name][0]))
        if same[0] != same[1]:
            raise RuntimeError(f"the gateway changed the stream: {same[0]!r} vs {same[1]!r}")
        think_s = OVERHEAD_THINK_MS / 1e3
        for name in ("direct", "via"):  # warm-up: connections, programs, code paths
            await rounds(loads[name], reqs[name], STREAMS, think_s, seed=0)
        for r in range(round_count):
            if r >= 2 and time.perf_counter() > deadline:
                progress(f"gateway: c={STREAMS}: stopping after {r} rounds (time budget)")
                break
            for name in (("direct", "via") if r % 2 == 0 else ("via", "direct")):
                started, cpu = time.perf_counter(), gateway.cpu_seconds()
                # the same think times on both paths (seeded by round)
                timings = await rounds(loads[name], reqs[name], per_round, think_s, seed=r + 1)
                busy = (gateway.cpu_seconds() - cpu) / (time.perf_counter() - started)
                samples[name] += timings
                lat = [t[0] for t in timings]
                progress(f"gateway: c={STREAMS} round {r + 1}/{round_count} {name:6s} "
                         f"p50 {_ms(lat, 50):8.2f} ms  p99 {_ms(lat, 99):8.2f} ms  "
                         f"(gateway {100 * busy:.0f} % busy)")
        for name, load in loads.items():
            if load.failed:
                progress(f"gateway: c={STREAMS} {name}: {load.failures()}")
    finally:
        for load in loads.values():
            load.close()
    direct = [t[0] for t in samples["direct"]]
    via = [t[0] for t in samples["via"]]
    p50, p99 = (_ms(via, q) - _ms(direct, q) for q in (50, 99))
    ttfb = [_ms([t[1] for t in samples["via"]], 50) - _ms([t[1] for t in samples["direct"]], 50)]
    progress(f"gateway: {STREAMS} streams of {OVERHEAD_EVENTS} chunks {OVERHEAD_GAP_MS:g} ms apart "
             f"(think time {OVERHEAD_THINK_MS:g} ms on average), "
             f"{len(direct)} + {len(via)} streams: direct p50 {_ms(direct, 50):.3f} / p99 "
             f"{_ms(direct, 99):.3f} ms, via p50 {_ms(via, 50):.3f} / p99 {_ms(via, 99):.3f} ms -> "
             f"overhead p50 {p50:.3f} / p99 {p99:.3f} ms (time to first byte: p50 +{ttfb[0]:.3f} ms)")
    return p50, p99


async def _profile_load(gateway_port: int, window_s: float) -> None:
    whole = Load(gateway_port)
    streams = Load(gateway_port)
    try:
        await window(whole, [request_bytes(gateway_port, f"bench-whole-{i:03d}", stream=False)
                              for i in range(THROUGHPUT_CLIENTS)], False, 0.5, window_s, None)
        await window(streams, [request_bytes(gateway_port, f"bench-chunks-{i:03d}", stream=True,
                                         usage=False, words=50, gap_ms=CHUNK_GAP_MS)
                                for i in range(CHUNK_STREAMS)], True, 0.5, window_s, None)
    finally:
        whole.close()
        streams.close()


def _print_profile(path: Path) -> None:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    progress("gateway: cProfile of the gateway process (non-streaming + streaming load):")
    print(out.getvalue(), file=sys.stderr, flush=True)


# -- the benchmark -----------------------------------------------------------------------------


@contextlib.contextmanager
def _sigterm_exits():
    """While the benchmark runs, SIGTERM unwinds it like Ctrl-C does, so the children are
    stopped and the temporary directory removed (SIGKILL: the children get SIGTERM from the
    kernel, see :func:`_child_setup`)."""
    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, stop)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _report_log_problems(log_path: Path) -> None:
    """Warnings and errors the gateway logged during the run (none expected)."""
    problems = [line for line in log_path.read_text("utf-8", "replace").splitlines()
                if '"level": "warning"' in line or '"level": "error"' in line
                or "Traceback" in line]
    if problems:
        progress(f"gateway: the gateway logged {len(problems)} warnings/errors; the first: {problems[0]}")
    else:
        progress("gateway: no warnings or errors in the gateway's log")


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def run(*, quick: bool = False, profile: bool = False) -> dict[str, float]:
    warmup_s, window_s = (0.5, 2.0) if quick else (1.5, 6.0)
    rounds, per_round = (2, 200) if quick else (4, 500)
    overhead_budget_s = 20.0 if quick else 60.0
    numbers: dict[str, float] = {}
    children: list[_Child] = []
    started = time.perf_counter()
    split = _cpu_split()
    gateway_cpus, other_cpus = split if split is not None else (None, None)
    with _sigterm_exits(), tempfile.TemporaryDirectory(prefix="sluice-bench-gateway-") as tmp:
        workdir = Path(tmp)
        previous_affinity = os.sched_getaffinity(0) if other_cpus is not None else None
        try:
            _raise_priority()
            if other_cpus is not None:
                os.sched_setaffinity(0, other_cpus)
            else:
                progress("gateway: fewer than two CPUs: nothing pinned (the gateway shares its core)")
            upstream, upstream_url = _start_upstream(workdir, other_cpus)
            children.append(upstream)
            gateway, gateway_url = _start_gateway(workdir, upstream_url, "gateway", gateway_cpus)
            children.append(gateway)
            upstream.wait_ready(upstream_url + "/health")
            gateway.wait_ready(gateway_url + "/health")
            progress(f"gateway: upstream {upstream_url}, gateway {gateway_url} (pids "
                     f"{upstream.proc.pid}, {gateway.proc.pid}); gateway on CPUs "
                     f"{sorted(gateway_cpus or [])}, upstream and load on {sorted(other_cpus or [])}")
            up_port, gw_port = _port(upstream_url), _port(gateway_url)

            numbers["req_per_s"], numbers["cpu_per_request"] = run_loop(
                _throughput(up_port, gw_port, gateway, warmup_s, window_s))
            numbers["cpu_per_chunk"] = run_loop(_per_chunk(gw_port, gateway, warmup_s, window_s))
            numbers["p50"], numbers["p99"] = run_loop(_overhead(
                up_port, gw_port, gateway, rounds, per_round,
                time.perf_counter() + overhead_budget_s))
            gateway.stop()
            children.remove(gateway)
            _report_log_problems(gateway.log_path)

            if profile:
                prof_path = workdir / "gateway.prof"
                profiled, profiled_url = _start_gateway(workdir, upstream_url, "profiled",
                                                        gateway_cpus, prof_path)
                children.append(profiled)
                profiled.wait_ready(profiled_url + "/health")
                run_loop(_profile_load(_port(profiled_url), window_s))
                profiled.stop()
                children.remove(profiled)
                _print_profile(prof_path)
        finally:
            for child in reversed(children):
                child.stop()
            if previous_affinity is not None:
                os.sched_setaffinity(0, previous_affinity)
    result("gateway_cpu_us_per_request", numbers["cpu_per_request"] * 1e6, "us")
    result("gateway_req_per_s", numbers["req_per_s"], "req/s")
    result("gateway_cpu_us_per_chunk", numbers["cpu_per_chunk"] * 1e6, "us")
    result("gateway_overhead_p50_ms", numbers["p50"], "ms")
    result("gateway_overhead_p99_ms", numbers["p99"], "ms")
    progress(f"gateway: took {time.perf_counter() - started:.1f} s; load average "
             f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    return numbers
