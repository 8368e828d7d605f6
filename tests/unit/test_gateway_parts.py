"""The gateway's pure parts: its config, header and body preparation, the SSE tap, usage
shapes, and capacity read off vLLM's /metrics text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog
import structlog.testing

from controller.admission import hold_shorter_than_wait, warn_if_hold_shorter_than_wait
from controller.serve_config import ServeConfig, load_serve_config, parse_serve_config
from controller.upstream import (
    ClientHeaders,
    forward_headers,
    prepare_body,
    sends_engine_priority,
    strip_client_engine_keys,
    with_engine_priority,
)
from controller.worker_answers import StreamTap, UsageCounts
from controller.workers import CapacityUnknown, capacity_from_metrics
from scheduler.config import POLICY_NAMES, ConfigError
from scheduler.config_reading import make_policy_config

REPO = Path(__file__).resolve().parents[2]
WORKER = {"name": "w0", "url": "http://127.0.0.1:8000"}


# -- config ------------------------------------------------------------------------------


def test_example_yaml_loads_and_its_gateway_keys_are_the_defaults():
    config = load_serve_config(REPO / "configs" / "example.yaml")
    assert [w.name for w in config.workers] == ["gpu-0", "gpu-1"]
    assert config.workers[1].capacity_tokens == 250_000 and config.workers[0].capacity_tokens is None
    defaults = ServeConfig(workers=config.workers)
    for key in ServeConfig.model_fields.keys() - {"policy"}:
        assert getattr(config, key) == getattr(defaults, key), key
    for name in POLICY_NAMES:  # every policy's section as the example gives it: the defaults
        example = config.policy.for_policy(name).model_dump()
        assert example == make_policy_config({"name": name}).model_dump(), name
    assert config.path == (REPO / "configs" / "example.yaml").resolve()


@pytest.mark.parametrize("data,keys", [
    ({}, ["workers"]),
    ({"workers": []}, ["workers"]),
    ({"workers": [{"name": "w", "url": "ftp://x"}]}, ["workers.0.url"]),
    ({"workers": [WORKER, {"name": "w0", "url": "http://b:1"}]}, ["workers"]),
    ({"workers": [{**WORKER, "capacity_tokens": 0}]}, ["workers.0.capacity_tokens"]),
    ({"workers": [{**WORKER, "kv_events": "http://x:1"}]}, ["workers.0.kv_events"]),
    ({"workers": [{**WORKER, "scheduling_policy": "lifo"}]}, ["workers.0.scheduling_policy"]),
    ({"workers": [WORKER], "listen": {"port": 70000}, "max_body_bytes": 1}, ["listen.port", "max_body_bytes"]),
    ({"workers": [WORKER], "upstream": {"read_timeout_s": 0}}, ["upstream.read_timeout_s"]),
    ({"workers": [WORKER], "policy": {"pause_threshold": 9}}, ["policy.pause_threshold"]),
    ({"workers": [WORKER], "polcy": {}}, ["polcy"]),
    ({"workers": [WORKER], "shards": {"index": 0, "gateways": ["http://a:1", "ftp://b"]}}, ["shards.gateways"]),
    ({"workers": [WORKER], "shards": {"index": 2, "gateways": ["http://a:1", "http://b:1"]}}, ["shards"]),
    ({"workers": [{"name": "w", "url": "ftp://x"}], "policy": {"bogus": 1}}, ["policy.bogus", "workers.0.url"]),
    ({"workers": [WORKER], "forward_client_keys": ["priorty"]}, ["forward_client_keys"]),
    ({"workers": [WORKER], "forward_client_keys": ["vllm_xargs."]}, ["forward_client_keys"]),
    ({"workers": [WORKER], "limits": {"max_hold_s": 0, "max_programs": 0}},
     ["limits.max_hold_s", "limits.max_programs"]),
    ({"workers": [WORKER], "shutdown_grace_s": -1}, ["shutdown_grace_s"]),
])
def test_config_errors_name_every_offending_key(data, keys):
    with pytest.raises(ConfigError) as err:
        parse_serve_config(data, "sluice.yaml")
    for key in keys:
        assert f"sluice.yaml: {key}" in str(err.value), str(err.value)



@pytest.mark.parametrize("endpoint", [
    "ipc:///tmp/sluice/kv-w0.sock",   # an absolute path: ipc:// then /tmp/...
    "ipc://kv-w0.sock",               # relative to the gateway's working directory
    "ipc://@sluice-kv-w0",            # Linux abstract namespace
    "tcp://127.0.0.1:5557",
    "tcp://*:5557",
    "inproc://kv-w0",
])
def test_zmq_endpoints_accept_ipc_paths_as_zmq_does(endpoint):
    config = parse_serve_config({"workers": [{**WORKER, "kv_events": endpoint, "replay": endpoint,
                                              "directives": endpoint}],
                                 "kv_events_bind": endpoint,
                                 # tcp://* binds beyond loopback without keys: allowed here
                                 "allow_insecure_bind": True})
    worker = config.workers[0]
    assert (worker.kv_events, worker.replay, worker.directives) == (endpoint,) * 3
    assert config.kv_events_bind == endpoint


@pytest.mark.parametrize("endpoint,problem", [
    ("ipc://", "needs a socket path"),
    ("ipc:///tmp/", "needs a socket path"),
    ("ipc:///tmp/kv sock", "whitespace"),
    ("ipc:///tmp/" + "x" * 120, "at most 107 bytes"),
    ("ipc:/tmp/kv.sock", "a ZMQ endpoint must look like"),
    ("tcp://", "a ZMQ endpoint must look like"),
])
def test_malformed_zmq_endpoint_is_rejected_naming_the_key(endpoint, problem):
    with pytest.raises(ConfigError) as err:
        parse_serve_config({"workers": [{**WORKER, "replay": endpoint}]}, "sluice.yaml")
    assert "sluice.yaml: workers.0.replay" in str(err.value) and problem in str(err.value), str(err.value)
    with pytest.raises(ConfigError) as err:
        parse_serve_config({"workers": [WORKER], "kv_events_bind": endpoint}, "sluice.yaml")
    assert "sluice.yaml: kv_events_bind" in str(err.value) and problem in str(err.value), str(err.value)

def test_admin_token_env_var_wins_over_the_literal_token():
    config = parse_serve_config({"workers": [WORKER], "admin_token": "literal-token"})
    assert config.resolved_admin_token({}) == "literal-token"
    assert config.resolved_admin_token({"SLUICE_ADMIN_TOKEN": "from-env"}) == "from-env"
    off = parse_serve_config({"workers": [WORKER], "admin_token_env": None})
    assert off.resolved_admin_token({"SLUICE_ADMIN_TOKEN": "x"}) is None


def test_missing_or_unreadable_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_serve_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("workers: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_serve_config(tmp_path / "bad.yaml")


# -- forwarding --------------------------------------------------------------------------


def test_forward_headers_drop_hop_by_hop_and_connection_named_ones():
    raw = [(b"Host", b"gw"), (b"Connection", b"keep-alive, X-Private"), (b"X-Private", b"1"),
           (b"Keep-Alive", b"5"), (b"Proxy-Authorization", b"p"), (b"Proxy-Foo", b"q"),
           (b"TE", b"trailers"), (b"Trailer", b"x"), (b"Transfer-Encoding", b"chunked"),
           (b"Upgrade", b"h2c"), (b"Content-Length", b"12"), (b"Accept-Encoding", b"gzip"),
           (b"X-Session-ID", b"client-said"), (b"Authorization", b"Bearer k"), (b"X-Other", b"y")]
    named = ClientHeaders(["x-private", "authorization", "x-other", "keep-alive", "te"])
    out = dict((k.lower(), v) for k, v in forward_headers(raw, "resolved", named))
    assert out == {b"authorization": b"Bearer k", b"x-other": b"y", b"x-session-id": b"resolved",
                   b"accept-encoding": b"identity", b"content-type": b"application/json"}


@pytest.mark.parametrize("client_priority", [False, True])
def test_vllms_priority_header_goes_only_when_the_clients_priority_is_forwarded(client_priority):
    raw = [(b"X-Vllm-Priority", b"-100"), (b"X-Other", b"y")]
    out = dict((k.lower(), v) for k, v in forward_headers(raw, "s", ClientHeaders(["x-other"], client_priority)))
    assert (b"x-vllm-priority" in out) is client_priority
    assert out[b"x-other"] == b"y"


def test_prepare_body_sets_session_continuation_and_asks_for_stream_usage():
    body = {"stream": True, "vllm_xargs": {"kv_cache_report_mode": "full"}}
    original_xargs = body["vllm_xargs"]
    assert prepare_body("/v1/chat/completions", body, "s1", "c" * 32) is True
    assert body["session_id"] == "s1"
    assert body["vllm_xargs"] == {"kv_cache_report_mode": "full", "continuation_id": "c" * 32}
    assert original_xargs == {"kv_cache_report_mode": "full"}  # the client's dict is not mutated
    assert body["stream_options"] == {"include_usage": True}
    asked = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": False}}
    assert prepare_body("/v1/completions", asked, "s1", None) is False
    off = {"stream": True, "stream_options": {"include_usage": False}}
    assert prepare_body("/v1/chat/completions", off, "s1", None) is True
    assert off["stream_options"]["include_usage"] is True
    assert prepare_body("/v1/chat/completions", {"stream": False}, "s1", None) is False
    assert prepare_body("/v1/messages", {"stream": True}, "s1", None) is False


# -- the SSE tap ----------------------------------------------------------------------------


def test_a_worker_is_fcfs_unless_its_config_says_priority():
    config = parse_serve_config({"workers": [WORKER, {"name": "w1", "url": "http://127.0.0.1:8001",
                                                     "scheduling_policy": "priority"}]})
    assert [w.scheduling_policy for w in config.workers] == ["fcfs", "priority"]


@pytest.mark.parametrize("route,sends", [
    ("/v1/chat/completions", True), ("/v1/completions", True), ("/v1/responses", True),
    ("/v1/messages", False),  # vLLM 0.32's Messages request has no priority field
])
def test_engine_priority_goes_on_the_routes_vllm_reads_it_on(route, sends):
    assert sends_engine_priority(route, {"model": "m"}) is sends


@pytest.mark.parametrize("forwarded,sends", [((), True), (("priority",), False)])
def test_a_forwarded_client_priority_goes_as_sent_and_the_policys_is_not_added(forwarded, sends):
    body = {"model": "m", "priority": 7}
    strip_client_engine_keys(body, frozenset(forwarded))
    assert sends_engine_priority("/v1/chat/completions", body) is sends
    assert body.get("priority") == (7 if forwarded else None)


@pytest.mark.parametrize("priority", [0, -5_000, 2_000, 7 * 10**9])
def test_engine_priority_is_spliced_into_the_encoded_body_as_a_json_key(priority):
    import msgspec

    body = {"model": "m", "session_id": "s", "messages": [{"role": "user", "content": "{x}"}],
            "vllm_xargs": {"continuation_id": "c"}}
    content = msgspec.json.encode(body)
    spliced = with_engine_priority(content, priority)
    assert json.loads(spliced) == {"priority": priority, **body}
    assert spliced.endswith(content[1:])  # the rest is the same bytes, not encoded again
    assert json.loads(with_engine_priority(b"{}", priority)) == {"priority": priority}
    with pytest.raises(ValueError, match="JSON object"):
        with_engine_priority(b"[1]", priority)


def _sse(obj) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


USAGE = {"prompt_tokens": 40, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 32}}
STREAM = [
    _sse({"choices": [{"delta": {"content": "a"}}], "usage": None}),
    _sse({"choices": [{"delta": {"content": "usage"}}]}),  # the word alone is no usage chunk
    _sse({"choices": [], "usage": USAGE}),
    b"data: [DONE]\n\n",
]


@pytest.mark.parametrize("step", [1, 2, 5, 17, 10_000])
def test_tap_drops_exactly_the_usage_chunk_whatever_the_chunking(step):
    raw = b"".join(STREAM)
    tap = StreamTap(drop_usage_chunk=True)
    out = b"".join(tap.feed(raw[i:i + step]) for i in range(0, len(raw), step)) + tap.flush()
    assert out == raw.replace(STREAM[2], b"")
    assert (tap.usage.prompt_tokens, tap.usage.completion_tokens, tap.usage.cached_tokens) == (40, 3, 32)
    assert tap.done and tap.dropped


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_tap_passes_chunks_through_unchanged_when_the_client_asked_for_usage(step):
    raw = b"".join(STREAM).replace(b"\n\n", b"\r\n\r\n")
    tap = StreamTap(drop_usage_chunk=False)
    pieces = [raw[i:i + step] for i in range(0, len(raw), step)]
    assert [tap.feed(p) for p in pieces] == pieces
    assert tap.flush() == b""
    assert tap.usage.completion_tokens == 3 and tap.done


def test_tap_sends_complete_events_at_once_and_holds_only_an_unfinished_one():
    tap = StreamTap(drop_usage_chunk=True)
    assert tap.feed(STREAM[0] + STREAM[1][:10]) == STREAM[0]
    assert tap.feed(STREAM[1][10:]) == STREAM[1]


def test_tap_drops_only_one_usage_chunk():
    second = _sse({"choices": [], "usage": USAGE})
    tap = StreamTap(drop_usage_chunk=True)
    assert tap.feed(STREAM[2] + second) == second


def test_usage_shapes_of_each_api():
    chat = UsageCounts()
    chat.update({"prompt_tokens": 10, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8}})
    assert chat.to_usage(0) == type(chat.to_usage(0))(10, 2, 8)
    responses = UsageCounts()
    responses.update({"input_tokens": 10, "output_tokens": 4, "input_tokens_details": {"cached_tokens": 6}})
    assert (responses.prompt_tokens, responses.completion_tokens, responses.cached_tokens) == (10, 4, 6)
    anthropic = UsageCounts()  # message_start, then the cumulative message_delta
    anthropic.update({"input_tokens": 3, "output_tokens": 1, "cache_read_input_tokens": 5,
                      "cache_creation_input_tokens": 2})
    anthropic.update({"output_tokens": 9})
    assert (anthropic.prompt_tokens, anthropic.completion_tokens, anthropic.cached_tokens) == (10, 9, 5)
    missing = UsageCounts()
    assert not missing.known and missing.to_usage(77).prompt_tokens == 77


# -- capacity --------------------------------------------------------------------------------


def test_capacity_is_blocks_less_the_null_block_times_block_size_summed_over_engines():
    one = 'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1001"} 1.0\n'
    assert capacity_from_metrics("# HELP x\n" + one) == 16_000
    two = one + 'vllm:cache_config_info{num_gpu_blocks="501",engine="1",block_size="32"} 1.0\n'
    assert capacity_from_metrics(two) == 16_000 + 16_000


def test_a_hybrid_models_capacity_is_vllms_group_aware_figure_less_the_null_blocks_share():
    # a sliding-window model: 1,001 blocks of 16 tokens hold 40,040 tokens of requests, as
    # vLLM 0.32 reports in kv_cache_size_tokens (its concurrency at max_model_len × max_model_len)
    hybrid = ('vllm:cache_config_info{block_size="16",kv_cache_size_tokens="40040",'
              'num_gpu_blocks="1001"} 1.0\n')
    assert capacity_from_metrics(hybrid) == 40_000
    # a full-attention model's figure differs only by a max-length request's last-block padding:
    # the exact block count stays
    plain = ('vllm:cache_config_info{block_size="16",kv_cache_size_tokens="15990",'
             'num_gpu_blocks="1001"} 1.0\n')
    assert capacity_from_metrics(plain) == 16_000
    unknown = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="None",num_gpu_blocks="1001"} 1.0\n'
    assert capacity_from_metrics(unknown) == 16_000


@pytest.mark.parametrize("text,problem", [
    ("vllm:num_requests_running 0\n", "no vllm:cache_config_info"),
    ('vllm:cache_config_info{block_size="16",num_gpu_blocks="None"} 1.0\n', "no num_gpu_blocks"),
])
def test_capacity_unknown_says_why(text, problem):
    with pytest.raises(CapacityUnknown, match=problem):
        capacity_from_metrics(text)


@pytest.mark.parametrize("limits, policy, longest_wait", [
    ({"max_hold_s": 120}, {"name": "program_aware", "max_wait_s": 60}, 135.0),  # stretch 2.25
    ({"max_hold_s": 100}, {"name": "program_aware", "max_wait_s": 60, "max_wait_stretch": 1.5}, 90.0),
    ({}, {"name": "program_aware"}, 135.0),                     # the defaults: 600 s > 135 s
    ({"max_hold_s": 10}, {"name": "least_loaded"}, None),        # no wait of its own
])
def test_a_hold_shorter_than_the_policys_longest_wait_is_named(limits, policy, longest_wait):
    config = parse_serve_config({"workers": [WORKER], "limits": limits, "policy": policy}, "s.yaml")
    figures = hold_shorter_than_wait(config.limits, config.policy)
    if longest_wait is None or config.limits.max_hold_s >= longest_wait:
        assert figures is None
        return
    assert figures == {"max_hold_s": config.limits.max_hold_s, "max_wait_s": policy["max_wait_s"],
                       "longest_wait_s": longest_wait}
    with structlog.testing.capture_logs() as logs:
        warn_if_hold_shorter_than_wait(structlog.get_logger(), config.limits, config.policy)
    assert [line["longest_wait_s"] for line in logs if "max_hold_s" in line["event"]] == [longest_wait]
