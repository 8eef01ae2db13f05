"""Summarising, printing and plotting simulation results: a run's numbers, a table of policies, and replica,
ratio and GPU timelines (`--plot`, which needs matplotlib: `pip install -e '.[plot]'`)."""

from __future__ import annotations

from typing import Any

from splitserve.autoscaler.sim.metrics import weighted_percentiles
from splitserve.autoscaler.sim.oracle import OracleResult
from splitserve.autoscaler.sim.simulator import SimResult
from splitserve.autoscaler.sim.trace import Status

COLUMNS = (("policy", "policy", "{}"), ("slo_attainment", "attain", "{:.3f}"), ("gpu_seconds", "GPU-s", "{:.0f}"),
           ("gpu_seconds_vs_oracle", "vs oracle", "{:.2f}x"), ("max_gpus", "max GPUs", "{}"),
           ("ttft_p90_s", "TTFT p90", "{:.2f}"), ("itl_p90_s", "ITL p90", "{:.3f}"), ("failed", "failed", "{}"))


def summary(res: SimResult) -> dict[str, Any]:
    """The numbers every report prints."""
    reqs = res.requests
    ok = [r for r in reqs if r.status == Status.FINISHED]
    ttfts = sorted(r.ttft for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None

    itl = _weighted(res.itl_samples)
    return {"policy": res.law, "requests": len(reqs), "finished": len(ok),
            "failed": sum(r.status == Status.FAILED for r in reqs),
            "slo_attainment": round(res.attainment(), 4), "gpu_seconds": round(res.gpu_seconds, 1),
            "feasible_attainment": round(res.attainment(feasible_only=True), 4),
            "feasible_fraction": round(sum(res.settings.feasible(r) for r in reqs) / max(1, len(reqs)), 4),
            "ttft_p50_s": pct(ttfts, 0.5), "ttft_p90_s": pct(ttfts, 0.9), "ttft_p99_s": pct(ttfts, 0.99),
            "itl_p50_s": itl[0], "itl_p90_s": itl[1], "itl_p99_s": itl[2],
            "end_time_s": round(res.end_time, 1), "events": res.events, "role_flips": res.flips,
            "max_gpus": max((p.gpus for p in res.timeline), default=0),
            "scale_changes": sum(1 for a, b in zip(res.timeline, res.timeline[1:], strict=False)
                                 if (a.prefill["desired"], a.decode["desired"]) != (b.prefill["desired"], b.decode["desired"]))}


def _weighted(samples: list[tuple[float, int]]) -> tuple[float | None, float | None, float | None]:
    p = weighted_percentiles(samples)
    return p.p50, p.p90, p.p99


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["".join(f"{title:>11}" for _, title, _ in COLUMNS)]
    for r in rows:
        cells = []
        for key, _, fmt in COLUMNS:
            v = r.get(key)
            cells.append(f"{'-' if v is None else fmt.format(v):>11}")
        lines.append("".join(cells))
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Fail early, in one line, when --plot cannot work."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise RuntimeError("--plot needs matplotlib (pip install -e '.[plot]')") from None


def plot(results: dict[str, SimResult], orc: OracleResult | None, path: str, title: str = "") -> None:
    """Replicas per role (ready + starting), the prefill:decode ratio and GPUs held, per policy, over time."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    for name, res in results.items():
        t = [p.time / 60 for p in res.timeline]
        pre = [p.prefill["ready"] + p.prefill["starting"] for p in res.timeline]
        dec = [p.decode["ready"] + p.decode["starting"] for p in res.timeline]
        (line,) = axes[0].step(t, pre, where="post", label=name)
        axes[1].step(t, dec, where="post", label=name, color=line.get_color())
        axes[2].step(t, [a / b if b else 0 for a, b in zip(pre, dec, strict=True)], where="post", label=name,
                     color=line.get_color())
        axes[3].step(t, [p.gpus for p in res.timeline], where="post", label=name, color=line.get_color())
    if orc is not None and orc.windows:
        t = [w.start / 60 for w in orc.windows] + [(orc.windows[-1].start + orc.windows[-1].length) / 60]
        for ax, vals in ((axes[0], [w.prefill for w in orc.windows]), (axes[1], [w.decode for w in orc.windows]),
                         (axes[2], [w.prefill / max(1, w.decode) for w in orc.windows]),
                         (axes[3], [w.prefill + w.decode for w in orc.windows])):
            ax.step(t, vals + vals[-1:], where="post", label="oracle", color="black", linestyle="--")
    for ax, label in zip(axes, ("prefill replicas", "decode replicas", "prefill:decode", "GPUs held"), strict=True):
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="upper left", fontsize=8, ncol=4)
    axes[-1].set_xlabel("minutes")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
