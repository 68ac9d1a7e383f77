"""A pod's first call of a torch.compile'd model, run as a child process by the tests.

argv: [BATCH SEQUENCE] (default 2 16), the input's shape. Builds a few
transformer blocks with fixed weights, compiles them with the inductor backend
on the CPU with static shapes (``dynamic=False``: each shape is its own graph,
so a shape the cache has not seen compiles anew), times the first call (which
compiles, or loads from the cache the environment points at), and prints one
JSON line with the time and inductor's FX-graph and AOTAutograd cache counters.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

BLOCKS = 2
WIDTH = 64


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        attended: torch.Tensor = self.attn(h, h, h, need_weights=False)[0]
        x = x + attended
        out: torch.Tensor = x + self.mlp(self.norm2(x))
        return out


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(Block() for _ in range(BLOCKS))).eval()
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
