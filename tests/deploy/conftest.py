"""tests/deploy's one fixture: the chart rendered once per value set (chart_support.VALUE_SETS), shared by
every test here. Helpers live in chart_support.py (a module name of its own: tests/ has other conftests)."""

from __future__ import annotations

import pytest
from chart_support import VALUE_SETS, Rendered, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, Rendered]:
    return {name: render(values) for name, values in VALUE_SETS.items()}
