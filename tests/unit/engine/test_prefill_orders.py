"""The prefill orders are named in three places that cannot import each other's kind (the torch-free
engine config, the scheduler, the prefill worker's flag); they must name the same orders, and the flag
orders the worker's queue as it orders the engine's forwards."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from alignedserve.engine import config, scheduler
from alignedserve.prefill.config import PrefillSettings
from alignedserve.prefill.core import OldestFirst, ShortestFirst


def test_the_config_the_scheduler_and_the_prefill_flag_name_the_same_orders() -> None:
    flag = get_args(PrefillSettings.model_fields["prefill_order"].annotation)
    assert set(config.PREFILL_ORDERS) == set(scheduler.PREFILL_ORDERS) == set(flag)


def test_the_prefill_order_flag_orders_the_worker_queue_too() -> None:
    assert PrefillSettings(prefill_order="fcfs").queue_order() == OldestFirst()
    shortest = PrefillSettings(prefill_order="shortest", prefill_max_wait_s=3.5).queue_order()
    assert shortest == ShortestFirst(max_wait_s=3.5)


def test_the_overtake_ratio_flag_reaches_the_engine_and_a_bad_one_says_what_to_give() -> None:
    assert PrefillSettings(prefill_overtake_ratio=8).engine_config().prefill_overtake_ratio == 8
    assert PrefillSettings().engine_config().prefill_overtake_ratio == config.PREFILL_OVERTAKE_RATIO
    with pytest.raises(ValueError, match="prefill_overtake_ratio must be > 0"):
        config.EngineConfig(model="smollm2", prefill_overtake_ratio=0)
    with pytest.raises(ValidationError, match="prefill_overtake_ratio"):
        PrefillSettings(prefill_overtake_ratio=0)
