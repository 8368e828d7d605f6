"""Sharded gateways behind a real nginx, with the shipped configuration (ops/nginx/).

Two gateways, each with two simworkers of its own, behind an nginx process that runs
ops/nginx/sluice-shard-key.conf as it is and ops/nginx/sluice-shards.conf with this test's
addresses. 64 programs make calls through nginx (plain sessions, sub-agents that name their
parent, Claude Code runs whose agents share the run's id), and the placement property must
hold: every call of a program reaches the one gateway that owns it, a sub-agent the gateway of
its parent. Then a third gateway joins the ring: only programs that move to it move. A
gateway that stops takes down only its own programs' calls, each with a JSON error, and that
error leaves the client's connection usable for its next call.

nginx comes from the system's packages (scripts/setup_proxy.sh installs it where it runs as
root, as CI does); without it this tier skips, and says so.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_harness import Gateway, gateway, read_http_answer, serve_config, wait_for
from tests.support.shard_fleet import (
    CLAUDE_RUNS,
    ROOTS,
    assert_held_by_owners,
    call,
    free_port,
    program_headers,
    root_headers,
    send_every_call,
    simworker_entries,
)


OPS = Path(__file__).resolve().parents[2] / "ops" / "nginx"
SHARD_KEY_CONF = OPS / "sluice-shard-key.conf"
SHARDS_CONF = OPS / "sluice-shards.conf"
# what each call's line in nginx's access log says: the key it hashed, the gateway it chose
LOG_FORMAT = "log_format sluice_shards '$sluice_shard_key $upstream_addr $status';"


def nginx_binary() -> str | None:
    chosen = os.environ.get("SLUICE_NGINX")
    if chosen:
        return chosen
    # Debian puts nginx in /usr/sbin, which a non-root PATH often leaves out
    return shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin")


NGINX = nginx_binary()
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (scripts/setup_proxy.sh "
                                                      "installs it where it runs as root)")



def shards_conf(listen_port: int, gateways: list[str]) -> str:
    """The shipped sluice-shards.conf with this test's listen port and gateways."""
    text = SHARDS_CONF.read_text()
    servers = re.findall(r"^( *)server 127\.0\.0\.1:\d+ (max_fails=0);$", text, flags=re.M)
    assert len(servers) == 2, "sluice-shards.conf's example upstream changed shape: update this test"
    indent, options = servers[0]
    ours = "\n".join(f"{indent}server {address} {options};" for address in gateways)
    text = re.sub(r"^ *server 127\.0\.0\.1:\d+ max_fails=0;\n(?: *server 127\.0\.0\.1:\d+ max_fails=0;\n)*",
                  ours + "\n", text, count=1, flags=re.M)
    text, listens = re.subn(r"listen 127\.0\.0\.1:\d+;", f"listen 127.0.0.1:{listen_port};", text)
    assert listens == 1, "sluice-shards.conf's listen line changed shape: update this test"
    return text


class Nginx:
    """One nginx process (no master, in the foreground) on a loopback port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.access_log = workdir / "access.log"
        self.process: subprocess.Popen | None = None

    def start(self, gateways: list[str]) -> Nginx:
        for temp in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
            (self.workdir / temp).mkdir(exist_ok=True)
        temps = "\n".join(f"    {kind}_temp_path {self.workdir / temp};" for kind, temp in
                          (("client_body", "body"), ("proxy", "proxy"), ("fastcgi", "fastcgi"),
                           ("uwsgi", "uwsgi"), ("scgi", "scgi")))
        conf = self.workdir / "nginx.conf"
        conf.write_text(f"""
daemon off;
master_process off;
pid {self.workdir / 'nginx.pid'};
error_log {self.workdir / 'error.log'} warn;
events {{ worker_connections 512; }}
http {{
{temps}
    {LOG_FORMAT}
    access_log {self.access_log} sluice_shards;
    include {SHARD_KEY_CONF};
{shards_conf(self.port, gateways)}
}}
""")
        checked = subprocess.run([NGINX, "-t", "-p", str(self.workdir), "-c", str(conf)],
                                 capture_output=True, text=True, check=False)
        assert checked.returncode == 0, checked.stderr
        self.access_log.write_text("")
        self.process = subprocess.Popen([NGINX, "-p", str(self.workdir), "-c", str(conf)],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_for(self._listening, timeout=10, what="nginx to listen")
        return self

    def _listening(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise AssertionError(f"nginx exited: {self.process.stderr.read().decode(errors='replace')}")
        with socket.socket() as probe:
            return probe.connect_ex(("127.0.0.1", self.port)) == 0

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGQUIT)  # nginx's graceful shutdown
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.process = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def error_log_tail(self, lines: int = 20) -> str:
        return "\n".join((self.workdir / "error.log").read_text().splitlines()[-lines:])

    def placements(self, calls: int) -> dict[str, set[str]]:
        """For each key nginx hashed, the gateways (host:port) it sent that key's calls to,
        once the log holds a line for each of the ``calls`` made: nginx writes a call's line
        after its answer has gone, so the last line can come after the client has read it."""
        def logged() -> dict[str, set[str]] | None:
            lines = [line for line in self.access_log.read_text().splitlines(keepends=True)
                     if line.endswith("\n")]
            if len(lines) < calls:
                return None
            chosen: dict[str, set[str]] = defaultdict(set)
            for line in lines:
                key, upstream, _status = line.rstrip("\n").rsplit(" ", 2)
                chosen[key].add(upstream)
            return chosen
        return wait_for(logged, timeout=10, what=f"nginx's access log to hold {calls} lines")


@contextmanager
def shard(name: str, workers: int) -> Iterator[Gateway]:
    """One gateway with ``workers`` simworkers of its own."""
    with ExitStack() as stack:
        entries = simworker_entries(stack, [f"{name}-w{i}" for i in range(workers)])
        yield stack.enter_context(gateway(serve_config(entries)))


def address(gw: Gateway) -> str:
    return f"127.0.0.1:{gw.server.port}"


@pytest.fixture
def two_shards(tmp_path: Path) -> Iterator[tuple[Nginx, list[Gateway], ExitStack]]:
    with ExitStack() as stack:
        gateways = [stack.enter_context(shard(name, 2)) for name in ("a", "b")]
        proxy = Nginx(tmp_path)
        stack.callback(proxy.stop)
        proxy.start([address(gw) for gw in gateways])
        yield proxy, gateways, stack


def test_every_call_of_a_program_reaches_the_gateway_that_owns_it(two_shards):
    proxy, gateways, stack = two_shards
    calls = program_headers()
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as client:
        send_every_call(client, calls)

    # every call of every program, and the streamed one send_every_call ends with
    placed = proxy.placements(sum(len(each) for each in calls.values()) + 1)
    assert set(placed) == set(calls), set(placed) ^ set(calls)
    split = {key: upstreams for key, upstreams in placed.items() if len(upstreams) != 1}
    assert not split, f"programs whose calls reached more than one gateway: {split}"
    owner = {key: next(iter(upstreams)) for key, upstreams in placed.items()}
    per_gateway = {address(gw): sum(1 for a in owner.values() if a == address(gw)) for gw in gateways}
    # both shards take programs (64 keys on a two-server ring: fewer than 12 on one is
    # a hash that does not spread)
    assert min(per_gateway.values()) >= 12, per_gateway

    # the gateways agree: each program lives on its owner only, a sub-agent with its parent
    assert_held_by_owners({address(gw): set(gw.programs()) for gw in gateways}, owner)


def test_a_third_gateway_takes_programs_only_for_itself_and_a_stopped_one_only_its_own(two_shards, tmp_path):
    proxy, gateways, stack = two_shards
    roots = ROOTS + CLAUDE_RUNS
    headers = root_headers()
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as client:
        for root in roots:
            assert call(client, headers[root]).status_code == 200
    before = {key: next(iter(upstreams)) for key, upstreams in proxy.placements(len(roots)).items()}

    # K = 2 → 3: a new gateway with workers of its own joins the ring
    third = stack.enter_context(shard("c", 2))
    proxy.stop()
    proxy.start([address(gw) for gw in gateways] + [address(third)])
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as client:
        for root in roots:
            assert call(client, headers[root]).status_code == 200
    after = {key: next(iter(upstreams)) for key, upstreams in proxy.placements(len(roots)).items()}
    moved = {key for key in roots if after[key] != before[key]}
    assert all(after[key] == address(third) for key in moved), \
        {key: (before[key], after[key]) for key in moved if after[key] != address(third)}
    # about a third of them move (ketama: 160 points per server, so the new gateway's share
    # is a third give or take a few points, and the ports are new each run); none, or most,
    # would be a hash that is not consistent
    assert 0 < len(moved) < len(roots) * 2 // 3, len(moved)
    assert moved <= set(third.programs()), moved - set(third.programs())

    # gateway a stops: its programs' calls get the proxy's JSON 502, the others still run
    stopped = gateways[0]
    stopped.close()
    with httpx.Client(base_url=proxy.url, timeout=30, trust_env=False) as client:
        for root in roots:
            try:
                answer = call(client, headers[root])
            except httpx.TransportError as broken:
                raise AssertionError(f"{root}: {broken!r}; nginx's error log ends:\n"
                                     f"{proxy.error_log_tail()}") from broken
            if after[root] == address(stopped):
                assert answer.status_code == 502, (root, answer.status_code, answer.text[:300])
                error = answer.json()["error"]
                assert error["type"] == "shard_unreachable" and "retry" in error["message"], error
                assert answer.headers.get("retry-after") == "5"
            else:
                assert answer.status_code == 200, (root, answer.status_code, answer.text[:300])
    assert sum(1 for root in roots if after[root] == address(stopped)) > 0


def test_the_json_502_leaves_the_clients_connection_usable_for_its_next_call(tmp_path):
    # both gateways of the ring are down, and the first call's body comes half a second after
    # its head; the proxy's 502 says keep-alive, so the next call on the same connection must
    # be answered too (with `proxy_request_buffering off` nginx tried the gateway before the
    # body was in, answered, and then closed the connection under the client's next call)
    proxy = Nginx(tmp_path).start([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    try:
        body = b'{"model":"sluice-sim","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}'
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                f"x-session-id: the-first-program\r\n\r\n").encode()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as connection:
            connection.sendall(head)
            # time for nginx to read the head, and (with the request unbuffered) to try the
            # gateway, before the body comes
            time.sleep(0.5)
            connection.sendall(body)
            first = read_http_answer(connection)
            assert first.startswith(b"HTTP/1.1 502") and b"shard_unreachable" in first, first[:300]
            assert b"connection: close" not in first.lower(), first[:300]
            connection.sendall(head + body)
            second = read_http_answer(connection)
            assert second.startswith(b"HTTP/1.1 502") and b"shard_unreachable" in second, \
                f"the call after the 502 got {second[:300]!r}: nginx's error log ends:\n" \
                f"{proxy.error_log_tail()}"
    finally:
        proxy.stop()
