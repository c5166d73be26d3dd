"""Deployment namespaces: two stacks on one broker never read each other's messages.

Services name topics and groups as `topics` spells them (`alignedserve.prefill`, group `prefill`); the
bus maps those logical names to the broker's names through the deployment's `Namespace`. The default
deployment (`alignedserve`, the root of every control-plane topic) keeps the names as they are, so a
broker shared with earlier releases sees the same streams; any other deployment re-roots the control
plane's topics (`prod.prefill`) and prefixes every other name (`prod.<name>`), groups and consumer
names included: Kafka groups are cluster-wide, so they need it even where topics already differ.
"""

from __future__ import annotations

import re
from typing import Protocol

from alignedserve.bus.topics import PREFIX

DEFAULT_DEPLOYMENT = PREFIX
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class Namespace(Protocol):
    deployment: str

    def topic(self, name: str) -> str:
        """The broker's name of a logical topic."""
        ...

    def group(self, name: str) -> str:
        """The broker's name of a consumer group or consumer (member) id."""
        ...


class DefaultNamespace:
    """The default deployment: the broker sees the names the code writes."""

    deployment = DEFAULT_DEPLOYMENT

    def topic(self, name: str) -> str:
        return name

    def group(self, name: str) -> str:
        return name


class DeploymentNamespace:
    """A named deployment: `alignedserve.X` becomes `<deployment>.X`; any other name `<deployment>.<name>`."""

    def __init__(self, deployment: str) -> None:
        self.deployment = deployment
        self._root = f"{PREFIX}."

    def topic(self, name: str) -> str:
        if name.startswith(self._root):
            return f"{self.deployment}.{name.removeprefix(self._root)}"
        return f"{self.deployment}.{name}"

    def group(self, name: str) -> str:
        return f"{self.deployment}.{name}"


def namespace_for(deployment: str = DEFAULT_DEPLOYMENT) -> Namespace:
    """The namespace of a deployment name (1-64 of [A-Za-z0-9_-]: it becomes part of topic names)."""
    if not _NAME.match(deployment):
        raise ValueError(f"deployment name {deployment!r} must be 1-64 of [A-Za-z0-9_-] (it prefixes topics)")
    if deployment == DEFAULT_DEPLOYMENT:
        return DefaultNamespace()
    return DeploymentNamespace(deployment)
