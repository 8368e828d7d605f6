"""(d) The publisher epoch: a nonce per engine start on every KV-event message.

vLLM's ``ZmqEventPublisher`` numbers its batches from 0 in each engine process, so a subscriber
can tell a restart only when the new stream's seq is lower than what it expected; a restart
whose first message to arrive is already past that point looks like the old stream going on
(with a gap that replay then "repairs" from the wrong engine). The plugin gives each publisher a
random 16-byte epoch, drawn once when the publisher is built (one per engine start and
data-parallel rank), and sends it as a fourth frame: ``[topic, seq, payload, epoch]``.
Sluice's subscriber (``controller/kv_wire.py``, ``publisher_epoch``) resets a worker's index
when the epoch changes. ZMQ SUB consumers that read the first three frames are unaffected;
one that insists on exactly three frames can turn the stamp off with ``SLUICE_PUBLISHER_EPOCH=off``.

How: the publisher thread sends through ``self._pub.send_multipart`` and looks ``self._pub`` up
on every send, so after vLLM's ``__init__`` the socket is wrapped in a proxy that appends the
epoch to three-frame messages and forwards everything else (``close``, options) unchanged.
Replies on the replay socket are left as vLLM sends them: a replay serves the same publisher
whose live stream revealed the gap, and a restart is seen on the live stream first.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from vllm.distributed.kv_events import ZmqEventPublisher

ENV_SWITCH = "SLUICE_PUBLISHER_EPOCH"
EPOCH_BYTES = 16
_ATTR = "_sluice_epoch"
_originals: dict[str, Any] = {}


class EpochStampedSocket:
    """A PUB socket whose three-frame messages get the epoch as a fourth frame."""

    __slots__ = ("_socket", "epoch")

    def __init__(self, socket: Any, epoch: bytes) -> None:
        self._socket = socket
        self.epoch = epoch

    def send_multipart(self, frames, *args, **kwargs):
        frames = tuple(frames)
        if len(frames) == 3:
            frames = (*frames, self.epoch)
        return self._socket.send_multipart(frames, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._socket, name)


def epoch_of(publisher: Any) -> bytes | None:
    """The epoch a patched publisher stamps (None when it stamps none)."""
    return getattr(publisher, _ATTR, None)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "").strip().lower() not in ("off", "0", "false", "no")


def _wrap_init(orig):
    @functools.wraps(orig)
    def __init__(self, *args, **kwargs):
        orig(self, *args, **kwargs)
        if not enabled() or self._pub is None:
            return
        epoch = os.urandom(EPOCH_BYTES)
        setattr(self, _ATTR, epoch)
        self._pub = EpochStampedSocket(self._pub, epoch)
    return __init__


def apply() -> None:
    """Patch ``ZmqEventPublisher`` (idempotent)."""
    if _originals:
        return
    orig = ZmqEventPublisher.__dict__["__init__"]
    _originals["__init__"] = orig
    ZmqEventPublisher.__init__ = _wrap_init(orig)


def remove() -> None:
    """Undo :func:`apply` (tests)."""
    for name, orig in _originals.items():
        setattr(ZmqEventPublisher, name, orig)
    _originals.clear()
