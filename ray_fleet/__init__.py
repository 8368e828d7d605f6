"""Sluice on Ray: the gateway and simulated engines as Ray actors, and a GRPO-style rollout
driver whose agent programs are Ray tasks (``python -m ray_fleet.rollout``).

Needs the ``ray`` extra (``pip install -e '.[ray]'``); nothing else of Sluice imports this
package. docs/architecture.md ("Scaling out on Ray") says what runs where and what a dead
node costs.
"""
