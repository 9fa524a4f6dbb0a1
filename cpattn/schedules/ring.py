"""Ring attention (point-to-point): key/value blocks travel around the ring.

Forward: P steps; at step t rank r holds the packed kv of rank (r - t) mod P, sends it to r + 1 while
receiving the next from r - 1 (the transfer is in flight during this step's compute), attends its
queries to it under the mask (EMPTY blocks skipped) and merges pairwise.

Backward: kv goes round again; a float32 dk/dv accumulator travels with each kv block, every rank adds
its contribution, and after P hops it is home. The incoming accumulator is waited for only after this
step's block gradients are computed, so its transfer overlaps compute too. dq stays local.

Per rank (P > 1): forward sends and receives (P-1) packed kv; backward (P-1) packed kv plus P float32
dk/dv accumulators.
"""

from __future__ import annotations

import torch

from ..kernels import acc_dtype
from .base import Runtime, Schedule, Shape, Volume, attend, attend_backward, new_accumulators, op_volume

TAG_KV, TAG_DKV = 0, 1


class RingSchedule(Schedule):
    name = "ring"
    layout = "contiguous"
    masks = "any"
    memory = "O(local), 2 kv buffers"
    summary = "p2p ring of kv blocks; dk/dv travel with their kv"

    def forward(self, rt: Runtime, q, k, v):
        comm, p, r = rt.comm, rt.world, rt.rank
        out_acc, lse_acc = new_accumulators(q)
        cur = torch.stack([k, v])  # one message per step: [2, b, s, h_kv, d]
        for t in range(p):
            if t < p - 1:
                nxt = comm.new_buffer(cur.shape, cur.dtype, cur.device)
                handle = comm.send_recv([(cur, (r + 1) % p)], [(nxt, (r - 1) % p)], tag=TAG_KV)
            attend(rt, q, cur[0], cur[1], rt.blocks(r, [(r - t) % p]), out_acc, lse_acc)
            if t < p - 1:
                handle.wait()
                cur = nxt
        return out_acc.to(q.dtype), lse_acc

    def backward(self, rt: Runtime, dout, q, k, v, out, lse):
        comm, p, r = rt.comm, rt.world, rt.rank
        dq = torch.zeros(q.shape, dtype=acc_dtype(q.dtype), device=q.device)
        cur = torch.stack([k, v])
        incoming = None  # (handle, buffer) of the dk/dv accumulator arriving from r - 1
        for t in range(p):
            if t < p - 1:
                nxt = comm.new_buffer(cur.shape, cur.dtype, cur.device)
                kv_handle = comm.send_recv([(cur, (r + 1) % p)], [(nxt, (r - 1) % p)], tag=TAG_KV)
            local = torch.zeros(cur.shape, dtype=dq.dtype, device=q.device)
            attend_backward(rt, dout, q, cur[0], cur[1], out, lse, rt.blocks(r, [(r - t) % p]),
                            dq, local[0], local[1])
            if incoming is not None:
                incoming[0].wait()
                local += incoming[1]
            if p > 1:
                buf = comm.new_buffer(local.shape, local.dtype, local.device)
                incoming = (comm.send_recv([(local, (r + 1) % p)], [(buf, (r - 1) % p)], tag=TAG_DKV), buf)
            if t < p - 1:
                kv_handle.wait()
                cur = nxt
        if incoming is not None:
            incoming[0].wait()
            local = incoming[1]
        return dq.to(q.dtype), local[0].to(k.dtype), local[1].to(v.dtype)

    def volume(self, shape: Shape, rank: int) -> Volume:
        p = shape.world
        if p == 1:
            return {"forward": {}, "backward": {}}
        kv, dkv = shape.kv_bytes, shape.dkv_bytes
        return {
            "forward": {"send": op_volume(p - 1, (p - 1) * kv, 0), "recv": op_volume(p - 1, 0, (p - 1) * kv)},
            "backward": {"send": op_volume(2 * p - 1, (p - 1) * kv + p * dkv, 0),
                         "recv": op_volume(2 * p - 1, 0, (p - 1) * kv + p * dkv)},
        }
