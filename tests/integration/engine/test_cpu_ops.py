"""A Llama layer's element-wise steps in C (`cpu_ops`), built with this host's C compiler, against the torch
formulations the model runs otherwise (`TorchLayerOps`, transformers' bit for bit): the residual sum and
the rotary positions are equal bit for bit, the RMSNorm within one bfloat16 step and the gated SiLU within two
(their float32 sum and expf may differ by an ulp). One row, and inputs the kernels do not take, go to torch."""

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


@pytest.mark.parametrize("rows", [2, 3, 13, 64])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(rows: int, with_delta: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    norm = _Norm(576, generator)
    h = (torch.randn(rows, 576, generator=generator) * 3).bfloat16()
    delta = torch.randn(rows, 576, generator=generator).bfloat16() if with_delta else None
    want_h, want = TORCH.add_rms_norm(norm, h.clone(), delta)
    got_h, got = cpu_ops.CpuLayerOps(silu=True).add_rms_norm(norm, h, delta)
    assert torch.equal(got_h, want_h)
    _within_steps(got, want)


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


def test_engine_decode_forwards_run_them() -> None:
    model = random_model(TINY_LLAMA_D64, seed=1).to(torch.bfloat16)
    engine = tiny_engine(model, dtype="bfloat16", decode_backend="cpu")
    assert engine.runner.decode_model.ops.name == "cpu"  # type: ignore[attr-defined]
    assert engine.runner.model.ops.name == "torch"  # type: ignore[attr-defined]
