"""`python -m alignedserve.loadgen` = `alignedserve-loadgen`."""

from __future__ import annotations

from alignedserve.loadgen.cli import main

raise SystemExit(main())
