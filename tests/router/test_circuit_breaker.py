"""The fleet router's per-replica circuit breaker, without Ray: K consecutive failures open it, the
router then skips the replica, and it closes after a cool-down on a success or a fresh ok report."""

from hypothesis import given
from hypothesis import strategies as st

from router.circuit_breaker import CircuitBreaker

A, B = "a", "b"


def opened(threshold: int = 3, cooldown_s: float = 10.0, at: float = 0.0) -> CircuitBreaker:
    breaker = CircuitBreaker(threshold, cooldown_s)
    for _ in range(threshold):
        breaker.record_failure(A, at)
    return breaker


def test_threshold_consecutive_failures_open_the_circuit_and_only_that_replica_is_skipped():
    breaker = CircuitBreaker(threshold=3, cooldown_s=10.0)
    assert not breaker.record_failure(A, 0.0)
    assert not breaker.record_failure(A, 0.1)
    assert breaker.allows(A, 0.2)
    assert breaker.record_failure(A, 0.2)  # the third in a row opens it
    assert breaker.is_open(A)
    assert not breaker.allows(A, 0.3)
    assert breaker.allows(B, 0.3) and not breaker.is_open(B)


def test_a_success_between_failures_resets_the_count():
    breaker = CircuitBreaker(threshold=2, cooldown_s=10.0)
    for t in range(10):
        breaker.record_failure(A, float(t))
        breaker.record_success(A, float(t) + 0.5)
    assert not breaker.is_open(A) and breaker.allows(A, 10.0)


def test_a_healthy_report_does_not_reset_the_count_of_a_closed_circuit():
    # A replica may report "ok" every second and still fail every request sent to it.
    breaker = CircuitBreaker(threshold=3, cooldown_s=10.0)
    for t in range(3):
        breaker.record_healthy_report(A, float(t))
        breaker.record_failure(A, float(t) + 0.5)
    assert breaker.is_open(A)


def test_within_the_cool_down_neither_successes_nor_reports_close_it():
    # Both reach the router late: they may predate the failures that opened the circuit.
    breaker = opened(cooldown_s=10.0, at=0.0)
    breaker.record_success(A, 5.0)
    breaker.record_healthy_report(A, 9.9)
    assert breaker.is_open(A) and not breaker.allows(A, 9.9)


def test_after_the_cool_down_a_fresh_ok_report_closes_it():
    breaker = opened(cooldown_s=10.0, at=0.0)
    breaker.record_healthy_report(A, 10.0)
    assert not breaker.is_open(A) and breaker.allows(A, 10.0) and breaker.allows(A, 10.1)


def test_half_open_lets_one_probe_per_cool_down_and_its_success_closes_it():
    breaker = opened(cooldown_s=10.0, at=0.0)
    assert breaker.allows(A, 10.0) and breaker.allows(
        A, 10.2
    )  # eligible until a request goes there
    breaker.on_picked(A, 10.2)  # the probe
    assert not breaker.allows(A, 10.5)  # no second one while the probe is out
    breaker.record_success(A, 11.0)
    assert not breaker.is_open(A) and breaker.allows(A, 11.0)


def test_a_failed_probe_restarts_the_cool_down():
    breaker = opened(cooldown_s=10.0, at=0.0)
    assert breaker.allows(A, 10.0)
    breaker.on_picked(A, 10.0)
    breaker.record_failure(A, 11.0)
    assert breaker.is_open(A)
    assert not breaker.allows(A, 20.0)
    breaker.record_healthy_report(A, 20.0)  # 9 s after the last failure: too early
    assert not breaker.allows(A, 20.5)
    assert breaker.allows(A, 21.0)


def test_an_unanswered_probe_does_not_strand_the_replica():
    # The probe's caller may vanish without reporting: the next cool-down lets another through.
    breaker = opened(cooldown_s=10.0, at=0.0)
    breaker.on_picked(A, 10.0)
    assert not breaker.allows(A, 19.9)
    assert breaker.allows(A, 20.0)


def test_threshold_zero_never_opens():
    breaker = CircuitBreaker(threshold=0, cooldown_s=1.0)
    for t in range(100):
        assert not breaker.record_failure(A, float(t))
    assert breaker.allows(A, 100.0) and not breaker.replicas()


def test_forget_drops_a_removed_replica():
    breaker = opened()
    breaker.forget(A)
    assert breaker.allows(A, 0.0) and not breaker.replicas()


events = st.lists(
    st.tuples(
        st.sampled_from(["fail", "ok", "report", "pick"]), st.floats(min_value=0, max_value=5)
    ),
    max_size=60,
)


@given(threshold=st.integers(1, 5), cooldown_s=st.floats(0.5, 20), script=events)
def test_open_iff_threshold_failures_in_a_row_and_never_closed_within_a_cool_down(
    threshold, cooldown_s, script
):
    """Against a model: opens on the threshold-th failure in a row; stays open (and skipped but for
    one
    probe per cool-down) until cooldown_s after its last failure; then a success or an ok report
    closes it."""
    breaker = CircuitBreaker(threshold, cooldown_s)
    now, run, last_failure, is_open, last_probe = 0.0, 0, 0.0, False, 0.0
    for kind, dt in script:
        now += dt
        cooled = now - last_failure >= cooldown_s
        if kind == "fail":
            breaker.record_failure(A, now)
            run, last_failure = run + 1, now
            is_open = is_open or run >= threshold
        elif kind == "ok":
            breaker.record_success(A, now)
            if not is_open or cooled:
                run, is_open = 0, False
        elif kind == "report":
            breaker.record_healthy_report(A, now)
            if is_open and cooled:
                run, is_open = 0, False
        else:
            allowed = breaker.allows(A, now)
            assert allowed == (not is_open or (cooled and now - last_probe >= cooldown_s))
            if allowed:
                breaker.on_picked(A, now)
                last_probe = now
        assert breaker.is_open(A) == is_open
