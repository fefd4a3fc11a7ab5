"""`python -m dcpjax.bench`: serving benchmarks (serve, compare)."""
