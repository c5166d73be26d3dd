"""Lean forward passes over transformers' own modules, with attention replaced by paged attention.

Weights, norms, activations, rotary embeddings and the LM head are transformers' modules; attention is
ours, because it must read and write the paged KV cache, and every linear layer goes through a
`LinearKernel` (`alignedserve.engine.linear`: oneDNN-packed weights on CPU float32, the module itself
elsewhere). Inputs are flattened across requests: T tokens of any mix of requests, each with its own
position.
"""

from __future__ import annotations

import copy
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from alignedserve.engine.kv_cache import KvLayout
from alignedserve.engine.linear import FusedGroup, LinearKernel, TorchLinear, linear_kernel


class LayerAttention(Protocol):
    """Writes a layer's new K/V into the cache and attends. query: [T, heads, d]; key, value: [T, kvh, d]
    -> [T, heads, d]."""

    def __call__(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
    ) -> torch.Tensor: ...


class PagedModel(Protocol):
    layout_heads: tuple[int, int, int, int]  # (layers, heads, kv_heads, head_dim)
    max_context: int
    linear: LinearKernel  # how every projection is multiplied (`with_linear` swaps it)

    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> final hidden states [T, hidden]."""
        ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32."""
        ...


def kv_layout(model: PagedModel, block_size: int, dtype: torch.dtype) -> KvLayout:
    layers, _, kv_heads, head_dim = model.layout_heads
    return KvLayout(layers, kv_heads, head_dim, block_size, dtype)


class LayerOps(Protocol):
    """The element-wise steps of a Llama-family layer, one strategy per model (`with_layer_ops`)."""

    name: str

    def add_rms_norm(
        self, module: Any, h: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """h [T, hidden] plus delta (if any) -> (that sum, its RMSNorm by `module`); h may be updated in place."""
        ...

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, vectors, d]; cos, sin: [T, 1, d] (sin signed) -> x at its positions, [T, vectors, d]."""
        ...

    def silu_mul(self, act_fn: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """act_fn(gate) * up: [T, intermediate]."""
        ...


class TorchLayerOps:
    """transformers' formulations, bit for bit (the accuracy contract's)."""

    name = "torch"

    def add_rms_norm(
        self, module: Any, h: torch.Tensor, delta: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = h if delta is None else h + delta
        return h, rms_norm(module, h)

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotary(x, cos, sin)

    def silu_mul(self, act_fn: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = act_fn(gate) * up
        return out


class LlamaFamilyModel:
    """Llama, Mistral, Qwen2, SmolLM: RMSNorm, rotary positions, GQA, gated MLP."""

    def __init__(self, hf_model: Any, linear: LinearKernel | None = None) -> None:
        config = hf_model.config  # transformers modules: attributes are dynamic
        self.model: Any = hf_model.model
        self.lm_head: Any = hf_model.lm_head
        self.linear: LinearKernel = linear or TorchLinear()
        self.ops: LayerOps = TorchLayerOps()
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(config.num_key_value_heads)
        self.head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // self.heads)
        self.scale = self.head_dim**-0.5
        self.layout_heads = (config.num_hidden_layers, self.heads, self.kv_heads, self.head_dim)
        self.max_context = _llama_context(config)

    @torch.inference_mode()
    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention
    ) -> torch.Tensor:
        tokens = input_ids.shape[0]
        linear = self.linear
        h = self.model.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.model.rotary_emb(h, positions.unsqueeze(0))  # [1, T, d] each
        cos, sin = cos[0].unsqueeze(1), signed_sin(sin[0].unsqueeze(1))  # [T, 1, d]: broadcast over heads
        ops, delta = self.ops, None  # delta: the last MLP's output, added to h with the next norm
        for index, layer in enumerate(self.model.layers):
            h, x = ops.add_rms_norm(layer.input_layernorm, h, delta)
            attn = layer.self_attn
            qkv = linear.fused((attn.q_proj, attn.k_proj, attn.v_proj), x)  # [T, (heads + 2 kvh) * d]
            q, k, v = self._rotated(qkv, cos, sin)
            o = attention(index, q, k, v, self.scale)  # [T, heads, d]
            o = linear(attn.o_proj, o.reshape(tokens, self.heads * self.head_dim))
            h, x = ops.add_rms_norm(layer.post_attention_layernorm, h, o)
            mlp = layer.mlp  # gated: down(act(gate(x)) * up(x)), as transformers' LlamaMLP
            gate, up = linear.many((mlp.gate_proj, mlp.up_proj), x)
            delta = linear(mlp.down_proj, ops.silu_mul(mlp.act_fn, gate, up))
        return ops.add_rms_norm(self.model.norm, h, delta)[1]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.lm_head, hidden).float()

    def _rotated(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, (heads + 2 kvh) * d] -> q [T, heads, d] and k [T, kvh, d] at their positions, v [T, kvh, d].
        q and k are rotated as one [T, heads + kvh, d] tensor: half the element-wise calls (the values are
        the same per element)."""
        tokens, rotated = qkv.shape[0], self.heads + self.kv_heads
        qk = self.ops.rotary(qkv[:, : rotated * self.head_dim].view(tokens, rotated, self.head_dim), cos, sin)
        v = qkv[:, rotated * self.head_dim :].view(tokens, self.kv_heads, self.head_dim)
        return qk[:, : self.heads], qk[:, self.heads :], v


class OptModel:
    """OPT: learned positions (offset 2), LayerNorm before or after, ReLU MLP, q pre-scaled."""

    POSITION_OFFSET = 2  # OPTLearnedPositionalEmbedding.offset

    def __init__(self, hf_model: Any, linear: LinearKernel | None = None) -> None:
        config = hf_model.config  # transformers modules: attributes are dynamic
        self.decoder: Any = hf_model.model.decoder
        self.lm_head: Any = hf_model.lm_head
        self.linear: LinearKernel = linear or TorchLinear()
        self.heads = int(config.num_attention_heads)
        self.head_dim = int(config.hidden_size) // self.heads
        self.layout_heads = (config.num_hidden_layers, self.heads, self.heads, self.head_dim)
        self.max_context = int(config.max_position_embeddings)
        self.pre_norm = bool(config.do_layer_norm_before)

    @torch.inference_mode()
    def hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: LayerAttention
    ) -> torch.Tensor:
        tokens = input_ids.shape[0]
        decoder, linear = self.decoder, self.linear
        h = decoder.embed_tokens(input_ids)
        if decoder.project_in is not None:
            h = linear(decoder.project_in, h)
        h = h + decoder.embed_positions.weight[positions + self.POSITION_OFFSET]
        for index, layer in enumerate(decoder.layers):
            residual = h
            x = layer.self_attn_layer_norm(h) if self.pre_norm else h
            attn = layer.self_attn
            q, k, v = linear.many((attn.q_proj, attn.k_proj, attn.v_proj), x)
            q = (q * attn.scaling).view(tokens, self.heads, self.head_dim)
            k = k.view(tokens, self.heads, self.head_dim)
            v = v.view(tokens, self.heads, self.head_dim)
            o = attention(index, q, k, v, 1.0)  # scaling already applied to q, as transformers does
            h = residual + linear(attn.out_proj, o.reshape(tokens, self.heads * self.head_dim))
            if not self.pre_norm:
                h = layer.self_attn_layer_norm(h)
            residual = h
            x = layer.final_layer_norm(h) if self.pre_norm else h
            h = residual + linear(layer.fc2, layer.activation_fn(linear(layer.fc1, x)))
            if not self.pre_norm:
                h = layer.final_layer_norm(h)
        if decoder.final_layer_norm is not None:
            h = decoder.final_layer_norm(h)
        if decoder.project_out is not None:
            h = linear(decoder.project_out, h)
        out: torch.Tensor = h
        return out

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear(self.lm_head, hidden).float()


def rms_norm(module: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm of the Llama family (weight * x / sqrt(mean(x^2) + eps), computed in float32)
    with torch's one fused op for the float32 part: bit-identical to the module, in four calls (two in
    float32) where the module makes eight. Other dtypes round to the input dtype before the weight
    multiply, as the module does."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), module.weight, module.variance_epsilon)
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, module.variance_epsilon)
    out: torch.Tensor = module.weight * normed.to(x.dtype)
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos: [T, 1, d]; sin: [T, 1, d] as `signed_sin` gives it -> x at its positions.

    transformers computes x * cos + rotate_half(x) * sin with rotate_half([x1, x2]) = [-x2, x1]; here
    the halves are swapped by one roll and the sign rides on sin: -x2 * s == x2 * -s exactly, so every
    element is the same, in four calls instead of seven."""
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[..., d] -> [-sin[:d/2], sin[d/2:]]: the sine table `rotary` takes (made once a forward)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _llama_groups(hf_model: Any) -> list[FusedGroup]:
    """Projections that read the same input: q/k/v, and the MLP's gate/up."""
    groups: list[FusedGroup] = []
    for layer in hf_model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        groups += [(attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)]
    return groups


def _opt_groups(hf_model: Any) -> list[FusedGroup]:
    return [
        (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj)
        for layer in hf_model.model.decoder.layers
    ]


def _llama_context(config: Any) -> int:
    # Full attention only: where a sliding window applies, the context is capped at the window so that
    # plain causal attention over the whole cache stays exact.
    context = int(config.max_position_embeddings)
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "model_type", "") == "mistral" or getattr(
        config, "use_sliding_window", False
    )
    if window and uses_window:
        context = min(context, int(window))
    return context


def paged_model(hf_model: Any, linear: str = "auto") -> PagedModel:
    """The lean forward for a loaded transformers causal LM; `linear`: its linear kernel's name."""
    kernel = linear_kernel(hf_model, linear, linear_groups(hf_model))
    if hf_model.config.model_type == "opt":
        return OptModel(hf_model, kernel)
    return LlamaFamilyModel(hf_model, kernel)


def linear_groups(hf_model: Any) -> list[FusedGroup]:
    """The projections of each layer that read the same input, which a kernel may run as one."""
    model_type = hf_model.config.model_type
    if model_type in ("llama", "mistral", "qwen2"):
        return _llama_groups(hf_model)
    if model_type == "opt":
        return _opt_groups(hf_model)
    raise ValueError(f"no paged forward for model type {model_type!r}; supported: llama, mistral, qwen2, opt")


def with_linear(model: PagedModel, linear: LinearKernel) -> PagedModel:
    """The same forward over the same weights, its projections through `linear`."""
    other = copy.copy(model)
    other.linear = linear
    return other


def with_layer_ops(model: PagedModel, ops: LayerOps) -> PagedModel:
    """The same forward, its element-wise steps through `ops` (models of the Llama family; others as
    they are)."""
    if not isinstance(model, LlamaFamilyModel):
        return model
    other = copy.copy(model)
    other.ops = ops
    return other
