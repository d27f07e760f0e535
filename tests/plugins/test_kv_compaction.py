"""`specpipe::copy_kv_slots`: the Triton kernel against the reference and an explicit snapshot
oracle, on overlapping chains, M not a power of two, several column chunks and strided caches.

On the CPU test device the kernel runs on CPU tensors under the Triton interpreter, which must
be on before the plugin's kernels are decorated (tests/conftest.py sets it; so does this module)."""

from __future__ import annotations

import os

from tests.device import ON_CPU, TEST_DEVICE

if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from plugins.kv_compaction import copy_kv_slots, copy_kv_slots_triton, warm_up

DEVICE = TEST_DEVICE  # SPECPIPE_TEST_DEVICE: "cpu" (kernels in the interpreter) or "cuda"


def random_kv(
    layers: int = 3, slots: int = 24, h_kv: int = 2, d: int = 8, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    gen = torch.Generator().manual_seed(layers * 1000 + slots)
    return torch.randn(2, layers, slots, h_kv, d, generator=gen).to(DEVICE, dtype)


def snapshot_oracle(kv: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """Read every source from an untouched copy, then write the destinations one by one."""
    before, out = kv.clone(), kv.clone()
    for s, t in zip(src, dst, strict=True):
        out[:, :, t] = before[:, :, s]
    return out


CASES = {
    "shift-down chain": ([5, 6, 7], [4, 5, 6]),
    "shift-up chain": ([4, 5, 6], [5, 6, 7]),
    "swap": ([2, 9], [9, 2]),
    "scattered, M = 5": ([17, 3, 12, 20, 8], [3, 4, 5, 6, 7]),
    "single slot": ([11], [2]),
    "onto itself": ([1, 2, 3], [1, 2, 3]),
}


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_and_reference_match_the_oracle(case: str, index_dtype: torch.dtype) -> None:
    src, dst = CASES[case]
    kv = random_kv()
    expected = snapshot_oracle(kv, src, dst)
    s, t = (torch.tensor(x, dtype=index_dtype, device=DEVICE) for x in (src, dst))
    ref, ker = kv.clone(), kv.clone()
    copy_kv_slots(ref, s, t)  # the op: the reference on CPU, the kernel on CUDA
    copy_kv_slots_triton(ker, s, t)
    assert torch.equal(ref, expected)
    assert torch.equal(ker, expected)


def test_kernel_on_many_slots_bf16_and_several_column_chunks() -> None:
    """M = 33 (tile 64 rows) over H_kv * D = 256 columns: two column chunks per plane."""
    kv = random_kv(layers=2, slots=80, h_kv=4, d=64, dtype=torch.bfloat16)
    src = list(range(40, 73))
    dst = list(range(39, 72))  # an overlapping chain of 33
    ker = kv.clone()
    copy_kv_slots_triton(ker, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    assert torch.equal(ker, snapshot_oracle(kv, src, dst))


def test_kernel_on_a_strided_cache() -> None:
    """A view whose head and dim strides are not the contiguous ones."""
    base = random_kv(layers=2, slots=16, h_kv=2, d=16)
    kv = base[..., ::2]  # D = 8 with stride 2
    src, dst = [9, 10, 11, 12], [8, 9, 10, 11]
    expected_view = snapshot_oracle(kv, src, dst)
    untouched = base[..., 1::2].clone()
    copy_kv_slots_triton(kv, torch.tensor(src, device=DEVICE), torch.tensor(dst, device=DEVICE))
    assert torch.equal(kv, expected_view)
    assert torch.equal(base[..., 1::2], untouched)


def test_no_slots_is_a_no_op() -> None:
    kv = random_kv()
    empty = torch.zeros(0, dtype=torch.long, device=DEVICE)
    for copy in (copy_kv_slots, copy_kv_slots_triton):
        out = kv.clone()
        copy(out, empty, empty)
        assert torch.equal(out, kv)


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 2, 12, 2, 4, generator=gen)
    torch.library.opcheck(copy_kv_slots, (kv, torch.tensor([5, 6, 7]), torch.tensor([4, 5, 6])))
    torch.library.opcheck(
        copy_kv_slots, (kv, torch.tensor([3], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    )


def test_bad_inputs_are_refused() -> None:
    kv = random_kv()
    index = torch.tensor([1, 2], device=DEVICE)
    with pytest.raises(ValueError, match=r"\[2, L, num_slots, H_kv, D\]"):
        copy_kv_slots(kv[0], index, index)
    with pytest.raises(ValueError, match=r"both be \[M\]"):
        copy_kv_slots(kv, index, index[:1])
    with pytest.raises(ValueError, match="int32 or int64"):
        copy_kv_slots(kv, index.float(), index)
    with pytest.raises(ValueError, match=r"\[2, L, num_slots, H_kv, D\]"):
        copy_kv_slots_triton(kv[:1], index, index)


def test_warm_up_moves_one_slot_onto_itself_and_changes_nothing() -> None:
    """`warm_up` launches every tile size up to its bound (on a GPU: compiles them), moving
    one slot onto itself: the cache is unchanged, the slot's K/V included."""
    kv = random_kv()
    before = kv.clone()
    warm_up(kv, slot=5, most=8)
    assert torch.equal(kv, before)
