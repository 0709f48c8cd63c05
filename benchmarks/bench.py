"""Benchmark suite entry point: ``python benchmarks/bench.py [--size-mb 300] [--json]``.

The suite itself lives in ``reshard._bench`` so that ``reshard bench`` runs the same
code; see that module's docstring for what is measured and how.
"""

from reshard._bench import main

if __name__ == "__main__":
    raise SystemExit(main())
