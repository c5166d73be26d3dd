"""The prefill orders are named in three places that cannot import each other's kind (the torch-free
engine config, the scheduler, the prefill worker's flag); they must name the same orders."""

from __future__ import annotations

from typing import get_args

from alignedserve.engine import config, scheduler
from alignedserve.prefill.config import PrefillSettings


def test_the_config_the_scheduler_and_the_prefill_flag_name_the_same_orders() -> None:
    flag = get_args(PrefillSettings.model_fields["prefill_order"].annotation)
    assert set(config.PREFILL_ORDERS) == set(scheduler.PREFILL_ORDERS) == set(flag)
