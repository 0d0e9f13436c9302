"""Benchmarks run on demand: ``python -m benchmarks`` lists them; see docs/benchmarks.md."""
