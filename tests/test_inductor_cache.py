"""One process at a time compiles into an inductor cache directory (runtime/graphs.inductor_cache):
a second one waits, saying so in one line, instead of writing the same compiled library beside it."""

from __future__ import annotations

import os
import threading

from yggtree.runtime.graphs import inductor_cache


def test_a_second_user_of_the_directory_waits_for_the_first(tmp_path, capfd):
    entered = threading.Event()
    first_inside, release = threading.Event(), threading.Event()

    def first():
        with inductor_cache(tmp_path):
            first_inside.set()
            release.wait(10)

    def second():
        with inductor_cache(tmp_path) as root:
            assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root)
            entered.set()

    a = threading.Thread(target=first)
    a.start()
    assert first_inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    assert not entered.wait(0.3)  # held by the first
    release.set()
    a.join(10)
    assert entered.wait(10)
    b.join(10)
    assert f"waiting for another process compiling graphs into {tmp_path.resolve()}" in capfd.readouterr().err


def test_other_directories_do_not_wait(tmp_path):
    with inductor_cache(tmp_path / "a"), inductor_cache(tmp_path / "b") as root:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(root)
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ or os.environ["TORCHINDUCTOR_CACHE_DIR"] != str(root)
