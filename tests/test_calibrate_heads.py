"""`vllm-sekv calibrate-heads` (vllm_sekv.calibrate_heads) end to end on
SmolLM2-135M, float32, CPU: the shares it measures are the model's own
attention, and a real model's best heads put several times the asked line's
share of the history on it."""
import json

import pytest
import torch

from vllm_sekv.cli import main

pytest.importorskip("transformers")


def test_calibrate_heads_writes_the_heads_that_find_the_asked_fact(model_dir, tmp_path, capsys):
    from vllm_sekv.calibrate import load_model
    from vllm_sekv.config import SekvConfig
    from vllm_sekv.index.retrieval_heads import load_heads, read_heads_file

    out = str(tmp_path / "heads.json")
    assert main(["calibrate-heads", model_dir, "--out", out, "--texts", "2", "--tokens", "512", "--heads", "6"]) == 0
    printed = capsys.readouterr().out
    assert "retrieval heads of" in printed and f"wrote {out}" in printed
    _, _, geometry = load_model(model_dir)
    found = read_heads_file(out)
    assert found.geometry == geometry and len(found.heads) == 6
    share = torch.tensor(found.share)
    assert share.shape == (geometry.num_layers, geometry.num_q_heads) and ((share >= 0) & (share <= 1)).all()
    best = [float(share[h]) for h in found.heads]
    assert best == sorted(best, reverse=True) and best[-1] >= share.flatten().topk(6).values[-1] - 1e-6
    # the asked line is about 20 of the 448 history tokens past the sink (a share of about 0.05);
    # the best heads put far more than that on it, the average head less
    assert best[0] > 5 * 0.05 and share.mean() < best[0] / 3
    assert json.loads(open(out).read())["calibration"]["texts"] == 2
    cfg = SekvConfig.from_sources({"rerank_blocks": 64, "rerank_heads_path": out}, environ={})
    assert load_heads(cfg, geometry) == [layer * geometry.num_q_heads + h for layer, h in found.heads]


def test_the_shares_are_the_models_own_attention(model_dir):
    from transformers import AutoModelForCausalLM

    from vllm_sekv.calibrate import _Capture, load_model
    from vllm_sekv.calibrate_heads import HeadsArgs, head_shares, make_text

    model, tok, geometry = load_model(model_dir)
    args = HeadsArgs(model=model_dir, out="", tokens=400, facts=3, sink_tokens=32)
    from vllm_sekv.calibration_corpus import essay_text

    stream = tok.encode(essay_text(max_chars=20_000), add_special_tokens=False)
    ids, hist, (a, b) = make_text(tok, stream, args, 1)
    assert "access code of" in tok.decode(ids[a:b]) and hist < len(ids)
    got = head_shares(model, _Capture(model, geometry), geometry, ids, hist, (a, b), 32)
    eager = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        att = eager(input_ids=torch.tensor([ids]), output_attentions=True).attentions
    for layer in range(geometry.num_layers):
        history = att[layer][0, :, hist:, :hist]          # each question token's attention on the history,
        history = history / history.sum(-1, keepdim=True)  # normalized over it, as the re-rank's over its blocks
        per_token = history[..., 32:].sum(1)                # [Hq, hist - 32]
        want = per_token[:, a - 32:b - 32].sum(-1) / per_token.sum(-1)
        torch.testing.assert_close(got[layer], want, rtol=1e-3, atol=1e-4)


def test_calibrate_heads_rejects_bad_arguments(model_dir, tmp_path, capsys):
    assert main(["calibrate-heads", model_dir, "--out", str(tmp_path / "h.json"), "--tokens", "100"]) == 2
    assert "'tokens'" in capsys.readouterr().err
    assert main(["calibrate-heads", model_dir, "--out", str(tmp_path / "h.json"), "--heads", "100000",
                 "--tokens", "512", "--texts", "1"]) == 2
    assert "'heads'" in capsys.readouterr().err
    assert main(["calibrate-heads", str(tmp_path / "nowhere"), "--out", str(tmp_path / "h.json")]) == 2
    assert "'model'" in capsys.readouterr().err
