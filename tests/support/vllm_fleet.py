"""Real vLLM workers (the CPU build, a tiny dummy-weight model) for the e2e tier.

Used by tests/e2e/conftest.py; the test modules import the helpers below. Each worker is
``python -m vllm.entrypoints.openai.api_server`` from ``.venv-vllm`` in a process group of
its own (the API server, its EngineCore and worker processes), with prefix caching, KV
events (ZMQ PUB) and their replay socket (ROUTER) on free loopback ports, a small KV pool,
and its log in a file. The Sluice plugin (installed into ``.venv-vllm`` by
scripts/setup_vllm_venv.sh) listens for retention directives on a third free port
(``SLUICE_DIRECTIVE_ENDPOINT``) and stamps the publisher epoch on every KV-event message. Stopping sends SIGTERM to the group, then SIGKILL.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import pickle
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import zmq

from entry.ports import free_ports
from scheduler.kv_events import BlockStored, EventBatch, EventBatchDecoder

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "tiny"
BLOCK_SIZE = 32
NUM_BLOCKS = 64                 # per worker: 2,048 tokens of KV
MAX_MODEL_LEN = 1024
# what the gateway reads off /metrics: the pool less vLLM's null block (block 0)
CAPACITY_TOKENS = (NUM_BLOCKS - 1) * BLOCK_SIZE
STARTUP_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 20.0
START_ATTEMPTS = 3  # a worker that loses a port race at start-up gets new ports
LOG_TAIL_LINES = 60

# vLLM's default block hash: sha256 over pickle, seeded with this string when PYTHONHASHSEED
# is unset (vllm/v1/core/kv_cache_utils.py, vllm/utils/hashing.py); the low 64 bits go on
# the wire (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES defaults to on).
_NONE_HASH_SEED = "vllm-none-hash"


def _sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def vllm_block_hashes(token_ids: Sequence[int], block_size: int = BLOCK_SIZE) -> list[int]:
    """The wire hashes vLLM gives the full blocks of a prompt (no LoRA, media or salt)."""
    parent = _sha256(_NONE_HASH_SEED)
    out = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = _sha256((parent, tuple(token_ids[start:start + block_size]), None))
        out.append(int.from_bytes(parent, "big") & ((1 << 64) - 1))
    return out


def _die_with_parent() -> None:
    """preexec_fn: own process group, and SIGTERM when pytest dies (PR_SET_PDEATHSIG), so
    a killed test run leaves no engine behind."""
    os.setpgrp()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class VllmWorker:
    name: str
    index: int
    port: int
    events_port: int
    replay_port: int
    directive_port: int
    log_path: Path
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    ready_s: float | None = None
    restarts: int = 0
    spawns: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    @property
    def directive_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.directive_port}"

    @property
    def topic(self) -> str:
        return f"kv@{self.name}@{MODEL_NAME}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def gateway_entry(self) -> dict:
        """This worker as a ``workers:`` entry of the gateway's config."""
        return {"name": self.name, "url": self.url, "kv_events": self.events_endpoint,
                "replay": self.replay_endpoint, "directives": self.directive_endpoint}

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError as err:
            return f"(no log: {err})"
        return "\n".join(text[-lines:])


@dataclass
class Fleet:
    python: Path
    model_dir: Path
    workdir: Path
    workers: list[VllmWorker] = field(default_factory=list)
    # more vLLM flags for every worker of this fleet (e.g. --scheduling-policy priority)
    extra_args: tuple[str, ...] = ()
    # the KV pool and context limit of every worker (the e2e tier's by default)
    num_blocks: int = NUM_BLOCKS
    max_model_len: int = MAX_MODEL_LEN

    def __getitem__(self, name: str) -> VllmWorker:
        for worker in self.workers:
            if worker.name == name:
                return worker
        raise KeyError(name)

    def command(self, worker: VllmWorker) -> list[str]:
        kv_events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{worker.events_port}",
            "replay_endpoint": f"tcp://*:{worker.replay_port}",
            "topic": worker.topic,
        }
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", MODEL_NAME,
            "--load-format", "dummy",
            "--host", "127.0.0.1", "--port", str(worker.port),
            "--block-size", str(BLOCK_SIZE),
            "--num-gpu-blocks-override", str(self.num_blocks),
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--enable-prompt-tokens-details",
            "--enforce-eager",  # no torch.compile warm-up: ~25 s less start-up per worker
            "--kv-events-config", json.dumps(kv_events),
            *self.extra_args,
        ]

    def environment(self, worker: VllmWorker) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)  # keeps vLLM's default block-hash seed (see above)
        for key in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME"):
            env.pop(key, None)
        cpus = sorted(os.sched_getaffinity(0))
        env.update({
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # one core per worker, round robin, instead of every worker on core 0
            "VLLM_CPU_OMP_THREADS_BIND": str(cpus[worker.index % len(cpus)]),
            "OMP_NUM_THREADS": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "SLUICE_DIRECTIVE_ENDPOINT": worker.directive_endpoint,
            # vLLM binds its KV-event sockets only on tcp://* (or ipc://): without CurveZMQ keys
            # the plugin refuses that unless told; the fleet's clients are all on loopback
            "SLUICE_ZMQ_ALLOW_INSECURE_BIND": "1",
        })
        return env

    # -- life cycle ----------------------------------------------------------------------

    def add(self, name: str) -> VllmWorker:
        index = len(self.workers)
        worker = VllmWorker(name, index, *free_ports(4),
                            self.workdir / f"{name}.log")
        self.workers.append(worker)
        return worker

    def spawn(self, worker: VllmWorker) -> None:
        """Start the process (from the main thread: PR_SET_PDEATHSIG follows the thread)."""
        with open(worker.log_path, "a" if worker.spawns else "w") as log:
            if worker.spawns:
                log.write(f"\n===== start {worker.spawns + 1} (ports {worker.port}, "
                          f"{worker.events_port}, {worker.replay_port}, "
                          f"{worker.directive_port}) =====\n")
                log.flush()
            worker.spawns += 1
            worker.proc = subprocess.Popen(
                self.command(worker), stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, cwd=self.workdir, env=self.environment(worker),
                preexec_fn=_die_with_parent,
            )
        worker.started_at = time.monotonic()
        worker.ready_s = None

    def wait_ready(self, workers: Iterable[VllmWorker], timeout: float = STARTUP_TIMEOUT_S,
                   new_ports_on_clash: bool = False) -> None:
        """Poll every worker's /health until all answer 200 (they start in parallel).
        Raises RuntimeError with the logs of the ones that died or did not make it. With
        ``new_ports_on_clash``, a worker that died because a port was taken meanwhile is
        started again on new ports (up to START_ATTEMPTS starts)."""
        pending = {w.name: w for w in workers}
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for name, worker in list(pending.items()):
                    if not worker.alive and new_ports_on_clash and worker.spawns < START_ATTEMPTS \
                            and "Address already in use" in worker.log_tail(400):
                        self.stop(worker)
                        worker.port, worker.events_port, worker.replay_port, worker.directive_port = \
                            free_ports(4)
                        self.spawn(worker)
                        continue
                    if not worker.alive:
                        code = worker.proc.returncode if worker.proc else None
                        raise RuntimeError(f"vLLM worker {name} exited with {code} during start-up; "
                                           f"log {worker.log_path}:\n{worker.log_tail()}")
                    try:
                        if client.get(f"{worker.url}/health").status_code == 200:
                            worker.ready_s = time.monotonic() - worker.started_at
                            del pending[name]
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    logs = "\n".join(f"--- {w.name} ({w.log_path}) ---\n{w.log_tail()}"
                                     for w in pending.values())
                    raise RuntimeError(f"vLLM workers {sorted(pending)} not healthy after "
                                       f"{timeout:.0f} s:\n{logs}")
                time.sleep(0.5)

    def start(self, names: Sequence[str]) -> None:
        workers = [self.add(name) for name in names]
        for worker in workers:
            self.spawn(worker)
        self.wait_ready(workers, new_ports_on_clash=True)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Crash a worker: ``sig`` to its whole process group, and wait for it."""
        worker = self[name]
        if worker.proc is None:
            return
        _signal_group(worker.proc, sig)
        try:
            worker.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(worker.proc, signal.SIGKILL)
            worker.proc.wait(5)

    def stop(self, worker: VllmWorker) -> None:
        proc = worker.proc
        if proc is None:
            return
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait(5)
        _signal_group(proc, signal.SIGKILL)  # stragglers of the group (EngineCore, workers)

    def restart(self, name: str) -> VllmWorker:
        worker = self[name]
        self.stop(worker)
        worker.restarts += 1
        self.spawn(worker)
        self.wait_ready([worker])
        return worker

    def stop_all(self) -> None:
        threads = [threading.Thread(target=self.stop, args=(w,)) for w in self.workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def logs(self) -> str:
        return "\n".join(f"--- vLLM worker {w.name} ({w.log_path}), last {LOG_TAIL_LINES} lines ---\n"
                         f"{w.log_tail()}" for w in self.workers)

    def tokenize_chat(self, messages: list[dict], worker: str | None = None) -> list[int]:
        """The prompt token ids vLLM builds for a chat request (chat template applied)."""
        target = self[worker] if worker else next(w for w in self.workers if w.alive)
        r = httpx.post(f"{target.url}/tokenize", json={"model": MODEL_NAME, "messages": messages},
                       timeout=30, trust_env=False)
        r.raise_for_status()
        return r.json()["tokens"]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


# -- KV events -----------------------------------------------------------------------------------


@dataclass
class Received:
    worker: str
    topic: str
    seq: int
    payload: bytes
    batch: EventBatch
    epoch: bytes | None = None


class KvEventTap:
    """The test's own ZMQ SUB on every worker's event socket, decoding with the core's
    structs; a background thread appends what arrives to ``received``."""

    def __init__(self, fleet: Fleet) -> None:
        self._ctx = zmq.Context()
        self._sockets: dict[zmq.Socket, str] = {}
        for worker in fleet.workers:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(worker.events_endpoint)
            self._sockets[sock] = worker.name
        self._decoder = EventBatchDecoder()
        self._lock = threading.Lock()
        self.received: list[Received] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-event-tap")
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        for sock in self._sockets:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                # [topic, seq, payload] from vLLM, plus the plugin's epoch as a fourth frame
                topic, seq, payload, *rest = sock.recv_multipart()
                try:
                    batch = self._decoder.decode(payload)
                except Exception as err:  # noqa: BLE001 - recorded; the test asserts none
                    self.errors.append(f"{self._sockets[sock]}: {err!r}")
                    continue
                with self._lock:
                    self.received.append(Received(self._sockets[sock], topic.decode(),
                                                  int.from_bytes(seq, "big"), payload, batch,
                                                  rest[0] if rest else None))

    def snapshot(self) -> list[Received]:
        with self._lock:
            return list(self.received)

    def stored(self, worker: str | None = None, session: str | None = None) -> list[BlockStored]:
        return [e for r in self.snapshot() if worker in (None, r.worker)
                for e in r.batch.events
                if isinstance(e, BlockStored) and session in (None, e.session_id)]

    def wait_stored(self, session: str, timeout: float = 10.0) -> list[tuple[str, BlockStored]]:
        deadline = time.monotonic() + timeout
        while True:
            found = [(r.worker, e) for r in self.snapshot() for e in r.batch.events
                     if isinstance(e, BlockStored) and e.session_id == session]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for sock in self._sockets:
            sock.close(0)
        self._ctx.term()


def replay(worker: VllmWorker, start_seq: int = 0, timeout_ms: int = 5000) -> list[tuple[str, int, bytes]]:
    """Ask a worker's replay socket for every buffered batch from ``start_seq`` on."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    try:
        sock.connect(worker.replay_endpoint)
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out = []
        while True:
            _, topic, seq, payload = sock.recv_multipart()
            if seq == b"\xff" * 8:
                return out
            out.append((topic.decode(), int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(0)
        ctx.term()
