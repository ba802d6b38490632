"""The engine's counters: what the KV budget allowed, and what the cache server cost."""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["EngineStats"]


@dataclass
class EngineStats:
    """Counters since construction (or ``reset_stats``); they show what the KV budget allowed."""

    requests_admitted: int = 0
    requests_finished: int = 0
    steps: int = 0
    prefill_tokens_computed: int = 0
    decode_tokens_computed: int = 0
    tokens_loaded: int = 0
    kv_tokens_stored: int = 0
    query_tokens_stored: int = 0
    query_rows_stored: int = 0
    query_bytes_stored: int = 0
    peak_running: int = 0
    peak_blocks_used: int = 0
    peak_waiting: int = 0
    #: Running requests whose blocks were taken back (the budget ran out) to be recomputed, and
    #: the tokens they had computed (computed again, counted in ``prefill_tokens_computed``).
    preemptions: int = 0
    recomputed_tokens: int = 0
    #: Preempted requests that were cut while decoding: swapped to host memory and back
    #: (never recomputed; :class:`~kvdrop_engine.decode_cut.KVSwap`).
    swaps: int = 0
    #: Steps that only decoded (no prompt chunk), their wall time on the loop thread (plan, launch,
    #: wait for the tokens; capturing a new CUDA graph is counted apart, in
    #: ``graph_capture_seconds``) and the cached tokens their attention read.
    #: ``prefix_load_seconds``: time spent loading cached prefixes (asking the server and copying
    #: into the blocks), summed over requests; it runs on connector threads, not the loop.
    decode_only_steps: int = 0
    #: KVzip's reconstruction pass (requests with ``reconstruct``): prompts scored, their tokens,
    #: the pass's wall time on the loop thread, and the score bytes stored.
    reconstructions: int = 0
    reconstruction_tokens: int = 0
    reconstruction_seconds: float = 0.0
    scores_bytes_stored: int = 0
    decode_step_seconds: float = 0.0
    decode_kv_tokens: int = 0
    graph_capture_seconds: float = 0.0
    prefix_load_seconds: float = 0.0
    #: Of ``prefix_load_seconds``, copying loaded prefixes into the blocks (the rest: asking the
    #: server and the transfer); and the wall time during which at least one load ran (loads
    #: overlap: the link's rate is the bytes loaded over this, one load's over the sum).
    prefix_copy_seconds: float = 0.0
    prefix_load_busy_seconds: float = 0.0
    #: Prompts cut after prefill (``--policy`` or a request's ``"kvdrop"``), their tokens kept
    #: and dropped, and the cuts' wall time on the loop thread (:mod:`kvdrop_engine.drop`).
    prompt_cuts: int = 0
    prompt_tokens_kept: int = 0
    prompt_tokens_dropped: int = 0
    cut_seconds: float = 0.0
    #: Cuts while decoding (``--decode-policy``; one per request cut), the tokens they dropped,
    #: their wall time on the loop thread (:mod:`kvdrop_engine.decode_cut`), and the most KV
    #: tokens one decoding request held in a step.
    decode_cuts: int = 0
    decode_tokens_dropped: int = 0
    decode_cut_seconds: float = 0.0
    peak_decode_kv_tokens: int = 0
    #: Where the loop thread's time goes (with ``decode_step_seconds`` and
    #: ``graph_capture_seconds``): steps that computed prompt tokens, starting and applying prefix
    #: loads, handing results over (stores started, events; ``window_seconds``, every second of
    #: which lies inside ``ship_seconds``, finalising query windows; ``reconstruction_seconds``
    #: kvzip's pass) and waiting for work (loads in flight included).
    prefill_step_seconds: float = 0.0
    load_apply_seconds: float = 0.0
    ship_seconds: float = 0.0
    window_seconds: float = 0.0
    idle_seconds: float = 0.0
    #: Store-thread time (summed over the stores, which run several at once): the prompts' KV
    #: stores (with their query chunks in full mode), the query windows' and kvzip's scores'.
    kv_store_seconds: float = 0.0
    window_store_seconds: float = 0.0
    scores_store_seconds: float = 0.0
    connector_fallbacks: int = 0  # loads that failed, timed out or were skipped: recomputed
    store_failures: int = 0  # stores that failed, timed out or were skipped
    #: The wall time these counters cover (since construction or ``reset_stats``), as of the
    #: snapshot: the loop thread's parts above add up to at most this.
    seconds: float = 0.0

    @property
    def tokens_computed(self) -> int:
        """Tokens the model ran (prefill + decode), i.e. not loaded from the server."""
        return self.prefill_tokens_computed + self.decode_tokens_computed

    def to_dict(self) -> dict[str, float]:
        """Plain dict (JSON-serialisable), including ``tokens_computed``."""
        return {**asdict(self), "tokens_computed": self.tokens_computed}
