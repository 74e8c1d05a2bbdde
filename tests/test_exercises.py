"""Every exercise, unmodified, stops at its first check with "... is not written yet"; every solution has checks.

CI runs the solutions themselves (`pytest --nbval-lax solutions`), so they are not run again here: an exercise runs
only up to its first check cell, which must be the first cell to fail, and must fail for the right reason.
"""

import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")  # a GPU machine running `pytest -m gpu` may not have the notebook tools
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
ipykernel_spec = pytest.importorskip("ipykernel.kernelspec")
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager  # noqa: E402
from jupyter_client.manager import KernelManager  # noqa: E402
from nbclient.exceptions import CellExecutionError  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXERCISES = sorted((ROOT / "exercises").glob("[0-9][0-9]_*.ipynb"))
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.py"))
CHECK = "with exercise("
NOT_WRITTEN = "is not written yet"
ANSI = re.compile(r"\x1b\[[0-9;]*m")  # colours in a kernel's traceback
CELL_TIMEOUT_S = 300  # a cell, or the kernel's start: a ceiling a loaded 2-core machine keeps; none comes near it


class CurrentEnvKernelSpecs(KernelSpecManager):
    """Whatever kernel a notebook names, run it with this interpreter (as nbval's --nbval-current-env does)."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(resource_dir=ipykernel_spec.RESOURCES, **ipykernel_spec.get_kernel_dict())


def is_check(cell) -> bool:
    return cell.cell_type == "code" and CHECK in cell.source


def test_there_are_exercises_for_every_solution():
    assert SOLUTIONS, "no solutions/NN_name.py found"
    names = sorted(p.stem for p in SOLUTIONS)
    assert sorted(p.stem for p in EXERCISES) == names, (
        f"exercises/ holds {[p.name for p in EXERCISES]}, solutions/ {names}: run `python tools/export.py`"
    )


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_has_checks_and_solution_blocks(path: Path):
    cells = jupytext.read(path, fmt="py:percent").cells
    checks = [i for i, c in enumerate(cells) if is_check(c)]
    blocks = [i for i, c in enumerate(cells) if c.cell_type == "code" and "# BEGIN SOLUTION" in c.source]
    assert checks, f"{path.name}: no check cell (a code cell with `{CHECK}...)`)"
    assert blocks, f"{path.name}: no `# BEGIN SOLUTION` ... `# END SOLUTION` block for the learner to write"
    assert blocks[0] < checks[0], f"{path.name}: the first check (cell {checks[0]}) comes before any solution block"


@pytest.mark.parametrize("path", EXERCISES, ids=lambda p: p.stem)
def test_unsolved_exercise_stops_at_its_first_check(path: Path):
    nb = nbformat.read(path, as_version=4)
    first_check = next((i for i, c in enumerate(nb.cells) if is_check(c)), None)
    assert first_check is not None, f"{path.name}: no check cell (a code cell with `{CHECK}...)`)"
    nb.cells = nb.cells[: first_check + 1]  # nothing after the first check runs

    km = KernelManager(kernel_name="python3", kernel_spec_manager=CurrentEnvKernelSpecs())
    resources = {"metadata": {"path": str(path.parent)}}
    client = nbclient.NotebookClient(
        nb, km=km, timeout=CELL_TIMEOUT_S, startup_timeout=CELL_TIMEOUT_S, resources=resources
    )
    with client.setup_kernel(env=os.environ | {"CI": "true"}):  # cwd: the exercises folder (resources' path)
        for index, cell in enumerate(nb.cells[:first_check]):
            if cell.cell_type != "code":
                continue
            try:
                client.execute_cell(cell, index)
            except CellExecutionError as e:
                traceback = ANSI.sub("", str(e))
                pytest.fail(
                    f"{path.name}: cell {index}, before the first check (cell {first_check}), failed:\n{traceback}"
                )
        try:
            client.execute_cell(nb.cells[first_check], first_check)
        except CellExecutionError as e:
            assert e.ename == "AssertionError" and NOT_WRITTEN in e.evalue, (
                f"{path.name}: the first check (cell {first_check}) should fail with AssertionError('... "
                f"{NOT_WRITTEN} ...'), got {e.ename}: {e.evalue}"
            )
        else:
            pytest.fail(f"{path.name}: the first check (cell {first_check}) passed: does the exercise ship solved?")
