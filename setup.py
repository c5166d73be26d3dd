"""Maps the repository's top-level folders onto import packages (metadata lives in pyproject.toml)."""

from setuptools import find_packages, setup

# folder -> import name: libs/alignedserve is the shared library, services/ and loadgen/ are
# their own import packages so each service stays a separate, small tree.
ROOTS = {"alignedserve": "libs/alignedserve", "alignedserve_services": "services", "alignedserve_loadgen": "loadgen"}


def _packages() -> list[str]:
    found: list[str] = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(packages=_packages(), package_dir=ROOTS)
