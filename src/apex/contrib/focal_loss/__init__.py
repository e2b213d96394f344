"""``apex.contrib.focal_loss``: NVIDIA Apex's fused sigmoid focal loss for one-stage detectors (see
:mod:`apex.contrib.focal_loss.focal_loss`).

``from apex.contrib.focal_loss import focal_loss`` gives the submodule, as upstream's package did, so
``focal_loss.FocalLoss.apply(...)`` and ``focal_loss.focal_loss(...)`` both work."""

from apex.contrib.focal_loss import focal_loss
from apex.contrib.focal_loss.focal_loss import FocalLoss

__all__ = ["FocalLoss", "focal_loss"]
