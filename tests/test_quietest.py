"""offline/timing.quietest: a measurement taken while other processes kept the cores busy is taken
again after each wait; the quietest is kept, and nothing waits after the last try."""

from __future__ import annotations

from yggtree.offline import timing


def test_the_quietest_is_kept_and_the_last_try_is_not_waited_after(monkeypatch):
    busy = iter([0.9, 0.5, 0.7])
    waits, said = [], []
    monkeypatch.setattr(timing.time, "sleep", waits.append)
    best = timing.quietest(lambda: {"load": {"other_cores": next(busy)}}, (1, 2), "x", said.append)
    assert best["load"]["other_cores"] == 0.5 and waits == [1, 2] and len(said) == 2
    assert said[0] == "other processes kept 0.90 cores busy while timing x: again in 1 s"


def test_a_quiet_or_unmeasurable_first_try_is_kept_at_once(monkeypatch):
    monkeypatch.setattr(timing.time, "sleep", lambda s: (_ for _ in ()).throw(AssertionError("waited")))
    assert timing.quietest(lambda: {"load": {"other_cores": 0.1}}, (5,), "x") == {"load": {"other_cores": 0.1}}
    assert timing.quietest(lambda: {"load": None}, (5,), "x") == {"load": None}
