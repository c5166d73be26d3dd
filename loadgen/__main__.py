"""`python -m alignedserve_loadgen` = `alignedserve-loadgen`."""

from __future__ import annotations

from alignedserve_loadgen.cli import main

raise SystemExit(main())
