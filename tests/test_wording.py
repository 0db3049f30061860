"""No tracked file speaks of how the work on the project was organised: a reader cannot see
our tracker, our schedule or the machines we borrowed, so a figure names its hardware and a
reason says what it is, not where it was discussed."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


# Each pattern names one kind of word; the exceptions are the project's own uses of a word
# (pytest's fixture scope, an AWS SSO session, a requests session object).
ORGANISATION_WORDS = {
    "a session": re.compile(
        r"(?<!scope=\")(?<!scope=')(?<!SSO )(?<!sso )(?<!\.)\bsessions?\b(?![_(=]|\.\w)",
        re.IGNORECASE,
    ),
    "a loan": re.compile(r"\b(?:le" r"nt|le" r"as(?:e|es|ed|ing))\b", re.IGNORECASE),
    "a machine by how it was obtained": re.compile(r"\bnvidia-h[12]00(?:-x\d)?\b", re.IGNORECASE),
    "a call of a borrowed machine": re.compile(
        r"\bdevice[ -](?:ca" r"lls?|mach" r"ines?)\b", re.IGNORECASE
    ),
    "an issue number": re.compile(r"\bissues? ?#?\d+", re.IGNORECASE),
}
TEXT_SUFFIXES = {".md", ".py", ".pyi", ".toml", ".rs", ".yml", ".yaml", ".txt", ".sh", ".sbatch"}


def organisation_words(line: str) -> list[str]:
    return [kind for kind, pattern in ORGANISATION_WORDS.items() if pattern.search(line)]


def test_nothing_tracked_speaks_of_how_the_work_was_organised():
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    hits = []
    for name in files.split():
        path = ROOT / name
        text = path.suffix in TEXT_SUFFIXES or name in {"Makefile", ".ci/run"}
        if text and name != "tests/test_wording.py" and path.is_file():  # a moved file: gone
            for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if kinds := organisation_words(line):
                    hits.append(f"{name}:{i}: ({', '.join(kinds)}) {line.strip()[:120]}")
    assert not hits, "say what the thing is instead:\n" + "\n".join(hits)


def test_the_organisation_words_are_found_and_the_projects_own_are_not():
    for line in [
        "measured in the seventh " + "session",
        "two Ses" + "sions on the H100",
        "a machine we le" + "nt",
        "in one le" + "ase",
        "on nvidia-h100" + "-x4",
        "measured in one device " + "call",
        "(iss" + "ue 33)",
        "see iss" + "ue #7",
    ]:
        assert organisation_words(line), line
    for line in [
        '@pytest.fixture(scope="session")',
        "an expired SSO session",
        "boto3.session.Session()",
        "device time per kernel category",
        "the issues a user hits",
        "lenticular",
    ]:
        assert not organisation_words(line), line


def _benchmarks_headings() -> tuple[set[str], set[str]]:
    """BENCHMARKS.md's section titles and their GitHub anchors."""
    titles = set()
    for line in (ROOT / "BENCHMARKS.md").read_text().splitlines():
        if m := re.match(r"#{2,4} (.+)", line):
            titles.add(m.group(1).strip())
    anchors = {re.sub(r"[^\w\- ]", "", t.lower()).replace(" ", "-") for t in titles}
    return titles, anchors


# A section named after "BENCHMARKS.md": as a link's anchor, or quoted ("Title" may wrap to the
# next line: the quote then closes there).
CITED_ANCHOR = re.compile(r"BENCHMARKS\.md#([\w-]+)")
CITED_TITLE = re.compile(r'BENCHMARKS\.md(?:, | \()"([^"]+)"')


def test_every_section_of_benchmarks_that_is_cited_exists():
    titles, anchors = _benchmarks_headings()
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout
    missing = []
    for name in files.split():
        path = ROOT / name
        if (
            path.suffix not in TEXT_SUFFIXES
            or not path.is_file()
            or name == "tests/test_wording.py"
        ):
            continue
        text = path.read_text(errors="replace")
        for m in CITED_ANCHOR.finditer(text):
            if m.group(1) not in anchors:
                missing.append(f"{name}: #{m.group(1)}")
        for m in CITED_TITLE.finditer(text):
            title = " ".join(m.group(1).split())  # a title wrapped over two lines
            if title not in titles:
                missing.append(f'{name}: "{title}"')
    assert not missing, "BENCHMARKS.md has no such section:\n" + "\n".join(missing)
    # The patterns find both forms (a title wrapped over two lines too).
    assert CITED_ANCHOR.search("[x](BENCHMARKS.md#loader)").group(1) == "loader"
    assert CITED_TITLE.search('(BENCHMARKS.md, "Warm\n  restarts")').group(1) == "Warm\n  restarts"
    assert "gpt-2-124m-against-nanogpt" in anchors and "GPT-2 124M against nanoGPT" in titles
