"""The runner's features, listed once from RunnerConfig, in the order their hooks run.

The order matters where two features touch the same thing: verification cuts a verify row to its
accepted run before async scheduling appends the row's tokens and before the n-gram proposer reads
them; proposals (n-gram after sampling, the draft's in `propose`) are cut to a grammar by the
structured feature after both; the draft's pacing learns the final proposals last (`proposed`).
"""

from __future__ import annotations

from workers.features.async_append import AsyncAppendFeature
from workers.features.base import RunnerContext, RunnerFeature
from workers.features.draft import DraftFeature
from workers.features.kv_loads import KVLoadsFeature
from workers.features.length import LengthFeature
from workers.features.lora import LoraFeature
from workers.features.mtp import MTPFeature
from workers.features.ngram import ProposerFeature
from workers.features.pooling import PoolingFeature
from workers.features.prompt_logprobs import PromptLogprobsFeature
from workers.features.structured import StructuredFeature
from workers.features.verify import VerifyFeature
from workers.features.vision import VisionFeature, is_vision_model
from workers.proposer import make_proposer
from workers.spec_async import AsyncDraftsFeature


def build_features(ctx: RunnerContext) -> list[RunnerFeature]:
    cfg, driver = ctx.config, ctx.is_driver
    spec = cfg.speculative
    features: list[RunnerFeature] = []
    if cfg.max_loras:
        features.append(LoraFeature(ctx))
    features.append(KVLoadsFeature(ctx))  # copies this runner cannot make fail loudly
    if is_vision_model(ctx.model):  # images spliced at their placeholders (every rank)
        features.append(VisionFeature(ctx))
    if driver and spec is not None and spec.method == "draft":  # rank 0 alone drafts
        features.append(DraftFeature(ctx))
    if driver and spec is not None and spec.method == "mtp":  # rank 0 alone runs the MTP layer
        features.append(MTPFeature(ctx))
    features += [PoolingFeature(ctx)]
    if spec is not None:
        features.append(VerifyFeature(ctx))
    if cfg.async_scheduling:
        features.append(AsyncAppendFeature(ctx))
        if spec is not None:
            features.append(AsyncDraftsFeature(ctx))
    proposer = make_proposer(spec)
    if proposer is not None:
        features.append(ProposerFeature(ctx, proposer))
    features.append(PromptLogprobsFeature(ctx))  # asked per request
    if driver and cfg.length_feature_dim:
        features.append(LengthFeature(ctx))
    if driver:  # only the sampling rank masks
        features.append(StructuredFeature(ctx))
    return features
