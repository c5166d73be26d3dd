"""Which Redis database each test module that starts services uses: one table, so no two share one.

Stacks of different modules leave streams, groups and heartbeats behind; a module flushes its own
database first and never touches another's. 0 is the shared default (conftest's `redis_url`), 14 is the
stack benchmark's own (`alignedserve bench stack`), 15 its tests'.
"""

from __future__ import annotations

OVERLOAD = 1  # integration/gateway/test_gateway_overload.py
POOL_USAGE = 2  # integration/gateway/test_gateway_pool_usage.py
CHAOS_SHARED_REDIS = 3  # chaos/test_chaos_hostile.py (two deployments on one database)
KVPOOL_SERVICE = 4  # integration/services/test_kvpool_service.py
PREFILL_SERVICE = 5  # integration/services/test_prefill_service.py
SUPERVISION = 6  # e2e/test_e2e_supervision.py
CHAOS = 7  # chaos/ (test_chaos_data_plane.py: its stacks under deployments of their own on it)
WITHOUT_TORCH = 8  # integration/gateway/test_gateway_without_torch.py
BATCHER_RESTART = 9  # integration/services/test_batcher_restart.py
MIGRATION = 10  # e2e/test_e2e_migration.py
E2E_STACK = 11  # e2e/conftest.py
DIST_INSTALL = 12  # e2e/test_dist_install.py
GATEWAY_BUS_BACKEND = 13  # integration/gateway/test_gateway_bus_backend.py
