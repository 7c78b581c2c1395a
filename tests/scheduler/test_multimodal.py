"""Images in the scheduler: chunks never end inside an image, a step encodes at most
max_num_encoder_tokens image tokens, and prefix-cache blocks over image tokens are keyed by the
images' digests."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler import EngineRequest, Request, SamplingParams, Scheduler, SchedulerConfig
from scheduler.block_hash import hash_prompt_blocks
from scheduler.block_manager import KVCacheManager
from scheduler.multimodal import (
    MAX_IMAGES_PER_REQUEST,
    ImageInput,
    ImageSpan,
    MultiModalInputs,
    PackedArray,
    encoder_tokens,
    fit_chunk,
    fit_images,
)
from tests.scheduler.contract_runner import ContractRunner

IMG = 7  # the placeholder id
PIXELS = (("pixel_values", PackedArray((1, 2), "float32", bytes(8))),)


def digest(seed: int) -> str:
    return hashlib.sha256(str(seed).encode()).hexdigest()


def prompt_with(layout: list[int | str]) -> tuple[list[int], MultiModalInputs]:
    """A prompt from a layout: an int n is n text tokens, "4:s" an image of 4 tokens, digest s."""
    ids: list[int] = []
    images = []
    for part in layout:
        if isinstance(part, int):
            ids += [100 + (len(ids) + i) % 50 for i in range(part)]
        else:
            n, seed = map(int, part.split(":"))
            images.append(ImageInput(ImageSpan(len(ids), n, digest(seed)), PIXELS))
            ids += [IMG] * n
    return ids, MultiModalInputs(tuple(images))


def image_request(rid: str, layout: list[int | str], max_tokens: int = 4) -> Request:
    ids, mm = prompt_with(layout)
    return Request(EngineRequest(rid, ids, SamplingParams(max_tokens=max_tokens), mm_inputs=mm))


def test_fit_chunk_ends_before_an_image_it_would_cut():
    spans = [ImageSpan(4, 6, digest(1)), ImageSpan(12, 3, digest(2))]
    assert fit_chunk(spans, 0, 4) == 4  # ends where the image starts
    assert fit_chunk(spans, 0, 7) == 4  # would end inside: cut back to its start
    assert fit_chunk(spans, 0, 10) == 10  # the whole image
    assert fit_chunk(spans, 4, 3) == 0  # starts at the image, cannot hold it: waits
    assert fit_chunk(spans, 6, 4) == 4  # starts inside (a prefix hit), ends at its end
    assert fit_chunk(spans, 10, 4) == 2  # ends before the second image
    assert encoder_tokens(spans, 0, 15) == 9 and encoder_tokens(spans, 10, 2) == 0


def test_fit_images_stops_at_the_first_image_past_the_encoder_budget():
    spans = [ImageSpan(2, 4, digest(1)), ImageSpan(6, 4, digest(2)), ImageSpan(12, 4, digest(3))]
    assert fit_images(spans, 0, 20, encoder_budget=8) == 12  # two images; ends before the third
    assert fit_images(spans, 0, 20, encoder_budget=3) == 2  # none fits: the text before the first
    assert fit_images(spans, 2, 20, encoder_budget=3) == 0
    assert fit_images(spans, 10, 2, encoder_budget=0) == 2  # text alone spends no encoder budget


@settings(max_examples=60, deadline=None)
@given(
    layout=st.lists(
        st.one_of(st.integers(1, 9), st.integers(1, 6).map(lambda n: f"{n}:{n}")),
        min_size=1,
        max_size=8,
    ),
    budget=st.integers(6, 24),
    encoder=st.integers(6, 16),
    blocks=st.integers(8, 40),
    copies=st.integers(1, 4),
)
def test_every_step_keeps_images_whole_and_within_the_encoder_budget(
    layout, budget, encoder, blocks, copies
):
    """Random prompts of text and images (several copies: prefix hits start chunks mid-image),
    small budgets and pools (preemption): no chunk ends inside an image, no step encodes more
    than max_num_encoder_tokens, and every request finishes with the contract runner's tokens."""
    if not any(isinstance(part, str) for part in layout):
        layout = [*layout, "3:3"]
    ids, mm = prompt_with(layout)
    cfg = SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_encoder_tokens=encoder,
        block_size=4,
        num_gpu_blocks=max(blocks, -(-(len(ids) + 8) // 4)),
        max_model_len=len(ids) + 8,
    )
    sched = Scheduler(cfg)
    runner = ContractRunner(cfg.block_size, cfg.num_gpu_blocks or 0, 0)
    for i in range(copies):
        spec = EngineRequest(f"r{i}", ids, SamplingParams(max_tokens=3), mm_inputs=mm)
        sched.add_request(Request(spec))
    spans = mm.spans
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        spent = 0
        for rid, n in out.num_scheduled_tokens.items():
            start = sched.requests[rid].num_computed_tokens - n
            assert fit_chunk(spans, start, n) == n, (rid, start, n)
            spent += encoder_tokens(spans, start, n)
        assert spent <= encoder
        sched.update_from_output(out, runner.execute(out))
    assert not sched.has_unfinished_requests()


def test_image_blocks_are_keyed_by_the_image_and_text_blocks_are_not():
    kv = KVCacheManager(SchedulerConfig(num_gpu_blocks=16, max_model_len=64, block_size=4))
    x = image_request("x", [8, "4:1", 8])
    y = image_request("y", [8, "4:2", 8])
    again = image_request("again", [8, "4:1", 8])
    hx, hy, ha = (kv._ensure_hashes(r, 5) for r in (x, y, again))
    text = hash_prompt_blocks(x.all_token_ids, 4)
    assert hx[:2] == hy[:2] == text[:2]  # the text before the image: shared with text requests
    assert all(a != b for a, b in zip(hx[2:], hy[2:]))  # the image's block and all after it
    assert hx[2] != text[2]  # the same placeholder ids alone do not make the key
    assert ha == hx


def test_an_image_that_no_step_can_hold_is_refused_naming_the_bound():
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=64,
            max_num_encoder_tokens=8,
            num_gpu_blocks=32,
            max_model_len=128,
        )
    )
    with pytest.raises(ValueError, match="images: an image of 9 tokens exceeds max_num_enc"):
        sched.add_request(image_request("r", [2, "9:1"]))
    sched.add_request(image_request("ok", [2, "8:1"]))  # exactly the budget runs


@pytest.mark.parametrize("value", [2**64, -1, 0, float("nan"), "x" * 100_000, 1 << 21, "yes"])
def test_max_num_encoder_tokens_out_of_bounds_is_refused_naming_it(value):
    with pytest.raises(ValueError, match="max_num_encoder_tokens"):
        SchedulerConfig(max_num_encoder_tokens=value)


def test_the_encoder_budget_defaults_to_the_token_budget():
    cfg = SchedulerConfig(max_num_batched_tokens=96, num_gpu_blocks=32, max_model_len=128)
    assert cfg.max_num_encoder_tokens is None
    assert Scheduler(cfg).encoder_budget == 96


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: ImageSpan(-1, 4, digest(1)), "offset"),
        (
            lambda: MultiModalInputs((ImageInput(ImageSpan(2**64, 4, digest(1)), ()),)).check(8),
            "leaves",
        ),
        (lambda: ImageSpan(0, 0, digest(1)), "length"),
        (lambda: ImageSpan(0, float("nan"), digest(1)), "length"),
        (lambda: ImageSpan(0, 4, "not-a-digest"), "digest"),
        (lambda: PackedArray((2, 2), "float32", bytes(8)), "holds 8 bytes"),
        (lambda: PackedArray((2**64,), "float32", b""), "shape"),
        (lambda: PackedArray((1,), "object", bytes(8)), "dtype"),
        (lambda: prompt_with([2, "4:1", "4:2"])[1].check(8), "leaves"),
        (
            lambda: MultiModalInputs((ImageInput(ImageSpan(0, 4, digest(1)), ()),) * 2).check(16),
            "overlaps",
        ),
        (
            lambda: MultiModalInputs(
                tuple(
                    ImageInput(ImageSpan(i, 1, digest(i)), ())
                    for i in range(MAX_IMAGES_PER_REQUEST + 1)
                )
            ).check(1000),
            "images per request",
        ),
    ],
)
def test_bad_image_inputs_are_refused_naming_the_field(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_a_request_carries_raw_images_or_expanded_inputs_never_both():
    ids, mm = prompt_with([2, "4:1"])
    with pytest.raises(ValueError, match="images: a request carries raw images or mm_inputs"):
        EngineRequest("r", ids, images=(object(),), mm_inputs=mm)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="images: must be a tuple of at most"):
        EngineRequest("r", ids, images=(object(),) * (MAX_IMAGES_PER_REQUEST + 1))  # type: ignore[arg-type]
    # A request with images drops the sender's block hashes (they know no digests).
    req = Request(EngineRequest("r", ids, block_hashes=[1, 2], mm_inputs=mm))
    assert req.image_spans == mm.spans and req.block_hashes == []
