"""A worker's ZMQ endpoints against ``worker_urls`` and the bind check, as the config is read
and as a worker joins (controller/worker_urls.py, controller/serve_config.py).

- ``kv_events``, ``replay`` and ``directives`` that the gateway connects to are held to the
  hosts and networks a worker URL is: an address written in a ``tcp://`` endpoint is checked
  when the config is read, a name is resolved when the worker joins. ``ipc://`` and
  ``inproc://`` endpoints reach no other host and pass.
- A ``kv_events`` holding ``*`` is bound by the gateway: beyond loopback it needs the worker's
  ``zmq_server_key`` or ``allow_insecure_bind``, like ``kv_events_bind`` needs its keys.

Nothing here connects anywhere: the only names resolved are ``localhost`` and numeric forms
the resolver reads without asking DNS.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

import anyio
import pytest

from controller.serve_config import ConfigError, WorkerConfig, WorkerUrlsConfig, parse_serve_config
from controller.worker_urls import UrlAllowList, WorkerUrlRefused
from sluice_vllm_plugin.zmq_auth import InsecureBindRefused, write_key_pair

DEFAULT = WorkerUrlsConfig().allow_list()
URL = "http://127.0.0.1:8000"
KEYS = ("kv_events", "replay", "directives")


def _config(**worker: str):
    return parse_serve_config({"workers": [{"name": "w0", "url": URL, **worker}]}, "sluice.yaml")


def _joins(allow: UrlAllowList, endpoint: str) -> None:
    anyio.run(allow.check_endpoint_addresses, endpoint, 10.0)


# -- the endpoints the gateway connects to ------------------------------------------------


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("endpoint,address", [
    ("tcp://169.254.169.254:5557", "169.254.169.254"),          # cloud metadata
    ("tcp://[::ffff:169.254.169.254]:5557", "169.254.169.254"),  # the same, written as IPv6
    ("tcp://::ffff:169.254.169.254:5557", "169.254.169.254"),    # libzmq needs no brackets
    ("tcp://[fe80::1%eth0]:5557", "fe80::1"),                    # IPv6 link-local
    ("tcp://8.8.8.8:5557", "8.8.8.8"),                           # public
    ("tcp://127.0.0.1:0;169.254.169.254:5557", "169.254.169.254"),  # SOURCE;HOST: HOST is reached
])
def test_config_refuses_an_endpoint_address_outside_worker_urls_naming_the_key(key, endpoint,
                                                                             address):
    with pytest.raises(ConfigError) as refused:
        _config(**{key: endpoint})
    message = str(refused.value)
    assert f"sluice.yaml: workers.0.{key}: '{endpoint}': {address}, which is in none of " \
           "worker_urls.networks" in message, message


def test_every_refused_endpoint_is_told_at_once():
    with pytest.raises(ConfigError) as refused:
        parse_serve_config({"workers": [
            {"name": "w0", "url": URL, "replay": "tcp://10.0.0.1:5558"},
            {"name": "w1", "url": URL, "kv_events": "tcp://169.254.169.254:5557",
             "directives": "tcp://8.8.4.4:5559"}]}, "sluice.yaml")
    message = str(refused.value)
    assert "workers.1.kv_events: 'tcp://169.254.169.254:5557'" in message
    assert "workers.1.directives: 'tcp://8.8.4.4:5559'" in message
    assert "workers.0" not in message


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5557", "tcp://[::1]:5557", "tcp://10.0.0.10:5557", "tcp://192.168.3.4:1",
    "tcp://172.20.0.5:5557", "tcp://[fd00::5]:5557", "tcp://localhost:5557",
    "tcp://worker-0.internal:5557",     # a name: resolved when the worker joins, not here
    "ipc:///tmp/sluice/kv-w0.sock", "ipc://@sluice-kv-w0", "inproc://kv-w0",  # local
])
def test_local_and_private_endpoints_are_accepted_from_the_config_and_at_join(endpoint):
    worker = _config(kv_events=endpoint, replay=endpoint, directives=endpoint).workers[0]
    assert (worker.kv_events, worker.replay, worker.directives) == (endpoint,) * 3
    assert worker.connected_endpoints() == dict.fromkeys(KEYS, endpoint)
    # at join, with the one name trusted as named (no DNS here)
    _joins(UrlAllowList.of(["http"], ["worker-0.internal"], DEFAULT.networks), endpoint)


def test_the_operators_networks_and_hosts_apply_to_endpoints_too():
    widened = {"networks": ["127.0.0.0/8", "169.254.0.0/16"]}
    parse_serve_config({"workers": [{"name": "w0", "url": URL,
                                     "replay": "tcp://169.254.10.1:5558"}],
                        "worker_urls": widened})
    narrow = UrlAllowList.of(["http"], ["engine-a"], [])
    _joins(narrow, "tcp://ENGINE-A:5557")  # named in hosts: trusted without resolving it
    with pytest.raises(ConfigError, match=r"workers\.0\.replay: 'tcp://10\.0\.0\.1:5558'"):
        parse_serve_config({"workers": [{"name": "w0", "url": URL,
                                         "replay": "tcp://10.0.0.1:5558"}],
                            "worker_urls": {"networks": ["127.0.0.0/8"]}})


def test_a_host_name_is_resolved_when_the_worker_joins():
    loopback_only = UrlAllowList.of(["http"], [], [ipaddress.ip_network("127.0.0.1/32")])
    _joins(loopback_only, "tcp://localhost:5557")
    for endpoint, why in [("tcp://0xa9fea9fe:5557", "resolves to 169.254.169.254"),
                          ("tcp://0x7f000002:5557", "resolves to 127.0.0.2"),
                          ("tcp://2130706434:5557", "resolves to 127.0.0.2")]:
        with pytest.raises(WorkerUrlRefused) as refused:
            _joins(loopback_only, endpoint)
        assert why in str(refused.value) and endpoint in str(refused.value)


@pytest.mark.parametrize("endpoint", ["tcp://*:5558", "tcp://:5558"])
def test_an_endpoint_the_gateway_connects_to_must_name_a_host(endpoint):
    with pytest.raises(WorkerUrlRefused, match="must name the worker's host"):
        _joins(DEFAULT, endpoint)


def test_local_transports_pass_without_resolving():
    for endpoint in ("ipc:///tmp/kv.sock", "ipc://@kv", "inproc://kv"):
        _joins(UrlAllowList.of(["http"], [], []), endpoint)  # no network allowed at all


def test_connected_endpoints_leave_out_a_kv_events_the_gateway_binds():
    from controller.kv_wire import binds  # here: the rest of this file runs without it

    worker = WorkerConfig(name="w0", url=URL, kv_events="tcp://*:5557",
                          replay="tcp://10.0.0.1:5558", directives="ipc:///tmp/d.sock")
    assert binds("tcp://*:5557") and binds("tcp://127.0.0.1:*") and not binds("tcp://h:1")
    assert worker.connected_endpoints() == {"replay": "tcp://10.0.0.1:5558",
                                            "directives": "ipc:///tmp/d.sock"}


# -- a kv_events the gateway binds --------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://*:5557", "tcp://0.0.0.0:*", "tcp://10.0.0.5:*",
                                      "tcp://eth0:*", "tcp://[::]:*"])
def test_a_keyless_kv_events_bind_beyond_loopback_is_refused_unless_allowed(endpoint):
    with pytest.raises(ConfigError) as refused:
        _config(kv_events=endpoint)
    message = str(refused.value)
    assert f"sluice.yaml: workers.0.kv_events: {endpoint} would listen beyond loopback" in message
    assert "allow_insecure_bind: true" in message and "zmq_server_key" in message
    allowed = parse_serve_config({"workers": [{"name": "w0", "url": URL, "kv_events": endpoint}],
                                  "allow_insecure_bind": True})
    assert allowed.workers[0].kv_events == endpoint


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:*", "tcp://[::1]:*", "tcp://localhost:*",
                                      "ipc://*", "ipc:///tmp/kv-*.sock"])
def test_a_kv_events_bound_on_loopback_or_ipc_needs_nothing(endpoint):
    config = _config(kv_events=endpoint)
    worker = config.workers[0]
    assert worker.kv_events == endpoint and worker.connected_endpoints() == {}
    config.check_kv_events_bind(worker)  # as the admin API's worker is checked at join


def test_a_workers_zmq_server_key_lets_its_kv_events_bind_every_interface(tmp_path: Path):
    """The bound SUB is then a CURVE client of that worker: it hears a publisher holding the
    worker's secret key and nobody else (tests/integration/test_worker_zmq_endpoint_checks.py)."""
    _public, gateway_secret = write_key_pair(tmp_path, "gateway")
    worker_public, _secret = write_key_pair(tmp_path, "worker")
    keys = {"zmq_keys": {"secret_key_file": str(gateway_secret)}}
    worker = {"name": "w0", "url": URL, "kv_events": "tcp://*:5557"}
    config = parse_serve_config({**keys, "workers": [{**worker,
                                                      "zmq_server_key": str(worker_public)}]})
    assert config.workers[0].kv_events == "tcp://*:5557"
    # the gateway's own pair alone is no key of the bound socket: still refused
    with pytest.raises(ConfigError, match=r"workers\.0\.kv_events: tcp://\*:5557 would listen"):
        parse_serve_config({**keys, "workers": [worker]})


def test_the_bind_check_of_a_joining_worker_names_kv_events():
    config = _config()
    joining = WorkerConfig(name="late", url=URL, kv_events="tcp://*:5557")
    with pytest.raises(InsecureBindRefused, match=r"^kv_events: tcp://\*:5557 would listen"):
        config.check_kv_events_bind(joining)
    config.check_kv_events_bind(WorkerConfig(name="late", url=URL, kv_events="tcp://127.0.0.1:*"))
