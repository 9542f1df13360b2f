"""The packages' public faces: ``publisher``, ``engines``, ``evlog`` and ``publisher.ray``.

A user imports from the faces (``from publisher import ControlPlane``). Each face imports its
names explicitly, except the few whose modules load torch, Ray or an optional extra, which are
listed in its ``_LAZY`` map and imported on first use. Checked here: every name of ``__all__``
resolves (a lazy one to its module's own object), and importing the faces -- and every name
that is not lazy -- loads neither torch nor Ray.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from types import ModuleType

import pytest

import engines
import evlog
import publisher
from tests.support.paths import REPO


def _faces() -> list[ModuleType]:
    faces: list[ModuleType] = [publisher, engines, evlog]
    try:
        import publisher.ray as on_ray
    except ImportError:  # pragma: no cover - the ray extra is part of the test install
        return faces
    return [*faces, on_ray]


@pytest.mark.parametrize("face", _faces(), ids=lambda f: f.__name__)
def test_every_name_resolves(face: ModuleType) -> None:
    lazy: dict[str, str] = getattr(face, "_LAZY", {})
    assert set(lazy) <= set(face.__all__)
    for name in face.__all__:
        value = getattr(face, name)
        if name in lazy:
            assert value is getattr(importlib.import_module(lazy[name]), name), name
    with pytest.raises(AttributeError):
        face.NoSuchName  # noqa: B018


def test_all_lists_each_name_once() -> None:
    for face in _faces():
        assert len(face.__all__) == len(set(face.__all__)), face.__name__


PROBE = """
import json, sys
import engines, evlog, publisher, publisher.ray
for face in (publisher, engines, evlog):
    lazy = getattr(face, "_LAZY", {})
    for name in face.__all__:
        if name not in lazy:
            getattr(face, name)
print(json.dumps({"torch": "torch" in sys.modules, "ray": "ray" in sys.modules,
                  "asyncpg": "asyncpg" in sys.modules}))
"""


def test_the_faces_load_no_torch_and_no_ray() -> None:
    """``import publisher`` (and every name it offers) loads neither the model stack nor Ray:
    a trainer or a gateway process that never runs an engine in process never pays for torch,
    and nothing but ``publisher.ray``'s names needs Ray installed. The PostgreSQL store's
    driver (an optional extra) is not loaded either."""
    done = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout) == {"torch": False, "ray": False, "asyncpg": False}
