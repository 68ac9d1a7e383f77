"""A plain PyTorch program using ``megacache``, run as a child process by the tests.

argv: SOCKET. Compiles two linear layers with inductor on the CPU inside
``agent.client._compile.megacache`` (no cache environment variables set) and
prints one JSON line: the first call's time and inductor's FX-graph and
AOTAutograd cache counters. Linears are library calls, so inductor generates no
C++ kernel: on the CPU the Mega-Cache holds the graph but not a kernel's shared
object, so with a kernel (a GELU) both processes ran the C++ compiler (28 s of
CPU for the pair, 12 s without) and the counters proved nothing more.
"""

from __future__ import annotations

import json
import sys
import time

import torch
from torch import nn

from agent.client._compile import megacache


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 32)).eval()
    x = torch.randn(4, 32)
    with megacache(socket_path=sys.argv[1], torch_version=torch.__version__, model_key="mega"):
        compiled = torch.compile(model, backend="inductor")
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
            }
        )
    )


if __name__ == "__main__":
    main()
