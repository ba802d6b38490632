"""Test and measurement tooling of kvdrop (e.g. ``profiling.PeakRSS``), kept out of the policies."""
