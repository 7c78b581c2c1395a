"""Sessions: which replica served each agent conversation's last turn, so the next turn goes there
while that replica is within the load ceiling (router/policies.py `PrefixAffinity`).

Bounded: at most `max_sessions` tracked, the least recently routed forgotten first, and a session
id of at most MAX_SESSION_ID_CHARS characters (the ingress refuses longer ones with a 400;
`check_session_id` is the library's check).

A request names its session by the body's `session_id` or the `x-session-id` header
(`request_session`); its `user` only where the app sets `session_from_user`, since one end user may
hold many conversations at once, and keying them all to one replica would pile a heavy user's
unrelated contexts there.
"""

from __future__ import annotations

from collections import OrderedDict

MAX_SESSION_ID_CHARS = 256
# Conversations tracked: about 64 bytes of id and 100 bytes of entry each, so ~16 MB at the bound.
MAX_SESSIONS = 100_000


SESSION_HEADER = "x-session-id"


def check_session_id(session: object, field: str = "session_id") -> str:
    """session, if it is a usable session id; ValueError naming the field otherwise."""
    if type(session) is not str or not 1 <= len(session) <= MAX_SESSION_ID_CHARS:
        shown = repr(session)[:40]
        raise ValueError(
            f"{field}: must be a string of 1 to {MAX_SESSION_ID_CHARS} characters, got {shown}"
        )
    return session


def request_session(
    body: str | None, header: str | None, user: str | None = None, from_user: bool = False
) -> str | None:
    """The session a request names: its body's session_id, else its x-session-id header (both
    given: they must agree), else, with from_user, its non-empty `user`. ValueError naming the
    field that is bad."""
    if header is not None:
        check_session_id(header, SESSION_HEADER)
        if body is not None and body != header:
            raise ValueError(f"{SESSION_HEADER}: differs from the body's session_id")
    session = body if body is not None else header
    if session is None and from_user and user:
        session = check_session_id(user, "user")
    return None if session is None else check_session_id(session)


class SessionTable:
    """session id -> the replica its last turn went to, least recently routed first."""

    def __init__(self, max_sessions: int = MAX_SESSIONS) -> None:
        if type(max_sessions) is not int or not 1 <= max_sessions <= 1 << 32:
            raise ValueError(
                f"max_sessions: must be an integer in [1, 2**32], got {max_sessions!r}"
            )
        self.max_sessions = max_sessions
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def replica_of(self, session: str) -> str | None:
        return self._replicas.get(session)

    def record(self, session: str, replica: str) -> None:
        """session's latest turn went to replica."""
        self._replicas[session] = replica
        self._replicas.move_to_end(session)
        while len(self._replicas) > self.max_sessions:
            self._replicas.popitem(last=False)

    def remove_replica(self, replica: str) -> None:
        """Forget the sessions of a replica that is gone (their next turns route afresh)."""
        for session in [s for s, r in self._replicas.items() if r == replica]:
            del self._replicas[session]
