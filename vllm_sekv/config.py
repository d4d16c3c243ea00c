"""The one typed configuration of vllm-sekv.

Read from `kv_connector_extra_config` (the JSON object inside vLLM's
`--kv-transfer-config`), then overridden by `SEKV_<KEY>` environment variables
(e.g. `SEKV_HOST_BYTES=8G`). Every key is declared once in `SekvConfig`; unknown
keys and bad values raise `ValueError` naming the key and what it accepts, so a
misconfigured server fails at start-up instead of serving.

Sizes accept integers (bytes) or strings with a binary unit: `512M`, `8G`,
`1.5GiB`, `64K`.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping

from vllm_sekv.config_values import parse_choice, parse_float, parse_int, parse_size_bytes

ENV_PREFIX = "SEKV_"
# SEKV_* variables that are not config keys (read elsewhere, documented there).
NON_CONFIG_ENV = frozenset({"SEKV_CACHE_DIR", "SEKV_MODEL_PARTS", "SEKV_VENV", "SEKV_TEST_WORKERS", "SEKV_COMMIT"})

POLICIES = ("slru", "lru")
RECOMPUTE_LAYOUTS = ("after_recent", "in_order")
MAX_PROBE_HOPS = 3  # probes per view step (`probe_hops`)
MAX_VIEW_PASSAGE_BLOCKS = 64  # most blocks a selected block's passage brings (`view_passage_blocks`)
MAX_QUESTION_PASSAGES = 64  # most passages text retrieval adds to a view (`view_question_passages`)
RESTORE_MODES = ("auto", "layerwise", "batched")
# Block summaries the views' index can use (`vllm_sekv.index.block_summaries`);
# those in SURPRISAL_SUMMARIES weight tokens by their surprisal and need
# `surprisal` on.
SURPRISAL_SUMMARIES = ("anchor_pre", "sub8a_pre", "wmean_pre", "wsub8_pre")
INDEX_SUMMARIES = (
    "sub4_pre", "sub8_pre", "sub16_pre", "mean_pre", "outlier_pre", "minmax_pre",
    "sub4_post", "sub8_post", "mean_post", "minmax_post", *SURPRISAL_SUMMARIES,
)
ON_OFF = ("off", "on")
LOOKALIKES = ("keep", "drop")
WORKSPACE_CODECS = ("exact", "fp8")
# `restore_codec` value: each block at the rank its zoom-router tier gives it.
ROUTER_CODEC = "router"
_COMBINE_RE = re.compile(r"^(mean|max|top[1-9][0-9]*)$")
# `view_preset` values -> the keys each sets where no source gives them.
# "accurate": the views that answered best on histories repeating templates
# (README, "Views that keep answers right"); with `rerank_heads_path`.
VIEW_PRESETS: dict[str, dict[str, Any]] = {
    "none": {},
    "accurate": {"rerank_blocks": 1024, "probe_hops": 3, "probe_lexical_hop": "on", "view_select_blocks": 32,
                 "view_passage_blocks": 8, "view_cut_lines": "on", "view_lookalikes": "drop",
                 "recompute_blocks": 100_000, "recompute_layout": "in_order"},
}


@dataclass(frozen=True)
class SekvConfig:
    """Validated settings. Field comments are the user-facing documentation."""

    # Byte budget of the host-memory tier (all sessions together).
    host_bytes: int = 4 << 30
    # Tokens per workspace block: the unit of capture, matching, restore and
    # of the Mean-K index. A power of two from 8 to 256.
    block_tokens: int = 32
    # Host-tier eviction policy: "slru" (recency + frequency: blocks recalled
    # again are protected from bursts of new blocks) or "lru".
    policy: str = "slru"
    # Share of the host tier that blocks recalled at least twice may hold
    # (slru only), in percent.
    protected_percent: int = 80
    # Shortest restore worth doing, in tokens; shorter matches are prefilled.
    min_restore_tokens: int = 32
    # How restores reach the GPU (CUDA only). "layerwise": each layer of all
    # of a step's blocks moves as its own copies, so the forward pass runs
    # while later layers are still in flight; "batched": whole blocks (every
    # layer) in large copies, batch by batch, before the forward; "auto":
    # layerwise when the blocks lie in long runs of consecutive host slots (a
    # restored history), batched when they are scattered (a view's selection).
    restore_mode: str = "auto"
    # Device memory for blocks kept between restores (CUDA; 0 = none): a
    # step copies the blocks an earlier step brought from this pool, on the
    # device, and moves over PCIe only the others, with the same result bit
    # for bit. The least recently used blocks make room. The pool serves
    # batched restores: with it, restore_mode auto restores batched.
    resident_bytes: int = 0
    # Folder of the NVMe tier ("" = no NVMe tier). Workspaces written there
    # survive a restart; one server per folder (it is locked).
    nvme_dir: str = ""
    # Byte budget of the NVMe tier.
    nvme_bytes: int = 64 << 30
    # Threads doing NVMe reads and writes in each worker.
    nvme_io_threads: int = 8
    # The remote tier: a Redis (or Valkey) several servers share
    # ("redis://[user:password@]host:port/db", "rediss://..." for TLS,
    # "unix:///path/to/socket"; "" = none). Blocks are written behind once
    # committed and read back when no local tier holds them; keys carry only
    # content hashes and keyed digests under `remote_prefix`; values expire
    # after `remote_ttl_s` (0: never; the Redis `maxmemory` policy decides).
    # Servers sharing it must share `hash_secret`. `remote_timeout_ms` bounds
    # each lookup on the scheduler thread, `remote_io_timeout_ms` each read or
    # write batch of the worker's `remote_io_threads`.
    remote_url: str = ""
    remote_prefix: str = "sekv:"
    remote_ttl_s: int = 0
    remote_timeout_ms: int = 50
    remote_io_timeout_ms: int = 2000
    remote_io_threads: int = 2
    # Durability of the NVMe tier: "on" = a record is fsync-ed before its
    # rename and its folder after (a block reported written survives a power
    # loss), and the manifest's transactions are durable when they commit;
    # "off" = no fsync (a crash can lose recent records and sessions, never
    # serve a damaged one: checksums make them misses).
    nvme_sync: str = "on"
    # Named sessions kept (the least recently used beyond this are forgotten;
    # their blocks stay restorable by content).
    max_sessions: int = 100_000
    # Optional per-tenant share of the host and NVMe budgets, in percent
    # (0 = none): a tenant at its share evicts its own blocks, never another's.
    tenant_host_percent: int = 0
    tenant_nvme_percent: int = 0
    # Execution views. A prompt longer than `view_tokens` is served from a
    # view: sink + the history blocks that score highest for the new tokens
    # (in their original order) + recent + new, at positions 0..V-1, with V <=
    # view_tokens and V + max_tokens within the model's native window.
    # 0 = the native window (views then serve only prompts beyond it; see the
    # README on --max-model-len).
    view_tokens: int = 0
    # History tokens every view keeps from the start (attention sink) and from
    # the end; multiples of block_tokens.
    sink_tokens: int = 64
    recent_tokens: int = 256
    # How the views' block index summarizes a block, and how the scores of
    # layers x query heads combine into one relevance per block ("max", "mean"
    # or "top<m>"). Chosen by benchmarks/index_study among the summaries that
    # need no surprisal.
    index_summary: str = "sub4_pre"
    index_combine: str = "max"
    # SeKV: record each captured token's surprisal -log p(x_t | x_<t) from the
    # model's own logits (the LM head over every computed token: about a fifth
    # of SmolLM2-135M's forward, 7% of Llama-3-8B's). Needed by the
    # surprisal-weighted index summaries ("on" or "off").
    surprisal: str = "off"
    # SeKV anchors (with surprisal on): a history token whose surprisal exceeds
    # the running mean by `anchor_alpha` running standard deviations is an
    # anchor. A view keeps the anchors of the blocks it leaves out as single
    # tokens, the most surprising first, within `anchor_percent` percent of
    # its budget (0: no anchors).
    anchor_alpha: float = 2.0
    anchor_percent: int = 6
    # Queries that score the index: the last this many new tokens (0 = all).
    probe_query_tokens: int = 64
    # Neighbours on each side of each selected block that the view takes
    # along with it (a fact cut by a block boundary comes whole).
    view_context_blocks: int = 0
    # Passages (0 = off): each selected block brings the rest of its passage
    # (the tokens between two blank lines or chat turn boundaries,
    # `workspace.passages`), nearest first, when the passage spans at most
    # this many blocks, so a paragraph, a document or a function comes
    # whole; a longer passage's block comes alone. Replaces
    # `view_context_blocks`; loads the tokenizer at start-up to find the
    # break tokens.
    view_passage_blocks: int = 0
    # Most candidate blocks a view selects (0 = as many as its room holds; a
    # selected block's neighbours or passage count). The room left holds the
    # latest history before the recent window, as it would fill a prompt cut
    # to its end: a view of a few best blocks inside a long stretch of
    # continuous history rather than of many fragments.
    view_select_blocks: int = 0
    # "on": each selected block also brings the neighbour holding the rest of
    # a line that one of its boundaries cuts, where the line spans just the
    # two blocks (`Passages.cut`: a chain's `VAR X = VAR Y` split after
    # `VAR X`, of which only one half ranks). Not counted against
    # `view_select_blocks`; loads the tokenizer at start-up to find the
    # line breaks.
    view_cut_lines: str = "off"
    # "drop": a view leaves out the look-alikes of its lead lines (of the first
    # probe's best, the block the question names, with the lines it cuts;
    # `index.lookalikes`: their template, none of their or the new tokens'
    # rare tokens); "keep": ranked as any.
    view_lookalikes: str = "keep"
    # Passages a view takes first, beside its selection (0 = off): those Okapi
    # BM25 ranks best against the question's words (`index.lexical.question_passages`,
    # pieces of at most 256 tokens), each with what a selected block brings.
    # Not counted against `view_select_blocks`; loads the tokenizer at start-up.
    view_question_passages: int = 0
    # Token-level re-rank of a probe's best candidates (0 = off): the index's
    # `rerank_blocks` highest-scoring blocks are scored again by the probe
    # queries' attention over their actual keys (from the host tier, each
    # block placed at the same distance before the queries), and the view
    # takes them in that order, ahead of the rest. Tells apart blocks that a
    # summary cannot (look-alike facts that differ in one token).
    rerank_blocks: int = 0
    # The heads the re-rank combines: a file written by `vllm-sekv
    # calibrate-heads MODEL --out PATH` ("" = every query head). A block's
    # re-rank score is then its best mass over the model's retrieval heads
    # only (`index.retrieval_heads`), not over heads that attend by position
    # or to sink tokens whatever the question. Needs `rerank_blocks`; the file
    # is read here, at start-up, and checked against the served model by the
    # worker.
    rerank_heads_path: str = ""
    # Lexical selection (0 = off): every history block is also scored by BM25
    # over token ids against the new tokens (`index.lexical`, a passage that
    # shares the question's rare words), and the view ranks blocks by the
    # index's reciprocal rank plus `lexical_weight` times the lexical score
    # scaled to the best block's (1: the lexically best block gains what the
    # index's best has; `index.lexical.fuse`).
    lexical_weight: float = 0.0
    # Lexical candidates for the re-rank (0 = none; needs `rerank_blocks`):
    # the history blocks that BM25 over token ids ranks this many best against
    # the new tokens (`index.lexical`) are re-ranked beside the index's best,
    # so that a passage sharing the question's rare words competes on its
    # actual keys even where its summary scored low. Unlike `lexical_weight`
    # it adds no lexical score to the ranking: the re-rank's attention decides.
    lexical_candidates: int = 0
    # Probe hops (1 = one probe): with 2 or more, a view step probes again
    # with the new tokens computed behind the view the hops so far chose,
    # so their queries have read that evidence and can find what it points
    # to (the second paragraph of a two-hop question, the next link of a
    # chain) where the new tokens alone share nothing with it. The view
    # interleaves the hops' rankings: each hop's best blocks, in turn.
    # Costs one more pass per hop (a restore of the view and a prefill of
    # the new tokens).
    probe_hops: int = 1
    # With probe_hops 2 or more: how much a later hop's ranking favours the
    # blocks it lifts over the hops before it (`view_passes.interleave_hops`):
    # 0 (each hop by its own ranking) to 1 (by the lift alone).
    probe_hop_gain: float = 0.0
    # "on": a lexical hop after the first probe, interleaved with the probes'
    # rankings as one more hop: every candidate block scored alone by BM25
    # over token ids against the lead lines (`index.lookalikes`,
    # `index.lexical.hop_scores`): the line a line names among look-alikes.
    probe_lexical_hop: str = "off"
    # Of a view's selected history blocks, the first this many in the order
    # the view chose them (best score first) are computed afresh inside the
    # view instead of restored (0 = restore all). Restored KV carries the
    # context it was first computed in (an ingest chunk, an earlier step's
    # view), look-alike facts included; recomputed KV sees this view. Costs
    # a prefill of the recomputed tokens per step. Not with coarse "on".
    recompute_blocks: int = 0
    # Where recomputed blocks go: "in_order" (virtual order kept: every
    # history block from the earliest recomputed one on is recomputed, the
    # recent window included) or "after_recent" (behind the restored history
    # and the recent window: the view's order changes; computes fewer tokens,
    # answers worse on code).
    recompute_layout: str = "in_order"
    # A named set of the view keys above (`VIEW_PRESETS`), each applied by
    # `from_sources` where no source gives the key itself: "accurate" = three
    # probes re-ranked over the model's retrieval heads (`rerank_heads_path`,
    # required), the lexical hop, the best 32 blocks with their passages and
    # cut lines, look-alikes left out, every selected block recomputed in
    # order: a prefill of the view instead of its restore; "none" = each
    # key's default.
    view_preset: str = "none"
    # SeKV zoom router file written by `vllm-sekv calibrate MODEL --out PATH`
    # ("" = no router: the training-free index above selects). Checked here, at
    # start-up: the file must exist and be a valid router file; its model
    # fingerprint is checked against the served model by
    # `index.router.load_router`. With a router (and `surprisal` on) the
    # views' probes rank blocks by the router's relevance of their
    # surprisal-weighted mean keys instead of `index_summary` / `index_combine`.
    router_path: str = ""
    # SeKV coarse attention (with surprisal on): the history a view leaves out
    # still counts, as one surprisal-weighted mean key and value per surprisal
    # segment, merged into every layer's attention by log-sum-exp ("on" or
    # "off"; a request can opt out with kv_transfer_params {"coarse": false}).
    # Summaries take at most `coarse_percent` percent of the view budget (one
    # token's KV each); more segments than that are merged into coarser groups.
    coarse: str = "off"
    coarse_percent: int = 10
    # The server secret that keys tenant digests (`workspace.tenants`): ""
    # = a random one kept owner-only in `nvme_dir` (or one per process
    # without an NVMe tier). Servers that share a tier must share it; give it
    # as SEKV_HASH_SECRET (vLLM logs its command-line arguments).
    hash_secret: str = ""
    # How a view's history moves to the device: "exact", or SeKV "lowrank(r)":
    # per block and surprisal segment, rank-r factors of pre-RoPE keys and of
    # values, kept on the host next to the exact block and rebuilt on the
    # device (lossy: fewer bytes moved; pieces of r tokens or fewer stay exact),
    # or "router" (needs `router_path`): each selected block at the rank the
    # zoom router's tier gives it (its `rank_levels`, e.g. 8, 16 or exact).
    restore_codec: str = "exact"
    # How the host tier keeps K/V: "exact" (the model dtype, bit for bit) or
    # "fp8": float8 e4m3 with one float32 scale per block, K or V, layer and
    # KV head (`store.fp8`). Halves the host bytes per token (the same
    # `host_bytes` holds about twice the blocks), the bytes of a restore's
    # host->device copy and of an NVMe record; lossy (each element within
    # 2**-4 of itself, or 2**-10 of its group's amax / 448 when tiny).
    # Records and the NVMe folder carry the codec: another codec's blocks are
    # misses. Over an e4m3 paged cache (`--kv-cache-dtype fp8`) the tier
    # keeps the bytes the cache holds, under its per-layer scales. Not with
    # `remote_url`, a lossy `restore_codec`, or another quantized paged cache
    # (refused when the model is known).
    workspace_codec: str = "exact"

    _SIZES = ("host_bytes", "nvme_bytes", "resident_bytes")
    _STRINGS = ("nvme_dir", "index_combine", "router_path", "rerank_heads_path", "restore_codec", "hash_secret",
                "remote_url", "remote_prefix")
    _FLOATS = ("anchor_alpha", "lexical_weight", "probe_hop_gain")
    _CHOICES = {"policy": POLICIES, "index_summary": INDEX_SUMMARIES, "restore_mode": RESTORE_MODES,
                "surprisal": ON_OFF, "coarse": ON_OFF, "view_cut_lines": ON_OFF, "nvme_sync": ON_OFF,
                "probe_lexical_hop": ON_OFF, "view_lookalikes": LOOKALIKES,
                "recompute_layout": RECOMPUTE_LAYOUTS, "workspace_codec": WORKSPACE_CODECS,
                "view_preset": tuple(VIEW_PRESETS)}

    def __post_init__(self) -> None:
        bt = self.block_tokens
        if bt < 8 or bt > 256 or bt & (bt - 1):
            raise ValueError(
                f"sekv config 'block_tokens': expected a power of two from 8 to 256, got {bt}"
            )
        if not 0 <= self.protected_percent <= 100:
            raise ValueError(
                f"sekv config 'protected_percent': expected 0..100, got {self.protected_percent}"
            )
        if self.max_sessions < 1:
            raise ValueError(f"sekv config 'max_sessions': expected at least 1, got {self.max_sessions}")
        for key in ("tenant_host_percent", "tenant_nvme_percent"):
            if not 0 <= getattr(self, key) <= 100:
                raise ValueError(f"sekv config '{key}': expected 0..100 (0: no share), got {getattr(self, key)}")
        if not 1 <= self.nvme_io_threads <= 256:
            raise ValueError(f"sekv config 'nvme_io_threads': expected 1..256, got {self.nvme_io_threads}")
        for key in ("sink_tokens", "recent_tokens"):
            n = getattr(self, key)
            if n < 0 or n % bt:
                raise ValueError(
                    f"sekv config '{key}': expected a non-negative multiple of block_tokens "
                    f"({bt}), got {n}"
                )
        for key in ("view_tokens", "probe_query_tokens", "view_context_blocks", "rerank_blocks",
                    "lexical_candidates", "recompute_blocks", "view_select_blocks"):
            if getattr(self, key) < 0:
                raise ValueError(f"sekv config '{key}': must not be negative, got {getattr(self, key)}")
        if self.view_tokens and self.view_tokens < self.sink_tokens + self.recent_tokens + 2 * bt:
            raise ValueError(
                f"sekv config 'view_tokens': {self.view_tokens} leaves no room for selected "
                f"history and new tokens next to sink_tokens + recent_tokens = "
                f"{self.sink_tokens + self.recent_tokens}; use 0 (the model's window) or at "
                f"least {self.sink_tokens + self.recent_tokens + 2 * bt}"
            )
        if not 0 <= self.view_question_passages <= MAX_QUESTION_PASSAGES:
            raise ValueError(f"sekv config 'view_question_passages': expected 0..{MAX_QUESTION_PASSAGES} "
                             f"(0: off), got {self.view_question_passages}")
        if not 0 <= self.view_passage_blocks <= MAX_VIEW_PASSAGE_BLOCKS:
            raise ValueError(f"sekv config 'view_passage_blocks': expected 0..{MAX_VIEW_PASSAGE_BLOCKS} "
                             f"(0: off), got {self.view_passage_blocks}")
        if self.view_passage_blocks and self.view_context_blocks:
            raise ValueError("sekv config 'view_passage_blocks': a selected block brings either its passage or "
                             "view_context_blocks neighbours; set one of them to 0")
        if not 1 <= self.probe_hops <= MAX_PROBE_HOPS:
            raise ValueError(f"sekv config 'probe_hops': expected 1..{MAX_PROBE_HOPS}, got {self.probe_hops}")
        if not 0.0 <= self.probe_hop_gain <= 1.0:
            raise ValueError(f"sekv config 'probe_hop_gain': expected 0 to 1, got {self.probe_hop_gain}")
        if not _COMBINE_RE.match(self.index_combine):
            raise ValueError(
                f"sekv config 'index_combine': expected mean, max or top<m> (e.g. top8), "
                f"got {self.index_combine!r}"
            )
        for key in ("anchor_alpha", "lexical_weight"):
            if not (math.isfinite(getattr(self, key)) and getattr(self, key) >= 0):
                raise ValueError(f"sekv config '{key}': expected a finite number >= 0, got {getattr(self, key)}")
        if not 0 <= self.anchor_percent <= 50:
            raise ValueError(f"sekv config 'anchor_percent': expected 0..50, got {self.anchor_percent}")
        if self.index_summary in SURPRISAL_SUMMARIES and self.surprisal != "on":
            raise ValueError(
                f"sekv config 'index_summary': {self.index_summary} weights tokens by their "
                f"surprisal; set 'surprisal' to on, or pick a summary without weights"
            )
        if self.resident_bytes and self.restore_mode == "layerwise":
            raise ValueError("sekv config 'resident_bytes': the resident pool serves batched restores; "
                             "set 'restore_mode' to auto or batched, or resident_bytes to 0")
        if self.min_restore_tokens < 0:
            raise ValueError(f"sekv config 'min_restore_tokens': must not be negative, got {self.min_restore_tokens}")
        if self.coarse == "on" and self.surprisal != "on":
            raise ValueError("sekv config 'coarse': summaries are surprisal-weighted and follow "
                             "surprisal segments; set 'surprisal' to on")
        if not 1 <= self.coarse_percent <= 50:
            raise ValueError(f"sekv config 'coarse_percent': expected 1..50, got {self.coarse_percent}")
        if self.restore_codec == ROUTER_CODEC:
            if not self.router_path:
                raise ValueError("sekv config 'restore_codec': 'router' takes each block's rank from "
                                 "the zoom router's tiers; set 'router_path' too")
        elif self.restore_codec != "exact":  # torch is imported only for a lossy codec
            from vllm_sekv.store.codecs import parse_codec

            try:
                parse_codec(self.restore_codec)
            except ValueError as e:
                raise ValueError(f"sekv config 'restore_codec': {e} (or 'router')") from None
        if self.workspace_codec == "fp8":
            if self.remote_url:
                raise ValueError("sekv config 'workspace_codec': fp8 is not supported with 'remote_url' "
                                 "(the remote tier stores exact blocks); use workspace_codec exact or "
                                 "no remote_url")
            if self.restore_codec != "exact":
                raise ValueError("sekv config 'workspace_codec': fp8 cannot be combined with a lossy "
                                 f"'restore_codec' ({self.restore_codec!r}); use restore_codec exact")
        if self.remote_url:
            from vllm_sekv.store.remote import check_url

            check_url(self.remote_url)
            if not self.hash_secret:
                raise ValueError("sekv config 'remote_url': servers sharing a remote tier must share "
                                 "'hash_secret' (give the same SEKV_HASH_SECRET to every server)")
        for key in ("remote_ttl_s", "remote_timeout_ms", "remote_io_timeout_ms", "remote_io_threads"):
            if getattr(self, key) < (0 if key == "remote_ttl_s" else 1):
                raise ValueError(f"sekv config '{key}': must be {'>= 0' if key == 'remote_ttl_s' else '> 0'}, "
                                 f"got {getattr(self, key)}")
        if self.hash_secret and len(self.hash_secret.encode()) < 16:
            raise ValueError("sekv config 'hash_secret': at least 16 bytes, or \"\" for a generated one")
        if self.recompute_blocks and self.coarse == "on":
            raise ValueError("sekv config 'recompute_blocks': coarse summaries are placed by the view's "
                             "virtual order, which recomputed blocks leave; use recompute_blocks 0 "
                             "with coarse on")
        if self.lexical_candidates and not self.rerank_blocks:
            raise ValueError("sekv config 'lexical_candidates': lexical candidates join the token-level "
                             "re-rank; set 'rerank_blocks' too")
        if self.rerank_heads_path:
            if not self.rerank_blocks:
                raise ValueError("sekv config 'rerank_heads_path': the heads are the token-level re-rank's; "
                                 "set 'rerank_blocks' too")
            from vllm_sekv.index.retrieval_heads import read_heads_file

            read_heads_file(self.rerank_heads_path)  # raises naming 'rerank_heads_path'
        if self.view_preset == "accurate" and not self.rerank_heads_path:
            raise ValueError("sekv config 'view_preset': accurate re-ranks over the model's retrieval heads; "
                             "set 'rerank_heads_path' to the file `vllm-sekv calibrate-heads MODEL --out PATH` "
                             "writes (once per model)")
        if self.rerank_blocks and self.router_path:
            raise ValueError("sekv config 'rerank_blocks': the zoom router ranks blocks on its own; "
                             "use rerank_blocks 0 with router_path")
        if self.router_path:
            if self.surprisal != "on":
                raise ValueError("sekv config 'router_path': the zoom router scores surprisal-weighted "
                                 "summaries; set 'surprisal' to on")
            # torch is imported only when a router is configured; raises naming 'router_path'
            from vllm_sekv.index.router import read_router_file

            read_router_file(self.router_path)

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_sources(
        cls, extra_config: Mapping[str, Any] | None, environ: Mapping[str, str] | None = None
    ) -> "SekvConfig":
        """Build from `kv_connector_extra_config`, then `SEKV_*` environment
        overrides; `view_preset`'s keys where neither gives them."""
        environ = os.environ if environ is None else environ
        known = cls.keys()
        raw: dict[str, Any] = {}
        for key, value in (extra_config or {}).items():
            if key not in known:
                raise ValueError(
                    f"sekv config: unknown key '{key}' in kv_connector_extra_config; "
                    f"accepted keys: {', '.join(known)}"
                )
            raw[key] = cls._parse(key, value)  # a bad value fails even if overridden
        for name, value in environ.items():
            if not name.startswith(ENV_PREFIX) or name in NON_CONFIG_ENV:
                continue
            key = name[len(ENV_PREFIX):].lower()
            if key not in known:
                raise ValueError(
                    f"sekv config: unknown environment variable '{name}'; accepted: "
                    + ", ".join(ENV_PREFIX + k.upper() for k in known)
                )
            raw[key] = cls._parse(key, value)
        preset = raw.get("view_preset", cls.view_preset)
        filled = {key: value for key, value in VIEW_PRESETS[preset].items() if key not in raw}
        try:
            return cls(**raw, **filled)
        except ValueError as e:  # name the preset where it set the key the error names
            named = [key for key in filled if f"'{key}'" in str(e)]
            if not named:
                raise
            raise ValueError(f"{e} (view_preset {preset!r} sets '{named[0]}'; give the key to change it)") from None

    @classmethod
    def _parse(cls, key: str, value: Any) -> Any:
        if key in cls._SIZES:
            return parse_size_bytes(key, value)
        if key in cls._STRINGS:
            return str(value)
        if key in cls._FLOATS:
            return parse_float(key, value)
        if key in cls._CHOICES:
            return parse_choice(key, value, cls._CHOICES[key])
        return parse_int(key, value)

    def to_extra_config(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

