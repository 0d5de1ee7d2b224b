"""runtime/gguf_file.py reads what gguf's own reader reads (metadata values, string arrays by their
count, every tensor's name, shape, type and bytes), and loading's dequantization gives gguf.quants'
bits; a file that is not a whole GGUF file is one YggError naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")

from yggtree.errors import YggError  # noqa: E402
from yggtree.runtime.gguf_file import Strings, read_gguf  # noqa: E402
from yggtree.runtime.loading import _dequantize, default_model_path  # noqa: E402

T = gguf.GGMLQuantizationType


def _same_as_gguf_reader(path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(str(path))
    keys = {k for k in theirs.fields if not k.startswith("GGUF.")}  # the reader's header pseudo-fields
    assert set(ours.fields) == keys
    for k in keys:
        f = theirs.fields[k]
        if f.types[0] == gguf.GGUFValueType.ARRAY and f.types[-1] == gguf.GGUFValueType.STRING:
            assert ours.fields[k] == Strings(len(f.data)), k
        elif f.types[:2] == [gguf.GGUFValueType.ARRAY] * 2:  # its contents() flattens arrays of arrays
            assert [x for a in ours.fields[k] for x in a] == f.contents(), k
        else:
            assert ours.fields[k] == f.contents(), k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors):
        assert a.shape == tuple(int(x) for x in b.shape) and a.kind == b.tensor_type, a.name
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name
        assert a.data.dtype == np.asarray(b.data).dtype, a.name


def _dequantized_as_gguf(path) -> None:
    for t in read_gguf(path).tensors:
        want = torch.from_numpy(gguf.quants.dequantize(np.asarray(t.data), t.kind).copy()).float()
        got = _dequantize(t)
        assert got.dtype == torch.float32 and got.numel() == want.numel(), t.name
        assert torch.equal(got.reshape(-1).view(torch.int32), want.reshape(-1).view(torch.int32)), t.name


def _write_sample(path, alignment: int = 32) -> None:
    """A small GGUF file with every metadata value type and the tensor types the runtime reads."""
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    if alignment != 32:
        w.add_custom_alignment(alignment)
    w.add_uint8("t.u8", 200), w.add_int8("t.i8", -5), w.add_uint16("t.u16", 60000), w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000), w.add_int32("t.i32", -7), w.add_float32("t.f32", 0.25)
    w.add_uint64("t.u64", 2**40), w.add_int64("t.i64", -(2**40)), w.add_float64("t.f64", 1e-300)
    w.add_bool("t.bool", True), w.add_string("t.str", "héllo")
    w.add_array("t.ints", [1, 2, 3]), w.add_array("t.floats", [0.5, -1.5])
    w.add_array("t.strings", ["a", "", "ünïcode", "x" * 300])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_tensor("norm", rng.standard_normal(64).astype(np.float32))
    w.add_tensor("half", rng.standard_normal((3, 64)).astype(np.float16))
    for kind in (T.Q4_0, T.Q4_1, T.Q8_0):
        x = rng.standard_normal((5, 96)).astype(np.float32)
        w.add_tensor(f"w.{kind.name}", gguf.quants.quantize(x, kind), raw_dtype=kind)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("alignment", [32, 64])
def test_a_written_file_reads_as_ggufs_reader_reads_it(tmp_path, alignment):
    path = tmp_path / "sample.gguf"
    _write_sample(path, alignment)
    _same_as_gguf_reader(path)
    _dequantized_as_gguf(path)
    f = read_gguf(path)
    assert f.get("t.strings") == Strings(4) and len(f.get("t.strings")) == 4 and f.get("absent", 3) == 3
    assert f.get("t.nested") == [[1, 2], [3]] and f.get("t.str") == "héllo"


def test_the_embedded_model_reads_and_dequantizes_as_gguf_does():
    _same_as_gguf_reader(default_model_path())
    _dequantized_as_gguf(default_model_path())


@pytest.mark.parametrize("damage,why", [("empty", "empty"), ("magic", "no GGUF magic"), ("version", "GGUF version 1"),
                                        ("big-endian", "big-endian"), ("truncated", "")])
def test_a_damaged_file_is_one_error_naming_it(tmp_path, damage, why):
    good = tmp_path / "good.gguf"
    _write_sample(good)
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes({"empty": b"", "magic": b"GGML" + data[4:], "version": data[:4] + b"\x01\0\0\0" + data[8:],
                     "big-endian": data[:4] + b"\0\0\0\x03" + data[8:], "truncated": data[: len(data) // 2]}[damage])
    with pytest.raises(YggError, match=f"cannot read GGUF file .*bad.gguf: .*{why}") as e:
        read_gguf(bad)
    assert "\n" not in str(e.value)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_any_cut_or_flipped_byte_reads_or_is_one_error(tmp_path_factory, data):
    """No prefix of a GGUF file, nor the file with one byte changed in its header, raises anything
    but YggError (or reads as a file)."""
    d = tmp_path_factory.mktemp("g")
    good = d / "good.gguf"
    _write_sample(good)
    raw = bytearray(good.read_bytes())
    if data.draw(st.booleans()):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1))]
    else:
        at = data.draw(st.integers(0, 600))
        raw[at] = data.draw(st.integers(0, 255))
    bad = d / "bad.gguf"
    bad.write_bytes(bytes(raw))
    try:
        read_gguf(bad)
    except YggError:
        pass
