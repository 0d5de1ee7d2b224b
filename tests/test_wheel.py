"""A wheel is a full install (issue #60 item 3): the package built from this tree holds everything
a run needs (the default plan, the pair's calibration and depth predictor, the drafter, the kernel
library's sources and headers), and installed into a fresh virtual environment outside the
checkout, the README's main command runs there and speculates.

Slow: it builds the wheel, makes a venv (``--system-site-packages``, so torch and the embedded
model's package are the machine's) and runs ``yggtree run`` with empty user caches, which builds
the default plan's graphs and measures its quick profile once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "Explain speculative decoding in two sentences."  # the README's


def sh(cmd: list[str], cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    return r


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """``(python, env, cwd)``: a fresh venv holding the wheel built from a copy of this tree's
    package (no build/ or egg-info left in the checkout, none of its stale files in the wheel),
    and the environment a user outside the checkout has (no PYTHONPATH, empty caches)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    src.mkdir()
    for f in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / f, src / f)
    shutil.copytree(ROOT / "yggtree", src / "yggtree", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(root / "dist"),
        str(src)], cwd=root)
    [wheel] = (root / "dist").glob("yggtree-*.whl")
    sh([sys.executable, "-m", "venv", "--system-site-packages", str(root / "venv")], cwd=root)
    python = root / "venv" / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env |= {"XDG_CACHE_HOME": str(root / "cache"), "XDG_DATA_HOME": str(root / "data"),
            "PATH": f"{root / 'venv' / 'bin'}{os.pathsep}{env.get('PATH', '')}"}
    sh([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=root, env=env)
    home = root / "home"  # the user's working directory: no checkout around it
    home.mkdir()
    where = sh([str(python), "-c", "import yggtree; print(yggtree.__file__)"], cwd=home, env=env).stdout.strip()
    assert Path(where).is_relative_to(root / "venv"), f"the venv imports yggtree from {where}, not the wheel"
    return python, env, home, wheel


def test_the_wheel_holds_what_a_run_needs(venv):
    python, env, home, wheel = venv
    names = set(zipfile.ZipFile(wheel).namelist())
    csrc = ROOT / "yggtree" / "runtime" / "csrc"
    for f in sorted(csrc.glob("*.cpp")) + sorted(csrc.glob("*.h")):
        assert f"yggtree/runtime/csrc/{f.name}" in names, f.name
    pair = "yggtree/assets/predictors/default__default__float32"
    for f in ("calibration.json", "depth_manifest.json", "depth_predictor.safetensors", "depth_baseline.safetensors"):
        assert f"{pair}/{f}" in names, f
    assert "yggtree/plans/default.yaml" in names
    assert any(n.startswith("yggtree/assets/drafters/smollm2-135m-eagle/") for n in names)
    # installed: the quick start finds the pair's calibration and predictor in the package, the
    # kernel library's sources and every header they include in site-packages
    check = r"""
import json, re
from pathlib import Path
import yggtree
from yggtree.plan import default_plan
from yggtree.quickstart import shipped_calibration, shipped_pair_dir
from yggtree.runtime.calibration import Calibration
from yggtree.runtime.kernels import HEADERS, SOURCES, library_missing
from yggtree.runtime.predictor import load_predictor
pkg = Path(yggtree.__file__).parent
plan = default_plan()
cal = shipped_calibration(plan)
Calibration.load(cal, plan)
load_predictor(shipped_pair_dir(plan), plan)
includes = set()
for f in SOURCES + HEADERS:
    includes |= set(re.findall(r'#include "([^"]+)"', f.read_text()))
csrc = Path(SOURCES[0]).parent
print(json.dumps({"pkg": str(pkg), "cal": str(cal), "sources": [str(f) for f in SOURCES + HEADERS],
                  "unresolved": sorted(i for i in includes if not (csrc / i).is_file()),
                  "missing_flags": library_missing()}))
"""
    got = json.loads(sh([str(python), "-c", check], cwd=home, env=env).stdout.strip().splitlines()[-1])
    pkg = Path(got["pkg"])
    assert Path(got["cal"]).is_relative_to(pkg) and all(Path(f).is_relative_to(pkg) for f in got["sources"])
    assert got["unresolved"] == []
    if got["missing_flags"]:
        print(f"kernel library not built: this CPU lacks {', '.join(got['missing_flags'])}")
    else:  # where the CPU runs it, the library builds from site-packages
        sh([str(python), "-c", "from yggtree.runtime.kernels import load_library; load_library()"], cwd=home, env=env,
           timeout=1200)


def test_the_readme_command_speculates_from_the_wheel(venv):
    python, env, home, _ = venv
    readme = (ROOT / "README.md").read_text()
    assert f'yggtree run --prompt "{PROMPT}"' in readme  # the command this test runs
    t0 = time.perf_counter()
    r = sh(["yggtree", "run", "--prompt", PROMPT, "--max-new-tokens", "32", "--json"], cwd=home, env=env,
           timeout=1800)
    took = time.perf_counter() - t0
    out = json.loads(r.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    print(f"first run from the wheel: {took:.0f} s; stats {json.dumps(stats)}; stderr: {r.stderr.strip()}")
    assert "Traceback" not in r.stderr and stats["new_tokens"] > 0
    # the default path took the quick start with the package's calibration, and the objective
    # chose trees (not only plain steps)
    assert "quick latency profile" in r.stderr and "no acceptance calibration" not in r.stderr
    assert "aal" in stats, stats
    trees = {k: n for k, n in stats.get("steps_by_choice", {}).items() if not k.startswith("0,")}  # D,W_d,W_v
    assert trees and stats["draft_calls"] > 0, stats  # its AAL is printed: the objective's choices vary by run
