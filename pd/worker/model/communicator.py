"""How the single controller moves activations between its TP ranks.

The hidden state lives on rank 0's device. Before a column-parallel projection it is broadcast to
every rank; after a row-parallel projection the ranks' partial sums are reduced back onto rank 0.
"""

from __future__ import annotations

import torch


class Communicator:
    """Ranks that all live on one device (the CPU): broadcast shares, reduce sums."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.devices = devices

    def broadcast(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x] * len(self.devices)

    def reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        out = partials[0]
        for p in partials[1:]:
            out = out + p
        return out


class NcclCommunicator(Communicator):
    """Ranks on separate CUDA devices of one process, joined by `torch.cuda.nccl` collectives."""

    def broadcast(self, x: torch.Tensor) -> list[torch.Tensor]:
        outs = [x] + [torch.empty_like(x, device=d) for d in self.devices[1:]]
        torch.cuda.nccl.broadcast(outs, root=0)
        return outs

    def reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        partials = [p.contiguous() for p in partials]
        torch.cuda.nccl.reduce(partials, root=0)  # sums into partials[0]
        return partials[0]


def make_communicator(devices: list[torch.device]) -> Communicator:
    if len(devices) > 1 and all(d.type == "cuda" for d in devices):
        assert len(set(devices)) == len(devices), "each CUDA rank needs its own device"
        return NcclCommunicator(devices)
    return Communicator(devices)
