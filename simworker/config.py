"""A simworker's settings: what ``sluice simworker`` and its callers configure (the engine's
preset and pool, its sockets, the clock's scale, reply lengths, the model length, vLLM's
scheduling flags, tool-call replies, the sampling seed and what a directive may do), checked
when built."""

from __future__ import annotations

from dataclasses import dataclass

from sim.engine import SCHEDULING_POLICIES
from sim.step_time import DEFAULT_PRESET, PresetSpec
from sluice_vllm_plugin.directive_limits import DEFAULT_LIMITS, DirectiveLimits
from sluice_vllm_plugin.zmq_auth import ServerKeys, ZmqKeyError

# The model length a worker serves when none is set (or its pool, if larger): Llama 3.1's
# and Qwen3's (with YaRN) context, the models of sim/step_time.py's presets.
DEFAULT_MAX_MODEL_LEN = 131_072


@dataclass(frozen=True, slots=True)
class SimWorkerConfig:
    name: str = "w0"
    model: str = "sluice-sim"
    preset: PresetSpec = DEFAULT_PRESET     # a named preset, or a model (from a preset file)
    num_blocks: int | None = None          # None: the preset's KV pool
    block_size: int = 16
    kv_events: str | None = "tcp://*:5557"  # None: no KV events
    replay: str | None = None
    directives: str | None = None          # ZMQ PULL for retention directives; None: none
    topic: str | None = None               # None: "kv@<name>"
    time_scale: float = 1.0
    # Multiplies the preset's prefill costs (per prompt token and per attention pair, so a
    # prompt costs this many times as much). A small demo pool holds contexts ~18× shorter
    # than a real agent's; scaling prefill keeps a re-prefill as costly, relative to a turn,
    # as it is for those on a GPU.
    prefill_scale: float = 1.0
    default_max_tokens: int = 256
    max_run_steps: int = 16
    max_run_wall_s: float = 0.05
    max_lag_wall_s: float = 0.25
    replay_buffer: int = 10_000
    # Responses API answers whose token sequences are kept for ``previous_response_id``
    # (oldest forgotten first).
    responses_kept: int = 1024
    # vLLM's --max-model-len; None: DEFAULT_MAX_MODEL_LEN or the pool, whichever is larger
    max_model_len: int | None = None
    # vLLM's --max-num-seqs; None: the preset's
    max_num_seqs: int | None = None
    # vLLM's --scheduling-policy ("fcfs", vLLM's default, or "priority")
    scheduling_policy: str = "fcfs"
    # Reply with a tool call while the conversation holds fewer tool results than this
    # (simworker/tool_calls.py); 0: every reply is text.
    tool_call_turns: int = 0
    # Seed of the worker's random source (replies sampled without a request seed); None:
    # fresh entropy, so two workers (or two runs) sample differently, as vLLM does.
    sampling_seed: int | None = None
    # What a directive may do to this worker: the engine plugin's limits, each field of
    # sluice_vllm_plugin/directive_limits.py's DirectiveLimits as ``directive_<field>`` (plain
    # values, so a config travels as JSON). TTLs and prefetch deadlines are clamped to
    # max_ttl_s; priorities into [priority_min, priority_max]; at most max_sessions sessions
    # hold directive state, each forgotten (released) forget_after_s after its latest
    # directive; a retain is refused past a session's or the total retained-block budget
    # (None: none); a message is at most max_message_bytes.
    directive_max_ttl_s: float = DEFAULT_LIMITS.max_ttl_s
    directive_priority_min: int = DEFAULT_LIMITS.priority_min
    directive_priority_max: int = DEFAULT_LIMITS.priority_max
    directive_max_sessions: int = DEFAULT_LIMITS.max_sessions
    directive_forget_after_s: float = DEFAULT_LIMITS.forget_after_s
    directive_max_session_retained_blocks: int | None = DEFAULT_LIMITS.max_session_retained_blocks
    directive_max_retained_blocks: int | None = DEFAULT_LIMITS.max_retained_blocks
    directive_max_message_bytes: int = DEFAULT_LIMITS.max_message_bytes
    # CurveZMQ (sluice_vllm_plugin/zmq_auth.py): this worker's key pair (the NAME.key_secret
    # file `sluice keys` writes) and the directory of the client public keys it accepts (the
    # gateway's NAME.key). Both or neither. With them the KV-event, replay and directive
    # sockets are CURVE servers that turn away every other client.
    zmq_secret_key_file: str | None = None
    zmq_client_keys_dir: str | None = None
    # Bind a socket without keys beyond loopback (e.g. tcp://*:5557): refused unless true.
    allow_insecure_bind: bool = False

    def __post_init__(self) -> None:
        if not self.time_scale > 0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if not self.prefill_scale > 0:
            raise ValueError(f"prefill_scale must be > 0, got {self.prefill_scale}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be ≥ 2 (block 0 is the null block), got {self.num_blocks}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be ≥ 1, got {self.block_size}")
        if self.default_max_tokens < 1 or self.max_run_steps < 1:
            raise ValueError("default_max_tokens and max_run_steps must be ≥ 1")
        if self.responses_kept < 0:
            raise ValueError(f"responses_kept must be ≥ 0, got {self.responses_kept}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be ≥ 1, got {self.max_model_len}")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be ≥ 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.tool_call_turns < 0:
            raise ValueError(f"tool_call_turns must be ≥ 0, got {self.tool_call_turns}")
        try:
            self.directive_limits
        except ValueError as err:
            raise ValueError(f"directive limits: {err}") from None
        if (self.zmq_secret_key_file is None) != (self.zmq_client_keys_dir is None):
            raise ValueError("zmq_secret_key_file and zmq_client_keys_dir go together: a CURVE "
                             "server needs its key pair and the client keys it accepts")
        try:
            self.zmq_server_keys
        except ZmqKeyError as err:
            raise ValueError(f"zmq_secret_key_file / zmq_client_keys_dir: {err}") from None

    @property
    def zmq_server_keys(self) -> ServerKeys | None:
        """The sockets' CURVE server keys, read from their files now; None without keys."""
        if self.zmq_secret_key_file is None or self.zmq_client_keys_dir is None:
            return None
        return ServerKeys.from_files(self.zmq_secret_key_file, self.zmq_client_keys_dir)

    @property
    def directive_limits(self) -> DirectiveLimits:
        return DirectiveLimits(
            max_ttl_s=self.directive_max_ttl_s, priority_min=self.directive_priority_min,
            priority_max=self.directive_priority_max, max_sessions=self.directive_max_sessions,
            forget_after_s=self.directive_forget_after_s,
            max_session_retained_blocks=self.directive_max_session_retained_blocks,
            max_retained_blocks=self.directive_max_retained_blocks,
            max_message_bytes=self.directive_max_message_bytes)

    @property
    def kv_topic(self) -> str:
        return f"kv@{self.name}" if self.topic is None else self.topic
