"""Test tooling of the SDK and the cache server, kept out of the shipped modules.

``server``: the real cache server as a subprocess on 127.0.0.1 (``spawn_server``, readiness,
clean stop); ``fuzz``: hostile wire messages for the server; ``toy``: a deterministic in-process
engine without a model, whose every cached row can be checked exactly.
"""
