"""One training step of a small attention layer whose sequence is split over the processes
(context parallelism, flashattn.distributed):

    torchrun --nproc-per-node 2 examples/context_parallel.py

Each process holds a zigzag shard of the sequence; ring attention computes the causal attention
of the whole sequence, the gradients of the layer's weights are summed over the processes (as
data parallelism sums them), and the weights take one SGD step. NCCL and CUDA tensors when every
process has a GPU, else gloo and CPU tensors. It also checks that Ulysses attention gives the
same output.
"""
import os

import torch
import torch.distributed as dist

import flashattn.distributed as cp


def main():
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32

    batch, heads, head_dim = 2, 4, 32
    seqlen = 64 * world  # the whole sequence; each process holds seqlen / world tokens
    width = heads * head_dim
    torch.manual_seed(0)  # the same weights and data on every process
    w_qkv = (torch.randn(width, 3 * width) / width**0.5).to(device, dtype).requires_grad_()
    w_out = (torch.randn(width, width) / width**0.5).to(device, dtype).requires_grad_()
    x = torch.randn(batch, seqlen, width).to(device, dtype)
    target = torch.randn(batch, seqlen, width).to(device, dtype)

    x_local, target_local = cp.shard(x), cp.shard(target)  # zigzag shards of the sequence
    n = x_local.shape[1]
    q, k, v = (x_local @ w_qkv).reshape(batch, n, 3, heads, head_dim).unbind(2)
    out = cp.ring_attention(q, k, v, causal=True)
    y = out.reshape(batch, n, width) @ w_out
    loss_local = ((y.float() - target_local.float()) ** 2).sum() / target.numel()
    loss_local.backward()

    loss = loss_local.detach().clone()
    dist.all_reduce(loss)
    for w in (w_qkv, w_out):  # the whole sequence's gradient: every shard's share, summed
        dist.all_reduce(w.grad)
        with torch.no_grad():
            w -= 0.1 * w.grad

    diff = (cp.ulysses_attention(q.detach(), k.detach(), v.detach(), causal=True) - out.detach()).abs().max()
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"world {world} on {device.type}: loss {loss.item():.6f}; ring == ulysses (max diff {diff.item():.2e})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
