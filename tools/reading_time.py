"""How long each notebook takes to read, computed from its source rather than guessed (issue 44).

    python tools/reading_time.py                 # a table each: core, deep dives, exercises
    python tools/reading_time.py --markdown      # the same in markdown: the README's block
    python tools/reading_time.py --write-readme  # rewrite that block in README.md

The formula, applied to each jupytext py:percent source:
  prose          words of markdown cells (tokens with a letter or digit), 120 words a minute
  exported code  non-blank lines of code cells tagged "export", 6 lines a minute: what is built
  other code     non-blank lines of the other code cells, 12 lines a minute
  questions      5 minutes each: a name `answer...` set to None, the value a learner replaces
In an exercise (solutions/*.py) the lines between BEGIN and END SOLUTION are the code built, at 6
lines a minute: the time to read the solved notebook, less than the time to write the solution.
"""

from __future__ import annotations

import argparse
import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import jupytext

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
START, END = "<!-- reading-time:start -->", "<!-- reading-time:end -->"
WORDS_PER_MIN = 120
BUILT_LINES_PER_MIN = 6
OTHER_LINES_PER_MIN = 12
MIN_PER_QUESTION = 5
BEGIN_SOLUTION, END_SOLUTION = "# BEGIN SOLUTION", "# END SOLUTION"


@dataclass(frozen=True)
class Count:
    """What one notebook source holds, in the units the formula prices."""

    path: Path
    words: int
    built: int  # exported lines in a notebook, solution lines in an exercise
    other: int
    questions: int

    @property
    def minutes(self) -> float:
        code = self.built / BUILT_LINES_PER_MIN + self.other / OTHER_LINES_PER_MIN
        return self.words / WORDS_PER_MIN + code + self.questions * MIN_PER_QUESTION


def words(text: str) -> int:
    """Words of prose: markup alone (`|`, `---`, `*`) is not read."""
    return sum(any(c.isalnum() for c in token) for token in text.split())


def questions(source: str) -> int:
    """Names `answer...` assigned None in one cell: `answer1 = answer2 = None` is two questions."""
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics: no question there
        return 0
    nones = [n for n in ast.walk(tree) if isinstance(n, ast.Assign) and is_none(n.value)]
    names = [t.id for node in nones for t in node.targets if isinstance(t, ast.Name)]
    return sum(name.startswith("answer") for name in names)


def is_none(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


def solution_lines(source: str) -> int:
    """Non-blank lines between BEGIN SOLUTION and END SOLUTION markers."""
    inside, count = False, 0
    for line in source.splitlines():
        marker = line.strip()
        if marker.startswith((BEGIN_SOLUTION, END_SOLUTION)):
            inside = marker.startswith(BEGIN_SOLUTION)
        elif inside and marker:
            count += 1
    return count


def non_blank(source: str) -> int:
    return sum(bool(line.strip()) for line in source.splitlines())


def built_lines(cell: dict) -> int:
    """The lines of a code cell that build something: an exported cell's, a solution's."""
    if "export" in cell["metadata"].get("tags", []):
        return non_blank(cell["source"])
    return solution_lines(cell["source"])


def count(path: Path) -> Count:
    """Words, built and other code lines, and questions of one py:percent source."""
    cells = jupytext.read(path, fmt="py:percent").cells
    prose = sum(words(c.source) for c in cells if c.cell_type == "markdown")
    code = [c for c in cells if c.cell_type == "code"]
    built = sum(map(built_lines, code))
    other = sum(non_blank(c.source) for c in code) - built
    asked = sum(questions(c.source) for c in code)
    return Count(path, prose, built, other, asked)


def deep_dive_order() -> list[str]:
    """tools/export.py's DEEP_DIVES, in reading order, read with ast."""
    for node in ast.parse((ROOT / "tools" / "export.py").read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else []
        if "DEEP_DIVES" in [getattr(t, "id", None) for t in targets]:
            return list(ast.literal_eval(node.value))
    raise SystemExit("tools/export.py defines no DEEP_DIVES")


def core() -> list[Count]:
    return [count(p) for p in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))]


def deep_dives() -> list[Count]:
    folder = ROOT / "notebooks" / "deep_dives"
    return [count(folder / f"{name}.py") for name in deep_dive_order()]


def exercises() -> list[Count]:
    return [count(p) for p in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))]


def hours(counts: list[Count]) -> float:
    return sum(c.minutes for c in counts) / 60


@dataclass(frozen=True)
class Group:
    title: str
    built: str  # what the built column counts
    link: str  # the notebook a row links to
    counts: list[Count]

    @property
    def header(self) -> list[str]:
        return [self.title, "words", self.built, "other lines", "questions", "minutes"]


def groups() -> list[Group]:
    return [
        Group("core notebook", "exported lines", "notebooks/{}.ipynb", core()),
        Group("deep dive", "exported lines", "notebooks/deep_dives/{}.ipynb", deep_dives()),
        Group("exercise", "solution lines", "exercises/{}.ipynb", exercises()),
    ]


def cells(c: Count) -> list[str]:
    numbers = [c.words, c.built, c.other, c.questions]
    return [*map(str, numbers), f"{c.minutes:.0f}"]


def summary(core: Group, deep: Group, exercise: Group) -> str:
    """The totals, under the tables: the sentence the README shows."""
    core_h, deep_h, ex_h = (hours(g.counts) for g in (core, deep, exercise))
    return (
        f"By `tools/reading_time.py` the core path reads in about {core_h:.1f} h, the deep dives in"
        f" {deep_h:.1f} h and the exercises, solved, in {ex_h:.1f} h."
    )


def text_table(group: Group) -> list[str]:
    rows = [group.header, *([c.path.stem, *cells(c)] for c in group.counts)]
    widths = [max(map(len, column)) for column in zip(*rows)]
    total = f"{'total'.ljust(widths[0])}  {hours(group.counts):.1f} h"
    return [*(padded(row, widths) for row in rows), total, ""]


def padded(row: list[str], widths: list[int]) -> str:
    """The name left-aligned, the numbers right-aligned."""
    name, *numbers = row
    return "  ".join([name.ljust(widths[0]), *map(str.rjust, numbers, widths[1:])])


def text() -> str:
    """One fixed-width table per group, then the totals."""
    all_groups = groups()
    tables = [line for g in all_groups for line in text_table(g)]
    return "\n".join([*tables, summary(*all_groups)]) + "\n"


def linked(stem: str, link: str) -> str:
    return f"[{stem}]({link.format(stem)})"


def markdown_table(group: Group) -> list[str]:
    """Each notebook linked, numbers right-aligned, no outer pipes (GitHub needs none)."""
    rows = [[linked(c.path.stem, group.link), *cells(c)] for c in group.counts]
    rule = ["---", *["--:"] * (len(group.header) - 1)]
    return [" | ".join(row) for row in [group.header, rule, *rows]] + [""]


def markdown() -> str:
    """The README's block: one markdown table per group, then the totals."""
    all_groups = groups()
    tables = [line for g in all_groups for line in markdown_table(g)]
    return "\n".join([*tables, summary(*all_groups)]) + "\n"


def readme_block(readme: str) -> str:
    """What README.md holds between the reading-time markers."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} block")
    return readme.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def write_readme(path: Path = README) -> None:
    """Replace what lies between the markers with markdown(), keeping the rest of the file."""
    readme = path.read_text()
    readme_block(readme)  # fails when a marker is missing
    head, rest = readme.split(START, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(f"{head}{START}\n\n{markdown()}\n{END}{tail}")  # blank lines: tables render


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--markdown", action="store_true", help="print the README's tables")
    parser.add_argument("--write-readme", action="store_true", help="rewrite them in README.md")
    args = parser.parse_args()
    if args.write_readme:
        write_readme()
    sys.stdout.write(markdown() if args.markdown or args.write_readme else text())


if __name__ == "__main__":
    main()
