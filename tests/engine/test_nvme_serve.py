"""The NVMe tier through real `vllm serve` processes: restart, faults, a second
server, hostile session ids. Every answer is compared with a plain server's."""
import urllib.error
from pathlib import Path

import pytest

from testbed.serving import LocalServer
from vllm_sekv.workspace.manifest import Manifest

from test_http_serve import VLLM_ARGS, post

pytestmark = pytest.mark.engine

ENV = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}
HOSTILE_IDS = ["../../etc/passwd", "x" * 256, "会话/🙂\\..", "\x00nul", ""]  # served ("": no session)
REFUSED_IDS = ["x" * 5000]  # an HTTP 400 naming session_id


def sekv_config(nvme_dir):
    return {"host_bytes": "256M", "nvme_dir": str(nvme_dir), "nvme_bytes": "1G"}


def history(essay, steps):
    messages = [{"role": "system", "content": "You are a careful research agent."}]
    for i in range(steps):
        chunk = essay[i * 2500 : (i + 1) * 2500]
        messages.append({"role": "user", "content": f"Tool output:\n{chunk}\n\nSummarize it in one line."})
        messages.append({"role": "assistant", "content": f"Summary {i}."})
    return messages[:-1]  # ends with the last user turn


def ask(url, model, messages, session_id="agent-1", reset=True):
    if reset:
        post(url, "/reset_prefix_cache")
    body = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0,
            "session_id": session_id}
    return post(url, "/v1/chat/completions", body)


def answer(r):
    return r["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def plain_answers(model_dir, essay):
    with LocalServer(model_dir, sekv=None, vllm_args=VLLM_ARGS, env=ENV) as server:
        return [answer(ask(server.url, model_dir, history(essay, n))) for n in (1, 2, 3, 4)]


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("nvme")


@pytest.fixture(scope="module")
def first_life(model_dir, essay, nvme_dir, plain_answers):
    """A server that sees steps 1-2 of the session, then stops."""
    with LocalServer(model_dir, sekv=sekv_config(nvme_dir), vllm_args=VLLM_ARGS, env=ENV) as server:
        out = [ask(server.url, model_dir, history(essay, n)) for n in (1, 2)]
        for sid in HOSTILE_IDS:
            out.append(ask(server.url, model_dir, history(essay, 1), session_id=sid))
        for sid in REFUSED_IDS:
            try:
                ask(server.url, model_dir, history(essay, 1), session_id=sid)
                out.append((200, ""))
            except urllib.error.HTTPError as e:
                out.append((e.code, e.read().decode(errors="replace")))
    return out


def test_first_life_answers_equal_plain(first_life, plain_answers):
    assert [answer(r) for r in first_life[:2]] == plain_answers[:2]


def test_hostile_session_ids_are_served_or_refused_and_never_become_paths(first_life, nvme_dir, plain_answers):
    served, refused = first_life[2 : 2 + len(HOSTILE_IDS)], first_life[2 + len(HOSTILE_IDS):]
    for r in served:
        assert answer(r) == plain_answers[0]
    for status, message in refused:
        assert status == 400 and "session_id" in message
    names = {p.name for p in Path(nvme_dir).rglob("*")}
    assert not any(sid and sid in name for sid in HOSTILE_IDS + REFUSED_IDS for name in names)
    assert not Path("/etc/passwd.blk").exists()
    (fp,) = [d for d in Path(nvme_dir).iterdir() if d.name.startswith("fp-")]
    manifest = Manifest(fp / "manifest.sqlite", {})
    assert {w.session_id for w in manifest.load()} == {"agent-1", *filter(None, HOSTILE_IDS)}
    manifest.close()


def test_restart_restores_from_nvme_and_computes_only_new_tokens(model_dir, essay, nvme_dir,
                                                                 first_life, plain_answers):
    with LocalServer(model_dir, sekv=sekv_config(nvme_dir), vllm_args=VLLM_ARGS, env=ENV) as server:
        r = ask(server.url, model_dir, history(essay, 3))
        params = r["kv_transfer_params"]["sekv"]
        assert answer(r) == plain_answers[2]
        prev_prompt = first_life[1]["usage"]["prompt_tokens"]
        assert params["restored_tokens"]["nvme"] >= prev_prompt // 32 * 32
        assert params["prefilled_tokens"] == r["usage"]["prompt_tokens"] - params["restored_tokens"]["nvme"]
        # a second server on the same folder is refused at start-up
        other = LocalServer(model_dir, sekv=sekv_config(nvme_dir), vllm_args=VLLM_ARGS, env=ENV)
        with pytest.raises(RuntimeError, match="server exited"):
            other.start(timeout_s=300)
        assert "is in use by another sekv server" in other.log_path.read_text(errors="replace")
        # the first server still serves
        assert answer(ask(server.url, model_dir, history(essay, 3))) == plain_answers[2]


def corrupt(nvme_dir):
    """Damage three records in three ways; return the damaged paths."""
    files = sorted(Path(nvme_dir).rglob("*.blk"), key=lambda p: p.stat().st_mtime)
    flipped, truncated, deleted = files[2], files[5], files[8]
    with open(flipped, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 0xFF]))
    with open(truncated, "r+b") as f:
        f.truncate(4096 + 100)
    deleted.unlink()
    return flipped, truncated, deleted


def test_damaged_records_are_recomputed_with_correct_answers(model_dir, essay, nvme_dir, plain_answers,
                                                             tmp_path):
    corrupt(nvme_dir)
    server = LocalServer(model_dir, sekv=sekv_config(nvme_dir), vllm_args=VLLM_ARGS, env=ENV)
    with server:
        r = ask(server.url, model_dir, history(essay, 4))
        assert answer(r) == plain_answers[3]
        assert r["kv_transfer_params"]["sekv"]["prefilled_tokens"] > 0
        again = ask(server.url, model_dir, history(essay, 4))  # and it keeps serving
        assert answer(again) == plain_answers[3]
    log = server.log_path.read_text(errors="replace")
    assert "failed (" in log and "it is a miss and will be recomputed" in log
    assert "checksum mismatch" in log or "short read" in log or "ENOENT" in log


def test_full_then_read_only_disk_costs_only_recompute(model_dir, essay, plain_answers, tmp_path):
    """The NVMe folder on a real 8 MiB filesystem: it fills up (ENOSPC), then its
    record folders are made read-only (read-only bind mounts: EROFS). Writes fail
    with log lines; answers stay right; the server keeps serving."""
    import subprocess

    root = tmp_path / "small"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(root)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    read_only = []
    try:
        server = LocalServer(model_dir, sekv=sekv_config(root), vllm_args=VLLM_ARGS, env=ENV)
        with server:
            got = [answer(ask(server.url, model_dir, history(essay, n))) for n in (1, 2)]
            (fp,) = [d for d in root.iterdir() if d.name.startswith("fp-")]
            for sub in (fp / "tmp", fp / "blocks"):
                subprocess.run(["mount", "--bind", str(sub), str(sub)], check=True)
                subprocess.run(["mount", "-o", "remount,bind,ro", str(sub)], check=True)
                read_only.append(sub)
            got += [answer(ask(server.url, model_dir, history(essay, n))) for n in (3, 4)]
        assert got == plain_answers
        log = server.log_path.read_text(errors="replace")
        assert "ENOSPC" in log and "EROFS" in log and "will be recomputed" in log
    finally:
        for sub in read_only:
            subprocess.run(["umount", "-l", str(sub)], capture_output=True)
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
