"""Engines the SDK talks to, as ``PostCompletion`` callables for request streams.

``openai``: any OpenAI-compatible completions server (vLLM, ``kvdrop engine``) over HTTP;
``toy``: a deterministic in-process engine whose cached rows can be checked exactly (tests, docs).
"""
