"""Which kernels a programmatic dependent launch overlaps, on a GPU (NVIDIA, Hopper on).

`python tests/pdl_probe.py`: a slow kernel (128 programs spinning, then setting a flag) is followed
by a reader of the flag, directly or through a middle kernel; each with and without the slow
kernel's `griddepcontrol.launch_dependents` and the PDL launch attribute on the kernels after it.
The reader does not wait (`griddepcontrol.wait`), so it sees the flag still 0 only if it ran
before the slow kernel finished. On the H200 (Triton 3.6, CUDA 13.0): only the direct dependent of
a triggering kernel ran early; through a middle kernel that triggers at once and then waits,
the reader ran after the slow kernel ended. That is why the expert stage's down kernel overlaps
SwiGLU and not gate/up (`experts.launch_stages`, `LaunchConfig.pdl`).
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def _slow(flag_ptr, out_ptr, n, TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
    acc = tl.program_id(0).to(tl.float32)
    for _ in range(n):
        acc = acc * 0.9999999 + 1.0
    tl.store(out_ptr + tl.program_id(0), acc)
    tl.store(flag_ptr, 1)


@triton.jit
def _middle(TRIGGER: tl.constexpr):
    if TRIGGER:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _reader(flag_ptr, seen_ptr):
    tl.store(seen_ptr, tl.load(flag_ptr, volatile=True))


def main() -> int:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for trigger in (False, True):
        for pdl in (False, True):
            for middle in (False, True):
                flag = torch.zeros(1, dtype=torch.int32, device="cuda")
                seen = torch.full((1,), -1, dtype=torch.int32, device="cuda")
                dependent = {"launch_pdl": True} if pdl else {}
                _slow[(128,)](flag, torch.empty(128, device="cuda"), 2_000_000, TRIGGER=trigger)
                if middle:
                    _middle[(4,)](TRIGGER=trigger, **dependent)
                _reader[(1,)](flag, seen, **dependent)
                torch.cuda.synchronize()
                print(f"trigger {trigger!s:5} pdl {pdl!s:5} middle kernel {middle!s:5}: the reader "
                      + ("ran before the slow kernel ended" if seen.item() == 0 else "ran after it"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
