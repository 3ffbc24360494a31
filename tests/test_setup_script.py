"""``scripts/setup.sh`` run against fake ``apt-get`` and ``python3`` on PATH: what it asks of apt."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SETUP = Path(__file__).parents[1] / "scripts" / "setup.sh"

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the script's apt-get branch is Debian's")


def _fake(bin_dir: Path, name: str, log: Path) -> None:
    """A command ``name`` that appends its arguments to ``log`` as one line and succeeds."""
    path = bin_dir / name
    path.write_text(f'#!{shutil.which("sh")}\necho "{name} $*" >> "{log}"\n')
    path.chmod(0o755)


def test_every_apt_get_waits_for_the_dpkg_lock(tmp_path):
    # issue 47: with another apt-get holding the dpkg lock, setup.sh gave up at once; every call
    # (update and install) must wait for it
    bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
    bin_dir.mkdir()
    for name in ("apt-get", "python3"):
        _fake(bin_dir, name, log)
    for tool in ("dirname", "id"):                   # what the script needs besides its builtins
        os.symlink(shutil.which(tool), bin_dir / tool)
    # no dot and no chromedriver on this PATH: both apt-get branches run
    result = subprocess.run([shutil.which("bash"), str(SETUP), "--test"], env={"PATH": str(bin_dir)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = log.read_text().splitlines()
    apt = [c for c in calls if c.startswith("apt-get ")]
    assert len(apt) == 4, calls                        # update + install, for graphviz and for chromium
    assert {c.split()[-1] for c in apt if " install " in c} == {"graphviz", "chromium-driver"}
    for call in apt:
        assert call.startswith("apt-get -o DPkg::Lock::Timeout=600 "), call
    assert any(c.startswith("python3 -m pip install") for c in calls)
