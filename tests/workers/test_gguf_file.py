"""workers/gguf_file.py reads a GGUF file's tensors as gguf-py's reader does (names, types,
dimensions, bytes), without building its metadata, and refuses a damaged file with a ValueError
naming the file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.random_kquant import write_tiny_kquant_gguf
from workers.gguf_file import read_gguf
from workers.model_files import default_model_path

MIXED = (
    {"qkv": "Q4_K", "v": "Q5_0", "attn_output": "Q5_1", "gate_up": "Q8_0", "ffn_down": "Q6_K"},
)


@pytest.fixture(scope="module")
def mixed_file(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf-file") / "mixed.gguf")
    write_tiny_kquant_gguf(path, layers=MIXED)
    return path


def assert_reads_like_gguf_py(path: str) -> None:
    ours = read_gguf(path)
    theirs = GGUFReader(path)
    arch = theirs.fields["general.architecture"]
    assert ours.architecture == bytes(arch.parts[-1]).decode()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for a, b in zip(ours.tensors, theirs.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        assert a.shape == tuple(int(d) for d in b.shape), a.name
        assert a.data.tobytes() == np.asarray(b.data).tobytes(), a.name
        if a.tensor_type.name != "BF16":
            assert a.data.shape == np.asarray(b.data).shape, a.name


def test_the_embedded_model_reads_as_gguf_py_reads_it():
    assert_reads_like_gguf_py(str(default_model_path()))


def test_a_file_of_mixed_block_and_float_types_reads_as_gguf_py_reads_it(mixed_file):
    assert_reads_like_gguf_py(mixed_file)
    types = {t.tensor_type.name for t in read_gguf(mixed_file).tensors}
    assert {"F32", "Q4_K", "Q5_0", "Q5_1", "Q6_K", "Q8_0"} <= types


def test_a_file_that_is_not_gguf_is_refused_naming_it(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(ValueError, match=r"x\.gguf' is not a GGUF file"):
        read_gguf(str(path))


def _forged(path, field: str, value: int) -> str:
    """A one-tensor file with its tensor's first dimension or its type id replaced."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = bytearray(Path(path).read_bytes())
    at = data.find(b"blk.0.ffn_up.weight") + len(b"blk.0.ffn_up.weight") + 4  # past n_dims
    if field == "dim":
        data[at : at + 8] = value.to_bytes(8, "little")
    else:  # the type id follows the two dimensions
        data[at + 16 : at + 20] = value.to_bytes(4, "little")
    Path(path).write_bytes(bytes(data))
    return str(path)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("dim", 2**62, "runs past the end"),
        ("dim", 2**64 - 1, "runs past the end"),
        ("type", 999, "has unknown type 999"),
    ],
)
def test_a_forged_tensor_size_or_type_is_a_value_error(tmp_path, field, value, match):
    with pytest.raises(ValueError, match=match):
        read_gguf(_forged(tmp_path / "forged.gguf", field, value))


@settings(max_examples=25, deadline=None)
@given(cut=st.floats(0.0, 0.999))
def test_a_truncated_file_is_a_value_error_naming_it(mixed_file, tmp_path_factory, cut):
    data = Path(mixed_file).read_bytes()
    path = tmp_path_factory.mktemp("cut") / "cut.gguf"
    path.write_bytes(data[: max(8, int(len(data) * cut))])
    with pytest.raises(ValueError, match="cut.gguf"):
        read_gguf(str(path))
