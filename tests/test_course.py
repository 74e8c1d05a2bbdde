"""Limits the course and the package promise (issues: the core path a learner finishes in a day; one job per room).

The numbers are the promise itself, not a measurement: a change that breaks one should move work into a deep dive or
split a room, not raise the number."""

import ast
import collections
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
CORE = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
DEEP_DIVES = sorted((ROOT / "notebooks" / "deep_dives").glob("*.py"))
MAX_ENGINE_MODULE_LINES = 350
MAX_RUNNER_LINES = 300
MAX_ENGINE_CLASS_LINES = 200  # LLMEngine: the step loop only
MAX_SERVE_MODULE_LINES = 400  # the OpenAI server's rooms (minivllm/serve/)
MAX_FMT_SKIPS = 0  # in all notebook sources: the formatter's output should read well
MAX_LINE = 100  # characters: ruff's line length
MAX_LINE_NODES = 20  # expressions (ast.expr) on one line: a denser line is split into steps
MAX_CORE_HOURS = 8  # the core path's reading time by tools/reading_time.py: a working day


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_six_core_notebooks():
    names = ["01_layers", "02_model", "03_kv_cache", "04_model_runner", "05_scheduler", "06_engine"]
    assert [p.stem for p in CORE] == names


def test_notebook_02_trains_tiny_text_only_when_its_checkpoint_is_missing():
    """Training tiny-text takes half a minute: a notebook run that finds the checkpoint reuses it."""
    tree = ast.parse((ROOT / "notebooks" / "02_model.py").read_text())
    guarded = {
        id(n) for g in ast.walk(tree) if isinstance(g, ast.If) for b in g.body for n in ast.walk(b)
    }
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", None) == "write_checkpoint"
        and any(isinstance(a, ast.Constant) and a.value == "tiny-text" for a in node.args)
    ]
    assert calls and all(id(call) in guarded for call in calls)


def deep_dive_table() -> dict[str, str]:
    """tools/export.py's DEEP_DIVES (deep dive -> the core notebook it follows), read with ast."""
    for node in ast.parse((ROOT / "tools" / "export.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", None) == "DEEP_DIVES" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise AssertionError("tools/export.py defines no DEEP_DIVES")


def test_each_deep_dive_opens_with_the_core_notebook_it_follows_and_that_the_core_needs_none():
    table = deep_dive_table()
    assert sorted(p.stem for p in DEEP_DIVES) == sorted(table)
    for path in DEEP_DIVES:
        text = path.read_text()
        opening = " ".join(
            text[text.index("# %% [markdown]") :].split("# %%")[1].replace("#", " ").split()
        ).lower()
        assert f"follows notebook {table[path.stem][:2]}" in opening, (
            f"{path.name}: say which notebook it follows"
        )
        assert "core path needs" in opening, f"{path.name}: say the core needs none"


def test_the_engine_rooms_stay_small():
    engine = ROOT / "minivllm" / "engine"
    too_long = {p.name: lines(p) for p in engine.glob("*.py") if lines(p) > MAX_ENGINE_MODULE_LINES}
    assert too_long == {}, f"engine modules over {MAX_ENGINE_MODULE_LINES} lines: split them by job"
    assert lines(engine / "model_runner.py") <= MAX_RUNNER_LINES
    tree = ast.parse((engine / "llm_engine.py").read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMEngine"]
    size = cls.end_lineno - cls.lineno + 1
    assert size <= MAX_ENGINE_CLASS_LINES, (
        f"LLMEngine is {size} lines, over {MAX_ENGINE_CLASS_LINES}"
    )


def test_the_server_rooms_stay_small():
    serve = ROOT / "minivllm" / "serve"
    too_long = {p.name: lines(p) for p in serve.glob("*.py") if lines(p) > MAX_SERVE_MODULE_LINES}
    assert too_long == {}, f"serve modules over {MAX_SERVE_MODULE_LINES} lines: split them by job"


def density_sources() -> list[Path]:
    """The package and every notebook source: the code a learner reads."""
    paths = [*(ROOT / "minivllm").rglob("*.py"), *(ROOT / "notebooks").rglob("*.py")]
    return sorted([*paths, *(ROOT / "solutions").glob("*.py")])


def density_offences(path: Path) -> list[str]:
    """`file:line: why` for each line over MAX_LINE characters or MAX_LINE_NODES expressions."""
    text, name = path.read_text(), path.relative_to(ROOT)
    lines = enumerate(text.splitlines(), 1)
    found = [(n, f"{len(line)} characters") for n, line in lines if len(line) > MAX_LINE]
    nodes = collections.Counter(
        x.lineno for x in ast.walk(ast.parse(text)) if isinstance(x, ast.expr)
    )
    found += [(n, f"{count} expressions") for n, count in nodes.items() if count > MAX_LINE_NODES]
    if path.parent.name == "notebooks" and path.name.startswith("0") and "# fmt: skip" in text:
        found.append((text[: text.index("# fmt: skip")].count("\n") + 1, "# fmt: skip"))
    return [f"{name}:{n}: {why}" for n, why in sorted(found)]


def test_density_limits_for_the_package_and_every_notebook():
    """Lines of at most 100 characters and 20 expressions; no formatter skip in the core."""
    offences = [o for path in density_sources() for o in density_offences(path)]
    assert not offences, f"{len(offences)} lines over the limits, the first {offences[0]}"


def test_few_formatter_skips():
    skips = sum(p.read_text().count("# fmt: skip") for p in [*CORE, *DEEP_DIVES])
    assert skips <= MAX_FMT_SKIPS, (
        f"{skips} '# fmt: skip' markers in the notebooks, over {MAX_FMT_SKIPS}"
    )


@functools.cache
def reading_time() -> ModuleType:
    """tools/reading_time.py, imported by path (tools/ is no package); registered, as dataclasses need."""
    spec = importlib.util.spec_from_file_location(
        "reading_time", ROOT / "tools" / "reading_time.py"
    )
    assert spec is not None and spec.loader is not None
    module = sys.modules["reading_time"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NOTEBOOK = """# %% [markdown]
# # A title
#
# Four words, then | markup.

# %% tags=["export"] module="minivllm.x"
def f() -> int:

    return 1

# %%
answer1 = answer2 = None  # two questions
answer = 3  # set, not asked
x = None
"""


def test_reading_time_prices_words_exported_and_other_lines_and_questions(tmp_path):
    tool = reading_time()
    (path := tmp_path / "n.py").write_text(NOTEBOOK)
    count = tool.count(path)
    assert (count.words, count.built, count.other, count.questions) == (6, 2, 3, 2)
    prose, code = 6 / 120, 2 / 6 + 3 / 12  # minutes: words, exported and other lines
    assert count.minutes == pytest.approx(prose + code + 2 * 5)


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,  # only the limit: an error in the tool fails
    reason="issue 44: the core reads in more than 8 h; move detail to deep dives",
)
def test_the_core_path_reads_in_a_working_day():
    tool = reading_time()
    hours = tool.hours(tool.core())
    assert hours <= MAX_CORE_HOURS, f"the core reads in {hours:.1f} h by tools/reading_time.py"


def test_readme_shows_the_reading_times_the_tool_computes():
    tool = reading_time()
    readme = (ROOT / "README.md").read_text()
    assert tool.START in readme and tool.END in readme, "README.md lost its reading-time markers"
    stale = "README's reading times differ from tools/reading_time.py's: run `make readme`"
    assert tool.readme_block(readme) == tool.markdown(), stale
