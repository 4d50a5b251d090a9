"""The command line as a whole: help is fast to load and errors are one sentence."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import cli_env, run_cli


def test_help_lists_commands_without_importing_them() -> None:
    code = (
        "import sys; from mtpwrap.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = [m for m in ('rich', 'pynvml', 'uvicorn', 'matplotlib', 'gguf', 'numpy', "
        "'httpx', 'starlette') if m in sys.modules]\n"
        "print('HEAVY', heavy)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=cli_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "build" in r.stdout and "doctor" in r.stdout
    assert "HEAVY []" in r.stdout


def test_unknown_option_is_a_config_error() -> None:
    r = run_cli("build", "--no-such-flag")
    assert r.returncode == 78
    assert "No such option" in r.stderr and "Traceback" not in r.stderr
