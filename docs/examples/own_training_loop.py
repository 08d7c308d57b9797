"""Your own training loop, with the GEMMs of every step computed by Cleave's workers.

Run: ``python docs/examples/own_training_loop.py`` (from the repository, after
``make setup``). It starts a coordinator inside this script and two local workers, trains
a small CNN for a few steps with a plain torch loop, and checks each loss against the
same loop without Cleave. Volunteers on other machines would join the printed URL with
``cleave-worker --coordinator URL`` (start the pool with ``host="0.0.0.0"``).
"""

from __future__ import annotations

import copy
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

from coordinator import Pool


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(64, 10),
    )  # fmt: skip


def main(steps: int = 5) -> None:
    model = make_model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.02, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(16, 3, 32, 32, generator=gen), torch.randint(0, 10, (16,), generator=gen))
        for _ in range(steps)
    ]

    with tempfile.TemporaryDirectory() as state, Pool(local_workers=2, state_dir=state) as pool:
        print(f"workers can join {pool.url} (key {pool.fingerprint})")
        pool.wait_for_workers(2, timeout=120)
        for step, (x, y) in enumerate(batches):
            with pool.offload():  # every GEMM in here is computed by the pool's workers
                loss = F.cross_entropy(model(x), y)
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()

            ref_loss = F.cross_entropy(reference(x), y)  # the same step, plain torch
            ref_loss.backward()
            ref_optimizer.step()
            ref_optimizer.zero_grad()
            share = pool.last_step.workers_share or 0.0
            print(
                f"step {step}  loss {loss.item():.6f}  plain torch {ref_loss.item():.6f}  "
                f"workers computed {share:.1%} of the FLOPs"
            )


if __name__ == "__main__":
    main()
