"""The C GEMM for decode on CPUs with AVX-512 BF16 (`cpu_linear`), built with this host's C compiler. It
matches `F.linear` within one bfloat16 step at every row count a tile specialization covers (1-12 rows,
and balanced tiles beyond), over strided inputs and column ranges split across two threads (torch's own
OpenMP threads; without OpenMP, all on the calling one). Behind the
engine, decode forwards of two or more rows take it where the "cpu" decode backend runs, the linear
kernel is "auto"; one-row calls, prefill and an explicit linear kernel keep the model's own. Where the CPU
has AMX tiles and k is a multiple of 32 the tile kernel (`cpu_linear_amx.c`) computes it: the row counts
here span one tile (16 rows) and more, and 576 / 1536 are such k."""

from __future__ import annotations

import ctypes
import os
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from engine_models import TINY_LLAMA_D64, mixed_prompts, random_model, tiny_engine
from torch import nn

from alignedserve.core.sampling import SamplingParams
from alignedserve.engine import cpu_kernels, cpu_linear
from alignedserve.engine.linear import TorchLinear

pytestmark = pytest.mark.skipif(
    not cpu_linear.kernel_available(), reason="needs a CPU with AVX-512 BF16 and a C compiler"
)


def _within_one_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal up to one bfloat16 rounding step of the output (the kernel sums k in another order)."""
    step = want.float().abs().clamp_min(1e-3) * 2**-7
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got != want).float().mean() < 0.01


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 17, 24, 25, 40, 64])
@pytest.mark.parametrize(("out_features", "in_features"), [(16, 2), (48, 576), (960, 576), (576, 1536)])
def test_matches_f_linear_within_one_bfloat16_step(rows: int, out_features: int, in_features: int) -> None:
    generator = torch.Generator().manual_seed(rows * 7 + out_features)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    _within_one_step(cpu_linear.linear(x, cpu_linear.pack(weight)), nn.functional.linear(x, weight))


@pytest.mark.usefixtures("two_threads")
def test_strided_rows_and_two_threads_give_the_one_thread_result() -> None:
    generator = torch.Generator().manual_seed(1)
    weight = (torch.randn(208, 96, generator=generator) * 0.05).bfloat16()  # 13 column blocks: split unevenly
    wide = torch.randn(9, 160, generator=generator).bfloat16()
    x = wide[:, 32:128]  # rows 160 elements apart
    packed = cpu_linear.pack(weight)
    split = cpu_linear.linear(x, packed)
    torch.set_num_threads(1)
    assert torch.equal(split, cpu_linear.linear(x.contiguous(), packed))
    _within_one_step(split, nn.functional.linear(x, weight))


@pytest.mark.usefixtures("two_threads")
def test_two_threads_are_torchs_own_openmp_threads_not_a_second_pool() -> None:
    x, weight = torch.randn(64, 576).bfloat16(), torch.randn(576, 576).bfloat16()
    torch.mm(x, weight)  # torch's team for this thread, started by its own op
    before = len(os.listdir("/proc/self/task"))
    cpu_linear.linear(x[:16], cpu_linear.pack(weight))
    assert len(os.listdir("/proc/self/task")) == before
    runtimes = {
        line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines() if "libgomp" in line
    }
    assert len(runtimes) == 1
    assert Path(next(iter(runtimes))).is_relative_to(Path(torch.__file__).parent)


def test_built_without_openmp_a_kernel_runs_every_item_on_the_calling_thread(tmp_path: Path) -> None:
    source = Path(cpu_linear.__file__).with_name("cpu_linear.c")
    compiler = shutil.which("cc") or shutil.which("gcc")
    assert compiler is not None
    serial = ctypes.CDLL(str(cpu_kernels._build(source, compiler, tmp_path, cpu_kernels.COMPILE_FLAGS, ())))
    weight, x = (torch.randn(208, 96) * 0.05).bfloat16(), torch.randn(9, 96).bfloat16()
    packed, out = cpu_linear.pack(weight), torch.empty(9, 208, dtype=torch.bfloat16)
    arguments = (x.data_ptr(), 96, packed.data_ptr(), out.data_ptr(), 208, 9, 96, 208, 2)
    serial.linear_bf16.argtypes = cpu_linear.LINEAR_ARGS
    assert serial.linear_bf16(*arguments) == 0  # two threads asked for, none to give
    assert torch.equal(out, cpu_linear.linear(x, packed))


def test_weights_it_cannot_take_stay_with_the_small_kernel() -> None:
    assert not cpu_linear.packable(torch.zeros(24, 64, dtype=torch.bfloat16))  # 24 columns: not 16s
    assert not cpu_linear.packable(torch.zeros(32, 63, dtype=torch.bfloat16))  # odd k
    assert not cpu_linear.packable(torch.zeros(32, 64))  # float32
    module = nn.Linear(64, 32, bias=True).bfloat16()
    holder = nn.Sequential(module)
    kernel = cpu_linear.CpuKernelLinear(partial(cpu_linear.packed_weights, holder, []), TorchLinear())
    x = torch.randn(4, 64).bfloat16()
    assert torch.equal(kernel(module, x), module(x))  # a bias: not packed


def test_one_row_and_many_rows_go_to_the_small_kernel_and_packing_waits_for_a_decode_call() -> None:
    module = nn.Linear(64, 32, bias=False).bfloat16()
    packs: list[int] = []

    def weights() -> cpu_linear.PackedWeights:
        packs.append(1)
        return cpu_linear.packed_weights(nn.Sequential(module), [])

    kernel = cpu_linear.CpuKernelLinear(weights, TorchLinear())
    for rows in (1, cpu_linear.MAX_ROWS + 1):
        assert kernel._weight((module,), torch.zeros(rows, 64, dtype=torch.bfloat16)) is None
    assert not packs  # nothing the kernel takes yet: nothing packed
    assert kernel._weight((module,), torch.zeros(2, 64, dtype=torch.bfloat16)) is not None
    kernel._weight((module,), torch.zeros(3, 64, dtype=torch.bfloat16))
    assert packs == [1]


@pytest.mark.usefixtures("no_amx_host")
def test_engine_decodes_through_it_and_prefills_through_its_own_kernel() -> None:
    model = random_model(TINY_LLAMA_D64, seed=4).to(torch.bfloat16)
    prompts = mixed_prompts(6, TINY_LLAMA_D64.vocab_size, long_lengths=[300], seed=6)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine = tiny_engine(model, dtype="bfloat16", decode_backend="cpu")
    assert engine.runner.decode_model.linear.name == "cpu"
    assert engine.runner.model.linear.name != "cpu"
    kernel_tokens = [o.output_token_ids for o in engine.generate(prompts, greedy)]
    explicit = tiny_engine(model, dtype="bfloat16", decode_backend="cpu", linear_kernel="onednn_packed")
    assert explicit.runner.decode_model is explicit.runner.model
    own_tokens = [o.output_token_ids for o in explicit.generate(prompts, greedy)]
    agree = sum(
        a == b for x, y in zip(kernel_tokens, own_tokens, strict=True) for a, b in zip(x, y, strict=True)
    )
    assert agree >= 0.9 * sum(len(x) for x in own_tokens)  # a one-step rounding may flip a near-tie


@pytest.mark.usefixtures("amx_host")
def test_an_amx_host_decodes_through_the_c_gemm_too() -> None:
    """On AMX tiles the C GEMM runs its tile kernel: decode takes it and the C element-wise steps."""
    model = random_model(TINY_LLAMA_D64, seed=4).to(torch.bfloat16)
    engine = tiny_engine(model, dtype="bfloat16", decode_backend="cpu")
    assert engine.runner.decode_model.linear.name == "cpu"
    assert engine.runner.model.linear.name != "cpu"
    assert engine.runner.decode_model.ops.name == "cpu"  # type: ignore[attr-defined]


@pytest.mark.skipif(cpu_linear.amx_library() is None, reason="needs a CPU with AMX bfloat16 tiles")
def test_the_tile_kernel_takes_every_k_in_steps_of_32_and_the_avx512_one_the_rest() -> None:
    amx, plain = cpu_linear.amx_library(), cpu_linear.library()
    assert amx is not None
    assert cpu_linear._gemm(576) == amx.linear_amx_bf16
    assert cpu_linear._gemm(96) == amx.linear_amx_bf16
    assert cpu_linear._gemm(80) == plain.linear_bf16  # not a multiple of 32
    generator = torch.Generator().manual_seed(3)
    weight = (torch.randn(80, 80, generator=generator) * 0.05).bfloat16()
    x = torch.randn(17, 80, generator=generator).bfloat16()
    _within_one_step(cpu_linear.linear(x, cpu_linear.pack(weight)), nn.functional.linear(x, weight))
