"""The layering contract in pyproject.toml keeps covering the whole data plane as it grows."""

from __future__ import annotations

import pkgutil
import tomllib
from pathlib import Path

import workers

ROOT = Path(__file__).resolve().parent.parent
#: What the gateway may import from the data plane.
WIRE = {"workers.protocol", "workers.errors"}


def _contract(name_start: str) -> dict:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return next(c for c in config["contracts"] if c["name"].startswith(name_start))


def test_every_data_plane_module_but_the_wire_types_is_forbidden_to_the_gateway():
    contract = _contract("The gateway sees only")
    forbidden = set(contract["forbidden_modules"])
    top = {f"workers.{m.name}" for m in pkgutil.iter_modules(workers.__path__)}
    uncovered = {m for m in top - WIRE if m not in forbidden}
    assert not uncovered, f"add {sorted(uncovered)} to forbidden_modules (or to the wire types on purpose)"
    assert "sandboxes" in forbidden and not forbidden & WIRE


def test_the_debt_list_names_only_gateway_imports_of_forbidden_modules():
    contract = _contract("The gateway sees only")
    forbidden = tuple(contract["forbidden_modules"])
    for edge in contract["ignore_imports"]:
        source, target = (part.strip() for part in edge.split("->"))
        assert source.startswith("gateway"), edge
        assert target.startswith(forbidden), edge
