"""The one integer check (no compilation): what passes, what is refused, and the message."""

import numpy as np
import pytest

from mirrorax._checks import check_int


@pytest.mark.parametrize("value", [1, 7, np.int32(3), np.int64(2)])
def test_integers_in_range_pass(value):
    check_int("steps", value)


@pytest.mark.parametrize("value, message", [
    (0, "steps must be an integer >= 1; received 0."),
    (True, "steps must be an integer >= 1; received True (of type bool)."),
    (np.bool_(True), "steps must be an integer >= 1; received np.True_ (of type bool)."),
    (2.0, "steps must be an integer >= 1; received 2.0 (of type float)."),
    ("3", "steps must be an integer >= 1; received '3' (of type str)."),
])
def test_anything_else_is_refused_with_what_was_received(value, message):
    with pytest.raises(ValueError) as e:
        check_int("steps", value)
    assert str(e.value) == message


def test_meaning_low_bound_and_error_type():
    check_int("seed", 0, 0)
    check_int("process_id", -3, None, error=TypeError)
    with pytest.raises(ValueError, match=r"^timeout must be an integer >= 1 \(seconds\); received -1\.$"):
        check_int("timeout", -1, meaning="seconds")
    with pytest.raises(TypeError, match=r"^process_id must be an integer; received 1\.5 \(of type float\)\.$"):
        check_int("process_id", 1.5, None, error=TypeError)
