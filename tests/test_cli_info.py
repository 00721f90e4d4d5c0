"""`addnorm info` and the CLI's top level."""

from __future__ import annotations

import subprocess
import sys

import pytest

from addnorm import backend as backends
from addnorm.cli import main


def test_info_lists_backends_and_passes_self_test(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in backends.REGISTRY:
        assert name in out
    assert "torch" in out and "threads" in out
    assert "ok [[0.0, -1.2238, 1.2238], [1.414, -0.707, -0.707]]" in out
    assert "FAILED" not in out


def test_info_self_test_detects_a_wrong_backend(monkeypatch):
    from addnorm import info

    monkeypatch.setattr(info, "WORKED_OUTPUT", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert main(["info"]) == 1


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


def test_unknown_command_exits_2():
    with pytest.raises(SystemExit) as err:
        main(["frobnicate"])
    assert err.value.code == 2


def test_console_script_runs():
    done = subprocess.run([sys.executable, "-m", "addnorm.cli", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("addnorm ")
