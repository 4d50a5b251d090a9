"""The benchmark the recipe proposed: speed by context, speculation statistics, KV compression,
rejection hotspots by token class, latency under load and a compressed-KV quality guard.

`runner` measures, `stats` turns counters into the figures, `report` writes JSON, Markdown and
PNG, `tune` sweeps speculation settings. See docs/benchmarks.md for what each figure means.
"""
