"""The suite's order for two processes (`make test` runs pytest-xdist, a module at a time to each): the longest
modules first, so that the last to finish are short ones and neither process idles long at the end (longest
processing time first). Each module's seconds come from `tests/durations.json`, as measured by the last
`make test-durations`; a module missing there counts as UNKNOWN_SECONDS. The order of tests inside a module is
kept."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

DURATIONS = Path(__file__).resolve().parents[1] / "durations.json"
UNKNOWN_SECONDS = 20.0  # a new module: about a cluster's start and a few requests


def _module(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _recorded() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--record-durations", action="store_true",
                     help=f"write the seconds (setup, call, teardown) of each module run to {DURATIONS}")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    seconds = _recorded()
    first_seen = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_module(item.nodeid), i)
    items.sort(key=lambda item: (-seconds.get(_module(item.nodeid), UNKNOWN_SECONDS), first_seen[_module(item.nodeid)]))


class _Recorder:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.seconds[_module(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(session.config, "workerinput"):  # an xdist worker: its controller sees every report
            return
        seconds = _recorded()
        seconds.update({m: round(s, 1) for m, s in self.seconds.items()})  # the modules run; the others as they were
        DURATIONS.write_text(json.dumps(dict(sorted(seconds.items())), indent=0) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--record-durations"):
        config.pluginmanager.register(_Recorder(), "record-durations")
