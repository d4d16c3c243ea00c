"""The header every benchmark report starts with (machine, commit, date, the
command that reproduces it) and where each benchmark writes its results.

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from a subfolder
    import report_header as H

    out = H.results_dir("gpu_restore")               # benchmarks/results/gpu_restore/
    lines = H.header("GPU restore", H.command(__file__))
    H.write_report(out / "report.md", lines + table)  # keeps the notes after H.NOTES_MARK
    json.dump({"meta": H.meta(H.command(__file__)), ...}, ...)

`commit()` is the short hash of HEAD (`+ local changes` when tracked files
differ from it); on a machine that got a copy of the working tree without
its git history, set `SEKV_COMMIT` to the commit the tree was taken from.
`machine()` names the CPU (and the GPUs, when torch is imported and sees
CUDA). Nothing here imports torch itself.
"""
from __future__ import annotations

import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
# Everything from this line on in an existing report is hand-written (history, reading of the
# figures) and survives when the script writes the report again.
NOTES_MARK = "<!-- Notes below this line are hand-written; the script keeps them when it rewrites the report. -->"


def results_dir(name: str) -> Path:
    """`benchmarks/results/<name>/`, the benchmark's own folder."""
    return RESULTS / name


def commit() -> str:
    if os.environ.get("SEKV_COMMIT"):
        return os.environ["SEKV_COMMIT"]
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if not sha:
        return "unknown (no git history here: set SEKV_COMMIT)"
    return sha + (" + local changes" if dirty else "")


def cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            model = next(ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    return f"{platform.machine()} ({model}), {os.cpu_count()} cores"


def machine() -> str:
    """The GPUs (through torch when this process loaded it, else `nvidia-smi`) and the host."""
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_available():
            names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        else:
            names = _nvidia_smi_names()
    except Exception:  # noqa: BLE001 - a broken CUDA set-up still gets a header
        names = []
    if names:
        return f"{len(names)} x {', '.join(sorted(set(names)))}; host {cpu()}"
    return f"{cpu()}, CPU only"


def _nvidia_smi_names() -> list[str]:
    """One name per GPU that `nvidia-smi` lists; none without it. For a
    process that runs its engines in children and never loads torch."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()] if out.returncode == 0 else []


def command(script: str | Path, argv: list[str] | None = None, prefix: str = "python") -> str:
    """The invocation as typed from the repository root."""
    path = Path(script).resolve()
    try:
        path = path.relative_to(REPO)
    except ValueError:
        pass
    args = sys.argv[1:] if argv is None else argv
    return " ".join([prefix, str(path), *(shlex.quote(a) for a in args)])


def today() -> str:
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())


def meta(commands: str | list[str], machine_: str | None = None, commit_: str | None = None,
         date: str | None = None) -> dict:
    """The header's facts, for the JSON next to the report."""
    cmds = [commands] if isinstance(commands, str) else list(commands)
    return {"machine": machine_ or machine(), "commit": commit_ or commit(), "date": date or today(),
            "commands": cmds}


def header(title: str, commands: str | list[str], machine_: str | None = None, commit_: str | None = None,
           date: str | None = None) -> list[str]:
    """`# title`, then machine, commit, date and the command(s), as Markdown lines."""
    m = meta(commands, machine_, commit_, date)
    cmds = m["commands"]
    return [f"# {title}", "",
            f"- Machine: {m['machine']}",
            f"- Commit: {m['commit']}",
            f"- Date: {m['date']}", "",
            "Command (from the repository root):" if len(cmds) == 1 else "Commands (from the repository root):",
            "", "```", *cmds, "```", ""]


def header_from(m: dict, title: str) -> list[str]:
    """`header()` from a `meta()` dict stored in a result file."""
    return header(title, m["commands"], m.get("machine"), m.get("commit"), m.get("date"))


def write_report(path: str | Path, lines: list[str]) -> None:
    """Write the Markdown; hand-written notes of the existing file (from `NOTES_MARK` on) are kept."""
    path = Path(path)
    tail = ""
    if path.exists():
        text = path.read_text()
        at = text.find(NOTES_MARK)
        if at >= 0:
            tail = text[at:]
    path.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(lines).rstrip("\n") + "\n"
    path.write_text(body + ("\n" + tail if tail else ""))
