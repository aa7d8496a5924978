"""The tensor pool reuses a storage only once nothing holds it, and gives idle memory back."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine.fobs.tensor_pool import TensorPool

MIB = 1 << 20


@pytest.fixture
def pool():
    pool = TensorPool(min_bytes=MIB, idle_release_s=60)
    yield pool
    pool.clear()


def test_a_dropped_tensor_s_memory_is_reused_for_the_same_byte_size(pool: TensorPool) -> None:
    first = pool.empty((256, 1024), torch.float32)
    address = first.data_ptr()
    del first

    again = pool.empty((1024, 512), torch.bfloat16)  # other shape and dtype, same 1 MiB

    assert again.data_ptr() == address
    assert again.shape == (1024, 512) and again.dtype == torch.bfloat16 and again.is_contiguous()
    assert (pool.allocated_bytes, pool.reused_bytes) == (MIB, MIB)


@pytest.mark.parametrize(
    "holder",
    [
        lambda t: t,
        lambda t: t[1:],
        lambda t: t.numpy(),
        lambda t: memoryview(t.numpy()),
        lambda t: t.untyped_storage(),
        lambda t: torch.nn.Parameter(t),
    ],
    ids=["tensor", "view", "numpy", "memoryview", "storage", "parameter"],
)
def test_memory_still_held_in_any_form_is_never_handed_out(pool: TensorPool, holder) -> None:
    tensor = pool.empty((MIB // 4,), torch.float32)
    address = tensor.data_ptr()
    kept = holder(tensor)  # noqa: F841 - held for the duration of the test
    del tensor

    other = pool.empty((MIB // 4,), torch.float32)

    assert other.data_ptr() != address
    assert pool.allocated_bytes == 2 * MIB and pool.reused_bytes == 0


def test_small_tensors_and_other_sizes_get_their_own_memory(pool: TensorPool) -> None:
    small = pool.empty((16,), torch.float32)
    del small
    big = pool.empty((MIB,), torch.uint8)
    del big

    bigger = pool.empty((2 * MIB,), torch.uint8)

    assert pool.allocated_bytes == 3 * MIB and pool.reused_bytes == 0
    assert bigger.numel() == 2 * MIB


def test_a_storage_resized_by_its_user_is_dropped_not_reused(pool: TensorPool) -> None:
    tensor = pool.empty((MIB,), torch.uint8)
    tensor.resize_(4 * MIB)
    del tensor

    again = pool.empty((MIB,), torch.uint8)

    assert pool.reused_bytes == 0 and again.untyped_storage().nbytes() == MIB


def test_memory_free_for_the_idle_time_is_released_and_memory_in_use_is_not() -> None:
    pool = TensorPool(min_bytes=MIB, idle_release_s=5)
    in_use = pool.empty((MIB,), torch.uint8)
    dropped = pool.empty((MIB,), torch.uint8)
    del dropped

    assert pool.release_idle(now=100.0) == 0  # first seen free: stamped
    assert pool.release_idle(now=104.0) == 0
    assert pool.idle_bytes() == MIB
    assert pool.release_idle(now=105.0) == MIB
    assert pool.idle_bytes() == 0

    del in_use  # free from now on, stamped at the next sweep
    assert pool.release_idle(now=1000.0) == 0
    assert pool.release_idle(now=1005.0) == MIB
    pool.empty((MIB,), torch.uint8)
    assert pool.reused_bytes == 0


def test_memory_taken_again_before_the_idle_time_is_kept() -> None:
    pool = TensorPool(min_bytes=MIB, idle_release_s=5)
    tensor = pool.empty((MIB,), torch.uint8)
    del tensor
    pool.release_idle(now=100.0)

    tensor = pool.empty((MIB,), torch.uint8)
    assert pool.release_idle(now=200.0) == 0
    del tensor

    assert pool.release_idle(now=201.0) == 0 and pool.idle_bytes() == MIB  # the clock restarted


def test_the_sweeper_gives_idle_memory_back_by_itself() -> None:
    pool = TensorPool(min_bytes=MIB, idle_release_s=0.1)
    try:
        tensor = pool.empty((MIB,), torch.uint8)
        del tensor
        deadline = time.monotonic() + 10
        while pool.idle_bytes() and time.monotonic() < deadline:
            time.sleep(0.05)

        assert pool.idle_bytes() == 0
        pool.empty((MIB,), torch.uint8)
        assert pool.reused_bytes == 0
    finally:
        pool.clear()


def test_tensors_taken_by_several_threads_at_once_never_share_memory(pool: TensorPool) -> None:
    errors: list[str] = []

    def work(value: int) -> None:
        for _ in range(200):
            tensor = pool.empty((MIB // 4,), torch.float32)
            tensor.fill_(value)
            if not tensor.eq(value).all():
                errors.append(f"thread {value}: another thread wrote into its tensor")
            del tensor

    threads = [threading.Thread(target=work, args=(value,)) for value in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert errors == []
    assert pool.allocated_bytes <= 4 * MIB and pool.reused_bytes >= 796 * MIB
