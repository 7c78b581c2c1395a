"""The `x-session-id` header names a request's session beside the body's `session_id`
(docs/router.md#sessions): bounded like it (1 to 256 characters), refused with a 400 naming the
header, and it must agree with the body's when both are given. Served by the shared tiny app."""

from __future__ import annotations

import httpx
import pytest

from tests.deploy.conftest import TINY, TINY_KEY

pytestmark = pytest.mark.slow

HEADER = "x-session-id"


def _post(url: str, path: str, body: dict, session: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {TINY_KEY}"}
    if session is not None:
        headers[HEADER] = session
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


CHAT = {"model": TINY, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
COMPLETION = {"model": TINY, "prompt": "Hi", "max_tokens": 1}


@pytest.mark.parametrize("path, body", [("/chat/completions", CHAT), ("/completions", COMPLETION)])
@pytest.mark.parametrize(
    "session",
    ["agent-7", str(2**64), "-1", "NaN", "s" * 256],
)
def test_a_session_header_within_its_bound_is_served(tiny_url, path, body, session):
    r = _post(tiny_url, path, body, session)
    assert r.status_code == 200, r.text
    # The same session in the body as well: they agree.
    assert _post(tiny_url, path, {**body, "session_id": session}, session).status_code == 200


@pytest.mark.parametrize("session", ["", "s" * 257, "s" * 10_000])
def test_a_session_header_out_of_its_bound_is_a_400_naming_it(tiny_url, session):
    r = _post(tiny_url, "/chat/completions", CHAT, session)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == HEADER and "1 to 256 characters" in error["message"]


def test_a_header_that_contradicts_the_body_is_a_400_naming_the_header(tiny_url):
    r = _post(tiny_url, "/completions", {**COMPLETION, "session_id": "agent-1"}, "agent-2")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == HEADER
