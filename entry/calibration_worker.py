"""A worker as ``sluice calibrate`` sees it (entry/calibration_driver.py drives it): what it
serves and how large its KV pool is (``/v1/models``, ``/metrics``), and streamed completions
checked for the answers calibration cannot use."""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families


class CalibrationError(RuntimeError):
    """The worker failed, refused, or answered something calibration cannot use."""


class StreamsApart(CalibrationError):
    """A decode batch's streams did not decode together long enough to time a step (the worker
    started them too far apart, as a busy host can): that try is lost, not the calibration."""


@dataclass(frozen=True, slots=True)
class WorkerInfo:
    url: str
    model: str
    owned_by: str
    max_model_len: int | None
    num_gpu_blocks: int
    block_size: int

    @property
    def kv_capacity_tokens(self) -> int:
        # vLLM's num_gpu_blocks counts the null block (block 0), which holds no tokens
        return (self.num_gpu_blocks - 1) * self.block_size

    def describe(self) -> str:
        length = f", max_model_len {self.max_model_len}" if self.max_model_len else ""
        return (f"{self.url}, model {self.model} (owned by {self.owned_by}{length}), "
                f"{self.num_gpu_blocks} KV blocks of {self.block_size} tokens")


@dataclass(slots=True)
class StreamResult:
    sent_at: float
    first_token_at: float | None = None
    # (arrival, tokens generated so far) for every chunk that carried tokens
    points: list[tuple[float, int]] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None


def _fail_http(err: httpx.HTTPError, url: str) -> CalibrationError:
    if isinstance(err, httpx.ConnectError):
        return CalibrationError(f"cannot reach the worker at {url}: {err}")
    if isinstance(err, httpx.TimeoutException):
        return CalibrationError(f"the worker at {url} did not answer in time ({type(err).__name__})")
    return CalibrationError(f"talking to the worker at {url} failed: {type(err).__name__}: {err}")


async def read_worker_info(client: httpx.AsyncClient, url: str, model: str | None) -> WorkerInfo:
    """The served model (``/v1/models``) and the KV pool (``/metrics``'s cache_config_info)."""
    try:
        models = await client.get(f"{url}/v1/models")
        metrics = await client.get(f"{url}/metrics")
    except httpx.HTTPError as err:
        raise _fail_http(err, url) from None
    if models.status_code != 200:
        raise CalibrationError(f"{url}/v1/models answered {models.status_code}: {models.text[:300]}")
    try:
        cards = models.json()["data"]
        served = {card["id"]: card for card in cards}
    except (ValueError, KeyError, TypeError):
        raise CalibrationError(f"{url}/v1/models is not an OpenAI model list: {models.text[:300]}") from None
    if not served:
        raise CalibrationError(f"{url}/v1/models lists no model")
    if model is None:
        model = next(iter(served))
    elif model not in served:
        raise CalibrationError(f"the worker serves {', '.join(served)}, not {model!r}")
    card = served[model]
    if metrics.status_code != 200:
        raise CalibrationError(f"{url}/metrics answered {metrics.status_code}; the KV pool's size "
                               "comes from vLLM's vllm:cache_config_info there")
    blocks, block_size = _cache_config(metrics.text, url)
    max_len = card.get("max_model_len")
    return WorkerInfo(url, model, str(card.get("owned_by", "unknown")),
                      max_len if isinstance(max_len, int) and max_len > 0 else None, blocks, block_size)


def _cache_config(text: str, url: str) -> tuple[int, int]:
    try:
        for family in text_string_to_metric_families(text):
            if family.name != "vllm:cache_config_info":
                continue
            for sample in family.samples:
                labels = sample.labels
                blocks, size = int(labels["num_gpu_blocks"]), int(labels["block_size"])
                if blocks < 2 or size < 1:
                    raise CalibrationError(f"{url}/metrics reports {blocks} KV blocks of {size} tokens")
                return blocks, size
    except (ValueError, KeyError) as err:
        raise CalibrationError(f"{url}/metrics: cannot read vllm:cache_config_info ({err})") from None
    raise CalibrationError(f"{url}/metrics has no vllm:cache_config_info (num_gpu_blocks, block_size): "
                           "is this a vLLM-compatible worker?")


class Worker:
    """Completions on one worker, streamed, with the checks that catch a worker answering
    nonsense."""

    def __init__(self, client: httpx.AsyncClient, info: WorkerInfo) -> None:
        self.client = client
        self.info = info

    async def complete(self, prompt: str, max_tokens: int, what: str) -> StreamResult:
        body = {"model": self.info.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
                "temperature": 0.0, "ignore_eos": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        url = self.info.url
        result = StreamResult(sent_at=time.monotonic())
        try:
            async with self.client.stream("POST", f"{url}/v1/completions", json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise CalibrationError(f"{what}: the worker answered {response.status_code}: {text[:300]}")
                async for line in response.aiter_lines():
                    arrived = time.monotonic()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    self._chunk(result, data, arrived, what)
        except httpx.HTTPError as err:
            raise _fail_http(err, url) from None
        self._check(result, max_tokens, what)
        return result

    @staticmethod
    def _chunk(result: StreamResult, data: str, arrived: float, what: str) -> None:
        try:
            chunk = json.loads(data)
        except ValueError:
            raise CalibrationError(f"{what}: the stream carried something that is not JSON: {data[:200]}") from None
        if not isinstance(chunk, dict):
            raise CalibrationError(f"{what}: a stream chunk is not an object: {data[:200]}")
        if "error" in chunk:
            raise CalibrationError(f"{what}: the worker failed mid-stream: {json.dumps(chunk['error'])[:300]}")
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            result.prompt_tokens = usage.get("prompt_tokens", result.prompt_tokens)
            result.completion_tokens = usage.get("completion_tokens", result.completion_tokens)
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                result.cached_tokens = details["cached_tokens"]
        if chunk.get("choices"):
            if result.first_token_at is None:
                result.first_token_at = arrived
            if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                result.points.append((arrived, usage["completion_tokens"]))

    @staticmethod
    def _check(result: StreamResult, max_tokens: int, what: str) -> None:
        if result.prompt_tokens is None or result.completion_tokens is None:
            raise CalibrationError(f"{what}: the stream reported no usage (prompt_tokens, completion_tokens); "
                                   "calibration needs stream_options.include_usage")
        if not isinstance(result.prompt_tokens, int) or result.prompt_tokens < 1:
            raise CalibrationError(f"{what}: the worker reported {result.prompt_tokens!r} prompt tokens")
        if result.first_token_at is None:
            raise CalibrationError(f"{what}: the stream carried no token")
        if result.completion_tokens < max_tokens:
            raise CalibrationError(f"{what}: asked for {max_tokens} tokens (ignore_eos), got "
                                   f"{result.completion_tokens}")
        counts = [n for _, n in result.points]
        if any(b < a for a, b in itertools.pairwise(counts)):
            raise CalibrationError(f"{what}: the token counts the stream reported went backwards: {counts[:20]}")
        if max_tokens > 1 and len(result.points) < 2:
            raise CalibrationError(f"{what}: the stream reported no running token counts "
                                   "(stream_options.continuous_usage_stats)")
