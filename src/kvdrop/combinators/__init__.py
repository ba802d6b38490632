"""Combinators: policies built from other, already built policies (like kvpress's
``ComposedPress``), and the RoPE re-rotation wrapper."""
