"""Worker URLs against the ``worker_urls`` allow-list, and what the gateway forwards to a
worker: client headers, engine-control body keys, the worker's own API key.

Nothing here connects anywhere: refused addresses are refused from their form, and the only
names resolved are ``localhost`` and numeric forms the resolver reads without asking DNS.
"""

from __future__ import annotations

import ipaddress

import anyio
import pytest

from controller.serve_config import ConfigError, WorkerConfig, WorkerUrlsConfig, parse_serve_config
from controller.upstream import ClientHeaders, forward_headers, strip_client_engine_keys
from controller.worker_urls import UrlAllowList, WorkerUrlRefused

DEFAULT = WorkerUrlsConfig().allow_list()


def _resolve_check(allow: UrlAllowList, url: str) -> None:
    anyio.run(allow.check_addresses, url, 10.0)


# -- the form and literal addresses --------------------------------------------------------


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:8000", "http://[::1]:8000", "http://10.1.2.3:8000", "https://172.20.0.5",
    "http://192.168.1.9:80", "http://[fd00::5]:8000", "http://127.0.0.1:8000/",
])
def test_the_default_allows_loopback_and_private_addresses(url):
    DEFAULT.check_form(url)


@pytest.mark.parametrize("url,address", [
    ("http://169.254.169.254", "169.254.169.254"),      # cloud metadata
    ("http://169.254.169.254:80", "169.254.169.254"),
    ("http://[fe80::1]:8000", "fe80::1"),                # IPv6 link-local
    ("http://[::ffff:169.254.169.254]", "169.254.169.254"),  # the same, written as IPv6
    ("http://8.8.8.8:8000", "8.8.8.8"),                  # public
    ("http://0.0.0.0:8000", "0.0.0.0"),
])
def test_the_default_refuses_link_local_and_public_addresses_without_connecting(url, address):
    with pytest.raises(WorkerUrlRefused) as refused:
        DEFAULT.check_form(url)
    message = str(refused.value)
    assert url in message and address in message and "worker_urls.networks" in message


@pytest.mark.parametrize("url,why", [
    ("http://127.0.0.1:8000/admin", "no path"),
    ("http://127.0.0.1:8000/?x=1", "no path"),
    ("http://127.0.0.1:8000?", "no path"),
    ("http://127.0.0.1:8000#frag", "no path"),
    ("ftp://127.0.0.1:8000", "scheme 'ftp'"),
    ("http://127.0.0.1:99999", "port"),
])
def test_a_worker_url_is_scheme_host_port_only(url, why):
    with pytest.raises(WorkerUrlRefused, match=why):
        DEFAULT.check_form(url)


def test_user_info_is_refused_and_its_password_never_shown():
    with pytest.raises(WorkerUrlRefused) as refused:
        DEFAULT.check_form("http://admin:hunter2@127.0.0.1:8000")
    assert "hunter2" not in str(refused.value) and "***@127.0.0.1:8000" in str(refused.value)


def test_schemes_narrow_what_is_allowed():
    only_https = WorkerUrlsConfig(schemes=["https"]).allow_list()
    only_https.check_form("https://10.0.0.1")
    with pytest.raises(WorkerUrlRefused, match="scheme 'http'"):
        only_https.check_form("http://10.0.0.1")


def test_an_operator_may_allow_a_network_the_default_refuses():
    allow = WorkerUrlsConfig(networks=["169.254.0.0/16"]).allow_list()
    allow.check_form("http://169.254.10.10:8000")
    with pytest.raises(WorkerUrlRefused):
        allow.check_form("http://127.0.0.1:8000")


# -- host names: resolved, every address checked --------------------------------------------


def test_a_host_name_is_resolved_and_its_addresses_checked():
    _resolve_check(DEFAULT, "http://localhost:8000")
    private_only = WorkerUrlsConfig(networks=["10.0.0.0/8"]).allow_list()
    with pytest.raises(WorkerUrlRefused) as refused:
        _resolve_check(private_only, "http://localhost:8000")
    assert "'localhost' resolves to" in str(refused.value)


@pytest.mark.parametrize("host", ["0xa9fea9fe", "0251.0376.0251.0376"])
def test_numeric_spellings_of_the_metadata_address_are_refused(host):
    # hex and octal forms of 169.254.169.254: not IP literals to ipaddress, but the resolver
    # reads them as that address (without asking DNS), and the check sees what it reads
    DEFAULT.check_form(f"http://{host}")  # a name, as far as the form goes
    with pytest.raises(WorkerUrlRefused, match="resolves to 169.254.169.254"):
        _resolve_check(DEFAULT, f"http://{host}")


def test_a_name_in_hosts_is_trusted_without_resolving_it():
    # .invalid never resolves; named in hosts, it is not looked up at all
    allow = WorkerUrlsConfig(hosts=["vllm-0.invalid"]).allow_list()
    _resolve_check(allow, "http://VLLM-0.invalid:8000")


# -- the config ------------------------------------------------------------------------------


def test_config_refuses_a_worker_url_outside_the_allow_list_naming_key_and_url():
    with pytest.raises(ConfigError) as refused:
        parse_serve_config({"workers": [
            {"name": "ok", "url": "http://127.0.0.1:8000"},
            {"name": "meta", "url": "http://169.254.169.254"},
            {"name": "path", "url": "http://127.0.0.1:9000/v1"},
        ]})
    lines = str(refused.value).splitlines()
    assert any("workers.1.url" in line and "http://169.254.169.254" in line for line in lines)
    assert any("workers.2.url" in line and "http://127.0.0.1:9000/v1" in line for line in lines)
    assert not any("workers.0" in line for line in lines)


def test_config_worker_urls_section():
    config = parse_serve_config({
        "worker_urls": {"schemes": ["https"], "networks": ["169.254.0.0/16"], "hosts": ["a.b"]},
        "workers": [{"name": "w", "url": "https://169.254.1.1:8000"}]})
    assert config.worker_urls.networks == [ipaddress.ip_network("169.254.0.0/16")]
    for bad, key in [({"schemes": ["gopher"]}, "worker_urls.schemes"),
                     ({"networks": ["10.0.0.1/8"]}, "worker_urls.networks"),
                     ({"hosts": ["a b"]}, "worker_urls.hosts")]:
        with pytest.raises(ConfigError, match=key):
            parse_serve_config({"worker_urls": bad,
                                "workers": [{"name": "w", "url": "http://127.0.0.1:1"}]})


# -- client headers ----------------------------------------------------------------------------

CLIENT_HEADERS = [
    (b"Authorization", b"Bearer sk-user"), (b"Cookie", b"session=abc"),
    (b"Proxy-Authorization", b"Basic cA=="), (b"x-api-key", b"sk-ant"),
    (b"X-Request-Id", b"forged-id"), (b"X-data-parallel-rank", b"3"),
    (b"X-Custom", b"c"), (b"X-Trace-Span", b"t"), (b"Content-Type", b"text/plain"),
]


def test_no_client_header_is_forwarded_unless_named():
    out = dict((k.lower(), v) for k, v in forward_headers(CLIENT_HEADERS, "s1"))
    assert out == {b"content-type": b"application/json", b"x-session-id": b"s1",
                   b"accept-encoding": b"identity"}


def test_named_headers_and_prefixes_are_forwarded_and_connection_named_ones_still_dropped():
    named = ClientHeaders(["x-custom", "x-trace-*", "authorization"])
    raw = [*CLIENT_HEADERS, (b"Connection", b"x-custom")]
    out = dict((k.lower(), v) for k, v in forward_headers(raw, "s1", named))
    assert out == {b"authorization": b"Bearer sk-user", b"x-trace-span": b"t",
                   b"content-type": b"application/json", b"x-session-id": b"s1",
                   b"accept-encoding": b"identity"}


def test_vllm_priority_header_follows_the_clients_priority():
    raw = [(b"X-Vllm-Priority", b"-5")]
    assert (b"x-vllm-priority", b"-5") not in forward_headers(raw, "s", ClientHeaders())
    assert (b"X-Vllm-Priority", b"-5") in forward_headers(raw, "s", ClientHeaders(client_priority=True))


@pytest.mark.parametrize("name", ["content-type", "X-Session-ID", "x-vllm-priority", "host",
                                  "bad name", "*"])
def test_forward_client_headers_refuses_what_the_gateway_sets_and_non_names(name):
    with pytest.raises(ConfigError, match="forward_client_headers"):
        parse_serve_config({"forward_client_headers": [name],
                            "workers": [{"name": "w", "url": "http://127.0.0.1:1"}]})


# -- engine-control body keys -----------------------------------------------------------------

ENGINE_BODY = {"kv_transfer_params": {"remote_host": "10.9.9.9"}, "ec_transfer_params": {"x": 1},
               "request_id": "forged", "priority": -9, "vllm_xargs": {"a": 1}, "cache_salt": "s"}


def test_engine_control_keys_are_stripped_unless_named():
    body = dict(ENGINE_BODY)
    strip_client_engine_keys(body, frozenset())
    assert body == {"cache_salt": "s"}  # the client's own cache isolation is its to keep
    body = dict(ENGINE_BODY)
    strip_client_engine_keys(body, frozenset({"kv_transfer_params", "request_id"}))
    assert set(body) == {"kv_transfer_params", "request_id", "cache_salt"}


def test_forward_client_keys_accepts_the_engine_control_keys():
    config = parse_serve_config({
        "forward_client_keys": ["kv_transfer_params", "ec_transfer_params", "request_id"],
        "workers": [{"name": "w", "url": "http://127.0.0.1:1"}]})
    assert config.forward_client_keys == ["kv_transfer_params", "ec_transfer_params", "request_id"]


# -- a worker's API key ------------------------------------------------------------------------


def test_api_key_from_the_environment_or_a_file(tmp_path):
    worker = WorkerConfig(name="w", url="http://127.0.0.1:1", api_key_env="W_KEY")
    assert worker.api_key({"W_KEY": "k-123"}) == "k-123"
    with pytest.raises(ConfigError, match="api_key_env: the environment variable W_KEY is not set"):
        worker.api_key({})
    key_file = tmp_path / "w.key"
    key_file.write_text("k-file-456\n")
    assert WorkerConfig(name="w", url="http://127.0.0.1:1", api_key_file=key_file).api_key() == "k-file-456"
    assert WorkerConfig(name="w", url="http://127.0.0.1:1").api_key() is None


def test_a_bad_api_key_is_refused_without_showing_it(tmp_path):
    key_file = tmp_path / "two.key"
    key_file.write_text("secret-one\nsecret-two\n")
    with pytest.raises(ConfigError) as refused:
        WorkerConfig(name="w", url="http://127.0.0.1:1", api_key_file=key_file).api_key()
    assert "api_key_file" in str(refused.value) and "secret" not in str(refused.value)
    with pytest.raises(ConfigError, match="api_key_file: .*cannot read"):
        WorkerConfig(name="w", url="http://127.0.0.1:1", api_key_file=tmp_path / "none").api_key()


def test_an_api_key_comes_from_one_place_and_never_inline():
    with pytest.raises(ConfigError, match="not both"):
        parse_serve_config({"workers": [{"name": "w", "url": "http://127.0.0.1:1",
                                         "api_key_env": "A", "api_key_file": "/k"}]})
    with pytest.raises(ConfigError, match="workers.0.api_key"):
        parse_serve_config({"workers": [{"name": "w", "url": "http://127.0.0.1:1",
                                         "api_key": "inline-secret"}]})
