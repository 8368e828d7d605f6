"""The simworker: a live, vLLM-like worker process around the simulator's engine model.

It serves vLLM's HTTP APIs, publishes KV events and takes retention directives like a real
engine with the Sluice plugin, so the gateway, the demo and the integration tests run without
a GPU. It imports the engine model from ``sim`` (engine, block pool, tokens, step time); the
offline simulator never imports it.
"""
