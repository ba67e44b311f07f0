"""The engine's host work a speculative decode step on a CPU, the device work replaced by a fixed
readback (2026-12-07 notes): `python docs/results/engine_host_standin_2026-12-07.py [REQUESTS]`.

The tiny preset with the kernels on (Triton's interpreter), R requests prefilled and decoding
with synthetic verification; each whole step's `device_work` returns 4 tokens a request
committed without running anything, so what is timed is the engine's step around it: the
scheduler, the whole step's host parts (rows, settings, keys, the readback's verdicts), the
requests' updates and the metrics. Not a test, not a GPU number: the same code's host cost on
this machine, to compare trees.
"""
import os
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")
import torch  # noqa: E402

from monodecode.checkpoint import SyntheticCheckpoint  # noqa: E402
from monodecode.config import preset  # noqa: E402
from monodecode.engine.engine import Engine  # noqa: E402
from monodecode.engine.params import SamplingParams  # noqa: E402
from monodecode.model import Model  # noqa: E402
from monodecode.spec.config import SpeculativeConfig  # noqa: E402

requests = int(sys.argv[1]) if len(sys.argv) > 1 else 8
model = Model.from_checkpoint(SyntheticCheckpoint(preset("tiny"), seed=21), torch.device("cpu"), torch.bfloat16)
config = SpeculativeConfig.from_json({"method": "dspark", "num_speculative_tokens": 5,
                                      "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 3.5})
engine = Engine(model, max_model_len=4096, max_num_seqs=8, speculative=config, mono="on")
for i in range(requests):
    engine.add_request(f"r{i}", list(range(5, 15)), SamplingParams(max_tokens=4000, temperature=0.7 * (i % 2),
                                                                   ignore_eos=True))
whole = engine.decoder.whole_step
b = whole.block_size
errors = len(whole.draft_runner.sync) + len(whole.target.sync)
verdicts = torch.full((requests, b + 2), 7, dtype=torch.long)
verdicts[:, -1] = 3  # 3 drafts accepted: 4 tokens a request a step
readback = torch.cat([torch.zeros(errors, dtype=torch.long), verdicts.flatten()])
logits = torch.zeros(requests, b + 1, model.config.vocab_size)
whole.device_work = lambda *args, **kwargs: (readback, logits)
for _ in range(3):  # the prefills (per-op, real), then decode steps
    engine.step()
steps = 300
start = time.perf_counter()
for _ in range(steps):
    engine.step()
print(f"{requests} requests: engine step {(time.perf_counter() - start) / steps * 1e6:.1f} us (device work stubbed)")
