"""Which history the host tier keeps when sessions compete for it: a view
step uses its session's whole history (its probes scored all of it), so an
active session's unselected blocks are not evicted ahead of an idle session's.
The planner and catalog driven as the scheduler side drives them, no vLLM."""
import pytest

from test_planner import BT, PAGED, Engine, prefill_and_finish
from vllm_sekv.store import LRUPolicy, SLRUPolicy
from vllm_sekv.workspace.catalog import BlockCatalog
from vllm_sekv.workspace.planner import WorkspacePlanner
from vllm_sekv.workspace.sessions import SessionTable
from vllm_sekv.workspace.view_passes import ViewBudget, final_pass, first_pass

BUDGET = ViewBudget(block_tokens=BT, view_tokens=12 * BT, sink_tokens=BT, recent_tokens=2 * BT)  # 8 chosen
SLOTS = 48


def engine(policy) -> Engine:
    eng = Engine()
    eng.catalog = BlockCatalog(SLOTS, policy)
    eng.planner = WorkspacePlanner(eng.catalog, SessionTable(), BT, PAGED)
    return eng


def history(session: int, blocks: int) -> list[int]:
    return [session * 1000 + i for i in range(blocks * BT)]


def view_step(eng: Engine, req_id: str, prompt: list[int]) -> None:
    """One step served from a view: it selects the earliest candidates,
    restores sink + them + recent, computes and saves the new tokens."""
    matched = eng.planner.match_history(req_id, prompt, "", None)
    probe = first_pass(len(prompt), matched, BUDGET)
    final = final_pass(probe, [-float(i) for i in range(len(probe.candidates))], BUDGET)
    restored = eng.planner.begin_view_pass(req_id, final)
    eng.tokens[req_id] = prompt
    eng.planner.set_paged_blocks(req_id, list(range(300, 300 + final.num_tokens // PAGED + 2)), replace=True)
    eng.planner.accept_restore(req_id, restored)
    eng.run({req_id: (restored, final.num_tokens - restored)})
    eng.planner.finish(req_id, prompt, len(prompt))
    eng.run({})


def held(eng: Engine, req_id: str, tokens: list[int]) -> int:
    """Leading blocks of `tokens` the workspace holds."""
    matched = eng.planner.match_history(req_id, tokens + [7], "", None)
    eng.planner.finish(req_id, tokens, 0)
    return matched


@pytest.mark.parametrize("policy", [LRUPolicy(), SLRUPolicy(SLOTS)], ids=["lru", "slru"])
def test_an_active_sessions_unselected_history_outlives_an_idle_sessions_blocks(policy):
    eng = engine(policy)
    a, s = history(1, 24), history(2, 20)
    prefill_and_finish(eng, "a-ingest", a)
    prefill_and_finish(eng, "s-ingest", s)  # an idle session, its blocks newer than a's
    view_step(eng, "a-step", a + [5, 6, 7])  # restores 11 of a's 24 blocks, uses all of them
    prefill_and_finish(eng, "b-ingest", history(3, 20))  # a third session fills the tier
    assert held(eng, "a-next", a) == 24
    assert held(eng, "s-next", s) < 20  # the idle session paid for it



def test_a_sessions_shared_history_is_the_longest_common_prefix_of_its_hashes():
    import random

    from vllm_sekv.workspace.sessions import _common_prefix

    rng = random.Random(2)
    for _ in range(300):
        old = [bytes([rng.randrange(3)]) for _ in range(rng.randrange(0, 60))]
        new = list(old)
        if new and rng.random() < 0.7:
            new[rng.randrange(len(new))] = b"x"
        new = new[:rng.randrange(0, len(new) + 1)] + [bytes([rng.randrange(3)]) for _ in range(rng.randrange(0, 9))]
        naive = 0
        while naive < min(len(old), len(new)) and old[naive] == new[naive]:
            naive += 1
        assert _common_prefix(old, new) == naive
