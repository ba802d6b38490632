"""kvdrop: pluggable KV-cache token-dropping policies."""
