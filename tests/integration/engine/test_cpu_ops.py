"""A Llama layer's element-wise steps in C (`cpu_ops`), built with this host's C compiler, against the torch
formulations the model runs otherwise (`TorchLayerOps`, transformers' bit for bit): the residual sum, the
RMSNorm (its squares added in the order torch's row sum adds them) and the rotary positions are equal bit
for bit, the gated SiLU within two bfloat16 steps (its expf may differ by an ulp). `ExactCpuLayerOps`, the
prefill's, runs only the bit-exact ones, and a prefill forward through it is torch's bit for bit. One row,
and inputs the kernels do not take, go to torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from engine_models import TINY_LLAMA_D64, random_model, tiny_engine

from alignedserve.engine import cpu_ops
from alignedserve.engine.model import TorchLayerOps, signed_sin

pytestmark = pytest.mark.skipif(
    not cpu_ops.kernel_available(), reason="needs a CPU with AVX-512 BF16 and a C compiler"
)
TORCH = TorchLayerOps()


def _within_steps(got: torch.Tensor, want: torch.Tensor, steps: int = 1) -> None:
    step = want.float().abs().clamp_min(1e-3) * 2**-7
    assert ((got.float() - want.float()).abs() <= steps * step).all()
    assert (got != want).float().mean() < 0.01


class _Norm(torch.nn.Module):  # the attributes transformers' LlamaRMSNorm has
    def __init__(self, hidden: int, generator: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(hidden, generator=generator)).bfloat16())
        self.variance_epsilon = 1e-5


@pytest.mark.parametrize(
    ("rows", "hidden"), [(2, 576), (3, 576), (13, 576), (64, 576), (256, 4096), (7, 8192)]
)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_is_torchs_bit_for_bit(rows: int, hidden: int, with_delta: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    norm = _Norm(hidden, generator)
    h = (torch.randn(rows, hidden, generator=generator) * 3).bfloat16()
    delta = torch.randn(rows, hidden, generator=generator).bfloat16() if with_delta else None
    want_h, want = TORCH.add_rms_norm(norm, h.clone(), delta)
    got_h, got = cpu_ops.CpuLayerOps(silu=True).add_rms_norm(norm, h, delta)
    assert torch.equal(got_h, want_h)
    assert torch.equal(got, want)


@pytest.mark.parametrize("n", [64, 576, 2048, 8192])  # 8,192 floats: the sum's cascade of levels
def test_row_sums_add_in_torchs_order(n: int) -> None:
    lanes = cpu_ops.aten_sum_lanes()
    assert lanes in cpu_ops.SUM_LANES
    x = torch.randn(200, n, generator=torch.Generator().manual_seed(n)) * 5
    assert torch.equal(cpu_ops._c_row_sums(x, lanes), x.sum(-1))
    other = next(w for w in cpu_ops.SUM_LANES if w != lanes)
    assert not torch.equal(cpu_ops._c_row_sums(x, other), x.sum(-1))  # the order is what makes it equal


def test_the_start_check_finds_the_c_steps_equal_to_torchs() -> None:
    assert cpu_ops.first_mismatch(cpu_ops.CpuLayerOps(silu=True), 576, 64) is None
    assert cpu_ops.first_mismatch(cpu_ops.CpuLayerOps(silu=True), 4096, 128, seed=3) is None


@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_is_torchs_bit_for_bit(dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    tokens, vectors = 7, 12
    qkv = torch.randn(tokens, (vectors + 3) * dim, generator=generator).bfloat16()
    x = qkv[:, : vectors * dim].view(tokens, vectors, dim)  # rows strided, as the model slices them
    angles = torch.randn(tokens, 1, dim, generator=generator)
    cos, sin = angles.cos().bfloat16(), signed_sin(angles.sin().bfloat16())
    assert torch.equal(cpu_ops.CpuLayerOps(silu=True).rotary(x, cos, sin), TORCH.rotary(x, cos, sin))


def test_silu_mul_matches_torch_on_strided_halves() -> None:
    generator = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(9, 2 * 1536, generator=generator) * 4).bfloat16()
    gate, up = gate_up[:, :1536], gate_up[:, 1536:]
    # two roundings: a SiLU one step off (an ulp of expf at a near-tie) moves the product by up to two
    _within_steps(cpu_ops.CpuLayerOps(silu=True).silu_mul(F.silu, gate, up), F.silu(gate) * up, steps=2)


@pytest.mark.usefixtures("two_threads")
def test_two_threads_give_each_steps_one_thread_bits() -> None:
    """The rows split across torch's threads (`cpu_parallel.h`); each row is computed alone either way."""
    generator = torch.Generator().manual_seed(4)
    norm, ops = _Norm(576, generator), cpu_ops.CpuLayerOps(silu=True)
    h = (torch.randn(17, 576, generator=generator) * 3).bfloat16()
    delta = torch.randn(17, 576, generator=generator).bfloat16()
    gate = (torch.randn(17, 1536, generator=generator) * 4).bfloat16()
    up = torch.randn(17, 1536, generator=generator).bfloat16()
    qk = torch.randn(17, 12, 64, generator=generator).bfloat16()
    angles = torch.randn(17, 1, 64, generator=generator)
    cos, sin = angles.cos().bfloat16(), signed_sin(angles.sin().bfloat16())

    def steps() -> list[torch.Tensor]:
        summed, normed = ops.add_rms_norm(norm, h.clone(), delta)
        return [summed, normed, ops.silu_mul(F.silu, gate, up), ops.rotary(qk, cos, sin)]

    split = steps()
    torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(split, steps(), strict=True))


def test_one_row_and_other_activations_take_torch() -> None:
    generator = torch.Generator().manual_seed(3)
    norm = _Norm(64, generator)
    h = torch.randn(1, 64, generator=generator).bfloat16()
    delta = torch.randn(1, 64, generator=generator).bfloat16()
    ops = cpu_ops.CpuLayerOps(silu=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(ops.add_rms_norm(norm, h, delta), TORCH.add_rms_norm(norm, h, delta), strict=True)
    )
    gate, up = torch.randn(4, 32).bfloat16(), torch.randn(4, 32).bfloat16()
    assert torch.equal(cpu_ops.CpuLayerOps(silu=False).silu_mul(F.gelu, gate, up), F.gelu(gate) * up)


def test_exact_ops_leave_the_silu_to_torch() -> None:
    generator = torch.Generator().manual_seed(4)
    gate, up = (torch.randn(2, 9, 1536, generator=generator) * 4).bfloat16()
    assert torch.equal(cpu_ops.ExactCpuLayerOps(576, 64).silu_mul(F.silu, gate, up), F.silu(gate) * up)


def test_engine_decode_forwards_run_them_and_prefill_the_exact_ones() -> None:
    model = random_model(TINY_LLAMA_D64, seed=1).to(torch.bfloat16)
    engine = tiny_engine(model, dtype="bfloat16", decode_backend="cpu")
    assert engine.runner.decode_model.ops.name == "cpu"  # type: ignore[attr-defined]
    assert engine.runner.model.ops.name == "cpu-exact"  # type: ignore[attr-defined]


def _causal(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One prompt's attention without a cache: [T, heads, d] in and out."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, scale=scale, enable_gqa=True
    )
    return o.transpose(0, 1)


def test_a_prefill_forward_through_the_exact_ops_is_torchs_bit_for_bit() -> None:
    model = random_model(TINY_LLAMA_D64, seed=2).to(torch.bfloat16)
    engine = tiny_engine(model, dtype="bfloat16", decode_backend="cpu")
    prefill = engine.runner.model
    ids = torch.randint(0, TINY_LLAMA_D64.vocab_size, (37,), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(37)
    exact = prefill.hidden(ids, positions, _causal)
    prefill.ops = TORCH  # type: ignore[attr-defined]
    assert torch.equal(exact, prefill.hidden(ids, positions, _causal))
