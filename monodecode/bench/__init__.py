"""Benchmarks against a running server; `serve` is the load generator behind `monodecode bench serve`."""
