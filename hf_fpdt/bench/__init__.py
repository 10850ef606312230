"""Benchmarks: ``python -m hf_fpdt.bench {speed,memory} ...`` print tables (targets live here, not in tests)."""
