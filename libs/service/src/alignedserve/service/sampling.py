"""The wire form of sampling parameters (`SamplingSpec`) to the engine's `SamplingParams` and back: field
for field, logit_bias as (id, bias) pairs in the engine and `LogitBias` structs on the wire."""

from __future__ import annotations

import dataclasses

from alignedserve.bus.messages import LogitBias, SamplingSpec
from alignedserve.core.sampling import SamplingParams


def to_params(spec: SamplingSpec) -> SamplingParams:
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(SamplingSpec)}
    fields["logit_bias"] = tuple((b.token_id, b.bias) for b in spec.logit_bias)
    return SamplingParams(**fields)


def to_spec(params: SamplingParams) -> SamplingSpec:
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(SamplingSpec)}
    fields["logit_bias"] = tuple(LogitBias(token_id=t, bias=b) for t, b in params.logit_bias)
    return SamplingSpec(**fields)
