"""`addnorm info` and the CLI's top level."""

from __future__ import annotations

import subprocess
import sys

import pytest

from addnorm import backend as backends
from addnorm.tools.cli import main


def test_info_lists_backends_and_passes_self_test(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in backends.REGISTRY:
        assert name in out
    assert "torch" in out and "threads" in out
    assert "ok [[0.0, -1.2238, 1.2238], [1.414, -0.707, -0.707]]" in out
    assert "FAILED" not in out


def test_info_self_test_detects_a_wrong_backend(monkeypatch):
    from addnorm.tools import info

    monkeypatch.setattr(info, "WORKED_OUTPUT", [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    assert main(["info"]) == 1


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    assert "info" in capsys.readouterr().out


def test_unknown_command_exits_2(capsys):
    assert main(["frobnicate"]) == 2
    assert capsys.readouterr().err.startswith("addnorm: error: argument COMMAND: invalid choice: 'frobnicate'")


def test_console_script_runs():
    done = subprocess.run([sys.executable, "-m", "addnorm", "--version"], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.startswith("addnorm ")


def test_ctrl_c_while_the_package_imports_is_one_line():
    """The installed command starts outside the package, so that a Ctrl-C during the seconds
    torch and numba take to import ends it with one line and status 130, as later."""
    from importlib.metadata import entry_points

    (script,) = entry_points(group="console_scripts", name="addnorm")
    assert script.value == "addnorm_cli:main"
    code = (
        "import builtins, sys\n"
        "real = builtins.__import__\n"
        "def interrupted(name, *args, **kwargs):\n"
        "    if name == 'addnorm.tools.cli':\n"
        "        raise KeyboardInterrupt\n"
        "    return real(name, *args, **kwargs)\n"
        "builtins.__import__ = interrupted\n"
        "import addnorm_cli\n"
        "sys.exit(addnorm_cli.main())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert (done.returncode, done.stderr) == (130, "addnorm: error: interrupted\n")


# --------------------------------------------------------------------------- one error mechanism


@pytest.fixture
def command(monkeypatch):
    """``addnorm boom`` runs the function this fixture is given: ``command(fn)``."""
    from addnorm.tools import cli

    def install(fn):
        def register(sub):
            sub.add_parser("boom").set_defaults(func=fn)

        if "boom_command" not in cli.COMMAND_MODULES:
            monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "boom_command"])
        monkeypatch.setitem(sys.modules, "boom_command", type("M", (), {"register": register}))

    return install


def _raise(err):
    def fn(args):
        raise err

    return fn


@pytest.mark.parametrize(
    "err, status, line",
    [
        (None, 2, "addnorm boom: error: --n must be positive"),  # UsageError, see below
        (
            OSError(28, "No space left on device", "out/x.png"),
            1,
            "addnorm boom: error: 'out/x.png': No space left on device",
        ),
        (KeyboardInterrupt(), 130, "addnorm boom: error: interrupted"),
        (
            ZeroDivisionError("float division by zero\nsecond line"),
            1,
            "addnorm boom: error: unexpected ZeroDivisionError: float division by zero; "
            "rerun with 'addnorm --traceback ...' to see where",
        ),
    ],
)
def test_every_failure_is_one_line_with_its_status(command, capsys, err, status, line):
    from addnorm.tools.cli import UsageError

    command(_raise(err if err is not None else UsageError("--n must be positive")))
    assert main(["boom"]) == status
    out, errout = capsys.readouterr()
    assert out == "" and errout == line + "\n"


def test_command_error_is_status_1_and_traceback_on_request(command, capsys):
    from addnorm.tools.cli import CommandError

    command(_raise(CommandError("the disk went away")))
    assert main(["boom"]) == 1
    assert capsys.readouterr().err == "addnorm boom: error: the disk went away\n"
    command(_raise(ValueError("a bug")))
    assert main(["--traceback", "boom"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith(
        "addnorm boom: error: unexpected ValueError: a bug\n"
    )


def test_broken_pipe_is_quiet(command, capsys):
    command(_raise(BrokenPipeError(32, "Broken pipe")))
    assert main(["boom"]) == 1
    assert capsys.readouterr() == ("", "")


def test_a_value_that_starts_like_a_negative_number_is_a_value(capsys):
    # argparse takes "-1e-5" and "-0.5,2" for options ("expected one argument") unless told otherwise
    assert main(["explain", "--eps", "-1e-5"]) == 2
    assert capsys.readouterr().err == "addnorm explain: error: --eps must be a non-negative number, got -1e-05\n"
    assert main(["explain", "--json", "--gamma", "-0.5,2,-.25"]) == 0
    assert '"gamma": [\n  -0.5,\n  2.0,\n  -0.25\n ]' in capsys.readouterr().out


def test_subcommand_usage_errors_name_the_subcommand(capsys):
    assert main(["plot", "hist", "--points"]) == 2
    assert capsys.readouterr().err == (
        "addnorm plot hist: error: argument --points: expected one argument (see 'addnorm plot hist --help')\n"
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "--arms", ""],
        ["train", "--out", " "],
        ["bench", "--impl", ""],
        ["bench", "--plot", ""],
        ["explain", "--normalized-shape", ""],
    ],
)
def test_an_empty_value_is_refused_not_taken_for_the_default(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    flag = argv[1]
    assert err == (
        f"addnorm {argv[0]}: error: argument {flag}: expected a value, got an empty string "
        f"(see 'addnorm {argv[0]} --help')\n"
    )
