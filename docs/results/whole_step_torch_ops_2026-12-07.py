"""The torch operations a whole speculative step's device work runs besides the kernels (on a GPU
each a kernel of the step's graph), counted on a CPU (2026-12-07 notes):
`python docs/results/whole_step_torch_ops_2026-12-07.py [--greedy]`.

The tiny preset with the kernels on (Triton's interpreter), one request; the second step's
`_device_step` runs under a dispatch mode that counts every aten operation not issued from
inside Triton's interpreter, views left out, by the code line of monodecode that issued it (up
to three frames below step_graph.py). On a CPU some operations run that a GPU skips (the fp32
copies of `fp32_linear`'s fallback) and a GPU may fuse what a CPU runs apart (F.rms_norm).
"""
import collections
import os
import sys
import traceback

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from monodecode.checkpoint import SyntheticCheckpoint  # noqa: E402
from monodecode.config import preset  # noqa: E402
from monodecode.decode import Decoder  # noqa: E402
from monodecode.model import Model  # noqa: E402
from monodecode.spec.config import SpeculativeConfig  # noqa: E402
from monodecode.spec.decoder import SpecRequest, SpeculativeDecoder  # noqa: E402

VIEWS = {"select", "slice", "view", "unsqueeze", "detach", "t", "expand", "squeeze", "transpose", "_unsafe_view"}


class Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.where = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stack = traceback.extract_stack()
        name = func.overloadpacket.__name__
        ours = [f for f in stack if "/monodecode/" in f.filename]
        if name not in VIEWS and ours and not any("triton" in f.filename for f in stack):
            start = max((i for i, f in enumerate(ours) if "step_graph" in f.filename), default=0)
            self.where[" > ".join(f"{f.filename.split('monodecode/')[-1]}:{f.lineno}" for f in ours[start:start + 3])] += 1
        return func(*args, **(kwargs or {}))


decoder = Decoder(Model.from_checkpoint(SyntheticCheckpoint(preset("tiny"), seed=21), torch.device("cpu"),
                                        torch.bfloat16), "on")
spec = SpeculativeDecoder(decoder, SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                                                "rejection_sample_method": "synthetic",
                                                                "synthetic_acceptance_length": 3.5}))
caches = spec.make_caches(8, 256)
temperature = 0.0 if "--greedy" in sys.argv else 0.7
requests = [SpecRequest(slot=0, position=10, anchor=5, temperature=temperature, generator=torch.Generator().manual_seed(0))]
spec.step(caches, requests)
device_step = spec.whole_step._device_step


def counted(*args, **kwargs):
    with Count() as count:
        out = device_step(*args, **kwargs)
    for where, n in sorted(count.where.items()):
        print(f"{n:4d} {where}")
    print(f"torch operations besides views: {sum(count.where.values())}")
    return out


spec.whole_step._device_step = counted
spec.step(caches, requests)
