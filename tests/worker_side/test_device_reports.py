"""Facts only the device knows when a step's report is built (a restore's
transfer time; whether a paged capture's slots were in the batch; whether an
fp8 capture's blocks were finite) travel in
the report unread and are folded in when it is read; on CUDA, building them
never waits for the GPU."""
import pickle

import numpy as np
import pytest
import torch

from vllm_sekv.protocol.metadata import SekvWorkerMeta
from vllm_sekv.protocol.stats import SekvStats
from vllm_sekv.worker_side.device_reports import CaptureCheck, RestoreTiming, SlotCheck, count_settled, in_batch

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")


class _DoneEvents:
    """A CPU stand-in for two completed CUDA timing events `ms` apart (a
    restore's timing cannot be recorded without a GPU)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_DoneEvents") -> float:
        return end.ms


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=str)
def test_in_batch_finds_the_slots_the_step_writes(dtype):
    mapping = torch.tensor([41, -1, 7, 300, 8, -1], dtype=dtype)  # -1: padding
    want = torch.tensor([7, 8, 9, 300, 0, 1000])
    assert in_batch(want, mapping).tolist() == [True, True, False, True, False, False]
    assert in_batch(want, torch.zeros(0, dtype=dtype)).tolist() == [False] * 6
    assert in_batch(torch.zeros(0, dtype=torch.int64), mapping).tolist() == []


def test_in_batch_sorts_a_large_batch_and_agrees_with_pairwise_comparison():
    g = torch.Generator().manual_seed(1)
    mapping = torch.randperm(1 << 16, generator=g)[:8192].to(torch.int32)  # a prefill chunk's slots
    want = torch.randint(0, 1 << 16, (4096,), generator=g)
    expected = torch.from_numpy(np.isin(want.numpy(), mapping.numpy()))
    assert len(want) * len(mapping) > (1 << 20)  # the sorting path
    assert torch.equal(in_batch(want, mapping), expected)
    assert torch.equal(in_batch(want[:100], mapping), expected[:100])  # pairwise


def test_a_capture_check_fails_the_host_slots_of_rows_missing_from_the_batch():
    mapping = torch.tensor([16, 17, 18, 90])
    want = torch.tensor([16, 17, 18, 19, 90])  # 19 was not written by this step
    check = CaptureCheck(want, mapping, host_slots=np.array([3, 3, 3, 3, 5]))
    assert check.ready()
    assert check.failed() == {3}  # one block's row missing: the whole block fails
    assert CaptureCheck(want[:3], mapping, np.array([3, 3, 3])).failed() == set()


def test_a_report_folds_its_pending_facts_in_when_settled():
    check = CaptureCheck(torch.tensor([4, 5]), torch.tensor([4]), np.array([1, 2]))
    timing = RestoreTiming(_DoneEvents(0.0), _DoneEvents(250.0), [("a", 0.75), ("b", 0.25)])
    meta = SekvWorkerMeta(3, failed_slots={9}, pending=[check, timing])
    assert meta.settled() is meta and not meta.pending
    assert meta.failed_slots == {9, 2}
    assert meta.restore_seconds == pytest.approx({"a": 0.1875, "b": 0.0625})
    assert meta.settled().failed_slots == {9, 2}  # settling twice changes nothing


def test_a_report_crosses_processes_settled_and_ranks_combine_settled_reports():
    mapping = torch.tensor([10, 11])
    a = SekvWorkerMeta(2, pending=[CaptureCheck(torch.tensor([10, 12]), mapping, np.array([0, 6]))])
    sent = pickle.loads(pickle.dumps(a))
    assert sent.failed_slots == {6} and sent.pending == []
    b = SekvWorkerMeta(2, pending=[RestoreTiming(_DoneEvents(0.0), _DoneEvents(40.0), [("r", 1.0)])])
    c = SekvWorkerMeta(1, pending=[CaptureCheck(torch.tensor([11]), mapping, np.array([4]))])
    both = b.aggregate(c)
    assert both.confirmed_step == 1 and both.failed_slots == set()
    assert both.restore_seconds == pytest.approx({"r": 0.04})


@CUDA
def test_on_cuda_a_check_and_a_timing_are_built_without_waiting_for_the_gpu():
    stream = torch.cuda.current_stream()
    mapping = torch.tensor([5, 6, 7], device="cuda")  # before the GPU is busy: a pageable copy waits for it
    want = torch.tensor([6, 8], device="cuda")
    assert CaptureCheck(want, mapping, np.array([2, 3])).failed() == {3}  # the pinned allocator's block, as in serving
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    torch.cuda._sleep(1_000_000_000)  # the GPU is busy for about half a second
    end.record(stream)
    check = CaptureCheck(want, mapping, np.array([2, 3]))
    timing = RestoreTiming(start, end, [("r", 1.0)])
    assert not check.ready() and not timing.ready()  # built while the device is still busy
    assert check.failed() == {3}
    assert timing.seconds() == start.elapsed_time(end) / 1000.0  # the events' own reading, once they ran
    assert check.ready() and timing.ready()


class _Capture:
    """What `count_settled` tells of dropped blocks: (count, why) each time."""

    def __init__(self) -> None:
        self.dropped: list[tuple[int, str]] = []

    def count_dropped(self, blocks: int, why: str) -> None:
        self.dropped.append((blocks, why))


def test_a_slot_check_fails_the_slots_of_false_flags_in_the_report_and_counts_them_with_its_reason():
    check = SlotCheck(torch.tensor([True, False, True, False]), np.array([3, 4, 5, 4]), "non-finite K/V")
    meta = SekvWorkerMeta(1, failed_slots={9}, pending=[check])
    assert pickle.loads(pickle.dumps(meta)).failed_slots == {4, 9}
    capture = _Capture()
    assert count_settled([check], SekvStats(), capture) == []
    assert capture.dropped == [(1, "non-finite K/V")]
