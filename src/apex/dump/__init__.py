"""Dumps of per-module forward and backward tensors into HDF5 files (the Ascend patch's ``apex.dump``).

``from apex.dump.dump import HookerAndDumper`` (or ``import apex.dump.dump as dump``) as with the patch; needs
``h5py`` (``pip install h5py``), imported only when a dump is registered or read.
"""

from .dump import HookerAndDumper

__all__ = ["HookerAndDumper"]
