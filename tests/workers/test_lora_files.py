"""An adapter's files are read whole, once, at load: regular files in the adapter directory only
(a FIFO, a directory or a symlink out of it is refused before a byte is read), under a size cap and
a time limit, with a content digest; lora_alpha's scaling is checked as the forward will use it.
Messages name files, never absolute paths."""

from __future__ import annotations

import json
import math
import os
import threading

import pytest
import torch
from safetensors.torch import save

from workers.lora.adapter import ModelShapes, parse_adapter, read_adapter
from workers.lora.files import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterFiles,
    call_with_timeout,
    read_adapter_files,
)

SHAPES = ModelShapes(num_layers=2, shapes={"q_proj": (8, 8), "o_proj": (8, 8)})
CAP = SHAPES.max_adapter_bytes(4)


def _config(**over) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **over}).encode()


def _weights(scale: float = 0.1, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    return save(
        {
            f"{prefix}.lora_A.weight": torch.randn(2, 8, generator=gen) * scale,
            f"{prefix}.lora_B.weight": torch.randn(8, 2, generator=gen) * scale,
        }
    )


@pytest.fixture()
def adapter_dir(tmp_path):
    path = tmp_path / "adapter"
    path.mkdir()
    (path / CONFIG_FILE).write_bytes(_config())
    (path / WEIGHTS_FILE).write_bytes(_weights())
    return path


def _read(path) -> AdapterFiles:
    # Bounded so that a read that blocks fails this test instead of hanging the suite.
    return call_with_timeout(lambda: read_adapter_files(str(path), CAP), 30.0, "test read")


def test_an_adapter_is_read_whole_and_kept_when_its_files_vanish(adapter_dir):
    adapter = read_adapter("a", str(adapter_dir), SHAPES, max_rank=4)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        os.remove(adapter_dir / name)
    a, b = adapter.weights[(1, "q_proj")]
    assert a.shape == (2, 8) and b.shape == (8, 2)
    assert adapter.identity == f"a@{adapter.digest[:32]}" and len(adapter.digest) == 64


def test_the_digest_follows_the_content_not_the_path(adapter_dir, tmp_path):
    first = _read(adapter_dir)
    os.rename(adapter_dir, tmp_path / "moved")
    assert _read(tmp_path / "moved").digest == first.digest
    (tmp_path / "moved" / WEIGHTS_FILE).write_bytes(_weights(seed=1))
    assert _read(tmp_path / "moved").digest != first.digest


def test_a_fifo_config_is_refused_without_waiting_for_a_writer(adapter_dir):
    os.remove(adapter_dir / CONFIG_FILE)
    os.mkfifo(adapter_dir / CONFIG_FILE)
    with pytest.raises(ValueError, match=f"{CONFIG_FILE} is not a regular file"):
        _read(adapter_dir)


def test_a_directory_in_place_of_the_weights_is_refused(adapter_dir):
    os.remove(adapter_dir / WEIGHTS_FILE)
    os.mkdir(adapter_dir / WEIGHTS_FILE)
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE} is not a regular file"):
        _read(adapter_dir)


def test_a_symlink_out_of_the_directory_is_refused_one_inside_is_read(adapter_dir, tmp_path):
    outside = tmp_path / "secret.json"
    outside.write_bytes(_config())
    os.remove(adapter_dir / CONFIG_FILE)
    os.symlink(outside, adapter_dir / CONFIG_FILE)
    with pytest.raises(ValueError, match=f"{CONFIG_FILE} links out of the adapter directory"):
        _read(adapter_dir)
    os.remove(adapter_dir / CONFIG_FILE)
    (adapter_dir / "real.json").write_bytes(_config())
    os.symlink(adapter_dir / "real.json", adapter_dir / CONFIG_FILE)
    assert _read(adapter_dir).config == _config()


def test_a_file_over_the_cap_is_refused_unread(adapter_dir):
    (adapter_dir / WEIGHTS_FILE).write_bytes(b"\0" * (CAP + 1))
    with pytest.raises(ValueError, match=f"{WEIGHTS_FILE} is larger than {CAP} bytes"):
        _read(adapter_dir)
    (adapter_dir / CONFIG_FILE).write_bytes(b" " * ((1 << 20) + 1))
    with pytest.raises(ValueError, match=f"{CONFIG_FILE} is larger than"):
        _read(adapter_dir)


def test_a_missing_file_is_named_without_its_absolute_path(adapter_dir):
    os.remove(adapter_dir / WEIGHTS_FILE)
    with pytest.raises(ValueError) as info:
        _read(adapter_dir)
    assert f"cannot read {WEIGHTS_FILE}" in str(info.value)
    assert str(adapter_dir) not in str(info.value)


def test_a_read_that_does_not_return_is_refused_at_the_time_limit():
    release = threading.Event()
    try:
        with pytest.raises(ValueError, match="lora_path: not read within 0.2 s"):
            call_with_timeout(release.wait, 0.2, "lora_path")
    finally:
        release.set()  # the left-behind thread ends
    assert call_with_timeout(lambda: 7, 5.0, "x") == 7
    with pytest.raises(KeyError):
        call_with_timeout(lambda: {}["k"], 5.0, "x")


@pytest.mark.parametrize("alpha", [1e308, 2**64, 1e6 * (1 + 1e-15)])
def test_an_alpha_past_its_bound_is_refused_naming_lora_alpha(alpha):
    files = AdapterFiles(_config(lora_alpha=alpha), _weights())
    with pytest.raises(ValueError, match=r"lora_alpha=.* at most 1e\+06"):
        parse_adapter("a", files, SHAPES, 4, torch.float32)


def test_weights_whose_scaled_update_overflows_are_refused_naming_lora_alpha():
    """The check runs on B times the scaling, as the forward uses it: finite weights and a
    bounded alpha can still overflow."""
    files = AdapterFiles(_config(lora_alpha=1e6), _weights(scale=1e35))
    with pytest.raises(ValueError, match="layers.1.q_proj: lora_B weights times the scaling of "):
        parse_adapter("a", files, SHAPES, 4, torch.float32)


def test_an_alpha_that_fits_float32_but_not_float16_is_refused_in_float16():
    files = AdapterFiles(_config(lora_alpha=1e6), _weights())
    adapter = parse_adapter("a", files, SHAPES, 4, torch.float32)
    assert torch.isfinite(adapter.weights[(1, "q_proj")][1]).all()
    with pytest.raises(ValueError, match="lora_alpha=1000000.0.*float16"):
        parse_adapter("a", files, SHAPES, 4, torch.float16)


@pytest.mark.parametrize("alpha", [-1, 0, math.nan, math.inf, "4", None])
def test_a_bad_alpha_is_refused_naming_it(alpha):
    config = json.loads(_config())
    config["lora_alpha"] = alpha
    # json.dumps writes NaN and Infinity, which json.loads reads back as floats.
    files = AdapterFiles(json.dumps(config).encode(), _weights())
    with pytest.raises(ValueError, match="lora_alpha"):
        parse_adapter("a", files, SHAPES, 4, torch.float32)


def test_the_size_cap_fits_the_largest_adapter_of_the_rank():
    # Two layers, two 8x8 targets at rank 4, float64: 2 * 2 * 4 * (8 + 8) * 8 bytes + header.
    assert CAP == 2 * 2 * 4 * 16 * 8 + (1 << 20)
