"""The house: the core never imports the face, and ``import attn`` loads the core only.

The tokenizer (``attn.tokenizer``) needs the optional ``tokenizers`` and ``jinja2``: it sits
with the face, and ``import attn`` loads neither it nor them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "attn"
FACE = (
    "attn.cli",
    "attn.demo",
    "attn.bench",
    "attn.integrations",
    "attn.fast_decode",
    "attn.tokenizer",
    "attn.__main__",
)
CORE = sorted(
    f"attn.{path.stem}"
    for path in PACKAGE.glob("*.py")
    if path.stem not in ("__init__", "__main__", "cli", "fast_decode", "tokenizer")
)


def imported_modules(module: str) -> set[str]:
    """Every ``attn`` module that ``module`` imports, at any depth of its code."""
    tree = ast.parse((PACKAGE / f"{module.removeprefix('attn.')}.py").read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.startswith("attn")}


@pytest.mark.parametrize("module", CORE)
def test_the_core_never_imports_the_face(module: str) -> None:
    face = sorted(name for name in imported_modules(module) if name.startswith(FACE))
    assert not face, f"{module} imports {face}: the face (command line, demo, bench, adapters, tokenizer) sits on top"


@pytest.mark.slow  # a fresh interpreter
def test_import_attn_loads_no_face() -> None:
    """Not the CPU fast path either: ``attn.compile_for_decode`` loads it when first asked for."""
    code = "import sys, attn; print(' '.join(m for m in sys.modules if m.startswith('attn.')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "attn.policy" in loaded and not [name for name in loaded if name.startswith(FACE)], loaded
    code = "import sys, attn; attn.compile_for_decode; print('attn.fast_decode' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "True\n"


@pytest.mark.slow  # a fresh interpreter
def test_the_tokenizer_loads_its_packages_only_when_imported() -> None:
    """``import attn`` loads neither tokenizers nor jinja2; ``attn.tokenizer`` loads them, and
    not transformers."""
    pytest.importorskip("tokenizers")
    code = (
        "import json, sys, attn; before = [m for m in ('tokenizers', 'jinja2') if m in sys.modules]; "
        "import attn.tokenizer; "
        "print(json.dumps([before, [m for m in ('tokenizers', 'jinja2', 'transformers') if m in sys.modules]]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(result) == [[], ["tokenizers", "jinja2"]]
