"""A pod's first call of a torch.compile'd model, run as a child process by the tests.

argv: [BATCH SEQUENCE] (default 2 16), the input's shape. Builds a transformer's
feed-forward layer (linear, GELU, linear) with fixed weights, compiles it with
the inductor backend on the CPU with static shapes (``dynamic=False``: each shape
is its own graph, so a shape the cache has not seen compiles anew), times the
first call (which compiles, or loads from the cache the environment points at),
and prints one JSON line with the time and inductor's FX-graph and AOTAutograd
cache counters. One generated kernel (the GELU; the linears are library calls)
gives every verdict the tests read (a miss, a hit, a partial miss): each kernel
more is seconds more of a C++ compiler in every cold run, and nothing more tested.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

WIDTH = 64


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.mlp(x)
        return out


def main() -> None:
    torch.manual_seed(0)
    model = FeedForward().eval()
    compiled = torch.compile(model, backend="inductor", dynamic=False)
    batch, sequence = [int(arg) for arg in sys.argv[1:3]] or [2, 16]
    x = torch.randn(batch, sequence, WIDTH)
    started = time.perf_counter()
    with torch.no_grad():
        compiled(x)
    first_call = time.perf_counter() - started
    counters = torch._dynamo.utils.counters
    print(
        json.dumps(
            {
                "first_call_seconds": first_call,
                "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
                "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
                "aotautograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
                "aotautograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
            }
        )
    )


if __name__ == "__main__":
    main()
