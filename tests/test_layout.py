"""The package's rooms (DESIGN.md): imports run one way, down the house, and each public name has one home."""

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "minivllm"


def test_the_lower_rooms_never_import_the_engine():
    code = (
        "import sys, minivllm.layers.sampler, minivllm.kernels, minivllm.models.qwen3, minivllm.models.loader, "
        "minivllm.attention.paged, minivllm.attention.prefill; "
        "print(sorted(m for m in sys.modules if m.startswith('minivllm.engine')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def public_definitions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_") and node.name != "main"
    }  # main: each `python -m` module's entry


def test_no_two_modules_define_the_same_public_name():
    homes: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for name in public_definitions(path):
            homes.setdefault(name, []).append(str(path.relative_to(PACKAGE)))
    assert {name: where for name, where in homes.items() if len(where) > 1} == {}
