"""Check on a GPU that the fused loss (with cuBLAS fp32 accumulation) matches the unfused one."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from plait.loss import _accumulate_mm, linear_cross_entropy  # noqa: E402

torch.manual_seed(0)
acc = torch.randn(512, 256, device="cuda")
a, b = torch.randn(512, 300, device="cuda", dtype=torch.bfloat16), torch.randn(300, 256, device="cuda", dtype=torch.bfloat16)
ref = acc + (a.float() @ b.float())
_accumulate_mm(acc, a, b)
print("accumulate_mm rel err", ((acc - ref).norm() / ref.norm()).item())
h = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(128256, 2048, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
t = torch.randint(0, 128256, (4096,), device="cuda")
loss = linear_cross_entropy(h, w, t)
loss.backward()
gh, gw = h.grad.float(), w.grad.float()
h.grad = w.grad = None
ref = F.cross_entropy((h.float() @ w.float().t()), t)
ref.backward()
for name, x, y in (("loss", loss.float(), ref), ("grad_h", gh, h.grad.float()), ("grad_w", gw, w.grad.float())):
    print(name, "rel err", ((x - y).norm() / y.norm()).item())
