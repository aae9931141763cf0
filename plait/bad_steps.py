"""Bad steps: a non-finite loss or gradient norm, and loss spikes.

The engine skips the update of a step whose global loss or gradient norm is not finite, on every
rank alike (`Engine._finish`), so the weights and the optimizer state stay those of the last good
step. The loop reports each such step (`"skipped": true` in metrics.jsonl, a line on stderr) and,
after `train.max_bad_steps` in a row, stops with one line, having saved that last good state.

A loss spike - the loss above `train.spike_factor` times the median of the last 100 losses - is
only reported (`"loss_spike": true`); it changes nothing.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from plait.errors import bad_value

SPIKE_WINDOW = 100
SPIKE_MIN_HISTORY = 10  # no median worth comparing against before this many steps


class StepHealth:
    def __init__(self, max_bad: int, spike_factor: float, start: int, say=lambda msg: None):
        self.max_bad, self.spike_factor, self.say = max_bad, spike_factor, say
        self.bad = 0  # consecutive bad steps so far
        self.last_good = start  # the step whose state the weights hold
        self.recent: deque[float] = deque(maxlen=SPIKE_WINDOW)

    def check(self, step: int, loss: float, grad_norm: float) -> dict:
        """Fields for the step's metrics record (empty for an ordinary step)."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self.bad += 1
            self.say(f"step {step} skipped: loss {loss}, gradient norm {grad_norm} (weights and optimizer "
                     f"untouched; {self.bad} in a row, train.max_bad_steps = {self.max_bad})")
            return {"skipped": True}
        self.bad, self.last_good = 0, step
        out = {}
        if self.spike_factor and len(self.recent) >= SPIKE_MIN_HISTORY:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                out = {"loss_spike": True, "loss_median": median}
                self.say(f"step {step}: loss spike {loss:.4f}, {loss / median:.1f}x the median {median:.4f} of the "
                         f"last {len(self.recent)} steps (train.spike_factor = {self.spike_factor:g})")
        self.recent.append(loss)
        return out

    @property
    def stop(self) -> bool:
        return self.bad >= self.max_bad

    def error(self, step: int, saved) -> Exception:
        first = step - self.bad + 1
        where = (f"the state of step {self.last_good} is saved in {saved}" if saved is not None else
                 "no step had finished well, so nothing was saved")
        return bad_value("train.max_bad_steps", self.max_bad,
                         f"steps {first}-{step} each had a non-finite loss or gradient norm and were skipped; "
                         f"{where}. Lower train.lr, check the data of those steps, or raise train.max_bad_steps")
