"""Benchmark harness: `blockspec bench` and its Python API.

    from blockspec.bench import BenchConfig, run_bench, write_outputs
    result = run_bench(BenchConfig(random_weights=True, arch="tiny", batch_sizes=(1, 2)))
    write_outputs(result, "bench-results")   # bench.json, bench.md, PNG plots
"""

from blockspec.bench.harness import BenchConfig, add_bench_parser, run_bench
from blockspec.bench.report import markdown, write_outputs

__all__ = ["BenchConfig", "add_bench_parser", "markdown", "run_bench", "write_outputs"]
