"""What a CurveZMQ test watches for on a socket monitor: the handshake failing, in any of the
ways libzmq reports it."""

from __future__ import annotations

import zmq

HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
