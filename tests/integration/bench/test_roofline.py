"""The engine bench's rooflines on tiny shapes: the streamed pass times every weight of the model once
per batch, with the kernel the engine would use."""

from __future__ import annotations

import torch

from alignedserve.bench.engine.roofline import LinearShapes, measure_roofline, measure_streamed_linears

SHAPES = LinearShapes({(96, 32): 3, (32, 96): 2}, attention_flops_per_key=0, kv_elements_per_key=0)


def test_the_streamed_pass_is_timed_for_every_batch() -> None:
    seconds = measure_streamed_linears(SHAPES, [1, 8], torch.float32, repeats=2)
    assert sorted(seconds) == [1, 8]
    assert all(0 < s < 5 for s in seconds.values())


def test_the_in_cache_roofline_counts_each_shape_by_its_multiplicity() -> None:
    roof = measure_roofline(SHAPES, 8, torch.float32, repeats=2)
    assert abs(roof.gflops * roof.linear_s * 1e9 - SHAPES.linear_flops_per_token * 8) < 1e-3
    assert roof.peak_gflops > 0
