"""apex.parallel: what upstream NVIDIA Apex's apex.parallel provides, on every device.

Each export lives in its own module; add new ones below in the same form.
"""

from .LARC import LARC

__all__ = ["LARC"]
