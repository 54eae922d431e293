"""A non-editable install gets every parity subpackage and the B* hardware profiles: build the
wheel (no dependencies, no build isolation: it uses the installed setuptools, a few seconds) and
list what it contains."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_wheel_contains_every_package_and_the_profiles(tmp_path):
    pytest.importorskip("setuptools")
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr[-2000:]
    (wheel,) = tmp_path.glob("ringbridge-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(p.parent.relative_to(ROOT)) for p in ROOT.glob("*/**/__init__.py")
                if p.parts[len(ROOT.parts)] in ("seqplan", "parity", "jax_impl", "torch_impl")}
    assert {"seqplan", "parity", "parity/core", "parity/runners", "jax_impl", "torch_impl"} <= packages
    missing = [p for p in packages if f"{p}/__init__.py" not in names]
    assert not missing, missing
    assert "parity/capacity/profiles/tpu-v5p.json" in names
    assert not any(n.startswith(("tests/", "benchmarks/", "notebooks/")) for n in names)
