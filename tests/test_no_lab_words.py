"""The product states what the software does and its current figures; the lab notebook stays out.

README.md, docs/guide/, the reference pages docs/*.md and the code (onnxcampo/ with its op units'
C++ and CUDA, passes/, costdb/) are scanned for the words of a lab notebook:

1. a work session by number: ``session 19``, ``Session 21`` (``a session``, ``InferenceSession``,
   ``the session's`` are ordinary words and pass);
2. one of the project's issues by number: ``issue 15``, ``issue #18``;
3. a benchmark run id: eight hex digits in backticks (`` `31efb559` ``) or after ``run``;
4. pending work told as a story: ``until the H200 decides``, ``until the next GPU run``, ``off
   until measured on the GPU``, ``the next benchmark run``, ``not measured yet``, ``not yet run on
   the H200`` (what has no figure says so: ``no GPU measurement``).

A match may span a line break (``session`` at the end of one line, ``19`` at the start of the next).
The results folder docs/benchmarks/ is left out: the measured results live there as files with the
commands that made them, named after what they measured or the date they were measured
(``docs/benchmarks/training-steps.md``, ``custom-ops/2026-12-06a/``); a path named after a session
or an issue (``issue17/session21/``) is flagged like the words. An upstream project's
issue is cited by its address (``github.com/microsoft/onnxruntime/issues/18048``).
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PATTERNS = {
    "session number": re.compile(r"\b[Ss]essions?\s*#?\d+"),
    "issue number": re.compile(r"\b[Ii]ssues?\s*#?\d+"),
    "run id": re.compile(r"`[0-9a-f]{8}`|\b[Rr]uns?\s+`?[0-9a-f]{8}\b"),
    "pending work": re.compile(
        r"\buntil\s+(?:the\s+H200|the\s+next\s+GPU\s+run|measured|timed)\b"
        r"|\bthe\s+next\s+(?:GPU|benchmark)\s+run\b"
        r"|\b[Nn]ot\s+(?:measured|run|timed)(?:\s+on\s+(?:the\s+|a\s+)?(?:GPU|CUDA|H200|H100))?\s+yet\b"
        r"|\b[Nn]ot\s+yet\s+(?:measured|run|timed)\b"),
}


def product_files(root: Path = ROOT) -> list[Path]:
    """README.md, docs/guide/*.md, docs/*.md (not docs/benchmarks/) and the code's sources."""
    files = [root / "README.md", *sorted((root / "docs" / "guide").rglob("*.md")),
             *sorted((root / "docs").glob("*.md"))]
    for package in ("onnxcampo", "passes", "costdb", "benchmarks"):
        files += sorted((root / package).rglob("*.py"))
    files += sorted(p for p in (root / "onnxcampo" / "ops").rglob("*")
                    if p.is_file() and (p.suffix in (".h", ".cc", ".cu", ".cmake") or p.name == "CMakeLists.txt"))
    return [f for f in files if f.is_file()]


def lab_words(text: str) -> list[tuple[int, str, str]]:
    """(line, kind, matched text) of every lab word in ``text``, in order of line."""
    hits = []
    for kind, pattern in PATTERNS.items():
        for m in pattern.finditer(text):
            hits.append((text.count("\n", 0, m.start()) + 1, kind, " ".join(m.group(0).split())))
    return sorted(hits)


def find_lab_words(root: Path = ROOT) -> list[str]:
    """``path:line: kind: text`` of every hit in the product's files."""
    return [f"{path.relative_to(root)}:{line}: {kind}: {found}"
            for path in product_files(root)
            for line, kind, found in lab_words(path.read_text(encoding="utf-8", errors="replace"))]


def test_the_patterns_flag_lab_words_and_pass_ordinary_ones():
    flagged = ("measured in session 19 on the H200", "Session 21, on an H100", "(issue 15, item 8)",
               "see issue #18", "runs `31efb559` and `11f82dcb`", "CUPTI, run `85841ec7`",
               "run dfc20ae3", "off by default until the H200 decides", "until the next GPU run",
               "since session\n19 (9.985 -> 9.486 ms)", "the time is not measured yet",
               "Not measured on the GPU yet.", "Not yet run on the H200.", "not run on CUDA yet",
               "(the next benchmark run of the training rows)", "off until measured on the GPU",
               "docs/benchmarks/issue17.md", "custom-ops/issue17/session21/rotation.json")
    for text in flagged:
        assert lab_words(text), text
    assert [line for line, _, _ in lab_words("a\nb session\n20 c")] == [2]
    ordinary = ("an InferenceSession with session options", "a session per provider",
                "the session's outputs", "sessions alive together", "a run of 8 steps",
                "docs/benchmarks/training-steps.md", "custom-ops/2026-12-06a/max_pool.json",
                "`abcdefgh`", "0x1f2e3d4c", "`--run 3`", "github.com/microsoft/onnxruntime/issues/18048",
                "until the GPU is free", "not measured on a GPU", "a plan yet", "not known yet")
    for text in ordinary:
        assert not lab_words(text), text


def test_the_checker_fails_on_a_planted_lab_word(tmp_path):
    (tmp_path / "docs" / "guide").mkdir(parents=True)
    (tmp_path / "docs" / "benchmarks").mkdir()
    (tmp_path / "README.md").write_text("# x\n\nBERT 10.3 ms (session 21).\n")
    (tmp_path / "docs" / "guide" / "a.md").write_text("fine\n")
    (tmp_path / "docs" / "benchmarks" / "issue17.md").write_text("## Session 21\n")  # results: left out
    (tmp_path / "onnxcampo").mkdir()
    (tmp_path / "onnxcampo" / "m.py").write_text('"""Off until the H200 decides."""\n')
    assert find_lab_words(tmp_path) == ["README.md:3: session number: session 21",
                                        "onnxcampo/m.py:1: pending work: until the H200"]


def test_no_lab_words_in_the_product():
    hits = find_lab_words()
    assert not hits, "lab notebook words outside docs/benchmarks/:\n" + "\n".join(hits)


if __name__ == "__main__":
    print("\n".join(find_lab_words()))
