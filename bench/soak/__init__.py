"""``python -m bench.soak`` (``make soak``): the gateway under hours of agent load and faults.

Real processes on loopback: ``--workers`` simworkers and one gateway (``sluice serve``) in
front of them; ``--sessions`` closed-loop agent sessions (entry/agent_client.py's SWE-bench
style programs, speaking chat, Messages and Responses in turn) alternate calls and tool
pauses for ``--duration-s``. Every ``--fault-every-s`` the next fault of a cycle is injected:

- ``worker_kill``: SIGKILL a worker, start it again after a while;
- ``worker_hang``: SIGSTOP a worker for longer than the gateway takes to mark it down, then
  SIGCONT it;
- ``worker_restart``: SIGTERM a worker and start it again at once;
- ``gateway_reload``: change the policy section of the config file and send SIGHUP;
- ``bad_input``: a burst of oversized and over-many headers, malformed and oversized bodies,
  and slow clients (silent, partial headers, partial body).

Every call a session makes is accounted for: it succeeds, or the client gets a clear error
(an HTTP error status with a JSON error body). A call is *lost* when it gets no answer: a
connection reset or close without an error, or no answer within ``--call-timeout-s``. The
gateway's RSS is sampled every 10 s. At the end every session stops at its next turn
boundary, the gateway must show nothing held or in flight, and then it is drained
(SIGTERM) and must exit cleanly. ``summary.json``, ``summary.md`` and ``rss.csv`` go to
``--out``; a line of progress is printed every minute.
"""
