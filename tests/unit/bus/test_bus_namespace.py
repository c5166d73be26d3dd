"""Deployment namespaces: the broker's names of topics and groups (`alignedserve.bus.namespace`)."""

from __future__ import annotations

import pytest

from alignedserve.bus import make_bus, topics
from alignedserve.bus.namespace import DEFAULT_DEPLOYMENT, namespace_for
from alignedserve.core.config import DEFAULT_DEPLOYMENT as CONFIG_DEFAULT


def test_the_default_deployment_keeps_the_names_the_code_writes() -> None:
    ns = namespace_for()
    assert DEFAULT_DEPLOYMENT == CONFIG_DEFAULT == topics.PREFIX
    assert ns.topic(topics.PREFILL) == "alignedserve.prefill"
    assert ns.topic("test-1.x") == "test-1.x"
    assert ns.group(topics.PREFILL_GROUP) == "prefill"


def test_a_named_deployment_reroots_control_topics_and_prefixes_everything_else() -> None:
    ns = namespace_for("prod-eu")
    assert ns.topic(topics.PREFILL) == "prod-eu.prefill"
    assert ns.topic(topics.tokens("gw-1")) == "prod-eu.tokens.gw-1"
    assert ns.topic(topics.dead_letter(topics.BATCHER)) == "prod-eu.batcher.dead"
    assert ns.topic("test-1.x") == "prod-eu.test-1.x"
    assert ns.group("prefill") == "prod-eu.prefill"
    assert namespace_for("other").topic(topics.PREFILL) != ns.topic(topics.PREFILL)


@pytest.mark.parametrize("bad", ["", "a.b", "a b", "x" * 65])
def test_a_deployment_name_must_fit_in_topic_names(bad: str) -> None:
    with pytest.raises(ValueError, match="deployment name"):
        namespace_for(bad)


def test_make_bus_takes_the_deployment() -> None:
    assert make_bus("redis://127.0.0.1:1/0", "blue").namespace.deployment == "blue"
    assert make_bus("kafka://127.0.0.1:1", "blue").namespace.deployment == "blue"
