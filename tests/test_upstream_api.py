"""NVIDIA Apex's top-level helpers from ``apex``: loaded lazily, with upstream's behaviour."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch

import apex


def test_lazy_and_listed():
    code = ("import sys, apex; assert 'torch' not in sys.modules; "
            "w = apex.DeprecatedFeatureWarning; assert 'torch' in sys.modules; print(w.__mro__[1].__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "FutureWarning"
    assert {"check_cudnn_version_and_warn", "DeprecatedFeatureWarning", "deprecated_warning"} <= set(dir(apex))


def test_check_cudnn_version_and_warn(monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: 8900)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert apex.check_cudnn_version_and_warn("feature", 8400) is True
    with pytest.warns(UserWarning, match=r"`feature` depends on cuDNN 9100 or later, but found cuDNN 8900"):
        assert apex.check_cudnn_version_and_warn("feature", 9100) is False
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    with pytest.warns(UserWarning, match="cuDNN is not available"):
        assert apex.check_cudnn_version_and_warn("feature", 8400) is False
    with pytest.raises(TypeError, match="required_cudnn_version"):
        apex.check_cudnn_version_and_warn("feature", "8400")


def test_deprecated_warning():
    with pytest.warns(apex.DeprecatedFeatureWarning, match="going away"):
        apex.deprecated_warning("going away")
