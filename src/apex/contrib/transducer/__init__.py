"""``apex.contrib.transducer``: NVIDIA Apex's RNN-T (transducer) joint and loss (see
:mod:`apex.contrib.transducer.transducer`)."""

from apex.contrib.transducer.transducer import TransducerJoint, TransducerLoss

__all__ = ["TransducerJoint", "TransducerLoss"]
