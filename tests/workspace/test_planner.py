"""The planner driven the way the scheduler-side connector drives it, without vLLM."""
import numpy as np
import pytest

from vllm_sekv.store import LRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.store.slot_runs import run_starts

BT, PAGED = 8, 16


class Engine:
    """Stands in for vLLM's scheduler: tokens per request and paged blocks."""

    def __init__(self, num_slots=64):
        self.catalog = BlockCatalog(num_slots, LRUPolicy())
        self.planner = WorkspacePlanner(self.catalog, SessionTable(), BT, PAGED)
        self.tokens: dict[str, list[int]] = {}
        self.step = -1
        self.plans = []

    def tokens_of(self, req_id):
        return self.tokens.get(req_id, [])

    def admit(self, req_id, prompt, salt="", session=None, local=0):
        self.tokens[req_id] = list(prompt)
        ext = self.planner.match(req_id, prompt, salt, session, local)
        num_paged = -(-(len(prompt) + 8) // PAGED)
        self.planner.set_paged_blocks(req_id, list(range(100, 100 + num_paged)), replace=True)
        self.planner.accept_restore(req_id, ext)
        self.planner.note_first_schedule(req_id, local + ext)
        return ext

    def run(self, scheduled, failed=frozenset()):
        plan = self.planner.plan_step(scheduled, self.tokens_of)
        self.plans.append(plan)
        self.step = plan.step_id
        self.planner.confirm(plan.step_id, set(failed), self.tokens_of)
        return plan


def prefill_and_finish(eng, req_id, prompt, **kw):
    ext = eng.admit(req_id, prompt, **kw)
    plan = eng.run({req_id: (ext, len(prompt) - ext)})
    st = eng.planner.finish(req_id, eng.tokens[req_id], len(prompt))
    eng.run({})  # a later step: commits whatever waited for confirmation
    return ext, plan, st


def test_first_request_captures_every_full_block():
    eng = Engine()
    prompt = list(range(1, 41))
    ext, plan, _ = prefill_and_finish(eng, "a", prompt)
    assert ext == 0
    assert len(plan.capture_paged_slots) == 40
    # paged slot of token t = block_ids[t // 16] * 16 + t % 16
    t = np.arange(40)
    assert np.array_equal(plan.capture_paged_slots, (100 + t // PAGED) * PAGED + t % PAGED)
    assert eng.catalog.num_committed == 5


def test_follow_up_restores_history_and_computes_only_new_tokens():
    eng = Engine()
    history = list(range(1, 41))
    prefill_and_finish(eng, "a", history)
    ext = eng.admit("b", history + [7] * 10)
    assert ext == 40
    plan = eng.run({"b": (40, 10)})
    (op,) = plan.restores
    t = np.arange(40)
    assert np.array_equal(op.paged_slots, (100 + t // PAGED) * PAGED + t % PAGED)
    slots = [eng.catalog.match_prefix(eng.planner.requests["b"].hashes)[i].host_slot for i in range(5)]
    assert np.array_equal(op.host_rows, np.repeat(slots, BT) * BT + t % BT)
    # the new tokens are captured, the restored ones are not captured again
    # every new token is captured (48..49 into a block that decode will fill);
    # none of the restored ones is captured again
    new = np.arange(40, 50)
    assert np.array_equal(plan.capture_paged_slots, (100 + new // PAGED) * PAGED + new % PAGED)


def test_restores_stop_one_token_short_of_a_fully_matched_prompt():
    eng = Engine()
    prefill_and_finish(eng, "a", list(range(1, 41)))
    assert eng.admit("b", list(range(1, 41))) == 39


def test_vllm_local_hit_is_not_restored_again():
    eng = Engine()
    prefill_and_finish(eng, "a", list(range(1, 41)))
    assert eng.admit("b", list(range(1, 51)), local=32) == 8


@pytest.mark.parametrize("prompt_tokens, local", [(50, 0), (40, 0), (50, 32), (45, 16)])
def test_the_slots_offered_at_the_match_are_the_ones_the_plan_restores(prompt_tokens, local):
    """What a worker's head start copies at the match (`match_slots`) is
    exactly what the step's restore reads, or the step would drop it."""
    eng = Engine()
    prefill_and_finish(eng, "a", list(range(1, 41)))
    prompt = list(range(1, prompt_tokens + 1))
    eng.tokens["b"] = prompt
    ext = eng.planner.match("b", prompt, "", None, local)
    assert ext > 0
    offered = eng.planner.match_slots("b", ext)
    eng.planner.set_paged_blocks("b", list(range(100, 104)), replace=True)
    eng.planner.accept_restore("b", ext)
    (op,) = eng.run({"b": (local + ext, prompt_tokens - local - ext)}).restores
    slot_of_row = op.host_rows // BT
    assert np.array_equal(offered, slot_of_row[run_starts(slot_of_row, step=0)])


def test_different_salt_never_matches():
    eng = Engine()
    prefill_and_finish(eng, "a", list(range(1, 41)), salt="tenant-1")
    assert eng.admit("b", list(range(1, 51)), salt="tenant-2") == 0
    assert eng.admit("c", list(range(1, 51)), salt="tenant-1") == 40


def test_a_failed_capture_is_never_committed():
    eng = Engine()
    prompt = list(range(1, 41))
    eng.admit("a", prompt)
    reserved = eng.planner.plan_step({"a": (0, 40)}, eng.tokens_of)
    bad_slot = int(reserved.capture_host_rows[0] // BT)
    eng.planner.confirm(reserved.step_id, {bad_slot}, eng.tokens_of)
    eng.planner.finish("a", prompt, 40)
    assert eng.catalog.num_committed == 4
    assert eng.admit("b", prompt + [0] * 8) == 0  # block 0 is missing: nothing restorable


def test_blocks_wait_for_the_worker_before_they_can_be_matched():
    eng = Engine()
    prompt = list(range(1, 41))
    eng.admit("a", prompt)
    eng.planner.plan_step({"a": (0, 40)}, eng.tokens_of)  # not confirmed yet
    assert eng.admit("b", prompt + [1]) == 0


def test_decode_tokens_are_captured_into_blocks_as_they_complete():
    eng = Engine()
    prompt = list(range(1, 13))  # 12 tokens: one full block, 4 of the next
    eng.admit("a", prompt)
    eng.run({"a": (0, 12)})
    for i in range(8):
        eng.tokens["a"].append(500 + i)  # sampled token
        eng.run({"a": (12 + i, 1)})
    eng.planner.finish("a", eng.tokens["a"], 20)
    eng.run({})
    assert eng.catalog.num_committed == 2  # 20 computed tokens -> 2 full blocks
    assert eng.admit("b", eng.tokens["a"] + [9]) == 16


def test_restored_blocks_are_pinned_until_the_step_is_confirmed():
    eng = Engine(num_slots=5)
    prefill_and_finish(eng, "a", list(range(1, 41)))  # fills all 5 slots
    eng.admit("b", list(range(1, 41)) + [3] * 8)
    plan = eng.planner.plan_step({"b": (40, 8)}, eng.tokens_of)
    assert plan.restores and not len(plan.capture_paged_slots)  # no slot could be freed
    eng.planner.confirm(plan.step_id, set(), eng.tokens_of)
    assert all(rec.pins == 0 for rec in eng.catalog.match_prefix(eng.planner.requests["b"].hashes))


def test_session_fork_is_recorded():
    eng = Engine()
    prefill_and_finish(eng, "a", list(range(1, 41)), session="s")
    prefill_and_finish(eng, "b", list(range(1, 17)) + [0] * 24, session="s")
    ws = eng.planner.sessions.get("", "s")
    assert ws.num_forks == 1 and len(ws.block_hashes) == 5


def test_accepting_more_than_matched_is_an_error():
    eng = Engine()
    eng.admit("a", list(range(1, 41)))
    with pytest.raises(ValueError):
        eng.planner.accept_restore("a", 8)


def test_history_spilled_to_nvme_is_read_back_before_it_is_restored():
    eng = Engine()
    eng.catalog = BlockCatalog(5, LRUPolicy(), 16, LRUPolicy())
    eng.planner = WorkspacePlanner(eng.catalog, SessionTable(), BT, PAGED)
    history = list(range(1, 41))
    prefill_and_finish(eng, "a", history)
    writes = {op.block_hash for plan in eng.plans for op in plan.nvme_writes}
    assert len(writes) == 5
    eng.planner.io_done([("write", h, True) for h in writes])
    prefill_and_finish(eng, "x", [9] * 40)  # another session pushes a's blocks off the host
    confirm_all_writes(eng)
    assert all(not r.restorable for r in eng.catalog.match_prefix(extend(history)))
    # The follow-up: first "not yet" while the worker reads ...
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) is None
    plan = eng.run({})
    reads = plan.nvme_reads
    assert {op.block_hash for op in reads} == writes
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) is None  # still reading
    eng.planner.io_done([("read", op.block_hash, True) for op in reads])
    # ... then the whole history.
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) == 40
    eng.planner.accept_restore("b", 40)
    assert eng.planner.requests["b"].nvme_read_tokens == 40


def test_a_failed_nvme_read_ends_the_match_there():
    eng = Engine()
    eng.catalog = BlockCatalog(5, LRUPolicy(), 16, LRUPolicy())
    eng.planner = WorkspacePlanner(eng.catalog, SessionTable(), BT, PAGED)
    history = list(range(1, 41))
    prefill_and_finish(eng, "a", history)
    writes = [op.block_hash for plan in eng.plans for op in plan.nvme_writes]
    eng.planner.io_done([("write", h, True) for h in writes])
    prefill_and_finish(eng, "x", [9] * 40)
    confirm_all_writes(eng)
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) is None
    reads = [op.block_hash for op in eng.run({}).nvme_reads]
    bad = extend(history)[2]  # the third block's file is corrupt
    eng.planner.io_done([("read", h, h != bad) for h in reads])
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) == 2 * BT


def confirm_all_writes(eng):
    eng.planner.io_done([("write", op.block_hash, True) for plan in eng.plans for op in plan.nvme_writes])


def extend(tokens, salt=""):
    from vllm_sekv.workspace.hashing import extend_block_hashes

    return extend_block_hashes([], tokens, BT, salt)


def test_a_request_id_used_again_never_inherits_the_finished_requests_kv():
    """Request ids are the client's to choose when vLLM does not randomize
    them: tenant B sending another prompt as `r` after tenant A's `r`
    finished gets a state of its own, never A's hashes or KV."""
    eng = Engine()
    prefill_and_finish(eng, "r", list(range(1, 41)), salt="tenant-a")
    assert eng.catalog.num_committed == 5
    assert eng.admit("r", list(range(500, 540)), salt="tenant-b") == 0
    assert eng.planner.requests["r"].tenant == "tenant-b"
    # Even the same prompt under another salt restores nothing of A's.
    prefill_and_finish(eng, "s", list(range(1, 41)), salt="tenant-a")
    assert eng.admit("s", list(range(1, 41)) + [9] * 8, salt="tenant-b") == 0
    # The same tenant repeating the id with a longer prompt finds its history as any request would.
    assert eng.admit("r2", list(range(1, 41)) + [5] * 8, salt="tenant-a") == 40


def test_a_request_id_used_again_before_the_last_ones_captures_are_confirmed_mixes_nothing():
    """Under asynchronous scheduling a finished request's captures wait for
    the worker's confirmation; a new request under the same id (another
    tenant, another prompt) must neither take those reservations nor have
    its KV committed under the finished request's block hashes."""
    eng = Engine()
    a = list(range(1, 41))
    eng.admit("r", a, salt="tenant-a")
    plan = eng.planner.plan_step({"r": (0, 40)}, eng.tokens_of)  # A's step, not yet confirmed
    eng.planner.finish("r", a, 40)
    eng.admit("r", list(range(900, 940)), salt="tenant-b")
    b_plan = eng.planner.plan_step({"r": (0, 40)}, eng.tokens_of)
    assert not set(b_plan.capture_host_rows.tolist()) & set(plan.capture_host_rows.tolist())
    eng.planner.confirm(b_plan.step_id, set(), eng.tokens_of)  # both steps confirmed
    eng.planner.finish("r", eng.tokens["r"], 40)
    eng.run({})
    # Tenant A's history restores from A's own captures, B's from B's.
    assert eng.admit("a2", a + [1] * 8, salt="tenant-a") == 40
    a_rows = eng.run({"a2": (40, 8)}).restores[0].host_rows
    assert set(a_rows.tolist()) == set(plan.capture_host_rows.tolist())


def test_blocks_the_remote_tier_holds_are_read_into_host_slots_before_they_are_restored():
    """A second server's planner: its catalog holds nothing of the history,
    the shared store (here a set, as `RemoteTier.lookup` answers) holds it."""
    first = Engine()
    history = list(range(1, 41))
    prefill_and_finish(first, "a", history)
    shared = {rec.block_hash for rec in first.catalog.match_prefix(extend(history))}

    def lookup(hashes, tenant, session_id):
        return next((i for i, h in enumerate(hashes) if h not in shared), len(hashes))

    eng = Engine()
    eng.planner.remote_lookup = lookup
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) is None  # reading from the store
    reads = eng.run({}).remote_reads
    assert {op.block_hash for op in reads} == shared and len(reads) == 5
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) is None  # still reading
    eng.planner.io_done([("remote_read", op.block_hash, op.block_hash != reads[3].block_hash) for op in reads])
    # the block that failed its checks is a miss: the match stops before it, and it is not offered again
    assert eng.planner.match("b", history + [7] * 8, "", None, 0) == 3 * BT
    assert eng.planner.requests["b"].remote_promoted >= {op.block_hash for op in reads[:3]}
    assert eng.planner.match("c", history + [8] * 8, "", None, 0) == 3 * BT


def test_committed_blocks_are_written_to_the_remote_tier_and_stay_until_written():
    eng = Engine(num_slots=5)
    eng.planner.remote_lookup = lambda hashes, tenant, session_id: 0
    prefill_and_finish(eng, "a", list(range(1, 41)))
    writes = [op for plan in eng.plans for op in plan.remote_writes]
    assert len(writes) == 5
    assert eng.admit("b", [9] * 40) == 0 and not eng.run({"b": (0, 40)}).capture_host_rows.size  # all 5 busy
    eng.planner.io_done([("remote_write", op.block_hash, True) for op in writes])
    assert eng.admit("c", [8] * 40) == 0 and eng.run({"c": (0, 40)}).capture_host_rows.size  # written: they may go


def test_a_long_prompt_never_evicts_its_own_first_blocks_ahead_of_an_idle_sessions():
    """SLRU keeps blocks used again (an idle session's history) protected and
    evicts from probation first, where a request's newly committed blocks
    are: while it runs, those are pinned, so its later captures evict the idle
    session's blocks instead of its own first ones."""
    from vllm_sekv.store.policy import SLRUPolicy
    from vllm_sekv.workspace.hashing import extend_block_hashes

    eng = Engine(num_slots=10)
    eng.catalog = eng.planner.catalog = BlockCatalog(10, SLRUPolicy(10, 0.8))
    idle = list(range(1, 49))  # 6 blocks, used twice: protected
    prefill_and_finish(eng, "a", idle)
    eng.catalog.touch(eng.catalog.match_prefix(extend_block_hashes([], idle, BT, "")))
    prompt = list(range(500, 564))  # 8 blocks, prefilled in two steps of 4
    eng.admit("b", prompt)
    eng.run({"b": (0, 32)})
    eng.run({"b": (32, 32)})  # 4 free slots taken by the first step: 4 evictions
    eng.planner.finish("b", prompt, len(prompt))
    eng.run({})
    assert len(eng.catalog.match_prefix(extend_block_hashes([], prompt, BT, ""))) == 8
    assert sum(h in eng.catalog for h in extend_block_hashes([], idle, BT, "")) == 2  # the idle session paid
    assert all(rec.pins == 0 for rec in eng.catalog.match_prefix(extend_block_hashes([], prompt, BT, "")))



def test_blocks_computed_while_every_host_slot_is_held_are_counted_as_not_kept():
    eng = Engine(num_slots=6)
    eng.admit("x", list(range(900, 924)))  # 3 blocks, pinned while x runs
    eng.run({"x": (0, 24)})
    prompt = list(range(1, 41))  # 5 blocks: 3 slots left
    eng.admit("a", prompt)
    eng.run({"a": (0, 32)})  # block 3 finds no slot
    eng.planner.finish("x", eng.tokens["x"], 24)  # x's slots could be given up now: too late for
    eng.run({"a": (32, 8)})                        # block 3, and a keeps none after it
    st = eng.planner.finish("a", prompt, 40)
    eng.run({})
    assert st.unkept_blocks == 2
    assert eng.admit("b", prompt + [5]) == 24
    assert eng.admit("c", list(range(900, 924)) + [5]) == 24  # x's blocks were not needed for a's


def test_a_block_another_request_kept_is_not_counted_as_not_kept():
    eng = Engine(num_slots=3)
    prompt = list(range(1, 41))
    eng.admit("a", prompt)
    eng.admit("b", prompt)
    eng.run({"a": (0, 40)})  # 3 slots: blocks 3 and 4 not kept
    eng.planner.finish("a", prompt, 40)
    eng.run({})
    st = eng.planner.finish("b", prompt, 0)  # b computed nothing
    assert st.unkept_blocks == 0
