"""Client API keys: who may call the gateway, each key's own bounds, and which key owns
which session.

Optional (``clients:`` in the serve config). Without keys nothing here runs and any client
may use any session, as before. With keys:

- **Every client call carries a key**: ``Authorization: Bearer <key>`` (OpenAI SDKs, and
  Claude Code with ``ANTHROPIC_AUTH_TOKEN``) or ``x-api-key: <key>`` (Anthropic SDKs, Claude
  Code with ``ANTHROPIC_API_KEY``), either one on any route; when both are sent they must
  name the same key. Else 401 in the route's error shape. A presented key is hashed and the
  hash compared with every key's in constant time (:func:`hmac.compare_digest`, no early
  exit), so neither the answer's timing nor its length says how close a guess was. Keys are
  never logged, never repeated in an error, and never forwarded to a worker
  (:func:`without_credentials`): the gateway consumed them.
- **Each key has its own bounds** (``max_programs``, ``max_held_calls``) on top of the
  global ``limits:``; :class:`controller.admission.Admission` enforces them (429).
- **A session belongs to the key whose call made it.** Another key's call on it (naming it,
  or naming it as a parent, or ending it with ``x-dynamo-session-final``) is refused with 403:
  a key cannot join, end or release another key's program. A session is owned while its
  program lives in the policy or a call of its owner is on the way to it; after that the id
  is free again. Sessions the gateway names from content (calls without identity) are named
  per key (:func:`controller.identity.resolve_identity`'s ``tenant``), so two keys that send
  the same opening get programs of their own.

The key file (``clients.keys_file``) and the variable (``clients.keys_env``) hold one YAML
mapping (JSON is YAML too) of key names to keys, a name to either the key itself or an
object with the key and its own bounds::

    alice: sk-alice-7Rq2v9xY3mLw8KpT          # the key alone: the clients: defaults apply
    batch:
      key: sk-batch-Hn4Jc6Pz1sVb5QeW
      max_programs: 50                       # programs it owns at once (null: no own bound)
      max_held_calls: 10                     # calls of it held at once (null: no own bound)

Names are 1–64 printable ASCII characters without spaces (they appear in logs and errors;
keys never do). Keys are 16–512 printable ASCII characters without spaces (they travel in a
header), and no key may be given twice.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from controller.errors import AUTHENTICATION, INVALID_API_KEY, PERMISSION, GatewayError
from controller.serve_config import ClientsConfig, ServeConfig
from scheduler.config import ConfigError

API_KEY_HEADER = "x-api-key"
AUTHORIZATION_HEADER = "authorization"
_CREDENTIAL_HEADERS = frozenset({API_KEY_HEADER.encode(), AUTHORIZATION_HEADER.encode()})
KEY_MIN_CHARS = 16
KEY_MAX_CHARS = 512
NAME_MAX_CHARS = 64
# Ownerships no longer in use are swept when the table has grown this much since the last
# sweep (and at this size at least), so that sweeping costs O(1) per claim on average.
SWEEP_MIN_ENTRIES = 1024

IsProgram = Callable[[str], bool]  # whether the policy tracks a program of this session id


def _printable(value: str) -> bool:
    return all("!" <= ch <= "~" for ch in value)


class _KeyEntry(BaseModel):
    """One key of the file, in its long form."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: Annotated[str, Field(min_length=KEY_MIN_CHARS, max_length=KEY_MAX_CHARS)]
    max_programs: Annotated[int, Field(ge=1)] | None = None
    max_held_calls: Annotated[int, Field(ge=1)] | None = None

    @field_validator("key")
    @classmethod
    def _header_safe(cls, value: str) -> str:
        if not _printable(value):
            # the value is not repeated: the message ends up in logs
            raise ValueError("must be printable ASCII without spaces")
        return value


@dataclass(frozen=True, slots=True)
class ClientKey:
    """One client key: its name and bounds, and the SHA-256 of its secret (the secret itself
    is not kept)."""

    name: str
    digest: bytes = field(repr=False)
    max_programs: int | None = None
    max_held_calls: int | None = None


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()


# -- reading the keys -----------------------------------------------------------------------


def parse_client_keys(text: str, source: str, defaults: ClientsConfig) -> list[ClientKey]:
    """The keys of one key file's ``text``; ``source`` names it in errors (each error names
    the key's name and field too, never the key). A key without bounds of its own takes
    ``defaults``' (an explicit ``null`` means none of its own)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        # PyYAML's own message quotes the offending line, which may hold a key: only the
        # position and the problem are reported.
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(err, "problem", None) or "a syntax error"
        raise ConfigError(f"{source}: not valid YAML{where}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{source}: not valid YAML: nested too deeply to parse") from None
    if not isinstance(data, dict) or not data:
        raise ConfigError(f"{source}: must be a mapping of key names to keys, with one key "
                          "at least")
    keys: list[ClientKey] = []
    problems: list[str] = []
    for name, value in data.items():
        if not isinstance(name, str) or not 1 <= len(name) <= NAME_MAX_CHARS or not _printable(name):
            problems.append(f"{source}: key name {str(name)[:NAME_MAX_CHARS]!r} must be 1 to "
                            f"{NAME_MAX_CHARS} printable ASCII characters without spaces")
            continue
        try:
            entry = _KeyEntry.model_validate({"key": value} if isinstance(value, str) else value)
        except ValidationError as err:
            for item in err.errors():
                loc = ".".join(str(part) for part in (name, *item["loc"]))
                problems.append(f"{source}: {loc}: {item['msg'].removeprefix('Value error, ')}")
            continue
        own = entry.model_fields_set
        keys.append(ClientKey(
            name=name,
            digest=_digest(entry.key.encode("ascii")),
            max_programs=entry.max_programs if "max_programs" in own else defaults.max_programs,
            max_held_calls=(entry.max_held_calls if "max_held_calls" in own
                            else defaults.max_held_calls),
        ))
    if problems:
        raise ConfigError("\n".join(problems))
    return keys


def load_client_keys(config: ServeConfig, environ: Mapping[str, str] | None = None
                     ) -> ClientKeys | None:
    """The gateway's client keys, from ``clients.keys_file`` and ``clients.keys_env``; None
    when neither is set (clients need no key). A ConfigError that names the setting when a
    source is missing, unreadable or invalid: a gateway told to require keys does not start
    open because its keys could not be read."""
    clients = config.clients
    env = os.environ if environ is None else environ
    keys: list[ClientKey] = []
    if clients.keys_file is not None:
        path = clients.keys_file
        if not path.is_absolute() and config.path is not None:
            path = config.path.parent / path
        source = f"clients.keys_file ({path})"
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
            raise ConfigError(f"{source}: cannot read the file ({reason})") from None
        keys += parse_client_keys(text, source, clients)
    if clients.keys_env is not None:
        source = f"clients.keys_env ({clients.keys_env})"
        text = env.get(clients.keys_env)
        if not text:
            raise ConfigError(f"{source}: the environment variable is not set or empty")
        keys += parse_client_keys(text, source, clients)
    if not keys:
        return None
    names: dict[str, ClientKey] = {}
    digests: dict[bytes, str] = {}
    for key in keys:
        if key.name in names:
            raise ConfigError(f"clients: the key name {key.name!r} is given twice")
        if key.digest in digests:
            raise ConfigError(f"clients: the keys named {digests[key.digest]!r} and "
                              f"{key.name!r} are the same key")
        names[key.name] = key
        digests[key.digest] = key.name
    return ClientKeys(keys)


def without_credentials(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """A request's raw headers without the client key headers (``Authorization``,
    ``x-api-key``): the gateway checked the key and a worker has no use for it."""
    return [(name, value) for name, value in raw if name.lower() not in _CREDENTIAL_HEADERS]


# -- authentication and ownership -----------------------------------------------------------


@dataclass(slots=True)
class _Ownership:
    key: ClientKey
    calls: int = 0  # the owner's calls on the session between their claim and their end


class ClientKeys:
    """The configured keys, and the sessions each owns. Runs on the event loop's thread
    only, without awaiting, so each method is one atomic step."""

    def __init__(self, keys: Iterable[ClientKey]) -> None:
        self.keys = tuple(keys)
        if not self.keys:
            raise ValueError("ClientKeys needs one key at least")
        self._owners: dict[str, _Ownership] = {}
        self._sessions_of: dict[str, set[str]] = {key.name: set() for key in self.keys}
        self._sweep_at = SWEEP_MIN_ENTRIES

    def __len__(self) -> int:
        return len(self.keys)

    # -- who is calling

    def authenticate(self, headers: Mapping[str, str]) -> ClientKey:
        """The key a call carries (``headers`` looked up by lower-case name); a 401
        :class:`GatewayError` when it carries none, a malformed one, one that is not a key
        here, or two that differ."""
        presented: list[tuple[str, str]] = []
        api_key = headers.get(API_KEY_HEADER)
        if api_key is not None:
            presented.append((API_KEY_HEADER, api_key.strip()))
        authorization = headers.get(AUTHORIZATION_HEADER)
        if authorization is not None:
            scheme, _, token = authorization.strip().partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise _unauthenticated("the Authorization header must be `Bearer <key>`")
            presented.append((AUTHORIZATION_HEADER, token.strip()))
        if not presented:
            raise _unauthenticated("this gateway needs a client key: send it as "
                                   "`Authorization: Bearer <key>` or `x-api-key: <key>`")
        found: ClientKey | None = None
        for header, secret in presented:
            key = self._match(secret)
            if key is None:
                raise _unauthenticated(f"the key in the {header} header is not a client key "
                                       "of this gateway")
            if found is not None and key is not found:
                raise _unauthenticated("the x-api-key and Authorization headers carry two "
                                       "different keys; send one")
            found = key
        assert found is not None
        return found

    def _match(self, secret: str) -> ClientKey | None:
        # Header values are latin-1 decoded (ASGI, Starlette): encoded back, they are the
        # bytes the client sent.
        digest = _digest(secret.encode("latin-1", "replace"))
        matched = None
        for key in self.keys:  # every key compared, whether one matched already or not
            if hmac.compare_digest(digest, key.digest):
                matched = key
        return matched

    # -- which key owns which session

    def owner(self, session_id: str) -> ClientKey | None:
        ownership = self._owners.get(session_id)
        return None if ownership is None else ownership.key

    def check(self, key: ClientKey, session_id: str, parent_id: str | None,
              is_program: IsProgram) -> None:
        """Refuse (403) a call of ``key`` on a session, or under a parent, that another key
        owns; claims nothing (a token count, which runs no program)."""
        if parent_id is not None and self._taken(key, parent_id, is_program):
            raise _not_owned(f"the parent session {parent_id} belongs to another client key")
        if self._taken(key, session_id, is_program):
            raise _not_owned(f"the session {session_id} belongs to another client key; a key "
                             "cannot join, end or release another key's session")

    def claim(self, key: ClientKey, session_id: str, parent_id: str | None,
              is_program: IsProgram) -> None:
        """A call of ``key`` on ``session_id`` is about to run: the session becomes
        ``key``'s if nobody owns it, and the call is counted until :meth:`call_ended`.
        A 403 :class:`GatewayError` when another key owns it or its parent."""
        self.check(key, session_id, parent_id, is_program)
        ownership = self._owners.get(session_id)
        if ownership is None or ownership.key is not key:
            if ownership is not None:  # vacant: the other key's program is gone
                self._sessions_of[ownership.key.name].discard(session_id)
            ownership = self._owners[session_id] = _Ownership(key)
            self._sessions_of[key.name].add(session_id)
            if len(self._owners) >= self._sweep_at:
                self._sweep(is_program)
        ownership.calls += 1

    def call_ended(self, key: ClientKey, session_id: str) -> None:
        """A call :meth:`claim` counted is over (answered, refused or failed)."""
        ownership = self._owners.get(session_id)
        if ownership is not None and ownership.key is key and ownership.calls > 0:
            ownership.calls -= 1

    def programs_of(self, key: ClientKey, is_program: IsProgram) -> int:
        """How many live programs ``key`` owns."""
        return sum(1 for session_id in self._sessions_of[key.name] if is_program(session_id))

    def calls_of(self, key: ClientKey) -> int:
        """How many of ``key``'s calls are between their claim and their end."""
        return sum(self._owners[session_id].calls for session_id in self._sessions_of[key.name])

    def _taken(self, key: ClientKey, session_id: str, is_program: IsProgram) -> bool:
        ownership = self._owners.get(session_id)
        return (ownership is not None and ownership.key is not key
                and not self._vacant(session_id, ownership, is_program))

    @staticmethod
    def _vacant(session_id: str, ownership: _Ownership, is_program: IsProgram) -> bool:
        """No call of its owner is on the way and the policy no longer tracks its program:
        the session has ended, and its id may start another key's program."""
        return ownership.calls == 0 and not is_program(session_id)

    def _sweep(self, is_program: IsProgram) -> None:
        for session_id, ownership in list(self._owners.items()):
            if self._vacant(session_id, ownership, is_program):
                del self._owners[session_id]
                self._sessions_of[ownership.key.name].discard(session_id)
        self._sweep_at = max(SWEEP_MIN_ENTRIES, 2 * len(self._owners))


def _unauthenticated(message: str) -> GatewayError:
    return GatewayError(401, message, AUTHENTICATION, code=INVALID_API_KEY)


def _not_owned(message: str) -> GatewayError:
    return GatewayError(403, message, PERMISSION)

