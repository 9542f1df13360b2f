"""The packages' public faces: ``publisher``, ``engines``, ``evlog`` and ``publisher.ray``.

A user imports from the faces (``from publisher import ControlPlane``); each face maps every
public name to the module that defines it (``_FACE``/``_LAZY``) and imports it on first use.
Checked here: every name resolves to its module's own object, ``__all__`` lists exactly the
map, and importing the faces (and every name that does not need them) loads neither torch nor
Ray nor any other module of the project.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

import engines
import evlog
import publisher

REPO = Path(__file__).resolve().parents[1]
# The names whose modules load the model stack or Ray by design.
HEAVY = {"engines": {"LocalEngine"}}


def _faces() -> list[tuple[ModuleType, dict[str, str]]]:
    faces = [(publisher, publisher._FACE), (engines, engines._FACE), (evlog, evlog._LAZY)]
    try:
        import publisher.ray as on_ray
    except ImportError:  # pragma: no cover - the ray extra is part of the test install
        return faces
    return [*faces, (on_ray, on_ray._LAZY)]


@pytest.mark.parametrize(("face", "mapping"), _faces(), ids=lambda f: getattr(f, "__name__", ""))
def test_every_name_resolves_to_its_module(face: ModuleType, mapping: dict[str, str]) -> None:
    assert set(mapping) <= set(face.__all__)
    for name, module in mapping.items():
        assert getattr(face, name) is getattr(importlib.import_module(module), name), name
    with pytest.raises(AttributeError):
        face.NoSuchName  # noqa: B018


def test_all_is_exactly_the_map() -> None:
    assert publisher.__all__ == sorted(publisher._FACE)
    assert engines.__all__ == sorted(engines._FACE)
    assert set(publisher.__all__) <= set(dir(publisher))
    assert set(engines.__all__) <= set(dir(engines))


PROBE = """
import json, sys
import engines, evlog, publisher, publisher.ray
loaded_by_import = sorted(
    m for m in sys.modules if m.split(".")[0] in ("engines", "evlog", "projections", "publisher")
)
heavy = {heavy}
for face in (publisher, engines, evlog):
    for name in face.__all__:
        if name not in heavy.get(face.__name__, ()):
            getattr(face, name)
print(json.dumps({{
    "loaded_by_import": loaded_by_import,
    "torch": "torch" in sys.modules,
    "ray": "ray" in sys.modules,
}}))
"""


def test_the_faces_import_nothing_heavy() -> None:
    """``import publisher`` loads no other module of the project (so the pure core, imported
    as ``publisher.core.decider``, stays light), and no public name but the local engine loads torch
    or Ray."""
    heavy = {face: sorted(names) for face, names in HEAVY.items()}
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(heavy=heavy)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout)
    # evlog's face imports its pure parts (events, records, the store contract) on purpose
    others = [m for m in facts["loaded_by_import"] if m.split(".")[0] != "evlog"]
    assert others == ["engines", "publisher", "publisher.ray"]
    assert (facts["torch"], facts["ray"]) == (False, False)
