"""pdserve benchmarks: each module is a command (`python -m benchmarks.<name>`) that prints a table and
writes JSON to `benchmarks/results/<name>.json`; see docs/BENCHMARKING.md for the methodology."""
