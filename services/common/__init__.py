"""Scaffolding every service shares: config, JSON logging, health/ready/metrics HTTP, SIGTERM drain."""

from __future__ import annotations
