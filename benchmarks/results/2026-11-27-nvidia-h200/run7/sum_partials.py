"""Time the dweight/dbias partials' sum alone, by column strip width."""

import torch

from addnorm.kernels.triton.backward_kernels import _sum_partials
from addnorm.tools.bench import kernel_seconds

for shape in [(2, 1056, 256), (2, 1056, 768), (2, 1056, 1024), (2, 264, 4096), (2, 132, 8192), (3, 528, 768)]:
    p = torch.randn(*shape, device="cuda")
    ref = _sum_partials(p, [torch.float32] * shape[0])
    line = f"{str(shape):18s}"
    for strip in (16, 32, 64, 128):
        t = kernel_seconds(lambda p=p, k=shape[0], strip=strip: _sum_partials(p, [torch.float32] * k, strip), "cuda")
        same = all(torch.equal(a, b) for a, b in zip(ref, _sum_partials(p, [torch.float32] * shape[0], strip)))
        line += f" | strip {strip:3d} {t * 1e6:6.1f} us{'' if same else ' (other bits)'}"
    print(line, flush=True)
