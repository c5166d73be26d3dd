"""Put this folder first on PYTHONPATH and the interpreter behaves as if torch were not installed.

Python imports `sitecustomize` at start-up. This one wraps the path finder so that `torch` and its
submodules are never found: `import torch` raises ModuleNotFoundError and `importlib.util.find_spec`
answers None, which is how transformers (and anyone else) checks whether torch is there. A `torch/`
package that raises on import would not do: find_spec would still find it, and transformers would then
import it and fail where a machine without torch works.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from importlib.machinery import ModuleSpec, PathFinder
from types import ModuleType
from typing import Any

HIDDEN = "torch"


class _PathFinderWithoutTorch:
    @staticmethod
    def find_spec(
        fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if fullname.partition(".")[0] == HIDDEN:
            return None
        return PathFinder.find_spec(fullname, path, target)

    @staticmethod
    def invalidate_caches() -> None:
        PathFinder.invalidate_caches()

    @staticmethod
    def find_distributions(*args: Any, **kwargs: Any) -> Iterable[Any]:
        # importlib.metadata asks the meta path finders for distributions (package versions)
        return PathFinder.find_distributions(*args, **kwargs)


sys.meta_path[:] = [_PathFinderWithoutTorch if f is PathFinder else f for f in sys.meta_path]
