"""Engines the SDK talks to, as ``PostCompletion`` callables for request streams.

``openai``: any OpenAI-compatible completions server (vLLM, ``kvdrop engine``) over HTTP;
the deterministic toy engine of the tests lives in :mod:`kvdrop_sdk.testing.toy`.
"""
