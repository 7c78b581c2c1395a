"""Cache salts across a disaggregated hand-off: the prefill engine sends a salted prompt's blocks
under the salted hashes, the decode engine loads them for that request, and afterwards they are
found by that salt alone."""

from __future__ import annotations

from engine.core import EngineCore
from scheduler import EngineRequest
from tests.engine import test_disagg
from tests.engine.test_disagg import BLOCK, GREEDY, colocated, disaggregated, drain, prompts

# test_disagg's fixtures: a prefill, a decode and a colocated engine of the tiny model.
engines = test_disagg.engines
pair = test_disagg.pair


def cached_tokens(engine: EngineCore, request: EngineRequest) -> int:
    engine.add_request(request)
    return [o for o in drain(engine) if o.request_id == request.request_id][-1].num_cached_tokens


def test_a_salted_prompt_crosses_under_its_salt_and_is_found_by_it_alone(engines, pair):
    prompt = prompts(451, (70,))[0]
    full = (len(prompt) // BLOCK) * BLOCK
    request = EngineRequest("salted-a", prompt, GREEDY, cache_salt="tenant-a")
    expected = colocated(engines[2], request)
    got, last = disaggregated(pair, request)
    assert got == expected
    assert last.num_cached_tokens == full  # the prefill's hashes are the decode request's
    decode = pair[1].engine
    assert cached_tokens(decode, EngineRequest("salted-b", prompt, GREEDY, cache_salt="b")) == 0
    assert cached_tokens(decode, EngineRequest("unsalted", prompt, GREEDY)) == 0
    again = EngineRequest("salted-a2", prompt, GREEDY, cache_salt="tenant-a")
    assert cached_tokens(decode, again) == full
