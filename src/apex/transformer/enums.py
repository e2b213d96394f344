"""Upstream's enums, with its member names and values (code compares and serializes them)."""

import enum

__all__ = ["AttnMaskType", "AttnType", "LayerType", "ModelType"]


class LayerType(enum.Enum):
    """A transformer layer's place: ``encoder`` (1) or ``decoder`` (2)."""

    encoder = 1
    decoder = 2


class AttnType(enum.Enum):
    """An attention block's kind: ``self_attn`` (1) or ``cross_attn`` (2)."""

    self_attn = 1
    cross_attn = 2


class AttnMaskType(enum.Enum):
    """An attention mask's kind: ``padding`` (1, a given mask) or ``causal`` (2, keys after the query masked)."""

    padding = 1
    causal = 2


class ModelType(enum.Enum):
    """A model's layout for pipeline schedules: ``encoder_or_decoder`` (1) or ``encoder_and_decoder`` (2)."""

    encoder_or_decoder = 1
    encoder_and_decoder = 2
