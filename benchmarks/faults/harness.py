"""Randomized fault injection against a real `vllm serve` with the sekv connector.

A seeded run alternates agent requests and faults:

* requests: the steps of a few multi-tenant sessions (growing histories of
  essay text), each answered greedily and compared token by token with what
  a plain vLLM server answered to the same prompt;
* faults, each drawn from the seed (kind, target, offset, timing), between
  requests or while one runs:
  `flip_payload`, `flip_header` (a bit of a record's identity or checksum),
  `truncate`, `delete_record`, `swap_record` (a valid record of another block
  under a block's name), `remove_folder` (tmp/ or a blocks/ subfolder),
  `fill_disk` (a filler file takes the folder's filesystem, freed later),
  `damage_manifest`, `junk` (a FIFO, a folder and garbage where records go),
  and `kill` (SIGKILL of the whole server, also mid-request and mid-write,
  then a restart on the same folder).

What it counts (`Counters`): faults by kind, kills, restarts, requests, wrong
tokens (positions where an answer differs from plain vLLM's, plus missing or
extra tokens), engine crashes (the server gone or an answer that is no answer,
without a kill), failed start-ups, and the tokens restored from the NVMe tier
by the first request after each restart.

The folder lives on a tmpfs of `disk_mib` where the process may mount one
(root), so that a full disk is a real ENOSPC; elsewhere `fill_disk` is
skipped. Blocking, single-threaded except for the request a fault overlaps.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

FAULTS = ("flip_payload", "flip_header", "truncate", "delete_record", "swap_record", "remove_folder",
          "fill_disk", "damage_manifest", "junk", "kill")
WEIGHTS = {"flip_payload": 6, "flip_header": 6, "truncate": 4, "delete_record": 4, "swap_record": 4,
           "remove_folder": 2, "fill_disk": 1, "damage_manifest": 1, "junk": 1, "kill": 1}
HEADER_IDENTITY_BYTES = 136  # a record header's identity, checksum and CRC (`store.records`)


# Seconds the last kill waits for the write-behind of the requests before it.
WRITE_BEHIND_S = 3.0


@dataclass
class Counters:
    faults_injected: int = 0
    faults_by_kind: Counter = field(default_factory=Counter)
    kills: int = 0
    restarts: int = 0
    requests: int = 0
    wrong_tokens: int = 0
    wrong_answers: int = 0
    engine_crashes: int = 0
    failed_startups: int = 0
    restored_after_restart_tokens: int = 0
    refused_requests: int = 0  # HTTP errors that are not a crash (none expected)

    def summary(self) -> dict:
        out = asdict(self)
        out["faults_by_kind"] = dict(sorted(self.faults_by_kind.items()))
        return out


@dataclass(frozen=True)
class Step:
    tenant: str
    session: str
    prompt: str


def sessions(essay: str, tenants: int = 2, per_tenant: int = 2, steps: int = 5, chunk_chars: int = 1400,
             skip_chars: int = 0, name: str = "s") -> list[list[Step]]:
    """Each session's steps: its history grows by one tool result per step.
    Each session reads its own stretch of the essay, after its first
    `skip_chars`; sessions are named `{name}{tenant}-{session}`."""
    out = []
    for t in range(tenants):
        for s in range(per_tenant):
            start = skip_chars + (t * per_tenant + s) * steps * chunk_chars
            text, session = "", []
            for k in range(steps):
                piece = essay[start + k * chunk_chars : start + (k + 1) * chunk_chars]
                text += f"\n\nTool output {k + 1}:\n{piece}\n\nNotes so far:"
                session.append(Step(f"tenant-{t}", f"{name}{t}-{s}", text))
            out.append(session)
    return out


def complete(url: str, model: str, step: Step, max_tokens: int, sekv: bool, timeout: float = 600) -> dict:
    """One greedy completion: its token ids and the connector's figures."""
    body = {"model": model, "prompt": step.prompt, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "cache_salt": step.tenant}
    if sekv:
        body["kv_transfer_params"] = {"session_id": step.session}
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        out = json.loads(r.read())
    choice = out["choices"][0]
    return {"token_ids": list(choice.get("token_ids") or []), "sekv": (out.get("kv_transfer_params") or {}).get("sekv")}


def reset_prefix_cache(url: str) -> None:
    req = urllib.request.Request(url + "/reset_prefix_cache", method="POST")
    urllib.request.urlopen(req, timeout=60).close()


def mount_tmpfs(path: Path, mib: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(path)],
                          capture_output=True).returncode == 0


class FaultRun:
    def __init__(self, model: str, workdir: Path, seed: int, vllm_args: list[str], env: dict[str, str],
                 sekv_config: dict, disk_mib: int = 160, max_tokens: int = 8, log=print) -> None:
        self.model, self.workdir, self.rng = model, Path(workdir), random.Random(seed)
        self.seed, self.vllm_args, self.env = seed, vllm_args, env
        self.max_tokens, self.log = max_tokens, log
        self.nvme_dir = self.workdir / "nvme"
        self.tmpfs = mount_tmpfs(self.nvme_dir, disk_mib)
        self.sekv_config = {**sekv_config, "nvme_dir": str(self.nvme_dir)}
        self.counters = Counters()
        self.server = None
        self.reference: dict[Step, list[int]] = {}
        self._filler: Path | None = None
        self._restarted = False

    # ------------------------------------------------------------ servers

    def compute_reference(self, steps: list[Step]) -> None:
        """Plain vLLM's greedy tokens for every step (its prefix cache reset before each)."""
        from testbed.serving import LocalServer

        with LocalServer(self.model, None, self.vllm_args, self.env,
                         log_path=self.workdir / "plain.log") as plain:
            for step in steps:
                reset_prefix_cache(plain.url)
                self.reference[step] = complete(plain.url, self.model, step, self.max_tokens, sekv=False)["token_ids"]

    def start(self) -> None:
        from testbed.serving import LocalServer

        for attempt in range(2):
            self.server = LocalServer(self.model, self.sekv_config, self.vllm_args, self.env,
                                      log_path=self.workdir / f"sekv-{self.counters.restarts}-{attempt}.log")
            try:
                self.server.start(timeout_s=600)
                return
            except (RuntimeError, TimeoutError) as e:
                self.counters.failed_startups += 1
                self.log(f"  START-UP FAILED: {str(e)[-400:]}")
        raise RuntimeError("the sekv server did not start twice in a row")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        self._free_disk()

    def close(self) -> None:
        self.stop()
        if self.tmpfs:
            subprocess.run(["umount", "-l", str(self.nvme_dir)], capture_output=True)

    def _alive(self) -> bool:
        return self.server is not None and self.server.proc is not None and self.server.proc.poll() is None

    # ------------------------------------------------------------ requests

    def request(self, step: Step, during: str | None = None) -> None:
        """Send `step` (with a fault of kind `during` injected while it runs)."""
        result: dict = {}

        def send() -> None:
            try:
                reset_prefix_cache(self.server.url)
                result["out"] = complete(self.server.url, self.model, step, self.max_tokens, sekv=True)
            except urllib.error.HTTPError as e:
                result["http"] = (e.code, e.read().decode(errors="replace")[:300])
            except (urllib.error.URLError, OSError, ValueError) as e:
                result["error"] = repr(e)

        thread = threading.Thread(target=send)
        thread.start()
        killed = False
        if during is not None:
            time.sleep(self.rng.uniform(0.0, 1.5))
            killed = self.inject(during)
        thread.join()
        self.counters.requests += 1
        if killed:
            return  # answered or not, the server was killed under it
        if "out" not in result:
            if not self._alive() or "error" in result:
                self.counters.engine_crashes += 1
                self.log(f"  CRASH on {step.session}: {result}")
                self.restart()
            else:
                self.counters.refused_requests += 1
                self.log(f"  REFUSED {step.session}: {result}")
            return
        got, want = result["out"]["token_ids"], self.reference[step]
        wrong = sum(a != b for a, b in zip(got, want)) + abs(len(got) - len(want))
        if wrong:
            self.counters.wrong_answers += 1
            self.log(f"  WRONG {step.session}: {got} != {want}")
        self.counters.wrong_tokens += wrong
        if self._restarted:
            restored = (result["out"]["sekv"] or {}).get("restored_tokens", {})
            self.counters.restored_after_restart_tokens += int(restored.get("nvme", 0))
            self._restarted = False

    def restart(self) -> None:
        self.stop()
        self.start()
        self.counters.restarts += 1
        self._restarted = True

    # -------------------------------------------------------------- faults

    def _folder(self) -> Path | None:
        folders = [d for d in self.nvme_dir.glob("fp-*") if d.is_dir()]
        return folders[0] if folders else None

    def _records(self) -> list[Path]:
        """The record files (regular files; a `junk` fault leaves others)."""
        folder = self._folder()
        paths = sorted(folder.glob("blocks/*/*.blk")) if folder else []
        return [p for p in paths if p.is_file() and not p.is_symlink()]

    def inject(self, kind: str) -> bool:
        """Inject one fault; True if it killed the server (and restarted it)."""
        records, rng = self._records(), self.rng
        folder = self._folder()
        did = True
        try:
            if kind == "kill":
                os.killpg(self.server.proc.pid, signal.SIGKILL)
                self.server.proc.wait()
                self.counters.kills += 1
                self.restart()
            elif kind in ("flip_payload", "flip_header", "truncate", "delete_record") and records:
                path = rng.choice(records)
                size = path.stat().st_size
                lo, hi = (4096, size) if kind == "flip_payload" else (0, min(HEADER_IDENTITY_BYTES, size))
                if kind == "delete_record":
                    path.unlink()
                elif kind == "truncate":
                    os.truncate(path, rng.randrange(0, max(size, 1)))
                elif hi <= lo:  # an earlier fault left the file too short for this one
                    did = False
                else:
                    offset = rng.randrange(lo, hi)
                    with open(path, "r+b") as f:
                        f.seek(offset)
                        byte = f.read(1)
                        f.seek(offset)
                        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
            elif kind == "swap_record" and len(records) >= 2:
                a, b = rng.sample(records, 2)
                shutil.copyfile(a, b)
            elif kind == "remove_folder" and folder is not None:
                subs = [folder / "tmp", *sorted((folder / "blocks").glob("*"))]
                shutil.rmtree(rng.choice(subs), ignore_errors=True)
            elif kind == "fill_disk" and self.tmpfs:
                self._fill_disk()
            elif kind == "damage_manifest" and folder is not None and (folder / "manifest.sqlite").exists():
                path = folder / "manifest.sqlite"
                data = bytearray(path.read_bytes())
                for _ in range(rng.randrange(1, 64)):
                    if data:
                        data[rng.randrange(len(data))] = rng.randrange(256)
                path.write_bytes(bytes(data[: rng.randrange(len(data) + 1)] if rng.random() < 0.3 else data))
            elif kind == "junk" and folder is not None:
                where = folder / "blocks" / f"{rng.randrange(256):02x}"
                where.mkdir(parents=True, exist_ok=True)
                name = f"{rng.getrandbits(128):032x}.r0.blk"
                choice = rng.randrange(3)
                if choice == 0:
                    os.mkfifo(where / name)
                elif choice == 1:
                    (where / name).mkdir()
                else:
                    (where / name).write_bytes(os.urandom(rng.randrange(1, 9000)))
                (folder / "tmp" / f"junk-{rng.getrandbits(32)}").mkdir(parents=True, exist_ok=True)
            else:
                did = False
        except (OSError, shutil.Error):
            did = True  # the server removed it first, a junk fault replaced it, the disk is full: still a fault
        if did:
            self.counters.faults_injected += 1
            self.counters.faults_by_kind[kind] += 1
        return kind == "kill"

    def _fill_disk(self) -> None:
        """Take the filesystem's free space with a filler file (freed by
        `_free_disk`, some faults later)."""
        self._free_disk()
        free = shutil.disk_usage(self.nvme_dir).free
        self._filler = self.nvme_dir / "filler"
        with open(self._filler, "wb") as f:
            try:
                f.truncate(0)
                chunk = b"\0" * (1 << 20)
                for _ in range(free >> 20):
                    f.write(chunk)
            except OSError:
                pass

    def _free_disk(self) -> None:
        if self._filler is not None:
            self._filler.unlink(missing_ok=True)
            self._filler = None

    # ------------------------------------------------------------------ run

    def run(self, num_faults: int, steps: list[list[Step]], requests_per_fault: float = 0.3,
            during_share: float = 0.3, max_kills: int | None = None, survivor: list[Step] | None = None) -> Counters:
        """Inject `num_faults` faults (at most `max_kills` of them kills);
        between them, requests (on average `requests_per_fault` per fault,
        each session's steps in order); a `during_share` of the requests has
        the next fault land while it runs. Ends with a last kill and restart
        and every session's next step. A `survivor` session (two steps or
        more, not in `steps`) takes its first step just before that kill and
        its second first after the restart: what it wrote behind, which no
        fault touched, must come back from disk (a restore is a prefix: the
        faulted sessions may have lost their first blocks)."""
        cursors = [0] * len(steps)
        self.start()
        due = 0.0
        while self.counters.faults_injected < num_faults:
            kinds = [k for k in FAULTS if (k != "fill_disk" or self.tmpfs)
                     and (k != "kill" or max_kills is None or self.counters.kills < max_kills)]
            kind = self.rng.choices(kinds, [WEIGHTS[k] for k in kinds])[0]
            due += requests_per_fault
            if due >= 1.0:
                due -= 1.0
                session = self.rng.randrange(len(steps))
                step = steps[session][cursors[session] % len(steps[session])]
                cursors[session] += 1
                if self.rng.random() < during_share:
                    self.request(step, during=kind)
                    self._log_fault(kind, "during a request")
                    continue
                self.request(step)
            self.inject(kind)
            self._log_fault(kind, "")
            if self.rng.random() < 0.2:
                self._free_disk()
        self._free_disk()
        # The last kill lands after every session's next step has been written
        # behind, so the restart always has blocks on disk to restore.
        for session, cursor in zip(steps, cursors):
            self.request(session[cursor % len(session)])
        if survivor:
            self.request(survivor[0])
        time.sleep(WRITE_BEHIND_S)
        self.inject("kill")
        if survivor:
            self.request(survivor[1])  # the first request after the restart: counted in `restored_after_restart_tokens`
        for session, cursor in zip(steps, cursors):
            self.request(session[(cursor + 1) % len(session)])
        return self.counters

    def _log_fault(self, kind: str, when: str) -> None:
        c = self.counters
        self.log(f"[{c.faults_injected:5d}] {kind:<16}{when:<17} requests={c.requests} wrong={c.wrong_tokens} "
                 f"crashes={c.engine_crashes} restarts={c.restarts}")
