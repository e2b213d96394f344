"""``import amp_C`` falls back to apex's multi-tensor ops when NVIDIA's compiled ``amp_C`` is absent.

NVIDIA's tests and Megatron-style code write ``import amp_C``, often before anything from ``apex``
(``try: import amp_C; from apex.multi_tensor_apply import multi_tensor_applier``). This distribution
ships no module of that name: NVIDIA's build installs a compiled one there, and two modules of one name
would shadow each other by ``sys.path`` order. Instead a finder is appended to the *end* of
``sys.meta_path``. Python asks it only after every regular finder failed to locate ``amp_C``, so an
installed NVIDIA ``amp_C`` always wins; without one, ``import amp_C`` yields a module holding the ops of
:mod:`apex.multi_tensor_apply.amp_C` (the same function objects).

Two places install the finder: ``import apex``, and at interpreter start-up the ``apex-amp_C.pth`` file
that the wheel puts beside this module in site-packages (``site`` runs its one ``import`` line). So the
order of the imports does not matter. This module is a top-level one with no dependency beyond the
standard library, so start-up imports neither ``apex`` nor ``torch``: both load only when ``amp_C`` is
imported and no other finder has it (the start-up cost is this module alone: about 0.3 ms of import time
measured with ``-X importtime``; importlib too is imported only then). ``python -S`` skips ``.pth`` files;
there ``import apex`` installs it.
"""

import sys

NAME = "amp_C"
SOURCE = "apex.multi_tensor_apply.amp_C"
PTH_NAME = "apex-amp_C.pth"
PTH_LINE = "import _apex_amp_c; _apex_amp_c.install(at_start_up=True)\n"

installed_at_start_up = False  # whether apex-amp_C.pth ran (`python -m apex` reports it)


class AmpCFallbackLoader:
    """Fills the ``amp_C`` module with apex's ops (imported at that moment, torch included)."""

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module) -> None:
        import importlib

        src = importlib.import_module(SOURCE)
        module.__doc__ = src.__doc__
        for name in src.__all__:
            setattr(module, name, getattr(src, name))
        module.__all__ = list(src.__all__)
        module.__apex_fallback__ = True  # how `python -m apex` and tests tell it from NVIDIA's


class AmpCFallbackFinder:
    """A meta-path finder for ``amp_C`` only; installed last, so consulted last."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != NAME:
            return None
        from importlib.machinery import ModuleSpec

        return ModuleSpec(NAME, AmpCFallbackLoader(), origin=SOURCE)

    def invalidate_caches(self) -> None:
        pass


def install(at_start_up: bool = False) -> None:
    """Appends the finder to ``sys.meta_path`` unless one is there already (``at_start_up``: called by the .pth)."""
    global installed_at_start_up
    installed_at_start_up = installed_at_start_up or at_start_up
    if not any(isinstance(f, AmpCFallbackFinder) for f in sys.meta_path):
        sys.meta_path.append(AmpCFallbackFinder())
