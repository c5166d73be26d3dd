"""Request ids on log lines: bound where a request is handled, gone when its handling ends."""

from __future__ import annotations

import asyncio
import io
import json

from alignedserve.service.logs import bind_request_ids, configure_logging, get_logger, request_context


async def test_ids_learnt_while_handling_a_request_stay_with_its_task() -> None:
    stream = io.StringIO()
    configure_logging("demo", "info", "json", stream=stream)
    log = get_logger("test")

    async def handle() -> None:
        with request_context("label-1"):
            bind_request_ids(internal_id="cmpl-label-1")
            log.info("admitted")
        log.info("after_the_block")  # still this request's task: the internal id stays

    await asyncio.create_task(handle())  # a task per request, as the HTTP server runs them
    log.info("elsewhere")
    admitted, after, elsewhere = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (admitted["request_id"], admitted["internal_id"]) == ("label-1", "cmpl-label-1")
    assert "request_id" not in after and after["internal_id"] == "cmpl-label-1"
    assert "request_id" not in elsewhere and "internal_id" not in elsewhere


def test_a_worker_logs_the_clients_label_next_to_the_internal_id_when_there_is_one() -> None:
    stream = io.StringIO()
    configure_logging("prefill", "info", "json", stream=stream)
    log = get_logger("test")
    with request_context("cmpl-req-1", "my-label"):
        log.info("labelled")
    with request_context("cmpl-req-2", ""):  # the client sent no X-Request-Id
        log.info("unlabelled")
    log.info("outside")
    labelled, unlabelled, outside = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (labelled["request_id"], labelled["client_request_id"]) == ("cmpl-req-1", "my-label")
    assert unlabelled["request_id"] == "cmpl-req-2" and "client_request_id" not in unlabelled
    assert "request_id" not in outside and "client_request_id" not in outside
