"""units: the one place sizes and ages are printed; the CLI's report and the TUI's cells print the same strings."""

from __future__ import annotations

import pytest

from ckpt_audit import models
from ckpt_audit.report import age_str
from ckpt_audit.units import NS_PER_S, format_age, format_ago, format_size
from tui import cells

NOW = 1_800_000_000 * NS_PER_S


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1.0 KiB"),
        (1536, "1.5 KiB"),
        (5 * 2**30, "5.0 GiB"),
        (3 * 2**50, "3072.0 TiB"),
    ],
)
def test_sizes(n, text):
    assert format_size(n) == text
    assert models.format_size is format_size  # the name models' many callers import is the same function


@pytest.mark.parametrize(
    ("ago_s", "text"), [(0, "0s"), (59, "59s"), (60, "1m"), (3599, "59m"), (3600, "1h"), (86399, "23h"), (90000, "1d")]
)
def test_ages_are_floored_to_one_unit_and_alike_in_cli_and_tui(ago_s, text):
    then = NOW - ago_s * NS_PER_S
    assert format_age(then, NOW) == age_str(then, NOW) == cells.age(then, NOW) == text
    assert format_ago(then, NOW) == f"{text} ago"


def test_unknown_and_future_times():
    assert format_age(None, NOW) == format_age(0, NOW) == age_str(0, NOW) == cells.age(None, NOW) == "-"
    assert format_age(NOW + 5 * NS_PER_S, NOW) == "0s"  # clock skew: never a negative age
    assert format_ago(None, NOW) == "never"
