"""The one reader of Prometheus text, llama-server's `/metrics` page.

Parsed by prometheus_client's own parser, for the front's re-export of the child's metrics
(`mtpwrap.front.metrics`), the supervisor's readings of its child
(`mtpwrap.supervision.child`) and the benchmarks' counters (`mtpwrap.bench.stats`).

The page is parsed in full when `families` is called — prometheus_client's parser is lazy, so
without this an error would surface halfway through a caller's loop, after some samples were
taken. Text that is not the exposition format raises ValueError (an HTML error page, a line
without a number); an empty page is no families. What each caller keeps of the samples (which
names, which labels) is the caller's: this module only reads.

prometheus_client is imported inside the functions: `mtpwrap --help` does not pay for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric
    from prometheus_client.samples import Sample


def families(text: str) -> list[Metric]:
    """Prometheus text → its metric families, in page order; ValueError when it is not one."""
    from prometheus_client.parser import text_string_to_metric_families

    return list(text_string_to_metric_families(text))


def samples(text: str) -> list[Sample]:
    """Every sample of every family of `families(text)`, in page order."""
    return [s for fam in families(text) for s in fam.samples]
