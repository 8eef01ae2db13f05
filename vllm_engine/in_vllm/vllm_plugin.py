"""A vLLM general plugin (entry point `vllm.general_plugins`), loaded inside vLLM's own processes where this
package is installed. It does one thing, and only when the worker that started the server asked for it
(`SPLITSERVE_NIXL_PROGRESS_DELAY_US` in the server's environment, set on CPU hosts): NIXL's progress thread,
which vLLM's NixlConnector starts with no pause between polls (a core per server, busy even when idle), sleeps
that many microseconds between polls. On a 2-core machine two idle servers otherwise take both cores.

It imports neither vLLM nor torch; it patches NIXL's agent configuration class before an agent is made.
"""

from __future__ import annotations

import os
import sys

ENV = "SPLITSERVE_NIXL_PROGRESS_DELAY_US"


def register() -> None:
    value = os.environ.get(ENV, "")
    if not value.isdigit() or int(value) <= 0:
        return
    try:
        import nixl._api  # noqa: F401  (nixl injects its build's module as nixl._api)
    except ImportError:
        return
    api = sys.modules.get("nixl._api")
    bind = getattr(api, "nixlBind", None)
    base = getattr(bind, "nixlAgentConfig", None)
    if base is None or getattr(base, "_splitserve_delay", None) is not None:
        return  # not the NIXL this was written for, or already patched (plugins load once per process and more)
    delay = int(value)
    prop = base.__dict__.get("pthrDelay")
    if prop is None:
        return

    class PacedConfig(base):  # type: ignore[misc, valid-type]
        _splitserve_delay = delay

        @property
        def pthrDelay(self) -> int:  # noqa: N802 (NIXL's name)
            return prop.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, v: int) -> None:  # noqa: N802
            prop.__set__(self, max(int(v), delay))

    bind.nixlAgentConfig = PacedConfig
