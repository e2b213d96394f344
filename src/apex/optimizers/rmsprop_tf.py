"""NpuFusedRMSpropTF: RMSprop with TensorFlow's conventions (as timm's RMSpropTF) on combined buffers."""

from __future__ import annotations

from .. import _core
from ._flat import FlatSet
from ._functional import l2_grad
from .rmsprop import RMSpropFamily, rms_step


def rmsprop_tf_math(p, g, square_avg, buf, grad_avg, *, lr, alpha, eps, weight_decay, momentum, decoupled_decay,
                    lr_in_momentum, grad_scale, settle):
    """One TF-style RMSprop update on fp32 tensors (in place).

    Differences from torch's RMSprop: the averages move as ``v += (1 - alpha)(x - v)``,
    eps goes inside the square root, the momentum buffer may accumulate ``lr * g / rms``
    (lr_in_momentum), and decoupled decay shrinks the param by ``wd * p`` (no lr factor,
    as the NPU patch) instead of adding ``wd * p`` to the gradient.
    """
    g = l2_grad(g, p, grad_scale, 0.0 if decoupled_decay else weight_decay)
    if decoupled_decay and weight_decay != 0:
        p.add_(p, alpha=-weight_decay)
    one_minus_alpha = 1 - alpha
    square_avg.add_(g * g - square_avg, alpha=one_minus_alpha)
    settle(square_avg)
    if grad_avg is not None:
        grad_avg.add_(g - grad_avg, alpha=one_minus_alpha)
        settle(grad_avg)
        rms = square_avg.addcmul(grad_avg, grad_avg, value=-1).clamp_(min=0).add_(eps).sqrt_()  # as the kernel
    else:
        rms = square_avg.add(eps).sqrt_()
    rms_step(p, g, rms, buf, lr=lr, momentum=momentum, lr_in_momentum=lr_in_momentum, settle=settle)


class NpuFusedRMSpropTF(RMSpropFamily):
    """RMSprop in TensorFlow's formulation (the NPU patch's NpuFusedRMSpropTF), fused over combined buffers.

    Args: params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0, momentum=0., centered=False,
    decoupled_decay=False, lr_in_momentum=True.

    Per step, with g the gradient (plus ``weight_decay * p`` unless ``decoupled_decay``)::

        square_avg += (1 - alpha) * (g*g - square_avg)
        grad_avg   += (1 - alpha) * (g - grad_avg)                       # centered only
        rms = sqrt(square_avg - grad_avg**2 + eps)                        # eps inside the root
        buf = momentum * buf + lr * g / rms;  p -= buf                    # lr_in_momentum
        buf = momentum * buf + g / rms;       p -= lr * buf               # otherwise
        p -= lr * g / rms                                                 # momentum == 0

    With ``decoupled_decay`` the param is first shrunk by ``p -= weight_decay * p`` (the NPU
    patch's rule, no lr factor; timm multiplies by lr).

    ``square_avg`` starts at **ones**, as TensorFlow and timm do: the first steps are then
    damped instead of dividing the gradient by ``sqrt(eps)``. The original NPU patch started
    it at zeros, which with eps=1e-10 makes the first update ``lr * g / sqrt((1-alpha) g^2)``,
    i.e. about ``lr / sqrt(1 - alpha)`` per element whatever the gradient's size.
    ``momentum_buffer`` and ``grad_avg`` start at zeros. A ``square_avg`` loaded from a
    checkpoint is kept as it is.
    """

    _state_fill = {"square_avg": 1.0}
    _math = staticmethod(rmsprop_tf_math)

    def __init__(self, params, lr=1e-2, alpha=0.9, eps=1e-10, weight_decay=0, momentum=0.0, centered=False,
                 decoupled_decay=False, lr_in_momentum=True):
        defaults = dict(
            lr=lr, momentum=momentum, alpha=alpha, eps=eps, centered=centered, weight_decay=weight_decay,
            decoupled_decay=decoupled_decay, lr_in_momentum=lr_in_momentum,
        )
        self._validate_group(defaults)
        super().__init__(params, defaults)

    def _math_options(self, group: dict) -> dict:
        return {"decoupled_decay": group["decoupled_decay"], "lr_in_momentum": group["lr_in_momentum"]}

    def _kernel_step(self, s: FlatSet, group: dict) -> None:
        ext = _core.ext
        flags = (
            (ext.FLAG_CENTERED if group["centered"] else 0)
            | (ext.FLAG_DECOUPLED if group["decoupled_decay"] else 0)
            | (ext.FLAG_LR_IN_MOMENTUM if group["lr_in_momentum"] else 0)
        )
        a = self._prepare_args(s, self._hp(group), flags)
        self._bind_slots(s, a)
        ext._raw_rmsprop_tf_step(a)
