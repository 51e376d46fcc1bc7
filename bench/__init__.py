"""Benchmarks (bench/README.md), run as modules from the repository root, e.g.
`python -m bench.bench_sync` (the Makefile's `bench` targets do).
"""
