"""Every metric the services export, read from their own metric classes (not from a list kept by hand)."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry

from alignedserve.batcher.metrics import BatcherMetrics
from alignedserve.decode.metrics import DecodeMetrics
from alignedserve.gateway.backend import BackendStats
from alignedserve.gateway.metrics import GatewayMetrics
from alignedserve.kvpool.index import PoolIndex
from alignedserve.kvpool.main import PoolStore, pool_metrics
from alignedserve.prefill.metrics import PrefillMetrics
from alignedserve.service.ops_metrics import BusMetrics, register_transfer_metrics
from alignedserve.transfer.client import ClientStats
from alignedserve.transfer.kv_store import KvStore

SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gauge": ("",),
    "info": ("_info",),
}

# Series from outside the services that the alerts and dashboards may name
EXTERNAL = {"kube_pod_container_status_restarts_total"}  # kube-state-metrics


def registries() -> dict[str, CollectorRegistry]:
    """One registry per service, filled as the service fills it (with the shared worker metrics)."""
    out: dict[str, CollectorRegistry] = {}
    gateway = GatewayMetrics("m", BackendStats, migrations=dict)
    out["gateway"] = gateway.registry
    for name in ("prefill", "decode", "kvpool", "batcher"):
        registry = CollectorRegistry()
        BusMetrics(registry)
        if name != "batcher":
            stats = ClientStats()
            # what a started endpoint reports (alignedserve.transfer.negotiation): the info gauge appears
            stats.negotiation = SimpleNamespace(version="1.21.0", transports=("tcp",), device_direct=False)
            register_transfer_metrics(registry, lambda stats=stats: stats)
        out[name] = registry
    PrefillMetrics(out["prefill"], KvStore(1))
    DecodeMetrics(out["decode"])
    BatcherMetrics(out["batcher"])
    index = PoolIndex("kvpool-0")
    pool_metrics(out["kvpool"], PoolStore(1, index.forget), index)
    return out


def families() -> dict[str, tuple[str, str, set[str]]]:
    """metric family name -> (type, help, services exporting it)."""
    found: dict[str, tuple[str, str, set[str]]] = {}
    for service, registry in registries().items():
        for family in registry.collect():
            kind, doc, services = found.get(family.name, (family.type, family.documentation, set()))
            found[family.name] = (kind, doc, services | {service})
    return found


def series_names() -> set[str]:
    """Every series name a scrape can show (a counter's _total, a histogram's _bucket, ...)."""
    return {name + suffix for name, (kind, _, _) in families().items() for suffix in SUFFIXES[kind]}
