"""Stage timelines of a request's path through a worker: a time.monotonic() mark at the end of each stage,
observed as the time between consecutive marks in a histogram labelled by stage (the decode and prefill
workers' handover stages)."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Histogram

# seconds: from 0.1 ms, since most stages of an idle handover are well under a millisecond, to the transfer
# deadline
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                 2.5, 5, 10, 30)


def observe_stages(histogram: Histogram, stages: Sequence[str], marks: Sequence[float]) -> None:
    """Stage i took marks[i + 1] - marks[i] (one more mark than stages)."""
    for stage, start, end in zip(stages, marks[:-1], marks[1:], strict=True):
        histogram.labels(stage).observe(end - start)
