"""pdserve benchmarks, installed with the package: the `pdserve bench`, `pdserve roofline` and `pdserve study`
commands (`*_command.py` and the modules they use), and one script per measured claim
(`python -m benchmarks.<name>`, which prints a table and writes JSON to `benchmarks/results/<name>.json`);
see docs/benchmarks.md for the commands and their latest figures, ../shared/docs/BENCHMARKING.md for the method."""
