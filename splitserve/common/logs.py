"""Structured logging: one JSON object per line on stderr, and a relay that turns a child program's plain-text
lines (a vLLM server's) into the same JSON lines."""

from __future__ import annotations

import collections
import json
import logging
import os
import re
import sys
import threading
import time
from typing import IO


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(time.time(), 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(level: str | None = None) -> None:
    level = (level or os.environ.get("SPLITSERVE_LOG_LEVEL", "info")).upper()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("transformers", "httpx", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


# vLLM's own line format: `INFO 11-28 12:00:01 [api_server.py:1234] message`, behind a process tag in its
# engine-core and API-server children: `(EngineCore_DP0 pid=123) WARNING 11-28 ...`.
_CHILD_LINE = re.compile(r"^(?:\((?P<proc>[^)]*)\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
                         r"\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[(?P<where>[^\]]*)\] (?P<msg>.*)$")


def relay_line(logger: logging.Logger, line: str, default: int) -> None:
    """One line of a child's output as a record of `logger`: at the level the line names (its logging prefix,
    which is dropped) or else at `default`."""
    line = line.rstrip("\r\n")
    if not line.strip():
        return
    m = _CHILD_LINE.match(line)
    if m is None:
        logger.log(default, line)
        return
    fields = {"where": m["where"], **({"process": m["proc"]} if m["proc"] else {})}
    logger.log(logging.getLevelName(m["level"]), m["msg"], extra={"fields": fields})


def relay_lines(stream: IO[str], logger: logging.Logger, default: int,
                tail: collections.deque[str] | None = None) -> threading.Thread:
    """A daemon thread that relays every line of `stream` (a child's stdout or stderr pipe) until it closes; each
    line is also kept in `tail` when given (a bounded deque: the child's last words)."""
    def pump() -> None:
        with stream:
            for line in stream:
                relay_line(logger, line, default)
                if tail is not None:
                    tail.append(line.rstrip("\n"))

    thread = threading.Thread(target=pump, name=f"relay-{logger.name}", daemon=True)
    thread.start()
    return thread
