"""The Batch API's settings: each bounded, and a bad value named by the app's config."""

import pytest

from deploy.config import AppConfig

INT_SETTINGS = (
    "batch_max_file_bytes",
    "batch_max_lines",
    "batch_max_line_bytes",
    "batch_quota_bytes",
    "batch_max_files",
    "batch_lines_in_flight",
)


@pytest.mark.parametrize("name", INT_SETTINGS)
@pytest.mark.parametrize("value", [2**64, -1, 0, float("nan"), 10**30, "4", True])
def test_each_batch_setting_refuses_a_bad_value_by_name(name, value):
    with pytest.raises(ValueError, match=name):
        AppConfig.from_args({name: value})


@pytest.mark.parametrize("value", ["", "a\x00b", "x" * 5000, 7])
def test_batch_dir_refuses_a_bad_path_by_name(value):
    with pytest.raises(ValueError, match="batch_dir"):
        AppConfig.from_args({"batch_dir": value})


def test_defaults_and_a_good_value():
    config = AppConfig.from_args({"batch_dir": "/srv/batches", "batch_lines_in_flight": 8})
    assert config.batch_dir == "/srv/batches" and config.batch_lines_in_flight == 8
    assert AppConfig.from_args({}).batch_max_lines == 50_000  # OpenAI's per-batch limit
