"""Which session a request names (router/sessions.py request_session): the body's session_id, the
x-session-id header, and `user` only where the app says so; every bad value is a ValueError naming
the field it came from."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from router.sessions import MAX_SESSION_ID_CHARS, SESSION_HEADER, request_session

GOOD = "agent-7"


def test_the_body_or_the_header_names_the_session_and_they_must_agree():
    assert request_session(GOOD, None) == GOOD
    assert request_session(None, GOOD) == GOOD
    assert request_session(GOOD, GOOD) == GOOD
    assert request_session(None, None) is None
    with pytest.raises(ValueError, match=f"^{SESSION_HEADER}: differs"):
        request_session(GOOD, "agent-8")


def test_user_names_a_session_only_where_configured_and_never_over_a_named_one():
    assert request_session(None, None, user="alice") is None
    assert request_session(None, None, user="alice", from_user=True) == "alice"
    assert request_session(None, GOOD, user="alice", from_user=True) == GOOD
    assert request_session(GOOD, None, user="alice", from_user=True) == GOOD
    assert request_session(None, None, user="", from_user=True) is None  # empty: no user


@pytest.mark.parametrize(
    "bad", ["", "x" * (MAX_SESSION_ID_CHARS + 1), "x" * 10_000_000, 2**64, -1, float("nan"), b"a"]
)
def test_a_bad_header_is_refused_naming_the_header(bad):
    with pytest.raises(ValueError, match=f"^{SESSION_HEADER}: must be a string of 1 to 256"):
        request_session(None, bad)


def test_a_user_too_long_for_a_session_is_refused_naming_user_only_where_configured():
    long = "u" * (MAX_SESSION_ID_CHARS + 1)
    assert request_session(None, None, user=long) is None
    with pytest.raises(ValueError, match="^user: must be a string of 1 to 256"):
        request_session(None, None, user=long, from_user=True)


@given(
    body=st.none() | st.text(max_size=300),
    header=st.none() | st.text(max_size=300),
    user=st.none() | st.text(max_size=300),
    from_user=st.booleans(),
)
def test_any_combination_is_a_valid_session_or_a_value_error_naming_its_field(
    body, header, user, from_user
):
    try:
        session = request_session(body, header, user, from_user)
    except ValueError as e:
        assert str(e).split(":")[0] in ("session_id", SESSION_HEADER, "user"), e
        return
    assert session is None or 1 <= len(session) <= MAX_SESSION_ID_CHARS
    assert session in (body, header, user if from_user else None)
