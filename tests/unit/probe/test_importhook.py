"""Post-import hooks fire after the module body ran, once, and immediately for loaded modules."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from dsec.probe.importhook import when_imported


@pytest.fixture
def module_dir(tmp_path: Path) -> Iterator[Path]:
    sys.path.insert(0, str(tmp_path))
    yield tmp_path
    sys.path.remove(str(tmp_path))
    for name in [n for n in sys.modules if n.startswith("dsec_hooktest_")]:
        del sys.modules[name]


def test_callback_runs_after_import_with_the_finished_module(module_dir: Path) -> None:
    (module_dir / "dsec_hooktest_a.py").write_text("VALUE = 41\nVALUE += 1\n")
    seen: list[int] = []
    when_imported("dsec_hooktest_a", lambda m: seen.append(m.VALUE))
    assert seen == []
    import dsec_hooktest_a  # type: ignore[import-not-found]

    assert seen == [42]
    del sys.modules["dsec_hooktest_a"]
    import dsec_hooktest_a  # type: ignore[import-not-found]  # noqa: F401, F811

    assert seen == [42], "a callback runs once"


def test_already_imported_module_gets_the_callback_now() -> None:
    seen: list[ModuleType] = []
    when_imported("json", seen.append)
    assert seen and seen[0].__name__ == "json"


def test_failing_callback_does_not_break_the_import(module_dir: Path) -> None:
    (module_dir / "dsec_hooktest_b.py").write_text("X = 1\n")

    def boom(_: ModuleType) -> None:
        raise RuntimeError("instrumentation bug")

    when_imported("dsec_hooktest_b", boom)
    import dsec_hooktest_b  # type: ignore[import-not-found]

    assert dsec_hooktest_b.X == 1
