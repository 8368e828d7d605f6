"""The load: the agents' calls, made by the demo's agent client, and the ledger of where
each one ended (success, a clear error, an unclear answer, or lost)."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from entry.agent_client import _ROUTES, AgentClient


@dataclass(slots=True)
class CallLedger:
    """Where every call the sessions made ended."""

    started: float
    sent: int = 0
    succeeded: int = 0
    # "STATUS error-type" -> count: answers with an error status and a JSON error body
    errors: Counter[str] = field(default_factory=Counter)
    # answers without a readable error body (an error status with anything else, or a 200
    # that is not the API's answer): not clear to a client
    unclear: Counter[str] = field(default_factory=Counter)
    # calls without an answer, by why
    lost: Counter[str] = field(default_factory=Counter)
    # (seconds into the run, outcome) of every call that did not succeed
    failures: list[tuple[float, str]] = field(default_factory=list)
    samples: list[str] = field(default_factory=list)

    def fail(self, bucket: Counter[str], key: str, detail: str) -> None:
        bucket[key] += 1
        self.failures.append((round(time.monotonic() - self.started, 2), key))
        if len(self.samples) < 20:
            self.samples.append(f"t={time.monotonic() - self.started:.1f}s {key}: {detail[:300]}")


def error_kind(response: httpx.Response) -> str | None:
    """``"STATUS type"`` when the answer carries an error body in the OpenAI shape
    (``{"error": {"type", "message"}}``) or Anthropic's (``{"type": "error", "error": {...}}``);
    None when it does not."""
    try:
        body = response.json()
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return None
    kind = error.get("code") if isinstance(error.get("code"), str) else error.get("type")
    return f"{response.status_code} {kind}"


class SoakAgentClient(AgentClient):
    """The demo's agent client with each call's outcome in a :class:`CallLedger`; once the
    soak's time is up a session stops at its next turn boundary instead of being cut."""

    def __init__(self, *args: Any, ledger: CallLedger, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ledger = ledger

    async def _call(self, http: httpx.AsyncClient, api: str, session: str,
                    messages: list[dict[str, str]], max_tokens: int, final: bool) -> str | None:
        if time.monotonic() >= self._deadline:
            return None
        ledger = self.ledger
        headers = {"x-session-id": session}
        if final:
            headers["x-dynamo-session-final"] = "true"
        ledger.sent += 1
        sent = time.monotonic()
        try:
            response = await http.post(_ROUTES[api], json=self._body(api, messages, max_tokens),
                                       headers=headers)
        except httpx.TimeoutException as err:
            ledger.fail(ledger.lost, f"no answer within the timeout ({type(err).__name__})",
                        f"{session} ({api})")
            return None
        except httpx.HTTPError as err:
            ledger.fail(ledger.lost, f"connection ended without an answer ({type(err).__name__})",
                        f"{session} ({api}): {err}")
            return None
        if response.status_code != 200:
            kind = error_kind(response)
            if kind is None:
                ledger.fail(ledger.unclear, f"{response.status_code} without a JSON error body",
                            f"{session} ({api}): {response.text[:200]}")
            else:
                ledger.fail(ledger.errors, kind, f"{session} ({api}): {response.text[:200]}")
            return None
        try:
            reply, prompt, cached, output = self._read(api, response.json())
        except (ValueError, KeyError, IndexError, TypeError) as err:
            ledger.fail(ledger.unclear, "200 with an unreadable answer",
                        f"{session} ({api}): {type(err).__name__}: {err}")
            return None
        ledger.succeeded += 1
        self._answered(api, sent, prompt, cached, output)
        return reply
