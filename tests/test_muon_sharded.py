"""Muon on FSDP/TP-sharded matrices (nanochat.optim.muon_sharded) against Muon on the whole matrix.

Two gloo ranks (spawned), each holding the same whole matrices, gradients and seeds. One
FP8Optim(torch.optim.Muon) steps the whole matrices (muon.muon_step, the one-process step); another
steps DTensors of them sharded on a 2-rank mesh: rows split evenly (FSDP2's Shard(0), FP8
momentum), rows split unevenly (3 and 2 rows of a 5-row matrix: fp32 momentum, torch's own
DTensor buffer), columns split (tensor parallelism's row-wise layer, FP8 momentum of each
shard's rows). Three steps, with Nesterov momentum and weight decay; the matrices are tall so
torch's lr factor of the global shape (sqrt(2)) differs from a shard's (1 or 2).

Tolerance: none; the gathered parameters and momenta equal the whole-matrix ones bit for bit.
The all-gather moves bits; the momentum update and the weight's update are elementwise (the
same ops on the same elements, one thread, every shard a multiple of the vector width); the
FP8 blocks of each shard are the whole matrix's blocks (shards.shard_problem); and Newton-Schulz
runs on the identical whole matrix on every rank. A step that orthogonalized each shard alone,
sliced the wrong rows or took a shard's lr factor would differ at the first step.

bf16 master weights (row shards, FP8 momentum): bf16 and bf16_split equal the whole-matrix run
bit for bit (the same elementwise rounding of the same fp32 result; bf16_split's low halves are
the shard's). bf16_sr draws its rounding bits for the shard, so it is compared within one bf16
step of the whole-matrix run after one step.
"""

from __future__ import annotations

import json

import torch

from nanochat.optim import FP8Optim, FP8Tensor

CASES = {  # name -> (global shape, the dim split over the 2 ranks)
    "rows": ((512, 256), 0),
    "uneven_rows": ((5, 384), 0),
    "columns": ((1024, 512), 1),
}
STEPS = 3


def _optimizer(params):
    muon = torch.optim.Muon(params, lr=0.02, momentum=0.95, nesterov=True, weight_decay=0.1)
    return FP8Optim(muon, opt_level=1, compile=False)


def _rank_worker(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        gen = torch.Generator().manual_seed(0)  # the same draws on both ranks
        whole = {n: torch.nn.Parameter(torch.randn(shape, generator=gen) * 0.05) for n, (shape, _) in CASES.items()}
        placements = {n: [Shard(dim)] for n, (_, dim) in CASES.items()}
        split = {n: torch.nn.Parameter(distribute_tensor(w.detach().clone(), mesh, placements[n]))
                 for n, w in whole.items()}
        start = {n: w.detach().clone() for n, w in whole.items()}
        ref, opt = _optimizer(list(whole.values())), _optimizer(list(split.values()))
        for _ in range(STEPS):
            for n, w in whole.items():
                g = torch.randn(w.shape, generator=gen)
                w.grad = g.clone()
                split[n].grad = distribute_tensor(g, mesh, placements[n])
            ref.step()
            opt.step()
        report = {"backends": {k: list(v) for k, v in opt.step_backends().items()}}
        for n, w in whole.items():
            p = split[n]
            buf, want_buf = opt.state[p]["momentum_buffer"], ref.state[w]["momentum_buffer"]
            part = buf.to_local()
            dense = part.dequantize() if isinstance(part, FP8Tensor) else part
            got_buf = DTensor.from_local(dense, mesh, p.placements, shape=p.shape, stride=p.stride(),
                                         run_check=False).full_tensor()
            want_dense = want_buf.dequantize() if isinstance(want_buf, FP8Tensor) else want_buf
            report[n] = {"param_equal": torch.equal(p.full_tensor(), w.detach()),
                         "moved": (w.detach() - start[n]).abs().max().item(),
                         "buffer_equal": torch.equal(got_buf, want_dense),
                         "buffer": type(part).__name__}
        for master in ("bf16", "bf16_split", "bf16_sr"):  # bf16 masters: the shard's own low halves / bits
            w = torch.nn.Parameter((torch.randn(512, 256, generator=gen) * 0.05).bfloat16())
            p = torch.nn.Parameter(distribute_tensor(w.detach().clone(), mesh, [Shard(0)]))
            ref, opt = (FP8Optim(torch.optim.Muon([x], lr=0.02, weight_decay=0.1), opt_level=1, compile=False,
                                 master_weights=master) for x in (w, p))
            first = w.detach().float()
            for _ in range(1 if master == "bf16_sr" else STEPS):  # sr: one step, so both round one fp32 result
                g = torch.randn(w.shape, generator=gen).bfloat16()
                w.grad, p.grad = g.clone(), distribute_tensor(g, mesh, [Shard(0)])
                ref.step()
                opt.step()
            got, want = p.full_tensor().float(), w.detach().float()
            report[master] = {"param_equal": torch.equal(got, want), "moved": (want - first).abs().max().item(),
                              "worst_rel": ((got - want).abs() / torch.maximum(got.abs(), want.abs()).clamp(min=1e-30)).max().item()}
        with open(f"{out}.{rank}", "w") as f:
            json.dump(report, f)
    finally:
        dist.destroy_process_group()


def test_sharded_muon_step_is_the_whole_matrix_step(tmp_path):
    out = tmp_path / "rank"
    torch.multiprocessing.spawn(_rank_worker, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank.{rank}").read_text())
        assert report["backends"] == {"eager": [3, 3]}, report  # every matrix stepped here, one call each
        for name in CASES:
            r = report[name]
            assert r["param_equal"] and r["buffer_equal"] and r["moved"] > 0, (rank, name, r)
        assert report["rows"]["buffer"] == "FP8Tensor" and report["columns"]["buffer"] == "FP8Tensor", report
        assert report["uneven_rows"]["buffer"] == "Tensor", report  # 5 x 384: below FP8's min_numel
        for master in ("bf16", "bf16_split"):  # deterministic roundings: the whole matrix's bits
            assert report[master]["param_equal"] and report[master]["moved"] > 0, (rank, master, report[master])
        # bf16_sr draws the shard's bits, not the whole matrix's: after one step each element is
        # one of the two bf16 values either side of the same fp32 result, so the two differ by at
        # most one bf16 spacing there, <= 2^-7 of the larger of them (8 significand bits)
        assert report["bf16_sr"]["moved"] > 0 and report["bf16_sr"]["worst_rel"] <= 2**-7, report["bf16_sr"]
