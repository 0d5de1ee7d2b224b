"""The offline extra: the base install runs the main command, offline commands without the extra
end with one line naming what to install."""

from __future__ import annotations

import subprocess
import sys

from yggtree.cli import OFFLINE_EXTRA, main


def test_offline_command_without_the_extra_is_one_line(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "sklearn", None)  # import sklearn now raises ImportError
    monkeypatch.setitem(sys.modules, "pandas", None)
    assert main(["calibrate", "--prompts", "1"]) == 1
    err = capsys.readouterr().err
    assert err == ("yggtree: error: `yggtree calibrate` needs scikit-learn, pandas (the offline extra): "
                   "pip install 'yggtree[offline]'\n")


def test_base_install_imports_no_offline_package():
    """Every command's parser and the whole runtime import with the offline packages absent."""
    code = (
        "import sys\n"
        f"for m in {sorted(OFFLINE_EXTRA)!r}: sys.modules[m] = None\n"
        "import pkgutil, importlib, yggtree, yggtree.runtime\n"
        "from yggtree.cli import build_parser\n"
        "build_parser()\n"
        "for m in pkgutil.iter_modules(yggtree.runtime.__path__, 'yggtree.runtime.'):\n"
        "    importlib.import_module(m.name)\n"
        "import yggtree.bench, yggtree.plan, yggtree.compiled, yggtree.tuned, yggtree.streaming\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
