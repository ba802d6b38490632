"""kvdrop_engine: the reference engine, a client of the kvdrop cache server.

Read it bottom to top, like gpt-fast: ``model`` (the decoder, torch only), ``weights`` and
``loading`` (checkpoints -> model), ``tokenizer``, ``paged`` (block-budgeted KV cache and its
attention backend), ``sampling``, ``scheduler``, ``runner`` and ``engine`` (continuous
batching), ``connectors`` (the links to a cache server through ``kvdrop_sdk``), ``completions``
and ``http`` (the OpenAI-compatible server) and ``cli`` (``kvdrop engine``).
"""
