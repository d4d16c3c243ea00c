"""vLLM's prefix-cache hashing spares requests served from views
(`compat.hash_views_opaquely`), with vLLM's real Request and block hasher."""
import pytest

from vllm_sekv import compat

BLOCK = 16


@pytest.fixture
def hashers(monkeypatch):
    """(plain vLLM hasher, view-aware hasher whose admission test says "long
    prompts are views"), built the way the engine core builds its own."""
    import vllm.v1.engine.core as engine_core
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    monkeypatch.setattr(engine_core, "get_request_block_hasher", engine_core.get_request_block_hasher)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    plain = engine_core.get_request_block_hasher(BLOCK, hash_fn)

    class Views:  # the scheduler side's admission test, held weakly by the shim
        def serves_from_views(self, request):
            return len(request.prompt_token_ids) > 4 * BLOCK

    views = Views()
    compat.hash_views_opaquely(views.serves_from_views)
    aware = engine_core.get_request_block_hasher(BLOCK, hash_fn)
    unbound = engine_core.get_request_block_hasher(BLOCK, hash_fn)  # the next hasher: plain again
    return plain, aware, unbound, views


def request(tokens, hasher, rid="r"):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(rid, list(tokens), SamplingParams(max_tokens=4), None, block_hasher=hasher)


def test_short_prompts_get_vllms_own_hashes(hashers):
    plain, aware, unbound, _ = hashers
    tokens = range(3 * BLOCK + 5)
    assert request(tokens, aware).block_hashes == request(tokens, plain).block_hashes
    assert len(request(tokens, plain).block_hashes) == 3


def test_a_prompt_served_from_views_is_not_hashed_at_creation(hashers):
    plain, aware, unbound, _ = hashers
    tokens = range(10 * BLOCK)
    assert request(tokens, aware).block_hashes == []
    assert len(request(tokens, plain).block_hashes) == 10
    assert len(request(tokens, unbound).block_hashes) == 10  # only the next hasher knows views


def test_view_passes_get_opaque_hashes_unique_to_their_salt(hashers):
    plain, aware, _, _ = hashers
    req = request(range(10 * BLOCK), aware)
    view = list(range(100, 100 + 3 * BLOCK + 7))
    compat.rewrite_request(req, view, "tenant\x00pass:0")
    content = request(view, plain).block_hashes
    assert len(req.block_hashes) == len(content) == 3
    assert not set(req.block_hashes) & set(content)
    assert len({len(h) for h in req.block_hashes} & {len(h) for h in content}) == 0
    first = list(req.block_hashes)
    compat.rewrite_request(req, view, "tenant\x00pass:1")
    assert len(req.block_hashes) == 3 and not set(req.block_hashes) & set(first)
    # Generated tokens that fill a block extend the pass's hashes.
    for t in range(BLOCK):
        req.append_output_token_ids(7 + t)
    assert len(req.block_hashes) == 4 and len(set(req.block_hashes)) == 4


def test_without_the_shim_a_rewrite_hashes_content(hashers):
    plain, _, _, _ = hashers
    req = request(range(2 * BLOCK), plain)
    view = list(range(50, 50 + 2 * BLOCK))
    compat.rewrite_request(req, view, "s")
    again = request(view, plain)
    again.cache_salt = "s"
    again.block_hashes = []
    again.update_block_hashes()
    assert req.block_hashes == again.block_hashes


def test_a_dead_admission_test_leaves_vllms_hasher(monkeypatch):
    import vllm.v1.engine.core as engine_core
    from vllm.utils.hashing import get_hash_fn_by_name

    monkeypatch.setattr(engine_core, "get_request_block_hasher", engine_core.get_request_block_hasher)

    class Views:
        def serves_from_views(self, request):
            return True

    views = Views()
    compat.hash_views_opaquely(views.serves_from_views)
    del views
    hasher = engine_core.get_request_block_hasher(BLOCK, get_hash_fn_by_name("sha256"))
    assert len(request(range(3 * BLOCK), hasher).block_hashes) == 3
