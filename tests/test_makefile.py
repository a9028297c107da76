"""What `make setup` leaves behind that every later process depends on."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.mark.parametrize("module", ["torch", "transformers.models.albert.modeling_albert", "kokoro.modules"])
def test_the_venv_s_libraries_are_installed_with_their_bytecode(module):
    """The venv is installed compiled (`uv pip install --compile-bytecode`): pip writes the .pyc
    files at install, uv only when asked, and where PYTHONDONTWRITEBYTECODE is set (CI's machines)
    no process writes them later, so every gate, worker and CLI process the tests start compiled
    torch, transformers and kokoro from source again (a tiny worker's engine: ~13 s, 8 with them)."""
    spec = importlib.util.find_spec(module)
    assert spec is not None and spec.origin, module
    cached = Path(importlib.util.cache_from_source(spec.origin))
    assert cached.is_file(), f"{module}: no {cached} (the venv was installed without --compile-bytecode)"
