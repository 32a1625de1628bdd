"""Worker: four pipeline ranks exchange with both neighbours and with the stage two away in
one post; each link carries one direction between two ranks on a group of its own; a channel
declaring neighbour links holds only those."""
import sys

import torch
import torch.distributed as dist

from megatron.plugin.pipeline.ir import Action, Kind
from megatron.plugin.pipeline.p2p import PeerChannel, neighbour_links


def main() -> int:
    dist.init_process_group("gloo")
    rank, n = dist.get_rank(), dist.get_world_size()
    channel = PeerChannel(dist.group.WORLD, f"pipeline rank {rank}", timeout_s=30.0)
    after, before = (rank + 1) % n, (rank - 1) % n
    far = (rank + 2) % n
    sends = [(Action(rank, Kind.SEND_F, rank, peer=after), torch.full((3,), float(rank))),
             (Action(rank, Kind.SEND_B, rank, peer=before), torch.full((3,), -float(rank))),
             (Action(rank, Kind.SEND_F, rank, peer=far, tensor="x"), torch.full((3,), 10.0 + rank))]
    recvs = [(Action(rank, Kind.RECV_F, before, peer=before), torch.empty(3)),
             (Action(rank, Kind.RECV_B, after, peer=after), torch.empty(3)),
             (Action(rank, Kind.RECV_F, far, peer=far, tensor="x"), torch.empty(3))]
    posted = channel.post(sends, recvs)
    links = {(p.actions[0].link(), tuple(a.is_send() for a in p.actions)) for p in posted}
    assert links == {((rank, after), (True,)), ((rank, before), (True,)),
                     ((before, rank), (False,)), ((after, rank), (False,)),
                     ((rank, far), (True,)), ((far, rank), (False,))}, links
    for p in posted:
        group = channel.links[p.actions[0].link()]
        assert all(op.group is group for op in p.ops)
        assert sorted(dist.get_process_group_ranks(group)) == sorted(p.actions[0].link())
        p.wait()
    assert torch.equal(recvs[0][1], torch.full((3,), float(before)))
    assert torch.equal(recvs[1][1], torch.full((3,), -float(after)))
    assert torch.equal(recvs[2][1], torch.full((3,), 10.0 + far))
    # A schedule of the 1F1B family declares its neighbours: only those links are created.
    near = PeerChannel(dist.group.WORLD, f"pipeline rank {rank}", 30.0, neighbour_links(n))
    assert set(near.links) == {pair for pair in neighbour_links(n) if rank in pair}, near.links
    dist.barrier()
    print(f"LINKS OK rank {rank}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
