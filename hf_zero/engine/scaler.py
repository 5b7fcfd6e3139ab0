"""Dynamic loss scaling for fp16 (the step skips on overflow and the scale adapts)."""
from __future__ import annotations

from typing import Dict


class LossScaler:
    """Dynamic loss scaling for fp16: halve and skip on overflow, double after `growth_interval` clean steps."""

    def __init__(self, init_scale: float, factor: float, growth_interval: int, min_scale: float) -> None:
        self.scale, self.factor, self.growth_interval, self.min_scale = float(init_scale), factor, growth_interval, min_scale
        self.good_steps = 0

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale = max(self.min_scale, self.scale / self.factor)
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= self.factor

    def state_dict(self) -> Dict[str, float]:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: Dict[str, float]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])
