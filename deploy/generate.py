"""Writes every generated Kubernetes file from its one source (`make k8s-generate`; tests check each is current):
the chart's CRDs and values.schema.json from the configuration model, and deploy/'s copies of the chart's Grafana
dashboard and SLO alert rules (the rules with the model's default SLOs filled in, for a plain Prometheus).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from splitserve.common.config import SLOSpec
from splitserve.hosts.k8s.chart_values import values_schema_json
from splitserve.hosts.k8s.crd import crd_yaml

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "splitserve"
RULES_TEMPLATE = CHART / "files" / "prometheus-rules.yaml"


def plain_rules(template: str, ttft: float, itl: float) -> str:
    """The chart's rules template as Helm's `tpl` renders it for these SLOs."""
    text = template.replace("{{ .ttft }}", f"{ttft:g}").replace("{{ .itl }}", f"{itl:g}")
    return re.sub(r"\{\{`(.*?)`\}\}", r"\1", text)


def generated() -> dict[Path, str]:
    """Every generated file and the text it must hold."""
    slo = SLOSpec()
    return {
        CHART / "crds" / "splitserve-crds.yaml": crd_yaml(),
        CHART / "values.schema.json": values_schema_json(),
        ROOT / "deploy" / "grafana" / "splitserve-dashboard.json": (CHART / "dashboards" / "splitserve.json").read_text(),
        ROOT / "deploy" / "prometheus" / "splitserve-rules.yaml": plain_rules(RULES_TEMPLATE.read_text(),
                                                                              slo.ttft_seconds, slo.itl_seconds),
    }


def main() -> int:
    for path, text in generated().items():
        if not path.exists() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
