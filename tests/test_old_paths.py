"""Renamed modules keep their old import paths for now: each warns (``DeprecationWarning``, pointing at the
importing line) and hands out the new module's names; every public name has one path that does not warn."""

from __future__ import annotations

import importlib
import sys
import warnings

import pytest

MOVED = [("cpattn.verify", "cpattn.exactness", "reference"),
         ("cpattn.kernel_calls", "cpattn.timed_calls", "kernel_calls"),
         ("cpattn.lab.calibrate", "cpattn.lab.machine_profile", "fit_link"),
         ("cpattn.lab.reproduce", "cpattn.lab.papers", "ringx_variants"),
         ("cpattn.core.kernels_cuda", "cpattn.core.cuda_ops", "pad_lse"),
         ("cpattn.core.kernel_table", "cpattn.core.kernel_order", "cuda_order")]


@pytest.mark.parametrize("old,new,name", MOVED)
def test_old_module_path_warns_and_hands_out_the_new_names(old, new, name):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: import {new} instead") as caught:
        __import__(old)  # as an ``import`` statement does
    assert caught[0].filename == __file__
    moved = sys.modules[old]
    assert getattr(moved, name) is getattr(importlib.import_module(new), name)


def test_topology_has_one_public_path():
    import cpattn
    import cpattn.cost
    from cpattn.core.topology import Topology

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cpattn.cost.Topology is Topology
    with pytest.warns(DeprecationWarning, match="cpattn.Topology is deprecated: import cpattn.cost.Topology"):
        assert cpattn.Topology is Topology
    assert "Topology" not in cpattn.__all__
