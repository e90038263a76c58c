"""Beyond one process: torchrun's process group, the run's process layout, and the wrapping.

    torchrun --nproc_per_node=8 scripts/base_train.py ...                # DDP
    torchrun --nproc_per_node=8 scripts/base_train.py --fsdp ...         # FSDP2
    torchrun --nproc_per_node=8 scripts/base_train.py --fsdp --tp 2 ...  # FSDP2 x 4, TP x 2

process_group.py  joining the ranks (NCCL on CUDA, gloo on CPU), collectives that are no-ops in
                  one process, restarts, a lost peer told from other errors
layout.py         Layout: --fsdp and --tp on this world, decided once and read by every part
wrap.py           the module to train: DDP, FSDP2, tensor parallelism on a 2-D mesh

Every rank reads its share of each global batch and gradients are averaged, so the ranks take
the step one process with their whole batch would. A model's tensor-parallel plan lives beside
the model (nanochat.model.parallelize), FP8 all-gather with FP8 (nanochat.fp8.all_gather).
Distributed runs checkpoint with DCP, which loads into any layout (nanochat.checkpoint.dcp).
"""
