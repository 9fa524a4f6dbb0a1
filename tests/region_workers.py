"""Functions the region tests run on worker processes (importable by spawned workers): a case with each
rank's step run as one call per region (``Runtime.regions``), forced on the CPU, on its dense form
(``flash_cpu`` / ``math``) or on FlexAttention's eager form (the ``flex_cuda`` path's code, uncompiled)."""

from __future__ import annotations

import contextlib
from functools import partial
from unittest import mock

from cpattn import exactness
from cpattn.core import cuda_ops, kernels
from cpattn.core.flex_masks import Region
from cpattn.core.masks import BlockKind, CausalMask, FullMask
from cpattn.schedules import base


def _regions_for_masks(q, mask, backend="auto", softcap=None) -> bool:
    return not isinstance(mask, (CausalMask, FullMask))


@contextlib.contextmanager
def forced(flex: bool, counts: dict):
    """Regions on for every mask but causal and full; ``counts``: kernel calls and those given a region.
    ``flex``: PARTIAL blocks on the ``flex_cuda`` path's functions, eager."""
    mask_for, kernel_for = kernels._mask_for, kernels.kernel_for

    def counted(path, mask):
        counts["calls"] += 1
        counts["regions"] += isinstance(mask, Region)
        return mask_for(path, mask)

    def flex_first(q, kind, backend="auto", kv_len=None, softcap=None):
        return "flex_cuda" if kind == BlockKind.PARTIAL else kernel_for(q, kind, backend, kv_len, softcap)

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(base, "region_calls", _regions_for_masks))
        stack.enter_context(mock.patch.object(kernels, "_mask_for", counted))
        if flex:
            stack.enter_context(mock.patch.object(kernels, "kernel_for", flex_first))
            stack.enter_context(mock.patch.dict(kernels._FORWARD, {
                "flex_cuda": partial(cuda_ops.flex_forward, compiled=False)}))
            stack.enter_context(mock.patch.dict(kernels._BACKWARD, {
                "flex_cuda": partial(cuda_ops.flex_backward, compiled=False)}))
        yield


def region_case(flex: bool = False, **fields) -> dict:
    """``exactness.rank_case`` with regions forced; ``regions``: this rank's kernel calls and region calls."""
    counts = {"calls": 0, "regions": 0}
    with forced(flex, counts):
        result = exactness.rank_case(**fields)
    return {**result, "regions": counts}
