"""What relaying a call asks of the gateway's shared state: the policy, and the tables every
call of a program must see whichever process relays it (:class:`PolicyLink`).

The relay path (controller/endpoints.py ``CallEndpoint``, controller/relay.py ``ProxyCall``)
reaches the policy, the conversations of calls without identity, the Responses ids, the
client keys' sessions and the model catalog only through a link, so the same code relays a
call in the gateway's one process (:class:`LocalPolicyLink`: plain method calls) and in a
relay process of ``sluice serve --relays N`` (controller/relay_link.py ``RemotePolicyLink``:
the same methods over a Unix socket to the policy process, which serves them with a
:class:`LocalPolicyLink` of its own, controller/policy_service.py). Every method takes and
returns plain data (client keys by name), so both sides agree on what crosses.

Every change a call makes to shared state is awaited before the call's last byte goes to
its client (completion, an answer to continue from, a Responses id), so a program's next
call — on whichever relay — finds it (controller/relay.py states and keeps this).
"""

from __future__ import annotations

from typing import Protocol

from controller.admission import Admitted
from controller.client_keys import ClientKey, ClientKeys
from controller.parts import Parts
from controller.conversations import AnswerKey
from scheduler.calls import CallRequest, Usage
from scheduler.coordinates import ContinuationId, SessionId


class PolicyLink(Protocol):
    """The shared state a relayed call reads and changes (module docstring)."""

    def worker_count(self) -> int:
        """How many workers the fleet has (a call is placed again at most once per worker)."""
        ...

    async def admit(self, call: CallRequest) -> Admitted | None:
        """:meth:`controller.admission.Admission.arrive`, or None when no worker can take
        calls now (every one fails its health checks)."""
        ...

    async def complete(self, request_id: str, usage: Usage) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def worker_unreachable(self, worker: str, problem: str) -> None:
        """A worker refused the connection: out of the fleet's rotation at once."""
        ...

    async def model_served(self, model: str) -> bool: ...

    async def lookup_response(self, response_id: str) -> SessionId | None:
        """The session whose call answered with ``response_id`` (Responses API)."""
        ...

    async def remember_response(self, response_id: str, session_id: SessionId) -> None: ...

    async def continue_conversation(self, group: SessionId, continues: AnswerKey | None,
                                    head: ContinuationId, client: str | None,
                                    fresh_head: ContinuationId) -> SessionId:
        """The program a call without identity continues, counted in flight
        (controller/conversations.py ``assign``); with client keys, never another key's
        (then a new program of the call's group, found by ``fresh_head``)."""
        ...

    async def conversation_ended(self, session_id: SessionId, head: ContinuationId,
                                 answered: bool, fingerprint: str | None) -> None:
        """``Conversations.answered`` (with the answer's fingerprint, None when unreadable)
        when ``answered``, else ``Conversations.failed``."""
        ...

    async def claim(self, client: str, session_id: SessionId,
                    parent_id: SessionId | None) -> None:
        """:meth:`controller.client_keys.ClientKeys.claim` (a 403 GatewayError)."""
        ...

    async def call_ended(self, client: str, session_id: SessionId) -> None: ...


class LocalPolicyLink:
    """The link inside the process that holds the policy: each method is the parts' own."""

    def __init__(self, parts: Parts, client_keys: ClientKeys | None) -> None:
        self._parts = parts
        self._client_keys = client_keys
        self._keys_by_name: dict[str, ClientKey] = (
            {} if client_keys is None else {key.name: key for key in client_keys.keys})

    def worker_count(self) -> int:
        return len(self._parts.workers.states)

    async def admit(self, call: CallRequest) -> Admitted | None:
        if not self._parts.workers.can_take_calls():
            return None
        return await self._parts.admission.arrive(call)

    async def complete(self, request_id: str, usage: Usage) -> None:
        await self._parts.admission.complete(request_id, usage)

    async def abort(self, request_id: str) -> None:
        await self._parts.admission.abort(request_id)

    async def worker_unreachable(self, worker: str, problem: str) -> None:
        await self._parts.workers.mark_unreachable(worker, problem)

    async def model_served(self, model: str) -> bool:
        return await self._parts.models.is_served(model)

    async def lookup_response(self, response_id: str) -> SessionId | None:
        found = self._parts.responses.get(response_id)
        return None if found is None else SessionId(found)

    async def remember_response(self, response_id: str, session_id: SessionId) -> None:
        self._parts.responses.put(response_id, session_id)

    async def continue_conversation(self, group: SessionId, continues: AnswerKey | None,
                                    head: ContinuationId, client: str | None,
                                    fresh_head: ContinuationId) -> SessionId:
        conversations = self._parts.conversations
        if client is not None and self._owned_by_another(client,
                                                         conversations.find(continues, head)):
            # Two keys sent the same conversation, answer and all. A lookup by a head that
            # matches nothing (the call's own request serial) mints a new program of the
            # group and finds none; the call's end is still reported under its real head.
            return conversations.assign(group, None, fresh_head)
        return conversations.assign(group, continues, head)

    async def conversation_ended(self, session_id: SessionId, head: ContinuationId,
                                 answered: bool, fingerprint: str | None) -> None:
        if answered:
            self._parts.conversations.answered_as(session_id, head, fingerprint)
        else:
            self._parts.conversations.failed(session_id, head)

    async def claim(self, client: str, session_id: SessionId,
                    parent_id: SessionId | None) -> None:
        assert self._client_keys is not None
        self._client_keys.claim(self._keys_by_name[client], session_id, parent_id,
                                self._parts.admission.policy.has_program)

    async def call_ended(self, client: str, session_id: SessionId) -> None:
        assert self._client_keys is not None
        self._client_keys.call_ended(self._keys_by_name[client], session_id)

    def owned_by_another(self, client: ClientKey, session_id: str | None) -> bool:
        """Whether ``session_id`` is a program another key than ``client`` owns."""
        return self._owned_by_another(client.name, session_id)

    def _owned_by_another(self, client: str, session_id: str | None) -> bool:
        if session_id is None or self._client_keys is None:
            return False
        owner = self._client_keys.owner(session_id)
        return owner is not None and owner.name != client
