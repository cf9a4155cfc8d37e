from __future__ import annotations

import subprocess
import sys

from helpers import CliRunner

import exl3tool
from exl3tool.cli import _register, app


def test_version_flag():
    _register()
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0
    assert exl3tool.__version__ in result.output


def test_python_dash_m_help():
    out = subprocess.run([sys.executable, "-m", "exl3tool", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    assert "exl3tool" in out.stdout
