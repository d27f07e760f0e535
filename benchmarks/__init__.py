"""Benchmarks: speed and acceptance reports (JSON + markdown)."""
