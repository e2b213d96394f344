"""The fields a wrapper of an optimizer (the two FP16_Optimizers) shows as its own: ``state`` and ``param_groups``
read and set the wrapped optimizer's, so learning-rate schedules and checkpoint code written for a plain optimizer
work on the wrapper."""

from __future__ import annotations


class WrapsOptimizer:
    optimizer: object

    @property
    def state(self):
        return self.optimizer.state

    @state.setter
    def state(self, value) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value) -> None:
        self.optimizer.param_groups = value
