"""The gate's pytest plugin as pytest needs it, whatever pytest >= 8 is installed."""
from __future__ import annotations

import pytest

from imagebuild.gate.runner import GatePlugin


def _plugin() -> GatePlugin:
    return GatePlugin(spec=None, container="c", inspect={}, gpu=False, require_gpu=False, env={})


def test_the_plugin_hashes_by_identity():
    """pytest 9.0 keeps registered plugins in a set: an unhashable plugin (a dataclass with eq) failed
    every gate with INTERNALERROR ("unhashable type: 'GatePlugin'"), reported as "no checks collected"."""
    a, b = _plugin(), _plugin()
    assert len({a, b}) == 2 and a != b and a == a


def test_a_plugin_registers_with_pytests_plugin_manager():
    pm = pytest.PytestPluginManager()
    p = _plugin()
    pm.register(p, name="imagebuild-gate")
    assert pm.is_registered(p)
