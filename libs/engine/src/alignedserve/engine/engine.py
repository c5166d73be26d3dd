"""LLMEngine: requests in, tokens out, over a paged KV cache; one prefill or decode forward per step.

Serving loop: `add_request` ... `step()` until `has_unfinished()` is False. Services use the lower-level
entry points: `prefill` (first token, KV kept), `export_kv` / `import_request` (move a request's KV to
another engine) and `free`.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from alignedserve.core.blocks import BlockAllocator, blocks_for
from alignedserve.core.sampling import SamplingParams
from alignedserve.core.stopping import StopChecker
from alignedserve.engine import cpu_attention, cpu_linear, cpu_ops
from alignedserve.engine.attention import (
    BucketedGrouping,
    DecodeGrouping,
    PaddedGrouping,
    PagedPrefill,
    PerSequenceGrouping,
)
from alignedserve.engine.config import DEFAULT_KV_CACHE_BYTES, EngineConfig, cpu_has_amx_bf16
from alignedserve.engine.cpu_linear import CpuKernelLinear, packed_weights
from alignedserve.engine.cpu_ops import CpuLayerOps, ExactCpuLayerOps, KernelUnavailable
from alignedserve.engine.decode_backend import FixedGrouping, GroupingSelector
from alignedserve.engine.decode_kv import DecodeKv, GatheredKv, StagedKv
from alignedserve.engine.kv_cache import KvLayout, PagedKvCache
from alignedserve.engine.kv_export import KvExport, export_kv, import_kv
from alignedserve.engine.loader import LoadedModel, load
from alignedserve.engine.model import (
    PagedModel,
    kv_layout,
    linear_groups,
    paged_model,
    with_layer_ops,
    with_linear,
)
from alignedserve.engine.penalties import TokenHistory, adjusted_logits
from alignedserve.engine.placement import place_process
from alignedserve.engine.request import (
    KvBudgetError,
    PromptTooLongError,
    Request,
    RequestError,
    RequestOutput,
    RequestStatus,
    StopRule,
    TokenLogprob,
    TokenStopRule,
)
from alignedserve.engine.runner import DecodeRow, ModelRunner, PrefillChunk, TokenScore
from alignedserve.engine.sampling import Sampler, make_generator
from alignedserve.engine.scheduler import PREFILL_ORDERS, ScheduledChunk, Scheduler
from alignedserve.engine.selector import ShapeSelector
from alignedserve.engine.timing import IterationTiming, NullTimer, WallTimer
from alignedserve.engine.triton_backend import select_backend


@dataclass(frozen=True, slots=True)
class RunningInfo:
    """One decoding request: what the per-iteration scheduler needs to plan around it."""

    request_id: str
    num_computed: int  # tokens whose K/V are in the cache (the request's prefix length)
    num_blocks: int  # KV blocks it holds now
    output_len: int  # tokens generated so far


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


WARM_UP_PROMPT_TOKENS = 8


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        """`loaded`: an already loaded model (tests share one); by default `config.model` is loaded."""
        self.config = config
        if config.device_type == "cpu":
            place_process(config.num_threads, config.cpus, config.nice)
        dtype = _DTYPES[config.dtype]
        self.loaded = loaded or load(config.model, dtype, config.device, config.cache_dir)
        self.device = torch.device(config.device)
        self.model = paged_model(self.loaded.hf_model, config.linear_kernel)
        self.layout = kv_layout(self.model, config.block_size, dtype)
        self.max_model_len = min(config.max_model_len or self.model.max_context, self.model.max_context)
        budget = config.kv_cache_bytes or DEFAULT_KV_CACHE_BYTES
        self.allocator = (
            BlockAllocator(config.num_blocks, config.block_size)
            if config.num_blocks is not None
            else BlockAllocator.from_budget(budget, self.layout.bytes_per_block, config.block_size)
        )
        self.cache = PagedKvCache(self.layout, self.allocator.num_blocks, self.device)
        timer = WallTimer(self.device) if config.timings else NullTimer()
        decode = select_backend(
            config.decode_backend,
            self.device,
            self.layout.dtype,
            config.block_size,
            _selector(config),
            _decode_kv(config, self.layout),
        )
        prefill_kernel = _prefill_kernel(decode.name)
        decode_model = _decode_model(self.model, self.loaded.hf_model, decode.name, config.linear_kernel)
        prefill_model = _prefill_model(self.model, self.loaded.hf_model, decode.name, config.linear_kernel)
        self.runner = ModelRunner(prefill_model, self.cache, decode, timer, prefill_kernel, decode_model)
        self.scheduler = Scheduler(
            self.allocator,
            config.max_num_seqs,
            config.max_prefill_tokens,
            PREFILL_ORDERS[config.prefill_order](config.prefill_overtake_ratio),
        )
        self.sampler = Sampler()
        self.timings: deque[IterationTiming] = deque(maxlen=100_000)
        self.eos_token_ids = _eos_ids(self.loaded)
        self._requests: dict[str, Request] = {}
        self._serials = itertools.count()  # Request.serial: decode attention keeps K/V staged by it
        self.last_step = "idle"  # what the last step() ran: "prefill", "decode" or "idle"

    @property
    def tokenizer(self):  # type: ignore[no-untyped-def]
        return self.loaded.tokenizer

    @property
    def model_config(self):  # type: ignore[no-untyped-def]
        return self.loaded.config

    @property
    def model_id(self) -> str:
        return self.loaded.model_id

    # --- serving loop -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._add(request_id, prompt_token_ids, params, park_after_prefill=False)

    def abort(self, request_id: str) -> None:
        """Forget the request and free its blocks; unknown ids are ignored (it may have just finished)."""
        request = self._requests.pop(request_id, None)
        if request is not None:
            self.scheduler.remove(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[RequestOutput]:
        """One forward: prefill of waiting requests if any can run, else one decode iteration."""
        chunks = self.scheduler.schedule_prefill()
        if chunks:
            self.last_step = "prefill"
            return self._run_prefill(chunks)
        running = self.scheduler.schedule_decode()
        if running:
            self.last_step = "decode"
            return self._run_decode(running)
        self.last_step = "idle"
        return []

    def generate(
        self, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[RequestOutput]:
        """Run prompts to completion; final outputs in prompt order."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(per_prompt)} SamplingParams")
        ids = [f"generate-{id(prompts)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, per_prompt, strict=True):
            self.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for output in self.step():
                if output.finished:
                    final[output.request_id] = output
            if self.last_step == "idle":
                raise RuntimeError("no request can run: parked requests hold the KV cache; free() them first")
        return [final[request_id] for request_id in ids]

    def warm_up(self) -> None:
        """A throwaway generation of two short prompts (a two-row decode, then a one-row one), so that no
        request pays the first forwards' one-time costs: packing the decode linears' weights
        (`CpuKernelLinear`), the AMX tile permission, oneDNN's first primitives. On the AMX host class
        the first two-row step had taken 0.86 s against a 37 ms median on the stack."""
        vocab = int(self.model_config.vocab_size)
        prompt = [token % vocab for token in range(1, WARM_UP_PROMPT_TOKENS + 1)]
        params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (2, 4)]
        self.generate([prompt, prompt], params)
        self.timings.clear()

    # --- disaggregated entry points ------------------------------------------------------------------

    def prefill(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> list[RequestOutput]:
        """Prefill only: run prompts to their first token and keep their KV (parked) for `export_kv`."""
        for request_id, prompt, params in requests:
            self.add_prefill(request_id, prompt, params)
        wanted = {request_id for request_id, _, _ in requests}
        outputs: dict[str, RequestOutput] = {}
        while wanted - outputs.keys():
            for output in self.prefill_step():
                outputs[output.request_id] = output
        return [outputs[request_id] for request_id, _, _ in requests]

    def add_prefill(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a prompt for `prefill_step`: it runs to its first token, then its KV waits (parked) for
        `export_kv`."""
        self._add(request_id, prompt_token_ids, params, park_after_prefill=True)

    def prefill_step(self) -> list[RequestOutput]:
        """One prefill forward over the queued prompts (a chunk of each, within `max_prefill_tokens`);
        the outputs of those that reached their first token. [] when none is queued."""
        if not self.has_prefill_work():
            return []
        chunks = self.scheduler.schedule_prefill()
        if not chunks:
            raise RuntimeError("prefill cannot proceed: the KV cache is held by other requests")
        return self._run_prefill(chunks)

    def has_prefill_work(self) -> bool:
        return bool(self.scheduler.waiting)

    def prefill_blocks_pending(self) -> int:
        """KV blocks the queued prompts will still take as their chunks run (reserved chunk by chunk)."""
        return self.scheduler.blocks_pending()

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the `RequestError` that `add_request`/`prefill` would, without taking the request."""
        params.validate()
        self._check_prompt(prompt_token_ids, params)

    def export_kv(self, request_id: str) -> KvExport:
        """The request's cached KV (all tokens but the last sampled one) as one contiguous buffer."""
        request = self._request(request_id)
        table = self.allocator.block_table(request_id)
        return export_kv(self.cache, table, request.num_computed, self.model_id)

    def import_request(
        self,
        request_id: str,
        kv: KvExport,
        prompt_token_ids: list[int],
        output_token_ids: list[int],
        params: SamplingParams,
        verified: bool = False,
    ) -> None:
        """Take over a request prefilled elsewhere: its KV goes into new blocks and it joins decode.
        `verified`: the payload's checksum was checked on arrival (see `import_kv`)."""
        if kv.header.num_tokens != len(prompt_token_ids) + len(output_token_ids) - 1:
            raise RequestError(
                f"KV holds {kv.header.num_tokens} tokens; expected prompt + output - 1 = "
                f"{len(prompt_token_ids) + len(output_token_ids) - 1}"
            )
        request = self._new_request(request_id, prompt_token_ids, params, park_after_prefill=False)
        request.output_token_ids = list(output_token_ids)
        self.allocator.allocate(request_id, kv.header.num_tokens + 1)
        try:
            import_kv(self.cache, kv, self.allocator.block_table(request_id), self.model_id, verified)
        except Exception:
            self.allocator.free(request_id)
            raise
        request.num_computed = kv.header.num_tokens
        self._requests[request_id] = request
        self.scheduler.add_running(request)

    def free(self, request_id: str) -> None:
        """Release a request in any state (parked after `prefill`, running, waiting)."""
        self.abort(request_id)

    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def running_requests(self) -> list[RunningInfo]:
        """The decoding requests in batch order, as a batch-level scheduler sees them (cheap: no copies)."""
        block_size = self.allocator.block_size
        return [
            RunningInfo(
                r.request_id,
                r.num_computed,
                self.allocator.capacity_tokens(r.request_id) // block_size,
                len(r.output_token_ids),
            )
            for r in self.scheduler.running
        ]

    def token_ids(self, request_id: str) -> tuple[list[int], list[int]]:
        """Copies of the request's prompt and output token ids (what travels with its exported KV)."""
        request = self._request(request_id)
        return list(request.prompt_token_ids), list(request.output_token_ids)

    # --- internals -----------------------------------------------------------------------------------

    def _add(
        self, request_id: str, prompt: list[int], params: SamplingParams, park_after_prefill: bool
    ) -> None:
        request = self._new_request(request_id, prompt, params, park_after_prefill)
        self._requests[request_id] = request
        self.scheduler.add(request)

    def _new_request(
        self, request_id: str, prompt: list[int], params: SamplingParams, park_after_prefill: bool
    ) -> Request:
        if request_id in self._requests:
            raise RequestError(f"request id {request_id!r} is already in the engine")
        params.validate()
        self._check_prompt(prompt, params)
        return Request(
            serial=next(self._serials),
            request_id=request_id,
            prompt_token_ids=list(prompt),
            params=params,
            stop_rule=self._stop_rule(params, prompt),
            generator=make_generator(params, self.device),
            park_after_prefill=park_after_prefill,
            logprobs=[] if params.logprobs is not None else None,
        )

    def _check_prompt(self, prompt: list[int], params: SamplingParams) -> None:
        if not prompt:
            raise RequestError("prompt_token_ids is empty; give at least one token")
        vocab = int(self.model_config.vocab_size)
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if any(token >= vocab for token, _ in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})")
        if len(prompt) > self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt)} tokens but the model's context is {self.max_model_len}; "
                f"shorten the prompt to at most {self.max_model_len} tokens"
            )
        # The longest this request can get must fit the whole cache, or it could never finish.
        longest = min(len(prompt) + params.max_tokens, self.max_model_len)
        if blocks_for(longest, self.allocator.block_size) > self.allocator.num_blocks:
            raise KvBudgetError(
                f"prompt + max_tokens = {longest} tokens need "
                f"{blocks_for(longest, self.allocator.block_size)} KV blocks but the cache has "
                f"{self.allocator.num_blocks}; lower max_tokens or raise kv_cache_bytes"
            )

    def _stop_rule(self, params: SamplingParams, prompt: list[int]) -> StopRule:
        if params.stop:
            return StopChecker(params, self.tokenizer, self.eos_token_ids, prompt)
        return TokenStopRule(params, self.eos_token_ids)

    def _history(self, request: Request) -> TokenHistory:
        params = request.params
        stops = params.ending_token_ids(self.eos_token_ids) if params.min_tokens else ()
        return TokenHistory(request.prompt_token_ids, request.output_token_ids, tuple(stops))

    def _request(self, request_id: str) -> Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _run_prefill(self, chunks: list[ScheduledChunk]) -> list[RequestOutput]:
        prefill_chunks = [self._prefill_chunk(c) for c in chunks]
        result = self.runner.prefill(prefill_chunks)
        self._note_timing()
        for chunk, ran, scores in zip(chunks, prefill_chunks, result.scores, strict=True):
            if scores is not None and ran.score_targets is not None:
                self._keep_prompt_logprobs(chunk, ran.score_targets, scores)
        completed = [c.request for c in chunks if c.completes]
        for chunk in chunks:
            self.scheduler.finish_prefill(chunk)
        return self._sample(completed, result.logits, first=True)

    def _prefill_chunk(self, chunk: ScheduledChunk) -> PrefillChunk:
        request, end = chunk.request, chunk.start + chunk.length
        wanted = request.params.prompt_logprobs
        return PrefillChunk(
            request.token_ids(chunk.start, end),
            chunk.start,
            self.allocator.block_table(request.request_id),
            chunk.completes,
            score_targets=request.prompt_targets(chunk.start, end) if wanted is not None else None,
            score_top=wanted or 0,
        )

    @staticmethod
    def _keep_prompt_logprobs(chunk: ScheduledChunk, targets: list[int], scores: list[TokenScore]) -> None:
        request = chunk.request
        if chunk.start == 0 or request.prompt_logprobs is None:  # a recompute after preemption restarts
            request.prompt_logprobs = []
        request.prompt_logprobs += [
            TokenLogprob(token, logprob, top) for token, (logprob, top) in zip(targets, scores, strict=True)
        ]

    def _run_decode(self, running: list[Request]) -> list[RequestOutput]:
        rows = [
            DecodeRow(
                r.output_token_ids[-1], r.num_computed, self.allocator.block_table(r.request_id), r.serial
            )
            for r in running
        ]
        logits = self.runner.decode(rows)
        self._note_timing()
        for request in running:
            request.num_computed += 1
        return self._sample(running, logits)

    def _sample(
        self, requests: list[Request], logits: torch.Tensor, first: bool = False
    ) -> list[RequestOutput]:
        """first: these requests just finished their prefill. Prompt logprobs ride on that output and on
        the final one (streams read the first, `generate` the last)."""
        if not requests:
            return []
        params = [r.params for r in requests]
        adjusted = None
        if any(p.adjusts_logits for p in params):  # the common batch builds no histories
            adjusted = adjusted_logits(logits, params, [self._history(r) for r in requests])
        sampled = self.sampler(logits, params, [r.generator for r in requests], adjusted)
        token_ids = sampled.token_ids.tolist()
        chosen = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        outputs = []
        for row, request in enumerate(requests):
            request.output_token_ids.append(token_ids[row])
            if request.logprobs is not None and chosen is not None and sampled.top_logprobs is not None:
                request.logprobs.append(TokenLogprob(token_ids[row], chosen[row], sampled.top_logprobs[row]))
            reason = request.stop_rule.check(request.output_token_ids)
            if reason is None and request.num_tokens >= self.max_model_len:
                reason = "length"  # the next token would need a position past the context
            if reason is not None:
                request.finish_reason = reason
                if request.status is not RequestStatus.PARKED:
                    self._requests.pop(request.request_id, None)
                    self.scheduler.remove(request)
            outputs.append(request.output(1, with_prompt_logprobs=first or reason is not None))
        return outputs

    def _note_timing(self) -> None:
        if self.runner.last_timing is not None:
            self.timings.append(self.runner.last_timing)
            self.runner.last_timing = None


def _selector(config: EngineConfig) -> GroupingSelector:
    fixed: dict[str, DecodeGrouping] = {
        "padded": PaddedGrouping(),
        "per_sequence": PerSequenceGrouping(),
        "bucketed": BucketedGrouping(ShapeSelector.MAX_PAD_TOKENS),
    }
    if config.attention in fixed:
        return FixedGrouping(fixed[config.attention])
    return ShapeSelector()


def _prefill_kernel(decode_backend: str) -> PagedPrefill | None:
    """Where the C decode kernel runs, its prefill kernel attends continuation chunks too (the same host
    class and library), except on AMX tiles: there torch's flash kernel computes on them and prefilled a
    2,048-token prompt in 256-token chunks in 0.5-0.6x the C kernel's time (docs/benchmarks.md, "The C
    decode path on AMX"). None: SDPA per span."""
    if decode_backend != "cpu" or cpu_has_amx_bf16():
        return None
    return cpu_attention.paged_prefill


def _decode_model(model: PagedModel, hf_model: Any, decode_backend: str, linear: str) -> PagedModel:
    """Where the C decode kernels run and the linear kernel is "auto", decode forwards of two rows or more
    run their element-wise steps in C (`cpu_ops`) and multiply by `_decode_linears`: the same host class
    and library build. Prefill (`_prefill_model`) and one-row decode stay transformers' bit for bit (the
    accuracy contract)."""
    if not _c_layer_steps(decode_backend, linear):
        return model
    silu = getattr(hf_model.config, "hidden_act", None) in ("silu", "swish")
    return with_layer_ops(_decode_linears(model, hf_model), CpuLayerOps(silu))


def _c_layer_steps(decode_backend: str, linear: str) -> bool:
    """Whether forwards may take the C element-wise steps (`cpu_ops`): where the C decode kernels run (the
    same host class and library build) and the linear kernel is "auto"."""
    return decode_backend == "cpu" and linear == "auto" and cpu_ops.kernel_available()


def _prefill_model(model: PagedModel, hf_model: Any, decode_backend: str, linear: str) -> PagedModel:
    """Where the C decode kernels run, prefill forwards take the C element-wise steps that are torch's bit
    for bit (`ExactCpuLayerOps`: the residual adds, RMSNorms and rotary positions, checked against torch
    at start), so prefill stays transformers' output under the accuracy contract; `model` where that
    check fails. Those steps were ~20 % of a prefill forward's samples on the stack (docs/benchmarks.md,
    "Prefill's element-wise steps in C, bit for bit")."""
    if not _c_layer_steps(decode_backend, linear):
        return model
    try:
        return with_layer_ops(
            model, ExactCpuLayerOps(int(hf_model.config.hidden_size), model.layout_heads[3])
        )
    except KernelUnavailable:
        return model


def _decode_linears(model: PagedModel, hf_model: Any) -> PagedModel:
    """The C GEMM (`cpu_linear`: on AMX tiles where the CPU has them, else AVX-512 BF16). On AMX hosts
    oneDNN's GEMM had beaten the AVX-512 one, 1.3-1.5x at 13 rows ("The C decode path on AMX"); the tile
    kernel beats oneDNN, 1.4-1.5x over SmolLM2's projections at 2-16 rows (docs/benchmarks.md, "Decode
    linears on AMX tiles")."""
    if not cpu_linear.kernel_available():
        return model
    packed = functools.partial(packed_weights, hf_model, linear_groups(hf_model))  # at the first decode
    return with_linear(model, CpuKernelLinear(packed, model.linear))


def _decode_kv(config: EngineConfig, layout: KvLayout) -> DecodeKv:
    if config.staged_kv_bytes == 0:
        return GatheredKv()
    return StagedKv(layout, config.staged_kv_bytes)


def _eos_ids(loaded: LoadedModel) -> list[int]:
    ids: set[int] = set()
    generation = getattr(loaded.hf_model, "generation_config", None)
    for source in (getattr(generation, "eos_token_id", None), loaded.config.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(i) for i in source)
    return sorted(ids)
