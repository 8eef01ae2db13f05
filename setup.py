"""Packaging: each top-level folder the architecture names is installed as `splitserve.<name>`, and every
package below it is discovered (folders holding only data, such as the autoscaler's profiles, ship as
package data). pyproject.toml holds the rest of the metadata."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOTS = {
    "splitserve": "splitserve",
    "splitserve.engine": "engine",
    "splitserve.router": "router",
    "splitserve.prefill_worker": "prefill_worker",
    "splitserve.decode_worker": "decode_worker",
    "splitserve.kv_transfer": "kv_transfer",
    "splitserve.vllm_engine": "vllm_engine",
    "splitserve.autoscaler": "autoscaler",
}
DATA = ["*.json", "*.proto", "*.pyi", "py.typed"]


def packages() -> list[str]:
    """Every package under each root, the roots themselves included (a root nested in another, as the
    `splitserve` folder holds none of the others, is never listed twice)."""
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        for sub in find_namespace_packages(folder, exclude=["*__pycache__*"]):
            if any(p.suffix in {".py", ".json", ".proto"} for p in (Path(folder) / sub.replace(".", "/")).iterdir()):
                found.append(f"{name}.{sub}")
    return found


setup(
    packages=packages(),
    package_dir=ROOTS,
    package_data={name: DATA for name in packages()},
)
