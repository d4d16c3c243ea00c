"""The head-start registry: a plan, or a restore's match, reaches the worker
of its own engine when that worker lives in the scheduler's process, and
nothing else. What the worker does with them is
tests/worker_side/test_device_restores.py's (on the CPU) and
tests/gpu/test_cuda_engine.py's (inside vLLM on CUDA, the only place where a
worker registers)."""
from types import SimpleNamespace

from vllm_sekv.protocol import head_start


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


class MatchWorker(Worker):
    """Also records the host slots of the matches it is offered."""

    def __init__(self):
        super().__init__()
        self.matches = []

    def head_start_match(self, host_slots):
        self.matches.append(list(host_slots))


def test_a_restore_match_reaches_the_worker_once_per_request(model_dir):
    """The scheduler side hands a worker in its process the slots of each
    restore it matches, once per request (one vLLM cannot schedule yet is
    matched again every step), and nothing for a miss."""
    from vllm.engine.arg_utils import EngineArgs

    from vllm_sekv import plugin
    from vllm_sekv.config import SekvConfig
    from vllm_sekv.scheduler_side.scheduler_connector import SekvSchedulerSide

    plugin.register()
    vllm_config = EngineArgs(model=model_dir, max_model_len=2048, kv_transfer_config={
        "kv_connector": "sekv", "kv_role": "kv_both"}).create_engine_config()
    side = SekvSchedulerSide(SekvConfig.from_sources({"host_bytes": "64M"}, environ={}), vllm_config)
    planner, bt = side.planner, side.planner.block_tokens
    history = list(range(1, 4 * bt + 1))
    planner.match("a", history, side.tenants.of(""), None, 0)  # the history's prefill, captured and committed
    planner.set_paged_blocks("a", list(range(8)), replace=True)
    planner.accept_restore("a", 0)
    plan = planner.plan_step({"a": (0, len(history))}, lambda _: history)
    planner.confirm(plan.step_id, set(), lambda _: history)
    planner.finish("a", history, len(history))
    planner.plan_step({}, lambda _: history)

    def request(req_id, prompt):
        return SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, all_token_ids=prompt,
                               cache_salt=None, kv_transfer_params=None, session_id=None,
                               sampling_params=SimpleNamespace(extra_args=None), max_tokens=8)

    worker = MatchWorker()
    head_start.register(side._engine_id, worker)
    try:
        follow_up = request("b", history + [7] * bt)
        assert side.get_num_new_matched_tokens(follow_up, 0) == (4 * bt, False)
        assert side.get_num_new_matched_tokens(follow_up, 0) == (4 * bt, False)  # not scheduled: again
        assert worker.matches == [planner.match_slots("b", 4 * bt).tolist()] and len(worker.matches[0]) == 4
        assert side.get_num_new_matched_tokens(request("c", [9] * 3 * bt), 0) == (0, False)
        assert len(worker.matches) == 1
    finally:
        head_start.unregister(side._engine_id, worker)
