"""Constrained decoding on the embedded SmolLM2: every output obeys its schema, regex or choice."""

from __future__ import annotations

import json
import logging
import re

import jsonschema
import pytest

from scheduler.sampling_params import SamplingParams
from scheduler.structured_output import StructuredOutput
from workers.grammar import big_stack_pool, validate

pytestmark = pytest.mark.slow

PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 1,
            "maxItems": 3,
        },
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
TOPICS = [
    "a pilot",
    "a chef",
    "a student",
    "a retired teacher",
    "a painter",
    "a nurse",
    "a farmer",
    "a software engineer",
    "a child",
    "a musician",
    "a lawyer",
    "a gardener",
    "an astronaut",
    "a baker",
    "a firefighter",
    "a librarian",
    "a doctor",
    "a sailor",
    "a poet",
    "a barista",
]


# The preemption test's requests: enough to overflow its 40-block pool.
FILLER, CONSTRAINED = 3, 3


def chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {topic} as a JSON user record."}]


def test_twenty_json_schema_outputs_parse_and_validate(smollm2_llm):
    constraint = StructuredOutput.json_schema(PERSON_SCHEMA)
    params = [
        SamplingParams(max_tokens=160, temperature=0.8, seed=i, structured=constraint)
        for i in range(len(TOPICS))
    ]
    outputs = smollm2_llm.chat([chat(t) for t in TOPICS], params, use_tqdm=False)
    for out in outputs:
        assert out.finish_reason == "stop", f"{out.text!r} did not finish"
        jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


def test_regex_and_choice_outputs_obey(smollm2_llm):
    pattern = r"[A-Z][a-z]{2,8} \d{1,3}(\.\d)?"
    choices = ["positive", "negative", "neutral"]
    prompts = ["The city and temperature:", "Name and score:", "Weather today:", "Player:"]
    regex = [
        SamplingParams(
            max_tokens=24, temperature=0.9, seed=i, structured=StructuredOutput("regex", pattern)
        )
        for i in range(4)
    ]
    choice = [
        SamplingParams(
            max_tokens=8, temperature=0.9, seed=i, structured=StructuredOutput.choice(choices)
        )
        for i in range(4)
    ]
    outputs = smollm2_llm.generate(prompts + prompts, regex + choice, use_tqdm=False)
    for out in outputs[:4]:
        assert re.fullmatch(pattern, out.text), out.text
    for out in outputs[4:]:
        assert out.text in choices, out.text


def test_unconstrained_rows_unchanged_by_constrained_neighbours(smollm2_llm):
    free = ["Once upon a time", "The capital of France is", "def fibonacci(n):"]
    free_params = SamplingParams(max_tokens=24, temperature=0.0)
    alone = smollm2_llm.generate(free, free_params, use_tqdm=False)
    constrained = SamplingParams(
        max_tokens=60, temperature=0.0, structured=StructuredOutput.json_schema(PERSON_SCHEMA)
    )
    mixed = smollm2_llm.generate(
        free + ["A user record:"] * 2, [free_params] * 3 + [constrained] * 2, use_tqdm=False
    )
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in alone]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constrained_request_survives_preemption(mode, llm_factory, caplog):
    # Same engine shape as the preemption invariance test: 40 blocks hold a fraction of the load.
    kwargs = dict(num_gpu_blocks=40, max_model_len=40 * 16, preemption_mode=mode)
    if mode == "swap":
        kwargs["num_cpu_blocks"] = 400
    llm = llm_factory(model="default", dtype="float32", **kwargs)
    before = llm.engine.stats().num_preemptions
    constraint = StructuredOutput.json_schema(PERSON_SCHEMA)
    # The filler first: the scheduler preempts the latest-admitted requests, the constrained ones.
    filler = [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)] * FILLER
    params = [
        SamplingParams(max_tokens=160, temperature=0.8, seed=i, structured=constraint)
        for i in range(CONSTRAINED)
    ]
    prompts = [chat("an old story " * 20)] * FILLER + [chat(t) for t in TOPICS[:CONSTRAINED]]
    with caplog.at_level(logging.DEBUG, logger="scheduler.preempt"):
        outputs = llm.chat(prompts, filler + params, use_tqdm=False)
    assert llm.engine.stats().num_preemptions > before
    preempted = {r.getMessage().split()[1] for r in caplog.records if "preempted" in r.msg}
    constrained = outputs[FILLER:]
    assert preempted & {out.request_id for out in constrained}, preempted
    for out in constrained:
        jsonschema.validate(json.loads(out.text), PERSON_SCHEMA)


@pytest.mark.parametrize(
    "constraint, field",
    [
        (
            StructuredOutput("json_schema", '{"type": "objectx"}', "response_format.json_schema"),
            "response_format.json_schema",
        ),
        (StructuredOutput("regex", "[a-", "structured_outputs.regex"), "structured_outputs.regex"),
        (
            StructuredOutput("grammar", "start: undefined_rule", "structured_outputs.grammar"),
            "structured_outputs.grammar",
        ),
    ],
)
def test_invalid_constraints_name_their_field(constraint, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        big_stack_pool(1, "test").submit(validate, constraint).result()


def test_bad_constraint_shapes_are_refused():
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutput.choice([])
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutput("xml", "<a/>")
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutput("regex", "a" * 300_000)
    with pytest.raises(ValueError, match="structured_outputs.json"):
        StructuredOutput.json_schema("{not json")
