"""The gateway's cost: latency it adds to a stream, and non-streaming requests per second.

Three processes on loopback (127.0.0.1, free ports picked at start):

- a **fast upstream** (this module's :func:`fast_upstream`, a raw ASGI app on uvicorn, started
  as ``python -m bench.gateway upstream PORT``): OpenAI-shaped chat completions with no model
  and no sleeps. A stream is eight pre-encoded SSE events sent one ASGI message each — the
  role chunk, five content chunks, the ``finish_reason`` chunk, the usage-only chunk (when
  the request asks for it) — then ``data: [DONE]``; a non-streaming answer is one
  pre-encoded ``chat.completion`` body with usage. ``GET /health`` answers 200.
- the **gateway**, exactly as users run it: ``sluice serve --config FILE`` (run as
  ``python -m entry.cli serve``) with one worker pointing at that upstream,
  ``capacity_tokens`` 10^12 and the default ``program_aware`` policy, so it never holds a call
  — every admission decision, identity resolution, metric, request log line (the default
  ``info`` level; its stderr goes to a file) and tick still happens.
- the **load generator**: this process, one :class:`httpx.AsyncClient` with one keep-alive
  connection per closed-loop client and target (see :class:`_Clients` for why not one pool).

``gateway_overhead_p50_ms`` / ``_p99_ms`` — 100 concurrent streams in a closed loop (each
stream a distinct ``x-session-id``, i.e. 100 programs, sending its next request as soon as
the previous one ends). Every request is timed in the load generator from just before the
request is sent to the last byte of the response read (``data: [DONE]`` seen, stream closed).
The requests ask for ``stream_options.include_usage`` themselves, so the gateway passes the
stream through without dropping a chunk and both paths return the same bytes (checked once).
After a discarded warm-up round of each, rounds *direct* (load generator → upstream) and
*via* (load generator → gateway → upstream) alternate, the order swapped every other round so
drift on the machine falls on both alike. The per-request latencies of all *via* rounds form
one distribution, those of all *direct* rounds another; the overhead at percentile q is
``q(via) − q(direct)``, the difference of the same percentiles of the two distributions (the
requests are not paired one to one — there is no pairing between two separate runs). A
request that fails (an error status, a stream cut short) is counted and reported on stderr,
not timed; more than a few abort the benchmark.

What this measures: in a closed loop at 100 concurrent streams the latency of a request is
mostly time spent queued behind the other 99 in whichever process is busiest, so the
overhead is the gateway's per-request CPU cost multiplied by the queue it builds, plus its
share of the machine's cores taken from the upstream and the load generator (all three
processes share the CPUs; on a 2-core machine that contention is a large part of the
number). So stderr also shows, per path, the CPU time each process spent per request (from
``/proc``, load-independent where the latencies are not), the latency one request sees
through an idle gateway — one stream at a time, same method — and the load average.

``gateway_req_per_s`` — non-streaming chat completions through the one gateway process at 64
concurrent clients (closed loop, distinct sessions), counted over a fixed window after a
warm-up; the same load straight to the upstream is shown on stderr as the ceiling that the
upstream and the load generator set on this machine.

``--profile`` adds one more gateway process run under cProfile (``python -m cProfile -o``)
with the streaming load and the non-streaming load, and prints its top functions to stderr
after the measurements; the reported numbers never come from the profiled run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from bench.common import percentile, progress, result

REPO = Path(__file__).resolve().parent.parent
STREAMS = 100
THROUGHPUT_CLIENTS = 64
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0
LOG_TAIL_BYTES = 4_000
# Failed requests (a 502, a broken stream) are counted, reported and left out of the
# timings; more than this many in one phase abort the benchmark.
MAX_FAILURES = 20

# -- the fast upstream -------------------------------------------------------------------------

MODEL = "bench-fast"
_CREATED = 1_700_000_000


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _chunk(delta: dict, finish: str | None = None) -> dict:
    return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _CREATED,
            "model": MODEL, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}


_USAGE = {"prompt_tokens": 24, "completion_tokens": 6, "total_tokens": 30,
          "prompt_tokens_details": {"cached_tokens": 16}}
_WORDS = ("Hello", " from", " the", " fast", " upstream")
STREAM_EVENTS: tuple[bytes, ...] = (
    _sse(_chunk({"role": "assistant", "content": ""})),
    *(_sse(_chunk({"content": word})) for word in _WORDS),
    _sse(_chunk({}, "stop")),
)
USAGE_EVENT = _sse({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": _CREATED,
                    "model": MODEL, "choices": [], "usage": _USAGE})
DONE_EVENT = b"data: [DONE]\n\n"
WHOLE_BODY = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": _CREATED, "model": MODEL,
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(_WORDS)},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": _USAGE,
}, separators=(",", ":")).encode()
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON_HEADERS = [(b"content-type", b"application/json"),
                 (b"content-length", str(len(WHOLE_BODY)).encode())]


async def _plain(send: Callable[[dict], Awaitable[None]], status: int, body: bytes) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


async def fast_upstream(scope: dict, receive: Callable[[], Awaitable[dict]],
                        send: Callable[[dict], Awaitable[None]]) -> None:
    """A raw ASGI app answering ``POST /v1/chat/completions`` as fast as it can."""
    if scope["type"] != "http":
        return
    path, method = scope["path"], scope["method"]
    if method == "GET" and path == "/health":
        await _plain(send, 200, b"ok")
        return
    if method != "POST" or path != "/v1/chat/completions":
        await _plain(send, 404, b"not found")
        return
    parts = []
    while True:
        message = await receive()
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    try:
        body = json.loads(b"".join(parts))
    except ValueError:
        await _plain(send, 400, b"bad json")
        return
    if body.get("stream") is not True:
        await send({"type": "http.response.start", "status": 200, "headers": _JSON_HEADERS})
        await send({"type": "http.response.body", "body": WHOLE_BODY})
        return
    options = body.get("stream_options")
    with_usage = isinstance(options, dict) and options.get("include_usage") is True
    await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
    for event in STREAM_EVENTS:
        await send({"type": "http.response.body", "body": event, "more_body": True})
    if with_usage:
        await send({"type": "http.response.body", "body": USAGE_EVENT, "more_body": True})
    await send({"type": "http.response.body", "body": DONE_EVENT, "more_body": False})


def _serve_upstream(port: int) -> None:
    import uvicorn

    uvicorn.run(fast_upstream, host="127.0.0.1", port=port, log_level="warning",
                access_log=False, lifespan="off")


# -- child processes ---------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the forked child
    """Linux: the child gets SIGTERM if the bench process dies without cleaning up."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return  # not Linux/glibc: the parent's try/finally still stops the child


class _Child:
    """A server process of the benchmark: started, waited on until it answers, stopped."""

    def __init__(self, name: str, argv: list[str], log_path: Path,
                 stop_signal: int = signal.SIGTERM) -> None:
        self.name = name
        self.stop_signal = stop_signal
        self.log_path = log_path
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
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


def _start_upstream(workdir: Path) -> tuple[_Child, str]:
    port = _free_port()
    child = _Child("fast upstream", [sys.executable, "-m", "bench.gateway", "upstream", str(port)],
                   workdir / "upstream.log")
    return child, f"http://127.0.0.1:{port}"


def _gateway_config(upstream_url: str, port: int) -> str:
    # Everything else at its default (configs/example.yaml): log level info, health checks
    # every 5 s, config file polled every 2 s, program_aware with its usual thresholds —
    # only the worker's capacity is so large that no call is ever held.
    return (
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        "workers:\n"
        f"  - {{name: fast, url: \"{upstream_url}\", capacity_tokens: 1000000000000}}\n"
        "policy:\n"
        "  name: program_aware\n"
    )


def _start_gateway(workdir: Path, upstream_url: str, label: str,
                   profile_path: Path | None = None) -> tuple[_Child, str]:
    port = _free_port()
    config = workdir / f"{label}.yaml"
    config.write_text(_gateway_config(upstream_url, port), encoding="utf-8")
    argv = [sys.executable]
    if profile_path is not None:
        argv += ["-m", "cProfile", "-o", str(profile_path)]
    argv += ["-m", "entry.cli", "serve", "--config", str(config)]
    # uvicorn re-raises the signal it stopped on once it is done: SIGTERM would then kill
    # the process before cProfile writes its file, SIGINT ends it in a KeyboardInterrupt
    # that cProfile's ``finally`` outlives.
    child = _Child(f"gateway ({label})", argv, workdir / f"{label}.log",
                   signal.SIGTERM if profile_path is None else signal.SIGINT)
    return child, f"http://127.0.0.1:{port}"


# -- load --------------------------------------------------------------------------------------


def _body(stream: bool, i: int) -> bytes:
    body: dict = {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are the benchmark's agent. Answer briefly."},
            {"role": "user", "content": f"Say hello to stream {i}."},
        ],
        "max_tokens": 16,
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    return json.dumps(body, separators=(",", ":")).encode()


def _headers(i: int) -> dict[str, str]:
    return {"content-type": "application/json", "x-session-id": f"bench-stream-{i:03d}",
            "authorization": "Bearer bench"}


class _Clients:
    """One :class:`httpx.AsyncClient` with one keep-alive connection per closed-loop client,
    as each agent has its own: httpcore's pool scans all its connections for every request
    it queues, so a single pool shared by 100 streams costs the load generator more than
    the upstream's whole answer."""

    def __init__(self, count: int, base_url: str) -> None:
        import httpx

        self.failed = 0
        self.first_failure: str | None = None
        self._transport_errors = (httpx.HTTPError, RuntimeError)
        self.each = [
            httpx.AsyncClient(base_url=base_url, trust_env=False, timeout=30.0,
                              limits=httpx.Limits(max_connections=1, max_keepalive_connections=1))
            for _ in range(count)
        ]

    async def __aenter__(self) -> _Clients:
        return self

    async def __aexit__(self, *exc: object) -> None:
        for client in self.each:
            await client.aclose()

    async def call(self, once, i: int, body: bytes, headers: dict[str, str]) -> bool:
        """One request; a failure is counted (and left out of the timings), too many abort."""
        try:
            await once(self.each[i], body, headers)
            return True
        except self._transport_errors as err:
            self.failed += 1
            if self.first_failure is None:
                self.first_failure = f"{type(err).__name__}: {err}"
            if self.failed > MAX_FAILURES:
                raise RuntimeError(f"more than {MAX_FAILURES} requests failed; the first: "
                                   f"{self.first_failure}") from err
            return False

    def failures(self) -> str:
        return f"{self.failed} failed (first: {self.first_failure})" if self.failed else "none failed"


async def _stream_once(client, body: bytes, headers: dict[str, str]) -> bytes:
    async with client.stream("POST", "/v1/chat/completions", content=body, headers=headers) as r:
        tail = b""
        async for chunk in r.aiter_raw():
            tail = (tail + chunk)[-64:]
        if r.status_code != 200 or not tail.endswith(DONE_EVENT):
            raise RuntimeError(f"stream answered {r.status_code}, ending {tail!r}")
    return tail


async def _whole_once(client, body: bytes, headers: dict[str, str]) -> bytes:
    r = await client.post("/v1/chat/completions", content=body, headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"request answered {r.status_code}: {r.text[:300]}")
    return r.content


async def _round(clients: _Clients, stream: bool, concurrency: int, requests: int) -> list[float]:
    """``requests`` calls from ``concurrency`` closed-loop clients; each call's latency (s)."""
    latencies: list[float] = []
    left = requests
    once = _stream_once if stream else _whole_once
    clock = time.perf_counter

    async def loop(i: int) -> None:
        nonlocal left
        body, headers = _body(stream, i), _headers(i)
        while left > 0:
            left -= 1
            start = clock()
            if await clients.call(once, i, body, headers):
                latencies.append(clock() - start)

    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(loop(i))
    return latencies


async def _timed_window(clients: _Clients, concurrency: int, warmup_s: float, window_s: float) -> float:
    """Non-streaming closed loop: completed requests per second inside the window."""
    counting = False
    done = 0
    stop = False

    async def loop(i: int) -> None:
        nonlocal done
        body, headers = _body(False, i), _headers(i)
        while not stop:
            if await clients.call(_whole_once, i, body, headers) and counting:
                done += 1

    async with asyncio.TaskGroup() as tg:
        for i in range(concurrency):
            tg.create_task(loop(i))
        await asyncio.sleep(warmup_s)
        counting, start = True, time.perf_counter()
        await asyncio.sleep(window_s)
        counting, elapsed = False, time.perf_counter() - start
        stop = True
    return done / elapsed


def _ms(values: list[float], q: float) -> float:
    return percentile(values, q) * 1e3


def _cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU time of a process so far (Linux /proc; None elsewhere)."""
    if pid is None:
        times = os.times()
        return times.user + times.system
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class _CpuMeter:
    """CPU seconds each process spent per request, summed over the rounds of each path."""

    def __init__(self, pids: dict[str, int | None]) -> None:
        self.pids = pids
        self.spent: dict[tuple[str, str], float] = {}
        self.requests: dict[str, int] = {}

    def snapshot(self) -> dict[str, float | None]:
        return {name: _cpu_seconds(pid) for name, pid in self.pids.items()}

    def add(self, path: str, before: dict[str, float | None], requests: int) -> None:
        after = self.snapshot()
        self.requests[path] = self.requests.get(path, 0) + requests
        for name, start in before.items():
            end = after[name]
            if start is not None and end is not None:
                self.spent[path, name] = self.spent.get((path, name), 0.0) + end - start

    def describe(self, path: str) -> str:
        n = self.requests.get(path, 0)
        parts = [f"{name} {self.spent[path, name] / n * 1e3:.2f}"
                 for name in self.pids if (path, name) in self.spent and n]
        return ", ".join(parts) + " ms CPU per request" if parts else "CPU not measured"


async def _overhead(direct_url: str, via_url: str, concurrency: int, rounds: int,
                    per_round: int, meter: _CpuMeter, deadline: float) -> dict[str, list[float]]:
    """Alternating direct/via rounds; stops early (after at least two) past ``deadline``."""
    samples: dict[str, list[float]] = {"direct": [], "via": []}
    async with _Clients(concurrency, direct_url) as direct, _Clients(concurrency, via_url) as via:
        clients = {"direct": direct, "via": via}
        same = []
        for pool in (direct, via):
            async with pool.each[0].stream("POST", "/v1/chat/completions", content=_body(True, 0),
                                           headers=_headers(0)) as r:
                same.append(await r.aread())
        if same[0] != same[1]:
            raise RuntimeError(f"the gateway changed the stream: {same[0]!r} vs {same[1]!r}")
        for name in ("direct", "via"):  # warm-up: connections, programs, code paths
            await _round(clients[name], True, concurrency, max(per_round // 2, 2 * concurrency))
        for r in range(rounds):
            if r >= 2 and time.perf_counter() > deadline:
                progress(f"gateway: c={concurrency}: stopping after {r} rounds (time budget)")
                break
            for name in (("direct", "via") if r % 2 == 0 else ("via", "direct")):
                started, cpu = time.perf_counter(), meter.snapshot()
                lat = await _round(clients[name], True, concurrency, per_round)
                meter.add(name, cpu, len(lat))
                samples[name] += lat
                progress(f"gateway: c={concurrency} round {r + 1}/{rounds} {name:6s} "
                         f"p50 {_ms(lat, 50):8.2f} ms  p99 {_ms(lat, 99):8.2f} ms  "
                         f"({len(lat) / (time.perf_counter() - started):,.0f} streams/s)")
        for name, pool in clients.items():
            if pool.failed:
                progress(f"gateway: c={concurrency} {name}: {pool.failures()}")
    return samples


async def _throughput(url: str, clients: int, warmup_s: float, window_s: float) -> float:
    async with _Clients(clients, url) as pool:
        rate = await _timed_window(pool, clients, warmup_s, window_s)
        if pool.failed:
            progress(f"gateway: non-streaming to {url}: {pool.failures()}")
        return rate


async def _profile_load(via_url: str, per_round: int, window_s: float) -> None:
    async with _Clients(max(STREAMS, THROUGHPUT_CLIENTS), via_url) as via:
        await _round(via, True, STREAMS, per_round)
        await _timed_window(via, THROUGHPUT_CLIENTS, 0.5, window_s)


def _print_profile(path: Path) -> None:
    import io
    import pstats

    out = io.StringIO()
    stats = pstats.Stats(str(path), stream=out)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(50)
    progress("gateway: cProfile of the gateway process (streaming + non-streaming load):")
    print(out.getvalue(), file=sys.stderr, flush=True)


def _report(label: str, samples: dict[str, list[float]]) -> tuple[float, float]:
    direct, via = samples["direct"], samples["via"]
    overhead = tuple(_ms(via, q) - _ms(direct, q) for q in (50, 99))
    progress(f"gateway: {label}, {len(direct)} + {len(via)} streams: direct p50 "
             f"{_ms(direct, 50):.3f} / p99 {_ms(direct, 99):.3f} ms, via p50 {_ms(via, 50):.3f} / "
             f"p99 {_ms(via, 99):.3f} ms -> overhead p50 {overhead[0]:.3f} / p99 {overhead[1]:.3f} ms")
    return overhead


# -- the benchmark -----------------------------------------------------------------------------


@contextlib.contextmanager
def _sigterm_exits():
    """While the benchmark runs, SIGTERM unwinds it like Ctrl-C does, so the children are
    stopped and the temporary directory removed (SIGKILL: the children get SIGTERM from the
    kernel, see :func:`_die_with_parent`)."""
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


def run(*, quick: bool = False, profile: bool = False) -> dict[str, float]:
    rounds, per_round = (2, 300) if quick else (5, 500)
    solo_rounds, solo_per_round = (2, 50) if quick else (4, 100)
    warmup_s, window_s = (0.5, 2.0) if quick else (1.5, 6.0)
    overhead_budget_s = 20.0 if quick else 40.0
    numbers: dict[str, float] = {}
    children: list[_Child] = []
    started = time.perf_counter()
    with _sigterm_exits(), tempfile.TemporaryDirectory(prefix="sluice-bench-gateway-") as tmp:
        workdir = Path(tmp)
        try:
            upstream, upstream_url = _start_upstream(workdir)
            children.append(upstream)
            gateway, gateway_url = _start_gateway(workdir, upstream_url, "gateway")
            children.append(gateway)
            upstream.wait_ready(upstream_url + "/health")
            gateway.wait_ready(gateway_url + "/health")
            progress(f"gateway: upstream {upstream_url}, gateway {gateway_url} "
                     f"(pids {upstream.proc.pid}, {gateway.proc.pid}); up to {rounds} rounds x "
                     f"{per_round} streams per path at c={STREAMS}")
            pids = {"gateway": gateway.proc.pid, "upstream": upstream.proc.pid, "load generator": None}

            meter = _CpuMeter(pids)
            samples = asyncio.run(_overhead(upstream_url, gateway_url, STREAMS, rounds, per_round,
                                            meter, time.perf_counter() + overhead_budget_s))
            numbers["p50"], numbers["p99"] = _report(f"c={STREAMS}", samples)
            progress(f"gateway: c={STREAMS} direct: {meter.describe('direct')}")
            progress(f"gateway: c={STREAMS} via:    {meter.describe('via')}")

            solo_meter = _CpuMeter(pids)
            solo = asyncio.run(_overhead(upstream_url, gateway_url, 1, solo_rounds, solo_per_round,
                                         solo_meter, time.perf_counter() + 10.0))
            _report("one stream at a time (c=1, for comparison)", solo)
            progress(f"gateway: c=1 via: {solo_meter.describe('via')}")

            cpu = _cpu_seconds(gateway.proc.pid)
            via_rps = asyncio.run(_throughput(gateway_url, THROUGHPUT_CLIENTS, warmup_s, window_s))
            cpu_after = _cpu_seconds(gateway.proc.pid)
            direct_rps = asyncio.run(_throughput(upstream_url, THROUGHPUT_CLIENTS, warmup_s / 2,
                                                 window_s / 2))
            numbers["req_per_s"] = via_rps
            busy = (f"; the gateway process was {100 * (cpu_after - cpu) / (warmup_s + window_s):.0f} % "
                    "busy" if cpu is not None and cpu_after is not None else "")
            progress(f"gateway: non-streaming at c={THROUGHPUT_CLIENTS}: {via_rps:,.0f} req/s via the "
                     f"gateway, {direct_rps:,.0f} req/s direct (the upstream + load generator "
                     f"ceiling){busy}")
            gateway.stop()
            children.remove(gateway)

            if profile:
                prof_path = workdir / "gateway.prof"
                profiled, profiled_url = _start_gateway(workdir, upstream_url, "profiled", prof_path)
                children.append(profiled)
                profiled.wait_ready(profiled_url + "/health")
                asyncio.run(_profile_load(profiled_url, rounds * per_round // 2, window_s))
                profiled.stop()
                children.remove(profiled)
                _print_profile(prof_path)
        finally:
            for child in reversed(children):
                child.stop()
    result("gateway_overhead_p50_ms", numbers["p50"], "ms")
    result("gateway_overhead_p99_ms", numbers["p99"], "ms")
    result("gateway_req_per_s", numbers["req_per_s"], "req/s")
    progress(f"gateway: took {time.perf_counter() - started:.1f} s; load average "
             f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs (the three processes share them "
             "with whatever else runs)")
    return numbers


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "upstream":
        with contextlib.suppress(KeyboardInterrupt):
            _serve_upstream(int(sys.argv[2]))
    else:
        sys.exit("usage: python -m bench.gateway upstream PORT (the benchmark itself: "
                 "python -m bench --only gateway)")
