"""The layout CONTRIBUTING.md maps: the library loads without its tools."""

from __future__ import annotations

import subprocess
import sys


def test_import_addnorm_loads_the_library_alone():
    code = "import sys, addnorm; print(sorted(m for m in sys.modules if m.startswith('addnorm')))"
    loaded = eval(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert "addnorm.ops" in loaded and "addnorm.functional" in loaded
    assert not [m for m in loaded if m.startswith(("addnorm.tools", "addnorm.testing", "addnorm.kernels.triton"))]


def test_the_command_line_runs_as_a_module():
    done = subprocess.run([sys.executable, "-m", "addnorm", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("addnorm ")
