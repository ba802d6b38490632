"""Experiments on top of the policies: the ``kvdrop demo`` command, the baseline-vs-dropped
pipeline it and the benchmarks share, and peak-memory measurement.

These modules use the SDK, the server and the reference engine; the policy modules never import
them.
"""
