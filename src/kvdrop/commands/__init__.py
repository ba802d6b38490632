"""The ``kvdrop`` subcommands, one module each (``add_arguments(parser)`` and ``run(args)``):
``list_cmd``, ``describe_cmd``, ``demo_cmd``, ``eval_cmd``, ``server_cmd`` and ``engine_cmd``.

Heavy imports (torch, zmq) stay inside ``run`` so ``--help`` is fast. The server's and the
engine's argument tables live beside them (:mod:`kvdrop_sdk.server.cli`,
:mod:`kvdrop_engine.cli`): the SDK must not import ``kvdrop``, and ``python -m kvdrop_sdk.server``
works without it.
"""
