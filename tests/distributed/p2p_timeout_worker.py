"""Worker: pipeline rank 1 waits for activations that rank 0 never sends (short timeout)."""
import sys

import torch
import torch.distributed as dist

from megatron.plugin.pipeline.ir import parse
from megatron.plugin.pipeline.p2p import PeerChannel, TransferTimeout


def main() -> int:
    dist.init_process_group("gloo")
    channel = PeerChannel(dist.group.WORLD, f"pipeline rank {dist.get_rank()}", timeout_s=2.0)
    status = 0
    if dist.get_rank() == 1:
        try:
            channel.exchange([], [(parse("1RECV_F5<0"), torch.empty(4, 1, 8))])
        except TransferTimeout as err:
            print(f"TIMEOUT: {err}", flush=True)
            status = 3
    dist.barrier()
    return status


if __name__ == "__main__":
    sys.exit(main())
