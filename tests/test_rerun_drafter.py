"""scripts/rerun_drafter.py (issue #19): its chunks are the shipped head's documented commands,
and a work directory's progress is read from the files the chunks write (no state of its own)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from helpers import load_script

README = Path(__file__).resolve().parent.parent / "yggtree/assets/drafters/smollm2-135m-eagle/README.md"


def flags(cmd: str) -> dict[str, str]:
    """--flag value pairs of a command line, paths dropped (they name other directories)."""
    toks = cmd.replace("\\\n", " ").split()
    out = {}
    for i, t in enumerate(toks):
        if t.startswith("--") and t not in ("--standalone",) and i + 1 < len(toks):
            out[t] = toks[i + 1]
    for path_flag in ("--transcripts", "--out", "--init-from"):
        out.pop(path_flag, None)
    return out


def test_the_stages_are_the_documented_commands(tmp_path):
    mod = load_script("rerun_drafter")
    text = README.read_text()
    documented = [flags(m) for m in re.findall(r"torchrun .*?--budget-minutes 55", text, re.S)]
    ours = {c.name: flags(" ".join(c.commands[0])) for c in mod.chunks(tmp_path) if c.name.startswith("stage")}
    assert len(documented) == 4 and len(ours) == 4
    for n, doc in enumerate(documented, start=1):
        mine = ours[f"stage{n}"]
        if n in (2, 3):  # they read the first 13 shards, all there were when they ran (the README says so)
            doc["--max-tokens"] = "1138407"
        assert mine == doc, n


def test_progress_is_read_from_the_files(tmp_path, capsys):
    mod = load_script("rerun_drafter")
    todo = mod.chunks(tmp_path)
    assert [c.name for c in todo][:4] == ["transcripts-0-6", "transcripts-6-12", "transcripts-12-18",
                                          "transcripts-18-20"]
    assert not any(mod.done(c) for c in todo)
    for p in todo[0].outputs:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"")
    assert mod.done(todo[0]) and not mod.done(todo[1])
    assert mod.main([str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "done  transcripts-0-6" and out[1] == "todo  transcripts-6-12" and out[-1] == "todo  compare"
    # the held-out shard comes with the last group
    assert todo[3].outputs[-1].name == "heldout-00000.safetensors"


def test_a_stopped_driver_stops_its_workers(tmp_path):
    """SIGTERM to the driver ends the chunk's workers too (none is left running unseen)."""
    import signal
    import subprocess
    import sys
    import time

    scripts = Path(__file__).resolve().parent.parent / "scripts"
    marker = f"{tmp_path}/never"
    code = (f"import sys, signal; sys.path.insert(0, {str(scripts)!r}); import rerun_drafter as r\n"
            "from pathlib import Path\n"
            "signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\n"
            f"r.run_chunk(r.Chunk('t', (('sleep', '301'), ('sleep', '301')), (Path({marker!r}),)), "
            f"Path({str(tmp_path)!r}))\n")
    def sleepers() -> int:
        n = 0
        for d in Path("/proc").iterdir():
            try:
                n += (d / "cmdline").read_bytes() == b"sleep\x00301\x00"
            except OSError:
                continue
        return n

    p = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 30
    while time.time() < deadline and sleepers() < 2:
        time.sleep(0.1)
    assert sleepers() == 2
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=30) == 143
    assert sleepers() == 0
    log = [json.loads(line) for line in (tmp_path / "rerun.jsonl").read_text().splitlines()]
    assert len(log) == 1 and log[0]["chunk"] == "t" and log[0]["interrupted"] and log[0]["wall_s"] >= 0


def fake_shard(path: Path, value: int) -> None:
    """A shard as the pipeline writes one: tensors, and their sha256 in the header's meta."""
    import hashlib

    import torch
    from safetensors.torch import save_file

    t = torch.full((4,), value, dtype=torch.int32)
    sha = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"tokens": t}, str(path), metadata={"meta": json.dumps({"sha256": sha})})


def test_progress_is_carried_to_a_new_machine(tmp_path, monkeypatch, capsys):
    """What one machine's work directory finished is saved small (log, shard hashes, finished heads,
    no optimizer checkpoint) and seeds another machine's, which then continues where it stopped."""
    mod = load_script("rerun_drafter")
    committed = tmp_path / "committed"
    monkeypatch.setattr(mod, "COMMITTED", committed)
    first, second, carry = tmp_path / "first", tmp_path / "second", tmp_path / "carry"
    names = [c.outputs for c in mod.chunks(first) if c.name.startswith("transcripts")]
    names = [p.name for outs in names for p in outs]
    for i, n in enumerate(names):
        fake_shard(committed / n, i)
        fake_shard(first / "data" / "transcripts" / n, i)  # regenerated, identical
    stage1 = first / "runs" / "stage1"
    stage1.mkdir(parents=True)
    for f in ("model.safetensors", "config.json", "manifest.json", "checkpoint.pt"):
        (stage1 / f).write_text(f)
    (first / "rerun.jsonl").write_text(json.dumps({"chunk": "stage1", "wall_s": 1.0, "done": True}) + "\n")
    mod.save(first, carry)
    assert sorted(p.name for p in (carry / "stage1").iterdir()) == ["config.json", "manifest.json", "model.safetensors"]
    assert set(json.loads((carry / "shards.json").read_text())) == set(names)

    assert mod.main([str(second), "--list", "--carry", str(carry)]) == 0
    listed = dict(line.split()[::-1] for line in capsys.readouterr().out.splitlines())
    assert all(listed[f"transcripts-{a}"] == "done" for a in ("0-6", "6-12", "12-18", "18-20"))
    assert listed["stage1"] == "done" and listed["stage2"] == "todo"
    assert not (second / "runs" / "stage1" / "checkpoint.pt").exists()
    assert (second / "rerun.jsonl").read_text() == (first / "rerun.jsonl").read_text()
    assert sorted(json.loads((second / "seeded.json").read_text())) == sorted(names)

    # a recorded hash the committed shard does not match: refused in one line naming the file
    shards = json.loads((carry / "shards.json").read_text())
    shards[names[0]] = "0" * 64
    (carry / "shards.json").write_text(json.dumps(shards))
    import pytest

    with pytest.raises(SystemExit, match=f"shards.json: {names[0]} was regenerated"):
        mod.main([str(tmp_path / "third"), "--list", "--carry", str(carry)])
