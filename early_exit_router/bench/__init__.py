"""Benchmarks: the side-by-side bench, the batch bench, quality metrics, compute and memory accounting, traces."""
