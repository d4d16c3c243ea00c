"""`vllm-sekv calibrate` (vllm_sekv.calibrate) end to end on a tiny random-weight
Llama stand-in (2 layers, 4 query / 2 KV heads, head_dim 16, a BPE tokenizer
trained here on the essays): the same code path as SmolLM2, in seconds."""
import torch
import pytest

from vllm_sekv.cli import main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from vllm_sekv.calibration_corpus import essay_text

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([essay_text(max_chars=60_000)],
                            trainers.BpeTrainer(vocab_size=800, special_tokens=["<unk>"], show_progress=False))
    # vocab 32768 (most ids unused) so the model has 4.3M parameters: a 0.05% budget of 2,134
    # fits the 1,052-parameter router
    cfg = LlamaConfig(vocab_size=32768, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=False, rope_theta=10000.0)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(path)
    return str(path)


ARGS = ["--texts", "2", "--heldout", "1", "--tokens", "1024", "--new-tokens", "32", "--steps", "5",
        "--recent-tokens", "64", "--budgets", "64", "128"]


def test_calibrate_writes_a_loadable_router(tiny_model_dir, tmp_path, capsys):
    from vllm_sekv.calibrate import load_model
    from vllm_sekv.config import SekvConfig
    from vllm_sekv.index.router import ZoomRouter, load_router

    out, cache = str(tmp_path / "router.pt"), tmp_path / "cache"
    assert main(["calibrate", tiny_model_dir, "--out", out, "--cache-dir", str(cache), *ARGS]) == 0
    printed = capsys.readouterr().out
    assert "heldout: 1 texts" in printed and "router (trained)" in printed and "1052 parameters" in printed
    assert len(list(cache.glob("*.pt"))) == 3                    # 2 training + 1 held-out text
    _, _, geometry = load_model(tiny_model_dir)
    router = ZoomRouter.load(out, geometry)
    assert router.num_parameters() == 1052 and router.meta["train_s"] >= 0
    for split in ("train", "heldout"):
        rows = router.meta[split]["rows"]
        kept = router.meta[split]["kept_only"]
        for name, row in rows.items():          # the oracle's top k hold the most mass
            assert kept <= row["k=8"] <= rows["oracle (true attention mass)"]["k=8"] + 1e-6, name
    cfg = SekvConfig.from_sources({"router_path": out, "surprisal": "on"}, environ={})
    assert isinstance(load_router(cfg, geometry), ZoomRouter)
    # a re-run reads the cached samples and gives the same figures
    out2 = str(tmp_path / "router2.pt")
    assert main(["calibrate", tiny_model_dir, "--out", out2, "--cache-dir", str(cache), *ARGS]) == 0
    again = ZoomRouter.load(out2, geometry)
    assert again.meta["heldout"] == router.meta["heldout"]
    for a, b in zip(router.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)


def test_captured_attention_mass_matches_the_models_own_attention(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from vllm_sekv.calibrate import _Capture, capture_sample, load_model
    from vllm_sekv.workspace.segment_summaries import summary_token_weights
    from vllm_sekv.workspace.segments import Segments

    model, tok, geometry = load_model(tiny_model_dir)
    ids = torch.randint(0, 800, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    rec = capture_sample(model, _Capture(model, geometry), ids, new_tokens=20, alpha=0.5)
    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    with torch.no_grad():
        att = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    hist = rec["hist"]
    segs = Segments(rec["starts"], rec["ends"], rec["is_anchor"])
    assert hist == 280 and segs.num_tokens == hist and segs.num_segments > 1 and segs.is_anchor[1:].any()
    seg_ids, _, n_s = summary_token_weights(torch.ones(hist), segs)      # anchors left out
    assert torch.equal(n_s, rec["summary_tokens"])
    for layer in range(geometry.num_layers):
        per_token = att[layer][0, :, hist:, :hist].sum(1)                 # [Hq, hist]
        assert torch.allclose(rec["total_mass"][layer], per_token.sum(-1), atol=1e-4)
        want = torch.stack([per_token[:, seg_ids == s].sum(-1) for s in range(segs.num_segments)], -1)
        assert torch.allclose(rec["mass"][layer], want, atol=1e-5)
    assert rec["q"].shape == (2, 20, 4, 16) and rec["summary_keys"].shape == (2, segs.num_segments, 2, 16)

def test_calibrate_rejects_bad_arguments(tiny_model_dir, tmp_path, capsys):
    assert main(["calibrate", tiny_model_dir, "--out", str(tmp_path / "r.pt"), "--tokens", "100"]) == 2
    assert "'tokens'" in capsys.readouterr().err
    assert main(["calibrate", str(tmp_path / "nowhere"), "--out", str(tmp_path / "r.pt")]) == 2
    assert "'model'" in capsys.readouterr().err
