"""``apex.contrib.clip_grad``: NVIDIA Apex's ``clip_grad_norm_`` (see :mod:`apex.contrib.clip_grad.clip_grad`)."""

from apex.contrib.clip_grad.clip_grad import clip_grad_norm_

__all__ = ["clip_grad_norm_"]
