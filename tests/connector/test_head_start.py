"""The head-start registry: a plan reaches the worker of its own engine when
that worker lives in the scheduler's process, and nothing else. The worker
side's use of it (copies enqueued at planning time, adopted by the step) runs
on CUDA only: tests/gpu/test_cuda_engine.py covers it end to end, inside vLLM."""
from types import SimpleNamespace

from vllm_sekv.connector import head_start


class Worker:
    """Records the plans it is offered (what `SekvWorkerSide.head_start` gets)."""

    def __init__(self):
        self.plans = []

    def head_start(self, plan):
        self.plans.append(plan)


def _config(engine_id):
    return SimpleNamespace(kv_transfer_config=SimpleNamespace(engine_id=engine_id))


def test_a_plan_reaches_only_its_own_engines_worker():
    a, b = Worker(), Worker()
    head_start.register(head_start.engine_id(_config("engine-a")), a)
    head_start.register(head_start.engine_id(_config("engine-b")), b)
    try:
        head_start.offer("engine-a", "plan 1")
        head_start.offer("engine-c", "plan 2")  # a worker in another process: nobody here
        assert a.plans == ["plan 1"] and b.plans == []
    finally:
        head_start.unregister("engine-a", a)
        head_start.unregister("engine-b", b)
    head_start.offer("engine-a", "plan 3")
    assert a.plans == ["plan 1"]


def test_unregistering_leaves_a_newer_worker_of_the_same_engine_in_place():
    old, new = Worker(), Worker()
    head_start.register("engine-d", old)
    head_start.register("engine-d", new)
    head_start.unregister("engine-d", old)
    head_start.offer("engine-d", "plan")
    assert new.plans == ["plan"] and old.plans == []
    head_start.unregister("engine-d", new)


def test_without_an_engine_id_nothing_is_registered_or_offered():
    worker = Worker()
    assert head_start.engine_id(SimpleNamespace()) is None
    head_start.register(None, worker)
    head_start.offer(None, "plan")
    assert worker.plans == []


def test_a_collected_worker_is_forgotten():
    head_start.register("engine-e", Worker())  # no other reference
    head_start.offer("engine-e", "plan")  # nothing to call, no error
    assert "engine-e" not in head_start._WORKERS
