"""Every file README.md and docs/ point to exists: markdown links, and repository paths in the text.

The docs mostly name files as repository paths in backticks (``docs/benchmarks/h200.md``,
``benchmarks/train_parity.py``) rather than as markdown links, so both are checked: a moved or renamed
file fails here until every page that names it follows. Code blocks (fenced or indented) are left
out: their command lines may name files a run would write.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

# top-level folders of the repository: a path in the text that starts with one of them is a
# repository path (``runtime/check.py`` inside a package, ``ddddocr/common.onnx`` inside a wheel are not)
TOP_LEVEL = ("docs", "scripts", "onnxcampo", "costdb", "passes", "benchmarks", "tests", ".ci")

FENCED = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INDENTED = re.compile(r"^(?: {4}|\t).*$", re.M)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)  # [label]: target
PATH = re.compile(r"(?<![\w/.$<>{}-])([\w.][\w.-]*(?:/[\w.-]+)+\.(?:md|json|jsonl|png|py|sh|onnx|toml|cc|h))(?![\w/-])")


def _prose(path: Path) -> str:
    return INDENTED.sub("", FENCED.sub("", path.read_text(encoding="utf-8")))


def _links(text: str) -> list[str]:
    """Relative link targets without their #fragment (URLs, mailto: and same-page anchors left out)."""
    targets = [m.group(1) for m in (*LINK.finditer(text), *REFERENCE.finditer(text))]
    return [t.split("#")[0] for t in targets
            if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t) and t.split("#")[0]]


def _repository_paths(text: str) -> list[str]:
    return [m.group(1) for m in PATH.finditer(text) if m.group(1).split("/")[0] in TOP_LEVEL]


def test_the_patterns_find_links_and_paths():
    text = ("See [the guide](guide/cli.md#options), ![plot](h200.png), [web](https://x.org/a.md), "
            "[here](#top), `docs/benchmarks/h200.md` and scripts/bench.py, not `runtime/check.py`.\n"
            "[ref]: ../ops.md\n\n    python scripts/never_run.py --out docs/none.json\n")
    prose = INDENTED.sub("", FENCED.sub("", text + "```\ndocs/in-a-fence.md\n```\n"))
    assert _links(prose) == ["guide/cli.md", "h200.png", "../ops.md"]
    assert _repository_paths(prose) == ["docs/benchmarks/h200.md", "scripts/bench.py"]


def test_relative_links_resolve():
    broken = [f"{doc.relative_to(ROOT)}: ({target})" for doc in DOCS for target in _links(_prose(doc))
              if not (doc.parent / target).exists()]
    assert not broken, broken


def test_repository_paths_named_in_the_docs_exist():
    """Relative to the repository root, or to the page (``costdb/README.md`` inside docs/benchmarks/)."""
    named = [(doc, path) for doc in DOCS for path in _repository_paths(_prose(doc))]
    assert len(named) > 100  # the pattern still matches how the docs name files
    missing = [f"{doc.relative_to(ROOT)}: {path}" for doc, path in named
               if not ((ROOT / path).exists() or (doc.parent / path).exists())]
    assert not missing, missing
