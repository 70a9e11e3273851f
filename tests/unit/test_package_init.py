"""The top-level package: its public names, and that importing it (or a core under it) stays cheap."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata

import pytest

import dsec

PUBLIC = {
    "Reporter",
    "ReporterConfig",
    "__version__",
    "attach",
    "attached",
    "autocast",
    "detach",
    "on_sampling_change",
    "sampling_allowed",
    "wait_for_sampling",
}


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys; print('\\n'.join(sys.modules))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return set(out.stdout.split())


def test_public_names_are_pinned() -> None:
    assert set(dsec.__all__) == PUBLIC
    assert set(dir(dsec)) == PUBLIC


def test_every_public_name_resolves_to_the_probe_object() -> None:
    from dsec.probe import attach as attach_mod
    from dsec.probe import reporter as reporter_mod

    assert dsec.attach is attach_mod.attach
    assert dsec.wait_for_sampling is attach_mod.wait_for_sampling
    assert dsec.Reporter is reporter_mod.Reporter
    assert dsec.ReporterConfig is reporter_mod.ReporterConfig


def test_unknown_name_is_an_attribute_error_and_submodules_still_import() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = dsec.no_such_name  # type: ignore[attr-defined]
    from dsec import quant  # a submodule, not a lazy name

    assert quant.__name__ == "dsec.quant"


def test_importing_dsec_loads_neither_the_probe_nor_its_dependencies() -> None:
    loaded = _modules_after("import dsec, dsec.breaker")
    assert not {"dsec.probe", "dsec.probe.attach", "httpx", "pydantic"} & loaded


def test_first_use_of_a_lazy_name_loads_the_probe() -> None:
    loaded = _modules_after("import dsec; dsec.attach")
    assert "dsec.probe.attach" in loaded


def test_version_comes_from_the_distribution_with_a_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dsec._installed_version() == dsec.__version__

    def missing(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert dsec._installed_version() == "0.0.0+unknown"
