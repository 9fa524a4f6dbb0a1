"""The parallelize function of the cpattn configs: torchtitan's activation checkpointing, per-block
``torch.compile`` and FSDP2 (over data x context parallel ranks, torchtitan's ``fsdp`` mesh), without
torch's own context parallelism (``apply_cp_to_forward``): the sequence split belongs to cpattn, whose
attention op the selective policy saves, so the backward does not run a block's exchange twice."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torchtitan.config import TORCH_DTYPE_MAP, CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointingConfig, SelectiveAC
from torchtitan.distributed.compile import apply_compile
from torchtitan.distributed.fsdp import apply_fsdp_to_decoder


class SelectiveCpattnAC(SelectiveAC):
    """torchtitan's selective policy (save matmuls every other time, attention and communication ops)
    with ``cpattn::attention`` among the ops whose outputs are saved: recomputing a block in the
    backward then reruns its projections and norms but not its attention, and so not its exchange."""

    def get_save_ops(self) -> set:
        return super().get_save_ops() | {torch.ops.cpattn.attention.default}


def parallelize_decoder(model: nn.Module, *, parallel_dims: ParallelDims, training: TrainingConfig,
                        parallelism: ParallelismConfig, compile_config: CompileConfig,
                        ac_config: ActivationCheckpointingConfig, dump_folder: str) -> nn.Module:
    """Activation checkpointing (``selective``: :class:`SelectiveCpattnAC`), then per-block compile, then
    FSDP2 over ``dp_shard x cp`` (HSDP with ``dp_replicate``), as torchtitan's ``parallelize_llama``
    orders them. Tensor, pipeline and expert parallelism are refused when the config is parsed."""
    if ac_config is not None:
        if type(ac_config) is SelectiveAC.Config:
            policy = SelectiveCpattnAC(ac_config, dump_folder=dump_folder)
        else:
            policy = ac_config.build(dump_folder=dump_folder)
        policy.apply(model)
    if compile_config.enable and "model" in compile_config.components:
        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
    dp_mesh = parallel_dims.get_mesh(names)
    apply_fsdp_to_decoder(
        model, dp_mesh,
        param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
        reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        pp_enabled=False,
        cpu_offload=training.enable_cpu_offload,
        reshard_after_forward_policy=parallelism.fsdp_reshard_after_forward,
        enable_symm_mem=parallelism.enable_fsdp_symm_mem,
    )
    if dist.get_backend(dp_mesh.get_group(0)) == "gloo":
        # torchtitan turns FSDP's gradient division off (it scales the loss by the global token count);
        # FSDP2 then reduce-scatters with PREMUL_SUM, which gloo lacks: a plain sum is the same
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model
