"""The wire form of sampling parameters (`SamplingSpec`) to the engine's `SamplingParams` and back."""

from __future__ import annotations

import dataclasses

from alignedserve.bus.messages import SamplingSpec
from alignedserve.engine.sampling import SamplingParams


def to_params(spec: SamplingSpec) -> SamplingParams:
    return SamplingParams(**{f.name: getattr(spec, f.name) for f in dataclasses.fields(SamplingSpec)})


def to_spec(params: SamplingParams) -> SamplingSpec:
    return SamplingSpec(**{f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingSpec)})
