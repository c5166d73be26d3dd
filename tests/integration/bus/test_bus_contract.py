"""The wire's sampling struct mirrors the engine's SamplingParams: same fields, same defaults."""

from __future__ import annotations

import dataclasses

from alignedserve.bus.messages import SamplingSpec
from alignedserve.core.sampling import SamplingParams


def test_sampling_spec_mirrors_engine_sampling_params() -> None:
    wire = {f.name: f.default for f in dataclasses.fields(SamplingSpec)}
    engine = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    assert wire == engine
    spec = SamplingSpec(max_tokens=5, temperature=0.7, top_k=40, top_p=0.9, seed=3, stop=("x",), logprobs=1)
    params = SamplingParams(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(SamplingSpec)})
    assert params.validate() == params
