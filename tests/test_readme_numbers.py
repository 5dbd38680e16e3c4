"""Every figure README.md and the docs pages it links to state is a measurement of
BENCHMARKS.md.

A figure is a number in a page's prose or tables (code, shell lines and inline code
left out) with a decimal point, a thousands separator, four digits or more, or a unit
(``%``, ``x``, ``ms``, ``s``, ``GiB``, ``bytes``, ``samples/s``, ``points``...). Each
must appear as a number in BENCHMARKS.md (the current tables) or in its dated history,
docs/benchmarks_history.md, and the section of the page it stands in must name
BENCHMARKS.md. The pages are :data:`PAGES`.
:data:`NOT_MEASURED` names the numbers that are no measurement, with what they are.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# number -> what it is, when it is no measurement
NOT_MEASURED = {
    "5,000": "the training images of the CIFAR-10 slice shipped in the package",
    "1,000": "the test images of that slice",
    "5.17": "the transformers version from which the Trainer calls an optimizer factory",
    "2025": "the year of the AdaFisher paper",
}
_FIGURE = re.compile(
    r"(?<![\w.\-+/])[+-]?(?P<number>\d{1,3}(?:,\d{3})+|\d+\.\d+|\d+)"
    r"(?P<unit>%|x\b|\s?(?:ms|s|GiB|GB|KB|bytes|samples/s|points)\b)?(?![\w.]\d|-\d)"
)


def prose(markdown: str) -> str:
    """The text of a Markdown page without code: fenced and indented blocks, inline code
    and link targets are blanked, line breaks kept.

    Example:
        >>> prose("a `b 1.5` c\\n```python\\nx = 2.5\\n```\\n    pip 3.5\\n[d](e/4.5)")
        'a  c\\n\\n\\n\\n\\n[d]'
    """

    def blank(match: re.Match) -> str:
        return "\n" * match.group(0).count("\n")

    text = re.sub(r"^```.*?^```", blank, markdown, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"^    .*$", "", text, flags=re.MULTILINE)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"\]\([^)\s]*\)", "]", text)


def figures(markdown: str) -> list[tuple[str, int, str]]:
    """``(number, line, section)`` of every figure of a Markdown page (see the module).

    Example:
        >>> figures("# T\\nran 3 seeds in 62.4 s (1.00x), 24858 samples/s, 2026-11-30\\n")
        [('62.4', 2, '# T'), ('1.00', 2, '# T'), ('24858', 2, '# T')]
    """
    text = prose(markdown)
    found = []
    for match in _FIGURE.finditer(text):
        number, unit = match.group("number"), match.group("unit")
        if not unit and re.fullmatch(r"\d{1,3}", number):
            continue  # counts and settings: 3 seeds, batch 512, 30 epochs
        before = text[: match.start()]
        headings = re.findall(r"^#+ .*$", before, flags=re.MULTILINE)
        found.append((number, before.count("\n") + 1, headings[-1] if headings else ""))
    return found


def sections(markdown: str) -> dict[str, str]:
    """Each section's text by its heading (the text before the first: ``""``); a ``#``
    line inside a fenced code block is a comment, not a heading.

    Example:
        >>> sorted(sections("# A\nx\n```python\n# not a heading\n```\n## B\ny\n"))
        ['', '# A', '## B']
    """
    fences = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
    markdown = fences.sub(lambda m: re.sub(r"^#", " #", m.group(0), flags=re.M), markdown)
    parts = re.split(r"^(#+ .*)$", markdown, flags=re.MULTILINE)
    out, heading = {"": parts[0]}, ""
    for part in parts[1:]:
        if re.fullmatch(r"#+ .*", part):
            heading = part
            out[heading] = ""
        else:
            out[heading] += part
    return out


def in_benchmarks(number: str, benchmarks: str) -> bool:
    """Whether ``number`` stands in BENCHMARKS.md as a number (not inside a longer one).

    Example:
        >>> in_benchmarks("0.13", "-0.14 and -0.13 points"), in_benchmarks("0.1", "0.13")
        (True, False)
    """
    return re.search(rf"(?<![\d.,]){re.escape(number)}(?![\d]|[.,]\d)", benchmarks) is not None


# the README and the pages that took its long explanations
PAGES = (
    "README.md",
    "docs/install.md",
    "docs/usage.md",
    "docs/scaling.md",
    "docs/precision_and_elastic.md",
    "docs/preemption.md",
    "docs/results.md",
)
TEXTS = {page: (ROOT / page).read_text() for page in PAGES}
README = TEXTS["README.md"]
# the current tables, then every measurement in the order it was made
BENCHMARKS = "\n".join(
    (ROOT / name).read_text() for name in ("BENCHMARKS.md", "docs/benchmarks_history.md")
)
FIGURES = [
    (page, *figure)
    for page, text in TEXTS.items()
    for figure in figures(text)
    if figure[0] not in NOT_MEASURED
]


def test_the_readme_has_figures_to_check():
    numbers = {number for page, number, _, _ in FIGURES if page == "README.md"}
    assert {"0.451", "0.077", "17781", "8.007"} <= numbers and "2026" not in numbers


@pytest.mark.parametrize(
    ("page", "number", "line", "section"),
    FIGURES,
    ids=[f"{page}:{n}@{line}" for page, n, line, _ in FIGURES],
)
def test_each_figure_is_a_benchmarks_measurement(page, number, line, section):
    where = f"{page}:{line}: {number} not in BENCHMARKS.md or its history"
    assert in_benchmarks(number, BENCHMARKS), where
    cited = "BENCHMARKS.md" in sections(TEXTS[page])[section]
    assert cited, f"{page}: {section!r} does not cite BENCHMARKS.md"


def test_what_is_not_measured_is_still_in_the_readme():
    # an exemption whose number has left the README would exempt a later figure unseen
    numbers = {number for number, _, _ in figures(README)}
    assert set(NOT_MEASURED) <= numbers
