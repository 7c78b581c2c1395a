"""The length predictor's state on disk, so a restarted replica predicts from its first request.

One JSON file (`length_predictor_state_path`): the feature groups' lengths and, with the probe,
its regression sums and recent residuals; a few hundred kB at most. It is written atomically (a
temporary file in the same directory, then a rename) every SAVE_EVERY finished requests and at
shutdown, and read once at start. The file names what the probe's features came from (`source`:
the model and the runner's projection) and their size; a file that cannot be read, does not
parse, or was written for other features is ignored with a warning and the predictor starts cold.
A failed save is logged: persistence never fails a request or the engine.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from typing import TYPE_CHECKING

from scheduler.length_live import LivePredictor
from scheduler.length_probe import ProbeConfig

if TYPE_CHECKING:
    from scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

STATE_VERSION = 1
SAVE_EVERY = 256  # finished requests between saves
MAX_STATE_BYTES = 64 << 20  # a state file larger than this did not come from us


def open_length_state(scheduler: Scheduler, source: str) -> LengthStateFile | None:
    """The state file of a scheduler whose config names one, its predictor restored from it;
    None when persistence is off (or a study replaced the predictor)."""
    path = scheduler.config.length_predictor_state_path
    model = scheduler.length_model()
    if path is None or not isinstance(model, LivePredictor):
        return None
    state = LengthStateFile(path, source, model)
    state.load()
    return state


class LengthStateFile:
    """Saves and restores one LivePredictor's state at `path`; `source` names what its features
    come from (a file written for another source is not loaded)."""

    def __init__(self, path: str, source: str, model: LivePredictor) -> None:
        self.path = path
        self.source = source
        self.model = model
        self._saved_at = 0  # the predictor's num_observed at the last save

    def load(self) -> bool:
        """Restore the predictor from the file; False (it stays as it was) when there is none or
        it is not usable."""
        model = self.model
        if not os.path.exists(self.path):
            return False
        try:
            if os.path.getsize(self.path) > MAX_STATE_BYTES:
                raise ValueError(f"larger than {MAX_STATE_BYTES} bytes")
            with open(self.path, encoding="utf-8") as f:
                state = json.load(f)
            self._restore(model, state)
        except (OSError, ValueError, TypeError, AttributeError, RecursionError) as exc:
            logger.warning("length predictor state %s ignored: %s", self.path, exc)
            return False
        self._saved_at = model.num_observed
        logger.info(
            "length predictor state loaded from %s (%d finished requests)",
            self.path,
            model.num_observed,
        )
        return True

    def _restore(self, model: LivePredictor, state: object) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a version {STATE_VERSION} length predictor state")
        if state.get("source") != self.source or state.get("dim") != model.dim:
            raise ValueError(
                f"written for features {state.get('source')!r} of dim {state.get('dim')!r}, "
                f"not {self.source!r} of dim {model.dim!r}"
            )
        groups, probe, num = state.get("groups"), state.get("probe"), state.get("num_observed")
        if not isinstance(groups, dict) or not isinstance(num, int) or num < 0:
            raise ValueError("groups or num_observed malformed")
        # Build aside and swap in whole: a file that fails halfway changes nothing.
        fresh = LivePredictor(model.dim, model.groups.config, _probe_config(model))
        fresh.groups.load_state(groups)
        if fresh.probe is not None:
            if not isinstance(probe, dict):
                raise ValueError("the probe's state is missing")
            fresh.probe.load_state(probe)
        model.groups, model.probe, model.num_observed = fresh.groups, fresh.probe, num

    def save(self) -> bool:
        """Write the predictor's state atomically; False (logged) when it could not be written."""
        model = self.model
        state = self._state()
        directory = os.path.dirname(os.path.abspath(self.path))
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=".length-state-", dir=directory)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(state, f, separators=(",", ":"))
            os.replace(tmp, self.path)
        except (OSError, ValueError) as exc:
            logger.warning("length predictor state not saved to %s: %s", self.path, exc)
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return False
        self._saved_at = model.num_observed
        return True

    def _state(self) -> dict[str, object]:
        """The file's JSON: the version and source it was written for, the predictor's state."""
        model = self.model
        return {
            "version": STATE_VERSION,
            "source": self.source,
            "dim": model.dim,
            "num_observed": model.num_observed,
            "groups": model.groups.state(),
            "probe": model.probe.state() if model.probe is not None else None,
        }

    def maybe_save(self) -> None:
        """Save when SAVE_EVERY more requests have finished since the last save."""
        if self.model.num_observed - self._saved_at >= SAVE_EVERY:
            self.save()


def _probe_config(model: LivePredictor) -> ProbeConfig | None:
    return model.probe.config if model.probe is not None else None
